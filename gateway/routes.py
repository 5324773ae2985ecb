"""HTTP routes besides chat: models, health, readiness, metrics, admin keys."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import Response

from gateway import anthropic, responses, tracing
from gateway.body import heavy_if, is_large, read_body, read_model
from gateway.collections import router as collections_router
from gateway.completions import chat_completions
from gateway.embeddings import embeddings, model_cards
from gateway.errors import APIError, JSONResponse
from gateway.keys import KeyNotFound
from gateway.ledger import FeedbackRecord
from gateway.state import AppState
from gateway.store import StoreUnavailable, find_request
from policies import (
    Catalog,
    Kind,
    PolicyError,
    PolicyNotWritable,
    PolicyRequest,
    PolicyRequestError,
    Spend,
    Worker,
)
from router import list_versions
from router.learned import resolve_cost_weight

router = APIRouter()
router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=True)
router.add_api_route("/v1/messages", anthropic.messages, methods=["POST"])  # Anthropic Messages
router.add_api_route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"])
router.add_api_route("/v1/embeddings", embeddings, methods=["POST"])  # gateway/embeddings.py
router.add_api_route("/v1/responses", responses.create, methods=["POST"])  # OpenAI Responses
router.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
router.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
router.include_router(collections_router)  # /v1/collections (retrieval, gateway/collections.py)


def _state(request: Request) -> AppState:
    return request.app.state.polyroute


def worker_card(worker: Worker, unavailable: str | None, retries: int) -> dict:
    return {
        "id": worker.name,
        "object": "model",
        "created": 0,
        "owned_by": worker.provider,
        "polyroute": {
            "available": unavailable is None,
            "unavailable_reason": unavailable,
            "tier": worker.tier.value,
            "input_price_per_m": str(worker.input_price_per_m),
            "output_price_per_m": str(worker.output_price_per_m),
            "total_params_b": worker.total_params_b,
            "active_params_b": worker.active_params_b,
            "architecture": worker.architecture.value,
            "license": worker.license,
            "jurisdiction": worker.jurisdiction,
            "region": worker.region,
            "context_window": worker.context_window,
            "capabilities": list(worker.capabilities),
            # How long a client can wait on this worker: per attempt, times 1 + retries (all within
            # the request deadline, POLYROUTE_REQUEST_TIMEOUT_S).
            "timeout_s": worker.timeout_s,
            "retries": retries,
            **({"local": local_card(worker)} if worker.local else {}),
        },
    }


def local_card(worker: Worker) -> dict:
    """What a client should know about a model the gateway runs itself: whether it follows
    instructions at all (a base model does not), the catalog's note, and how prompts are built."""
    spec = worker.local
    assert spec is not None
    return {
        "instruct": spec.instruct,
        "note": spec.note,
        "chat_format": spec.chat_format,
        # a built-in template's name, or a file's name without the operator's directory
        "chat_template": Path(spec.chat_template).stem if spec.chat_template else None,
    }


