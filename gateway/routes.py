"""HTTP routes besides chat: models, health, readiness, metrics, admin keys."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from gateway.body import read_model
from gateway.completions import chat_completions
from gateway.errors import APIError, JSONResponse
from gateway.keys import KeyNotFound
from gateway.state import AppState
from policies import Worker

router = APIRouter()
router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=True)


def _state(request: Request) -> AppState:
    return request.app.state.polyroute


def worker_card(worker: Worker, unavailable: str | None) -> dict:
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
        },
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    state.auth.client(request)
    admission = state.admission()
    data = [
        {
            "id": "auto",
            "object": "model",
            "created": 0,
            "owned_by": "polyroute",
            "polyroute": {"available": bool(admission.pool), "router": state.router.name},
        }
    ]
    for worker in state.catalog.workers:
        exclusion = admission.exclusion_for(worker.name)
        data.append(worker_card(worker, exclusion.reason if exclusion else None))
    return JSONResponse({"object": "list", "data": data})


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when at least one worker can be called; lists every worker's state."""
    state = _state(request)
    admission = state.admission()
    workers = {w.name: {"ready": True} for w in admission.pool}
    for exclusion in admission.excluded:
        workers[exclusion.worker] = {"ready": False, "reason": exclusion.reason}
    for name, proc in state.local.items():
        workers[name]["local"] = {"state": proc.state, "detail": proc.detail}
    ready = bool(admission.pool)
    body = {"ready": ready, "router": state.router.name, "workers": workers}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    name: str = Field("", max_length=128)


@router.get("/admin/keys")
async def admin_list_keys(request: Request) -> JSONResponse:
    state = _state(request)
    state.auth.admin(request)
    return JSONResponse({"data": [r.public() for r in state.auth.store.list()]})


@router.post("/admin/keys", status_code=201)
async def admin_create_key(request: Request) -> JSONResponse:
    state = _state(request)
    state.auth.admin(request)
    body = await read_model(request, KeyCreate, 64 * 1024)
    record, plaintext = state.auth.store.create(body.tenant, body.name)
    return JSONResponse({**record.public(), "key": plaintext}, status_code=201)


@router.delete("/admin/keys/{key_id}")
async def admin_revoke_key(key_id: str, request: Request) -> JSONResponse:
    state = _state(request)
    state.auth.admin(request)
    try:
        record = state.auth.store.revoke(key_id)
    except KeyNotFound:
        raise APIError(
            404, f"no key with id {key_id!r}", type="not_found_error", code="key_not_found"
        ) from None
    return JSONResponse(record.public())


@router.get("/admin/workers")
async def admin_workers(request: Request) -> JSONResponse:
    state = _state(request)
    state.auth.admin(request)
    admission = state.admission()
    return JSONResponse(
        {
            "pool": [w.name for w in admission.pool],
            "excluded": [
                {"worker": e.worker, "rule": e.rule, "reason": e.reason} for e in admission.excluded
            ],
            "catalog": [w.model_dump(mode="json") for w in state.catalog.workers],
        }
    )