@router.get("/v1/models")
@tracing.traced
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.client(request)
    catalog = state.catalog_for(request)  # one version for the whole list: the catalog is hot-reloaded
    router = state.router.current
    admission = state.availability(catalog)
    data = [
        {
            "id": "auto",
            "object": "model",
            "created": 0,
            "owned_by": "polyroute",
            "polyroute": {
                "available": bool(admission.pool),
                "router": router.name,
                "router_version": router.version,
                "calibrated": sorted(
                    w for w, b in _router_basis(router, catalog).items() if b["basis"] == "calibrated"
                ),
            },
        }
    ]
    engine = state.policy.engine
    for alias, description in engine.policy.aliases.items() if engine else ():
        data.append(
            {
                "id": alias,
                "object": "model",
                "created": 0,
                "owned_by": "polyroute",
                "polyroute": {"alias": True, "description": description, "available": bool(admission.pool)},
            }
        )
    for worker in catalog.of_kind(Kind.chat):
        exclusion = admission.exclusion_for(worker.name)
        data.append(
            worker_card(worker, exclusion.reason if exclusion else None, state.client.retries_for(worker))
        )
    data += model_cards(catalog, engine)  # embedding workers and aliases (/v1/embeddings)
    return JSONResponse({"object": "list", "data": data})


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when a policy is in force and at least one chat worker can be called; lists every worker,
    embedding workers too (`"kind": "embedding"`: they do not make the gateway ready, as an in-process
    embedder is always up while every chat request would fail).
    `catalog` says the catalog in force (sha256) and warns when the file on disk differs from it: an
    edit not applied yet, or refused (`refused`, `on_disk_error`: why; gateway/catalog_reload.py).
    A shared store (Redis) that stops answering leaves a replica that reached it ready but
    `degraded` (Settings.ready_requires_store)."""
    state = _state(request)
    catalog = state.catalog  # one version for the whole answer: the catalog is hot-reloaded
    admission = state.availability(catalog)
    workers: dict[str, dict[str, Any]] = {}
    for available, marks in (
        (admission, {}),
        (state.availability(catalog, Kind.embedding), {"kind": "embedding"}),
    ):
        workers |= {w.name: {"ready": True, **marks} for w in available.pool}
        workers |= {e.worker: {"ready": False, "reason": e.reason, **marks} for e in available.excluded}
    for name, proc in state.local.items():
        workers[name]["local"] = {"state": proc.state, "detail": proc.detail}
    policy = state.policy.status()
    store = state.auth.store
    # both at once: a Redis that stops answering (not refusing) makes each wait its 5 s timeout
    keys_ok, shared_ok = await asyncio.gather(asyncio.to_thread(store.ping), state.stores.ping())
    keys = {"backend": type(store).__name__, "ok": keys_ok}
    store_ok = keys["ok"] and shared_ok
    state.store_reached = state.store_reached or store_ok
    # A shared store that stops answering makes every replica alike unable to reach it: unready, all
    # would leave the Service at once. So only a replica that never reached it (nothing verified, a
    # rollout during the outage) is unready, unless the operator asks for the strict rule.
    store_ready = store_ok or (state.store_reached and not state.settings.ready_requires_store)
    ready = bool(admission.pool) and policy["in_force"] and store_ready
    body = {
        "ready": ready,
        "degraded": not store_ok,  # serving without the shared store (docs/replicas.md)
        "router": state.router.status(),
        "policy": policy,
        # a warning, never a reason to be unready: the catalog in force still serves
        "catalog": await asyncio.to_thread(state.catalog_file.status),
        "keys": keys,
        "store": state.stores.status(),
        "workers": workers,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.set_worker_up(state.catalog_for(request))  # at this scrape, for the catalog in force
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    name: str = Field("", max_length=128)
    rpm: int | None = Field(None, gt=0, description="this key's requests per minute")
    tpm: int | None = Field(None, gt=0, description="this key's tokens per minute")

    @field_validator("rpm", "tpm", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        """JSON true is not 1 request a minute (pydantic's lax mode would read it so)."""
        if isinstance(value, bool):
            raise ValueError("must be a whole number of requests or tokens per minute, not true/false")
        return value


@router.get("/admin/keys")
async def admin_list_keys(request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    records = await asyncio.to_thread(state.auth.store.list)  # a file or Redis: off the event loop
    return JSONResponse({"data": [r.public() for r in records]})


@router.post("/admin/keys", status_code=201)
async def admin_create_key(request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    body = await read_model(request, KeyCreate, 64 * 1024)
    record, plaintext = await asyncio.to_thread(
        lambda: state.auth.store.create(body.tenant, body.name, rpm=body.rpm, tpm=body.tpm)
    )
    out = {**record.public(), "key": plaintext}
    # allowed (a policy may name the tenant later), but said: a typo made a key without limits
    engine = state.policy.engine
    if engine is not None and body.tenant not in engine.policy.tenants:
        out["warning"] = (
            f"tenant {body.tenant!r} is not in the policy in force: no budget, tenant rate limit or "
            "data class applies to this key until the policy names it"
        )
    return JSONResponse(out, status_code=201)


@router.delete("/admin/keys/{key_id}")
async def admin_revoke_key(key_id: str, request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    try:
        record = await asyncio.to_thread(state.auth.store.revoke, key_id)
    except KeyNotFound:
        raise APIError(
            404, f"no key with id {key_id!r}", type="not_found_error", code="key_not_found"
        ) from None
    return JSONResponse(record.public())


@router.get("/admin/spend/{tenant}")
async def admin_spend(tenant: str, request: Request) -> JSONResponse:
    """A tenant's spend today and this month (settled plus what in-flight requests hold)."""
    state = _state(request)
    await state.auth.admin(request)
    usage = await _usage(state, tenant)
    return JSONResponse(
        {"tenant": tenant, "daily_usd": f"{usage.daily_usd:f}", "monthly_usd": f"{usage.monthly_usd:f}"}
    )


@router.get("/admin/workers")
async def admin_workers(request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    catalog = state.catalog  # one version for the whole answer: the catalog is hot-reloaded
    admission = state.availability(catalog)
    return JSONResponse(
        {
            "pool": [w.name for w in admission.pool],
            "excluded": [
                {"worker": e.worker, "rule": e.rule, "reason": e.reason} for e in admission.excluded
            ],
            "catalog": [w.model_dump(mode="json") for w in catalog.workers],
            # the catalog above is the one in force (catalog_file.sha256); this says whether the file on
            # disk still matches, and why an edit was not applied (gateway/catalog_reload.py)
            "catalog_file": await asyncio.to_thread(state.catalog_file.status),
        }
    )


# ---- policies ------------------------------------------------------------------------------------
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/plain")


@router.get("/admin/policies")
async def admin_get_policy(request: Request) -> Response:
    """The policy YAML in force (as text), its version in x-polyroute-policy-version."""
    state = _state(request)
    await state.auth.admin(request)
    text, engine = state.policy.text, state.policy.engine
    if text is None or engine is None:
        raise APIError(404, "no valid policy is loaded", type="not_found_error", code="policy_unavailable")
    return Response(
        text, media_type="application/yaml", headers={"x-polyroute-policy-version": engine.version}
    )


@router.put("/admin/policies")
async def admin_put_policy(request: Request) -> JSONResponse:
    """Replace the policy: validated like a file edit; refused whole if invalid; audited."""
    state = _state(request)
    admin = await state.auth.admin(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type not in YAML_TYPES:
        raise APIError(
            415, f"send the policy as YAML ({', '.join(YAML_TYPES)})", code="unsupported_media_type"
        )
    settings = state.settings
    if settings.redis_url and settings.policy_file is None:
        # Replicas share state through Redis, but this policy file is this replica's own data dir's:
        # a PUT through the Service would change one pod and answer "in force", and the replicas'
        # sovereignty and budget rules would differ. A POLYROUTE_POLICY_FILE set explicitly is the
        # operator's choice of a file (shared, or a single replica's), and is written as asked.
        raise APIError(
            409,
            "this gateway shares its state through Redis (REDIS_URL) but its policy file is its own data "
            "dir's, which other replicas do not read: a PUT would change this replica only. Set "
            "POLYROUTE_POLICY_FILE to a policy every replica reads (the Helm chart's `policy` value, a "
            "ConfigMap) and edit that, or set it to this file to PUT here deliberately",
            code="policy_not_shared",
        )
    raw = await read_body(request, settings.max_body_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the policy must be UTF-8 text", code="invalid_policy") from None
    try:
        # validated, checked against the catalog, written and swapped as a file edit is; a refusal is
        # logged and audited the same way too (policies/loader.py)
        engine = await asyncio.to_thread(state.policy.replace, text, f"{admin.id} ({admin.name})")
    except PolicyError as exc:
        raise APIError(400, str(exc), code="invalid_policy") from None
    except PolicyNotWritable as exc:  # e.g. the Helm chart's read-only ConfigMap mount
        if exc.read_only:
            raise APIError(409, str(exc), code="policy_file_read_only") from None
        raise APIError(503, str(exc), type="server_error", code="policy_write_failed") from None
    return JSONResponse({"version": engine.version, "status": state.policy.status()})


@router.get("/admin/policies/status")
async def admin_policy_status(request: Request) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    return JSONResponse(state.policy.status())


@router.get("/admin/policies/audit")
async def admin_policy_audit(request: Request, limit: int = 100) -> JSONResponse:
    state = _state(request)
    await state.auth.admin(request)
    audit = state.policy.audit
    entries = await asyncio.to_thread(audit.entries, max(1, min(limit, 1000))) if audit else []  # a file
    return JSONResponse({"data": entries})


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = "default"
    model: str = "auto"
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    data_class: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    assume_available: bool = Field(
        False, description="take every worker as callable (no provider key, server up): the rules alone"
    )


@router.post("/admin/policies/explain")
async def admin_policy_explain(request: Request) -> JSONResponse:
    """Dry run: the data class, the rules in scope, the pool and each excluded worker with its rule."""
    state = _state(request)
    await state.auth.admin(request)
    body = await read_model(request, ExplainRequest, state.settings.max_body_bytes)
    engine = state.policy.engine
    if engine is None:
        raise APIError(
            503, f"no valid policy is loaded: {state.policy.last_error}", code="policy_unavailable"
        )
    texts = [body.text] if body.text else []
    for message in body.messages or []:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
    catalog = state.catalog_for(request)  # the workers and their availability, from one version
    policy_request = PolicyRequest(
        tenant=body.tenant,
        model=body.model,
        texts=tuple(texts),
        data_class=body.data_class,
        prompt_chars=sum(len(t) for t in texts),
        max_output_tokens=body.max_tokens,
        spend=await _usage(state, body.tenant),
    )
    try:
        # detection over megabytes: off the event loop
        admission = await heavy_if(
            is_large(request),
            engine.evaluate,
            policy_request,
            catalog,
            state.down_workers(catalog),
            assume_available=body.assume_available,
        )
    except PolicyRequestError as exc:
        raise APIError(400, str(exc), param="data_class", code="invalid_data_class") from None
    explained = {"tenant": body.tenant, "model": body.model, "assume_available": body.assume_available}
    return JSONResponse({**explained, **admission.explain()})


def _store_down(what: str, exc: Exception) -> APIError:
    return APIError(
        503,
        f"{what} cannot be reached right now: {exc}",
        type="server_error",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )


async def _usage(state, tenant: str) -> Spend:
    try:
        return await state.stores.budgets.usage(tenant)
    except StoreUnavailable as exc:
        raise _store_down("the budget store", exc) from None


# ---- feedback and the router -----------------------------------------------------------------
class Feedback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=64)
    score: float | None = Field(None, ge=0, le=1, description="0 (bad) .. 1 (good)")
    thumbs: Literal["up", "down"] | None = None
    comment: str | None = Field(None, max_length=2000)

    @model_validator(mode="after")
    def _one_signal(self) -> Feedback:
        if (self.score is None) == (self.thumbs is None):
            raise ValueError("give exactly one of score (0..1) or thumbs ('up'/'down')")
        return self

    @property
    def value(self) -> float:
        if self.score is not None:
            return self.score
        return 1.0 if self.thumbs == "up" else 0.0


@router.post("/v1/feedback", status_code=201)
async def feedback(request: Request) -> JSONResponse:
    """How good an answer was: stored in the ledger, joined to its request when the router retrains.

    Feedback sent right after an answer may arrive before the request's record (a stream's is written
    after its last chunk; another replica flushes its records to Redis every few hundred ms), so an id
    not found yet is waited for, up to `feedback_wait_s`, before the 404 that says it does not exist.
    Another tenant's id gets the same 404 after the same wait: its existence is not confirmed."""
    state = _state(request)
    key = await state.auth.client(request)
    body = await read_model(request, Feedback, 64 * 1024)
    try:
        found = await find_request(state.ledger, body.request_id, key.tenant, state.settings.feedback_wait_s)
    except StoreUnavailable as exc:
        raise _store_down("the ledger", exc) from None
    if found is None:
        raise APIError(
            404, f"no request with id {body.request_id!r}", type="not_found_error", code="request_not_found"
        )
    _, worker = found
    state.ledger.record_feedback(FeedbackRecord(body.request_id, key.tenant, body.value, worker))
    return JSONResponse(
        {"request_id": body.request_id, "worker": worker, "score": body.value}, status_code=201
    )


@router.get("/admin/router")
async def admin_router(request: Request) -> JSONResponse:
    """The router in force, the λ a request that sets none gets (and where it comes from), what makes
    the gateway decide otherwise than the model was validated (``warnings``), per worker what the
    router knows of it and whether it can be called now, the model versions on disk, and the last load
    error if any."""
    state = _state(request)
    await state.auth.admin(request)
    versions = await asyncio.to_thread(list_versions, state.router.root)
    router = state.router.current
    catalog = state.catalog_for(request)  # the router's workers and their availability, from one version
    weight = resolve_cost_weight(setting=state.settings.cost_weight, card=_card(router))
    cost_weight = {"value": weight.value, "source": weight.source, "described": weight.described}
    if weight.source == "model card":
        cost_weight["reason"] = _card(router).get("operating_cost_weight_reason")
    warnings = router.warnings(state.settings.plan_code_exec) if hasattr(router, "warnings") else []
    return JSONResponse(
        {
            **state.router.status(),
            "cost_weight": cost_weight,
            "warnings": warnings,
            "workers": _router_workers(state, router, catalog),
            "versions": versions,
        }
    )


def _card(router) -> dict:
    """The model card of the router in force ({} for the rule-based router)."""
    return getattr(getattr(router, "artifact", None), "card", None) or {}


def _router_basis(router, catalog: Catalog) -> dict[str, dict]:
    """Per chat worker of `catalog` (the answer's one version), what `router` (the router in force)
    knows of it: calibrated, profile_like (looked up in `catalog`) or a prior."""
    workers = catalog.of_kind(Kind.chat)
    basis = getattr(router, "basis", None)
    if basis is None:
        return {w.name: {"basis": "rules"} for w in workers}
    by_name = {w.name: w for w in catalog.workers}
    return {w.name: basis(w, by_name) for w in workers}


def _router_workers(state: AppState, router, catalog: Catalog) -> dict[str, dict]:
    """Per chat worker of `catalog`, what `router` knows of it (`_router_basis`) and whether it can be
    called right now, by the check and in the words of /v1/models and /readyz (`AppState.availability`:
    its key env var unset, its local server down or disabled). Without it, a worker the router can
    never pick read here as merely running on a prior."""
    admission = state.availability(catalog)
    workers = {}
    for name, basis in _router_basis(router, catalog).items():
        exclusion = admission.exclusion_for(name)
        reason = exclusion.reason if exclusion else None
        workers[name] = {**basis, "available": reason is None, "unavailable_reason": reason}
    return workers
