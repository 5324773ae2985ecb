"""POST /v1/chat/completions: auth → validation → admission → routing → worker calls → response.

Fallback walks the router's ranking, which holds only admissible workers; a pinned worker gets
retries but no fallback (the client named it). A stream falls back only before its first byte;
after that, a failure ends the stream with an error event. A workflow `auto` chose that produces no
answer falls back the same way, over the ranked workers it did not try (gateway/compose.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import caching, compose, memory, ratelimits, tracing
from gateway.body import heavy_if, is_large, read_model
from gateway.errors import APIError, error_response
from gateway.judge import completion_text
from gateway.ledger import RequestRecord, stored_query
from gateway.readmit import still_admits
from gateway.schemas import ChatCompletionRequest
from gateway.state import AppState
from gateway.store import (
    BudgetExceeded,
    Limit,
    Limits,
    Reservation,
    StoreReplyError,
    StoreUnavailable,
    to_micros,
)
from gateway.upstream import (
    Attempt,
    CallScope,
    Completion,
    OpenStream,
    WorkerError,
    attempts_header,
    calling,
    given_up,
    with_attempts,
)
from policies import Admission, PolicyRequest, PolicyRequestError, Spend, estimate_tokens, predicted_cost
from policies.admission import BUDGET_RULE_PREFIX
from policies.catalog import Catalog, Kind
from router import RouteDecision, RouteRequest, estimate_cost
from router.compose.base import Admissible, still_admitted, why_excluded
from router.learned import cost_weight_of
from router.routelog import route_log

log = logging.getLogger("polyroute.gateway")
# One line per chat request: which worker served it, how it ended, how long it took, what it cost.
access = logging.getLogger("polyroute.access")

AUTO = "auto"


def format_cost(cost: Decimal) -> str:
    return f"{cost.quantize(Decimal('0.000000001')):f}"


DATA_CLASS_HEADER = "x-polyroute-data-class"
COST_WEIGHT_HEADER = "x-polyroute-cost-weight"


class Wire:
    """The client's API on the way in and out: how a request is read and how answers, streams and
    errors are written. This one is OpenAI chat completions; gateway/anthropic.py reads and writes
    Anthropic Messages. Between the two ends every request runs the same pipeline (`serve`)."""

    def authenticated(self, tenant: str) -> None:
        """The request's tenant, known before the body is read (a wire that reads the tenant's stored
        state, as gateway/responses.py does for previous_response_id, keeps it)."""

    async def read(self, request: Request, state: AppState) -> ChatCompletionRequest:
        return await read_model(request, ChatCompletionRequest, state.settings.max_body_bytes)

    def policy_texts(self) -> tuple[str, ...]:
        """Text the client sent that the wire keeps rather than forwards (gateway/anthropic.py applies
        stop sequences itself): classified with the request all the same."""
        return ()

    def error(self, err: APIError) -> Response:
        return error_response(err)

    def answer(self, body: dict, headers: dict[str, str], background: BackgroundTask | None) -> Response:
        return Response(
            orjson.dumps(body), media_type="application/json", headers=headers, background=background
        )

    def cached(self, body: bytes, headers: dict[str, str]) -> Response:
        return Response(body, media_type="application/json", headers=headers)

    def stream(self, body: AsyncIterator[bytes], headers: dict[str, str]) -> Response:
        return EventStream(body, media_type="text/event-stream", headers=headers)

    async def composed(self, response: Response) -> Response:
        """A workflow's answer (gateway/compose.py writes OpenAI JSON or SSE)."""
        return response

    async def frames(
        self, chunks: AsyncIterator[dict], worker: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The worker's chunks as this API's SSE events (WorkerError, DeadlinePassed pass through)."""
        async for chunk in chunks:
            if chunk.get("usage") and not chunk.get("choices") and not include_usage:
                continue
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"

    def error_event(self, message: str, code: str) -> bytes:
        return _error_event(message, code)

    def done(self) -> bytes:
        """The stream's last bytes, however it ended (empty: none)."""
        return b"data: [DONE]\n\n"


OPENAI = Wire()


class TranslatingWire(Wire):
    """A wire for another API: a workflow's finished OpenAI answer (gateway/compose.py writes JSON or
    SSE) is read back and written again through this wire's ``error``, ``frames`` and ``answer``."""

    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The response headers this API adds to polyroute's (ids in its own form, ignored fields)."""
        return headers

    async def composed(self, response: Response) -> Response:
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        if response.status_code >= 400:
            body = orjson.loads(response.body)["error"]
            err = APIError(
                response.status_code,
                body["message"],
                type=body.get("type") or "server_error",
                code=body.get("code"),
                param=body.get("param"),
            )
            err.headers = headers
            return self.error(err)
        if hasattr(response, "body_iterator"):
            raw = b"".join([part async for part in response.body_iterator])  # type: ignore[attr-defined]
            chunks = [
                orjson.loads(line[6:])
                for line in raw.decode().splitlines()
                if line.startswith("data: ") and line[6:].strip() != "[DONE]"
            ]
            worker = headers.get("x-polyroute-worker", "polyroute")

            async def replay() -> AsyncIterator[dict]:
                for chunk in chunks:
                    yield chunk

            return EventStream(
                self.frames(replay(), worker, True),
                media_type="text/event-stream",
                headers=self._headers(headers),
            )
        return self.answer(orjson.loads(response.body), headers, None)


def model_names(catalog: Catalog, aliases) -> list[str]:
    """Every name a request's `model` may take, for the 404 that lists them."""
    return ["auto", *(compose.PREFIX + w for w in compose.WORKFLOWS), *aliases, *catalog.names]


def admission_for(
    state: AppState,
    request: Request,
    tenant: str,
    chat: ChatCompletionRequest,
    engine,
    spend: Spend,
    extra_texts: tuple[str, ...] = (),
) -> Admission:
    """Ask the policy in force which workers may serve this request. Fails closed."""
    require_policy(state, engine)
    catalog = state.catalog_for(request)  # the request's own, as every read of it (AppState.catalog_for)
    version = {"x-polyroute-policy-version": engine.version}
    # A workflow (compose:<name>) draws from auto's pool, under auto's rules and its own (policies/engine.py)
    model = chat.model
    known = (
        model == AUTO
        or model.startswith(compose.PREFIX)
        or model in engine.policy.aliases
        or catalog.get(model)
    )
    if not known:
        names = model_names(catalog, engine.policy.aliases)
        raise APIError(
            404,
            f"The model '{chat.model}' does not exist. Use one of: {', '.join(names)}",
            code="model_not_found",
            param="model",
            headers=version,
        )
    policy_request = PolicyRequest(
        tenant=tenant,
        model=model,
        texts=chat.texts() + extra_texts,  # + recalled memory: the workers will see it too
        data_class=chat.metadata_str("data_class") or request.headers.get(DATA_CLASS_HEADER),
        prompt_chars=chat.prompt_chars(),
        max_output_tokens=chat.output_budget(),
        spend=spend,
    )
    return evaluate_policy(state, catalog, engine, policy_request)


def require_policy(state: AppState, engine) -> None:
    """Fail closed: with no valid policy loaded, no worker may be called."""
    if engine is None:
        raise APIError(
            503,
            f"No valid policy is loaded, so no worker may be called: {state.policy.last_error}",
            type="server_error",
            code="policy_unavailable",
        )


def evaluate_policy(
    state: AppState, catalog: Catalog, engine, policy_request: PolicyRequest, kind: Kind = Kind.chat
) -> Admission:
    """The policy's verdict over the workers of `kind` of `catalog` (the request's: AppState.catalog_for);
    a policy that cannot be evaluated refuses the request (503) rather than guess."""
    version = {"x-polyroute-policy-version": engine.version}
    try:
        return engine.evaluate(policy_request, catalog, state.down_workers(catalog), kind=kind)
    except PolicyRequestError as exc:
        raise APIError(
            400, str(exc), param="metadata.data_class", code="invalid_data_class", headers=version
        ) from None
    except Exception:
        log.exception("policy %s could not be evaluated; refusing the request", engine.version)
        raise APIError(
            503,
            "The policy could not be evaluated for this request; no worker was called.",
            type="server_error",
            code="policy_evaluation_failed",
            headers=version,
        ) from None


def withhold_above(engine, tenant: str, admission: Admission):
    """For memory expansions: a document classed stricter than the request was admitted for is not
    shown to the worker (the pool was chosen for the request's class, not for that document's)."""
    policy = engine.policy

    def withhold(text: str) -> str | None:
        found = engine.classify(PolicyRequest(tenant=tenant, texts=(text,)))
        if policy.strictness(found.data_class) <= policy.strictness(admission.data_class):
            return None
        return (
            f"classified {found.data_class} ({'; '.join(found.reasons)}), above this request's "
            f"{admission.data_class}; ask again with metadata.data_class={found.data_class}"
        )

    return withhold


def _denied(admission: Admission, subject: str) -> APIError:
    """403 when rules emptied the pool (naming them), 503 when workers simply cannot be called.

    A pool the tenant's budget alone emptied is the 403 `budget_exceeded` the reservation gives
    when it catches the same condition a moment later (a client need not know which caught it)."""
    listed = "; ".join(f"{e.worker}: {e.reason} [{e.rule}]" for e in admission.excluded)
    rules = sorted({e.rule for e in admission.denied_by_policy})
    if rules and all(rule.startswith(BUDGET_RULE_PREFIX) for rule in rules):
        return APIError(
            403,
            f"No worker was called: the tenant's budget admits no worker for {subject} "
            f"({', '.join(rules)}). {listed}",
            type="insufficient_quota",
            code="budget_exceeded",
        )
    if rules:
        return APIError(
            403,
            f"Policy {admission.policy_version} admits no worker for {subject} "
            f"(data class {admission.data_class}; rules: {', '.join(rules)}). {listed}",
            type="permission_error",
            code="policy_denied",
        )
    return APIError(
        503, f"No worker can serve {subject}. {listed}", type="server_error", code="no_admissible_worker"
    )


MAX_COST_WEIGHT = 100.0  # λ: past a few units the cheapest admissible worker wins anyway


def _float_param(value: object, name: str, low: float, high: float) -> float | None:
    """A bounded, finite number (a JSON number or a numeric string, as headers carry them).

    `float()` alone takes "inf", "nan" and 1e999 (which JSON parsers turn into infinity), and
    True as 1.0; an infinite λ would then turn every utility into NaN and the ranking into noise."""
    if value is None:
        return None
    number = float("nan")
    if not isinstance(value, bool):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            pass
    if not (math.isfinite(number) and low <= number <= high):
        raise APIError(
            400,
            f"{name} must be a finite number between {low:g} and {high:g}",
            param=name,
            code="invalid_value",
        )
    return number


def route_request(
    request: Request, chat: ChatCompletionRequest, admission: Admission, tenant_weight
) -> RouteRequest:
    """What the router sees: sizes, the last user message, λ or a target. λ: the request's own
    (metadata > header) and the tenant's, resolved below the operator's and the model's by
    router/learned.py resolve_cost_weight."""
    metadata = chat.metadata or {}
    weight = _float_param(
        metadata.get("cost_weight", request.headers.get(COST_WEIGHT_HEADER)),
        "metadata.cost_weight",
        0,
        MAX_COST_WEIGHT,
    )
    return RouteRequest(
        prompt_chars=chat.prompt_chars(),
        max_output_tokens=chat.output_budget(),
        needs_tools=bool(chat.tools),
        prefer_fewer_active_params=admission.prefer_fewer_active_params,
        text=chat.last_user_text(),
        turns=chat.user_turns(),
        cost_weight=weight,
        min_quality=_float_param(metadata.get("min_quality"), "metadata.min_quality", 0, 1),
        tenant_cost_weight=tenant_weight,
    )


async def decide(
    catalog: Catalog, route: RouteRequest, chat: ChatCompletionRequest, admission: Admission, router
):
    """The ordered workers to try, all from the pool, or the OpenAI error that explains why none.
    `catalog`: the request's (AppState.catalog_for), the one its admission was decided on."""
    worker = catalog.get(chat.model)
    if worker is not None:  # pinned by name: that worker or nothing
        if not admission.admits(worker.name):
            only = Admission(
                (),
                tuple(e for e in admission.excluded if e.worker == worker.name),
                admission.policy_version,
                admission.data_class,
            )
            raise _denied(only, f"'{worker.name}'")
        return RouteDecision((worker,), "pinned", "pinned by the request", estimate_cost(worker, route))
    if not admission.pool:
        raise _denied(admission, "this request")
    if router.name == "learned":  # embeds the query: CPU work off the event loop
        return await asyncio.to_thread(router.route, route, admission.pool)
    return router.route(route, admission.pool)


def route_headers(request_id: str, decision: RouteDecision, admission: Admission, router) -> dict[str, str]:
    return {
        **policy_headers(request_id, admission),
        "x-polyroute-strategy": decision.strategy,
        "x-polyroute-route-reason": decision.reason,
        "x-polyroute-router-version": router.version,
    }


def policy_headers(request_id: str, admission: Admission) -> dict[str, str]:
    return {
        "x-polyroute-request-id": request_id,
        "x-polyroute-policy-version": admission.policy_version,
        "x-polyroute-data-class": admission.data_class,
    }


def final_error(failures: list[WorkerError]) -> APIError:
    summary = "; ".join(f"{f.worker}: {f.message}" for f in failures)
    last = failures[-1]
    if all(isinstance(f, BudgetRefusal) for f in failures):  # no worker fits what is left of the budget
        return APIError(
            last.status,
            f"No worker was called: {summary}",
            type="insufficient_quota" if last.status == 403 else "server_error",
            code=last.code,
            headers={"retry-after": "1"} if last.status == 503 else {},
        )
    called = [f for f in failures if not isinstance(f, BudgetRefusal)]
    if called and all(f.context_exceeded for f in called):  # the client must shorten the prompt
        return APIError(
            400,
            "The prompt and max_tokens do not fit the context window of any admissible worker "
            f"(workers with no larger window were not tried). {summary}",
            code="context_length_exceeded",
            param="messages",
        )
    if called and all(f.unsupported for f in called):  # no worker tried has these parameters
        names = list(dict.fromkeys(name for f in called for name in f.unsupported))
        return APIError(
            400,
            f"{_tried(called, 'cannot', 'cannot')} take {', '.join(names)}: leave "
            f"{'it' if len(names) == 1 else 'them'} out, or ask another worker. {summary}",
            code="unsupported_parameter",
            param=names[0],
        )
    # the request itself was refused upstream: the client must change it
    if not last.fallback and not last.unsupported:
        return APIError(last.status if 400 <= last.status < 500 else 400, summary, code="upstream_rejected")
    if all(f.status == 429 for f in failures):
        return APIError(
            429,
            f"{_tried(failures, 'is', 'are')} rate limited. {summary}",
            type="rate_limit_error",
            code="upstream_rate_limited",
            headers={"retry-after": str(_retry_after(failures))},
        )
    if all(f.status == 504 for f in failures):
        return APIError(
            504, f"{_tried(failures)} timed out. {summary}", type="server_error", code="upstream_timeout"
        )
    return APIError(502, f"{_tried(failures)} failed. {summary}", type="server_error", code="upstream_failed")


def _tried(failures: list[WorkerError], one: str = "", many: str = "") -> str:
    """The final error's subject (and verb): the one worker tried, a pinned one say, by name, since
    "All workers are rate limited" read as if others had been tried too; else how many were."""
    names = list(dict.fromkeys(f.worker for f in failures))
    if len(names) == 1:
        return " ".join(filter(None, ("The worker", names[0], one)))
    return " ".join(filter(None, (f"All {len(names)} workers tried", many)))


def _retry_after(failures: list[WorkerError]) -> int:
    """Whole seconds until the first rate-limited worker said it would take calls again (its
    Retry-After; one second for a worker that said nothing), so a client's retry is not refused."""
    return max(1, math.ceil(min(f.retry_after_s or 1.0 for f in failures)))


class BudgetRefusal(WorkerError):
    """A worker skipped because reserving its predicted cost would overspend (or cannot be checked)."""

    def __init__(
        self, worker: str, status: int, message: str, code: str, left_micros: int | None = None
    ) -> None:
        super().__init__(worker, status, message, fallback=status == 403)
        self.code = code
        self.left_micros = left_micros  # what the budget still had, when it was the budget that refused


def tenant_budget(engine, tenant: str) -> Limits:
    config = engine.policy.tenants.get(tenant) if engine is not None else None
    if config is None:
        return Limits()
    daily, monthly = config.budget.daily_usd, config.budget.monthly_usd
    return Limits(
        to_micros(daily) if daily is not None else None, to_micros(monthly) if monthly is not None else None
    )


async def budget_usage(state: AppState, tenant: str, limits: Limits) -> Spend:
    """What the tenant has spent and holds, for the policy's budget rule; budgets fail closed."""
    if not limits.any:
        return Spend()
    try:
        return await state.stores.budgets.usage(tenant)
    except StoreUnavailable as exc:
        state.metrics.store_unavailable.labels("budgets").inc()
        raise budget_store_down(exc) from None
    except StoreReplyError as exc:
        raise store_reply_error(exc) from None


def store_reply_error(exc: StoreReplyError) -> APIError:
    """Redis rejected one of our operations: a bug (logged once per kind), not an outage. Only this
    request fails, with a 500; the breaker stays closed and other requests are served."""
    return APIError(
        500,
        f"internal error in the gateway's shared store ({exc.what}); this request was not completed",
        type="server_error",
        code="store_error",
    )


def budget_store_down(exc: Exception) -> APIError:
    return APIError(
        503,
        f"This tenant has a budget and the budget store cannot be reached, so no worker is called "
        f"(budgets fail closed): {exc}",
        type="server_error",
        code="budget_store_unavailable",
        headers={"retry-after": "1"},
    )


@dataclass(slots=True)
class Usage:
    """Tokens and cost of worker calls, summed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = Decimal(0)

    def add(self, prompt_tokens: int, completion_tokens: int, cost_usd: Decimal) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd


@dataclass
class Exchange:
    """One request's context from decision to ledger: its holds on budgets and limits included.

    Budget holds: each attempt (one worker) starts with one hold of its predicted cost. A memory
    loop calls the worker again, so before each further call the hold is extended by that call's
    prediction (`cover`), and the call that would cross the budget is refused: at every moment
    settled + reserved ≤ budget, as README's bound says. What calls have already cost is never
    released: an attempt given up after calls that were answered (`unsettled`) is settled with
    that amount (`release`), and the ledger record adds it (`settled`).
    """

    request_id: str
    tenant: str
    chat: ChatCompletionRequest
    admission: Admission
    decision: RouteDecision
    router_version: str
    headers: dict[str, str]
    budget: Limits = field(default_factory=Limits)
    limits: list[Limit] = field(default_factory=list)
    cache: caching.CachePlan | None = None
    holds: list[Reservation] = field(default_factory=list)  # the current attempt's, together
    started: float = field(default_factory=time.perf_counter)
    memory: memory.MemoryPlan | None = None  # context from collections/session (gateway/memory.py)
    predicted_micros: int = 0  # the predictions of the current attempt's calls so far (`cover`)
    unsettled: Usage = field(default_factory=Usage)  # answered calls of the current attempt, not yet billed
    settled: Usage = field(default_factory=Usage)  # given-up attempts' calls, already on the budget
    settled_micros: int = 0  # ... as the budget counted them (rounded up per settle)
    route: RouteRequest | None = None  # what the router saw: its choice is logged for offline evaluation
    cost_weight: float | None = None  # the λ in force for it (resolve_cost_weight under the router used)
    cost_weight_source: str | None = None  # where that λ came from (router/learned.py COST_WEIGHT_SOURCES)
    degraded: compose.Composition | None = None  # a workflow answered in fast mode: traced as such
    # workers fast mode does not try: those the workflow `auto` chose already tried (compose.respond)
    skip: frozenset[str] = frozenset()
    explain: bool = False  # x-polyroute-trace: 1 (the trace goes to the client too)
    wire: Wire = OPENAI  # the client's API: how the answer is written
    trace: tracing.RequestTrace = field(default_factory=tracing.current)  # its span (tracing.OFF: none)
    # asked before each attempt: None, or why the policy in force no longer admits a worker (a reload
    # since admission: gateway/readmit.py), the one check its workflow's steps ask too
    admissible: Admissible | None = None
    # workers the policy in force left out after the request was admitted, and why: never tried
    excluded: dict[str, str] = field(default_factory=dict)
    request: Request | None = None  # the client's, watched for a hang-up while workers are called
    gone: bool = False  # the client hung up: no further attempt starts, and the ledger says 499
    # fast mode's worker calls' scope (gateway/upstream.py CallScope): `readmit` before each retry,
    # and the calls the request's deadline or its cancellation (the shutdown) cut short
    calls: CallScope = field(init=False)
    # those calls, labelled with what cut them (`cut_at_deadline`, `_cut_at_shutdown`): after
    # `failures`' in the attempts
    cut: list[Attempt] = field(default_factory=list)
    # the client's parameters the answering worker's request went without (`note_ignored`)
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.calls = CallScope(readmit=self.readmit)

    async def admits(self, worker) -> bool:
        """Whether the policy in force still admits ``worker`` for this request (see `admissible`),
        asked before each attempt: retries and fallbacks take seconds, during which the policy file
        may be reloaded, and a worker the operator excluded since is not called (a policy decision is
        never undone downstream, the newer one included; the check fails closed). One it no longer
        admits is kept in `excluded`, with why, as a workflow's `Run.admits` keeps it."""
        return await still_admitted(self.admissible, self.excluded, worker)

    async def readmit(self, worker) -> str | None:
        """`admits` as the retry loop asks it before retrying the same worker: None, or why not."""
        return await why_excluded(self.admissible, self.excluded, worker)

    def cut_at_deadline(self) -> None:
        """The request's deadline cut fast mode short: the call it cut (and that worker's calls
        retried before it) go on the books as cut by the deadline, the status a stream it cuts gets."""
        self.cut = self.calls.cut_by("deadline", STREAM_STATUS["deadline"])

    @property
    def held_micros(self) -> int:
        """What the current attempt's holds reserve."""
        return sum(hold.micros for hold in self.holds)

    def remaining(self, state: AppState) -> float:
        """Seconds left of the request's deadline (POLYROUTE_REQUEST_TIMEOUT_S) for worker calls."""
        return self.started + state.settings.request_timeout_s - time.perf_counter()

    async def hold(self, state: AppState, worker, micros: int | None = None) -> None:
        """Start an attempt: reserve this worker's predicted cost (or `micros`) on the tenant's budget."""
        self.predicted_micros = 0
        if micros is None:
            micros = to_micros(predicted_cost(worker, self.chat.prompt_chars(), self.chat.output_budget()))
        await self._reserve(state, worker, micros)

    async def cover(self, state: AppState, worker, chat: ChatCompletionRequest) -> None:
        """Before each call of an attempt that calls its worker more than once (memory): extend the
        hold so it covers every call's prediction, this one's included (the chat actually sent, so
        the first call's recalled memory counts too). Raises BudgetRefusal: the call must not run."""
        self.predicted_micros += to_micros(predicted_cost(worker, chat.prompt_chars(), chat.output_budget()))
        missing = self.predicted_micros - self.held_micros
        if missing > 0:
            await self._reserve(state, worker, missing)

    def spent(self, prompt_tokens: int, completion_tokens: int, cost_usd: Decimal) -> None:
        """A call of the current attempt answered: what it cost is owed whatever happens next."""
        self.unsettled.add(prompt_tokens, completion_tokens, cost_usd)

    def answered(self) -> None:
        """The attempt's answer accounts for all its calls (memory merges the rounds)."""
        self.unsettled = Usage()

    async def _reserve(self, state: AppState, worker, micros: int) -> None:
        if not self.budget.any:
            return
        try:
            reservation = await state.stores.budgets.reserve(self.tenant, micros, self.budget)
        except BudgetExceeded as exc:
            raise BudgetRefusal(
                worker.name, 403, f"budget:{exc.period}: {exc}", "budget_exceeded", exc.left_micros
            ) from None
        except StoreUnavailable as exc:
            state.metrics.store_unavailable.labels("budgets").inc()
            raise BudgetRefusal(
                worker.name, 503, budget_store_down(exc).message, "budget_store_unavailable"
            ) from None
        self.holds.append(reservation)

    async def _settle(self, state: AppState, micros: int) -> None:
        """Settle the attempt's holds with `micros` (one settles, the others are released)."""
        holds, self.holds = self.holds, []
        if not holds:
            state.stores.budgets.record(self.tenant, micros)
            return
        await state.stores.budgets.settle(holds[0], micros)
        for extra in holds[1:]:
            await state.stores.budgets.release(extra)

    async def release(self, state: AppState) -> None:
        """Give up the current attempt: its holds go, except what its answered calls cost."""
        spent, self.unsettled = self.unsettled, Usage()
        if not self.holds and not spent.cost_usd:
            return
        micros = to_micros(spent.cost_usd)
        await self._settle(state, micros)
        self.settled.add(spent.prompt_tokens, spent.completion_tokens, spent.cost_usd)
        self.settled_micros += micros

    async def finish(
        self,
        state: AppState,
        worker: str | None,
        status: int,
        failures: list[WorkerError],
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cost: Decimal = Decimal(0),
        strategy: str | None = None,
        trace: dict | None = None,
    ) -> None:
        """Settle the budget holds with the actual cost, correct the token limits, write the ledger.

        The ledger record counts every call of the request, given-up attempts' included. Written in a
        task of its own, pending in the gateway's background work until it is (AppState.pending_books):
        the shutdown cancels the requests still running, and one cancelled while its settle waits on
        Redis lost its record and its settle, as the lifespan closed the ledger without waiting."""
        books = state.pending_books()
        try:
            await books.write(
                self._book(
                    state, worker, status, failures, prompt_tokens, completion_tokens, cost, strategy, trace
                )
            )
        finally:
            books.done()

    async def _book(
        self,
        state: AppState,
        worker: str | None,
        status: int,
        failures: list[WorkerError],
        prompt_tokens: int,
        completion_tokens: int,
        cost: Decimal,
        strategy: str | None,
        trace: dict | None,
    ) -> None:
        """`finish`'s bookkeeping, run to its end whatever happens to the request's task."""
        now = Usage(prompt_tokens, completion_tokens, cost)
        now.add(self.unsettled.prompt_tokens, self.unsettled.completion_tokens, self.unsettled.cost_usd)
        self.unsettled = Usage()
        micros = to_micros(now.cost_usd)
        await self._settle(state, micros)
        total = Usage(self.settled.prompt_tokens, self.settled.completion_tokens, self.settled.cost_usd)
        total.add(now.prompt_tokens, now.completion_tokens, now.cost_usd)
        if self.limits:
            await ratelimits.correct_tokens(
                state.stores.limiter, self.tenant, self.limits, total.prompt_tokens + total.completion_tokens
            )
        latency_ms = round((time.perf_counter() - self.started) * 1000, 2)
        query = stored_query(self.chat.last_user_text(), self.admission.data_class)  # a long one: head, tail
        log_access(
            self.request_id,
            self.tenant,
            self.chat.model,
            worker,
            strategy or self.decision.strategy,
            status,
            latency_ms,
            self.settled_micros + micros,
        )
        state.ledger.record_request(
            RequestRecord(
                id=self.request_id,
                tenant=self.tenant,
                model=self.chat.model,
                worker=worker,
                strategy=strategy or self.decision.strategy,
                status=status,
                prompt_tokens=total.prompt_tokens,
                completion_tokens=total.completion_tokens,
                cost_micros=self.settled_micros + micros,
                latency_ms=latency_ms,
                policy_version=self.admission.policy_version,
                router_version=self.router_version,
                data_class=self.admission.data_class,
                fallbacks=tuple(f.worker for f in failures),
                **query.record_fields(),
                turns=self.chat.user_turns(),
                trace=trace,
                route=self._route_log(state) if strategy is None else None,  # not for a composed one
            )
        )
        self.trace.settled(self, worker, status, strategy or self.decision.strategy, total.cost_usd, trace)

    def _route_log(self, state: AppState) -> dict | None:
        """How the router chose this request's worker (router/routelog.py), when it chose, with the λ
        in force and its source: the replay keeps a λ the request, tenant or operator fixed, and
        lets a candidate resolve its own otherwise."""
        if self.route is None:
            return None
        if self.cost_weight is None or self.cost_weight_source is None:
            resolved = cost_weight_of(self.route, state.settings.cost_weight)
            weight, source = resolved.value, resolved.source
        else:
            weight, source = self.cost_weight, self.cost_weight_source
        pool = (w.name for w in self.admission.pool)
        return route_log(self.decision, self.route, pool, weight, source)


def log_access(
    request_id: str,
    tenant: str,
    model: str,
    worker: str | None,
    strategy: str,
    status: int,
    latency_ms: float,
    cost_micros: int,
    extra: str = "",
) -> None:
    """The one access line of a request that reached the books (`extra`: an endpoint's own fields)."""
    access.info(
        "%s tenant=%s model=%s worker=%s strategy=%s status=%d latency_ms=%.0f cost_usd=%s%s",
        request_id,
        tenant,
        model,
        worker or "-",
        strategy,
        status,
        latency_ms,
        f"{cost_micros / 1e6:.6f}",
        f" {extra}" if extra else "",
    )


def refused(
    state: AppState,
    err: APIError,
    headers: dict[str, str],
    wire: Wire = OPENAI,
    endpoint: str = "",
    started: float | None = None,
    stream: bool = False,
) -> Response:
    """A request turned down before any worker was called: one access line, the error metric, and
    (`started`: when it arrived) its latency, as every request's."""
    err.headers = {**headers, **err.headers}
    if started is not None:
        state.metrics.observe_latency(started, stream)
    tracing.error(err, headers)
    access.info(
        "%s refused status=%d code=%s%s",
        headers.get("x-polyroute-request-id", "-"),
        err.status,
        err.code or err.type,
        f" endpoint={endpoint}" if endpoint else "",
    )
    state.metrics.errors.labels(err.code or err.type).inc()
    state.metrics.requests.labels("-", "-", str(err.status)).inc()
    return wire.error(err)


async def chat_completions(request: Request) -> Response:
    return await serve(request, OPENAI)


@tracing.traced  # the request's span (gateway/tracing.py); nothing when tracing is off
async def serve(request: Request, wire: Wire) -> Response:
    """The pipeline, whatever the client's API: auth, the body (read by `wire`), rate limits, memory,
    data class and policy, cache, routing, budgets, worker calls with fallback, ledger and metrics."""
    state: AppState = request.app.state.polyroute
    started = time.perf_counter()
    request_id = "req_" + uuid.uuid4().hex
    headers = {"x-polyroute-request-id": request_id}
    router = state.router.current  # one router for the whole request, even if a new model lands now
    engine = state.policy.engine  # one policy snapshot for the whole decision, even if a reload lands now
    catalog = state.catalog_for(request)  # one catalog for the whole request, prices included
    charged: list[Limit] = []  # the rate limits this request's tokens were charged to
    stream = False
    try:
        key = await state.auth.client(request)
        wire.authenticated(key.tenant)
        chat = await wire.read(request, state)
        stream = bool(chat.stream)
        tenant = engine.policy.tenants.get(key.tenant) if engine is not None else None
        limits = ratelimits.limits_under(
            engine, key, sum(estimate_tokens(chat.prompt_chars(), chat.output_budget()))
        )
        headers |= await ratelimits.enforce(state.stores.limiter, state.metrics, key.tenant, limits)
        charged = limits
        budget = tenant_budget(engine, key.tenant)
        spend = await budget_usage(state, key.tenant, budget)
        recalled = await memory.plan(request, state, key.tenant, chat)  # retrieval memory, or None
        memory_texts = (recalled.injected_text(),) if recalled is not None else ()
        # detection over megabytes: off the event loop, which serves everyone
        with tracing.step("policy"):
            admission = await heavy_if(
                is_large(request),
                admission_for,
                state,
                request,
                key.tenant,
                chat,
                engine,
                spend,
                memory_texts + wire.policy_texts(),
            )
        tracing.admitted(admission)
        if recalled is not None:
            recalled.withhold = withhold_above(engine, key.tenant, admission)
        headers = {**headers, **policy_headers(request_id, admission)}
        cache_plan = caching.plan(
            request,
            chat,
            key.tenant,
            tenant.cache if tenant is not None else None,
            # an answer is kept for the policy and the worker catalog it was made under: after an edit
            # of either (both hot-reloaded), the same request asks the workers again
            f"{admission.policy_version}@{catalog.digest or 'built-in'}",
            admission.data_class,
        )
        if recalled is not None:  # an answer built on collections that change is not cached
            cache_plan = None
        if (
            cache_plan is not None
            and (hit := await caching.lookup(state.stores.cache, cache_plan)) is not None
        ):
            return await _from_cache(
                state, request_id, key.tenant, chat, admission, router, limits, headers, hit, wire
            )
        if cache_plan is not None:  # a miss, whether or not an answer then comes to be stored
            state.metrics.cache.labels("miss").inc()
        route = route_request(request, chat, admission, tenant.cost_weight if tenant else None)
        with tracing.step("route"):
            decision = await decide(catalog, route, chat, admission, router)
            composition = await compose.plan(
                state, request, chat, route, decision, router, admission, recalled
            )
    except (APIError, StoreReplyError) as exc:  # StoreReplyError: e.g. the rate-limit script
        err = exc if isinstance(exc, APIError) else store_reply_error(exc)
        # refused before any worker call (policy, budget, store...): the tokens it was charged go back
        if charged:
            await ratelimits.give_back(state.stores.limiter, key.tenant, charged)
        return refused(state, err, headers, wire, started=started, stream=stream)
    weight = cost_weight_of(route, state.settings.cost_weight, router)
    exchange = Exchange(
        request_id,
        key.tenant,
        chat,
        admission,
        decision,
        router.version,
        {**headers, **route_headers(request_id, decision, admission, router)},
        budget=budget,
        limits=limits,
        cache=cache_plan,
        memory=recalled,
        route=route,
        cost_weight=weight.value,
        cost_weight_source=weight.source,
        degraded=composition if composition.degraded else None,
        explain=request.headers.get(compose.TRACE_HEADER) == "1",
        wire=wire,
        request=request,
    )
    # before each attempt, as before each step of a workflow: a reload may exclude a worker meanwhile
    exchange.admissible = still_admits(state, request, exchange)
    exchange.skip = composition.skip  # fast mode in place of a workflow: workers over the client's ceiling
    if cache_plan is not None:
        exchange.headers[caching.CACHE_HEADER] = "miss"
    if composition.note:
        exchange.headers[compose.COMPOSE_HEADER] = composition.note
    log.debug("request %s tenant=%s -> %s", request_id, key.tenant, [w.name for w in decision.workers])
    try:
        if composition.workflow is not None:
            composed = await compose.respond(state, request, exchange, composition)
            if composed is not None:
                return await wire.composed(composed)
            # the workflow auto chose produced no answer: fast mode over the workers it did not try
        if chat.stream:
            return await _stream(state, exchange)
        return await _complete(state, exchange)
    except StoreReplyError as exc:  # a reservation Redis rejected: this request stops here
        await exchange.finish(state, None, 500, [])
        return refused(state, store_reply_error(exc), exchange.headers, wire, started=started, stream=stream)


async def _from_cache(
    state: AppState,
    request_id,
    tenant,
    chat,
    admission,
    router,
    limits,
    headers,
    hit: caching.CachedAnswer,
    wire: Wire = OPENAI,
) -> Response:
    state.metrics.cache.labels("hit").inc()
    decision = RouteDecision((), "cache", "exact-match response cache", Decimal(0))
    exchange = Exchange(request_id, tenant, chat, admission, decision, router.version, headers, limits=limits)
    await exchange.finish(state, hit.worker, 200, [])
    state.metrics.requests.labels(hit.worker, "cache", "200").inc()
    state.metrics.observe_latency(exchange.started, chat.stream)
    headers = {
        **headers,
        "x-polyroute-worker": hit.worker,
        "x-polyroute-strategy": "cache",
        "x-polyroute-route-reason": decision.reason,
        "x-polyroute-cost-usd": "0",
        caching.CACHE_HEADER: "hit",
    }
    return wire.cached(hit.body, headers)


async def first_success(
    state: AppState, ex: Exchange, call, failures: list[WorkerError] | None = None
) -> tuple[object | None, list[WorkerError]]:
    """Try the decision's workers in order (all admissible) until one answers or one refuses for good.

    Each attempt first reserves the worker's predicted cost; a failed attempt releases it (keeping
    what its answered calls cost, see `Exchange.release`), so only the answering worker's hold is
    left for `Exchange.finish` to settle. `failures` (if given) is filled as attempts fail, so a
    caller whose deadline cuts this short still knows what was tried. Before each attempt the policy
    in force is asked again (`Exchange.admits`: a reload may have excluded the worker since the
    request was admitted), and before each retry of the same worker too (`Exchange.readmit`, which
    the retry loop asks through `Exchange.calls`); once the client has hung up (`Exchange.gone`) no
    attempt starts.
    """
    failures = [] if failures is None else failures
    with calling(ex.calls):  # each retry asks the policy in force too; a deadline's cut is kept
        return await _first_success(state, ex, call, failures)


async def _first_success(
    state: AppState, ex: Exchange, call, failures: list[WorkerError]
) -> tuple[object | None, list[WorkerError]]:
    too_long_for = 0  # the largest context window a worker found this prompt too long for
    for worker in ex.decision.workers:
        if worker.name in ex.skip:
            continue  # a workflow auto chose tried it, and produced no answer
        if too_long_for and worker.context_window <= too_long_for:
            continue  # the same prompt would overflow a window no larger
        if ex.gone:
            break  # nobody is waiting for the answer
        if not await ex.admits(worker):
            continue  # a policy reload since admission left it out
        try:
            await ex.hold(state, worker)
        except BudgetRefusal as err:
            failures.append(err)
            if not err.fallback:
                break
            continue
        try:
            return await call(worker, state.api_base(worker)), failures
        except WorkerError as err:
            if err.prompt_tokens or err.completion_tokens:  # an answer with nothing in it, still billed
                ex.spent(err.prompt_tokens, err.completion_tokens, err.cost_usd)
            await ex.release(state)
            failures.append(err)
            if err.context_exceeded:
                too_long_for = max(too_long_for, worker.context_window)
            if not err.fallback and not err.unsupported:  # a parameter another worker may have
                break
        except BaseException:  # cancelled (client gone, deadline) or a bug: no hold outlives the request
            await asyncio.shield(ex.release(state))
            raise
    return None, failures


class DeadlinePassed(Exception):
    """The request's total deadline (POLYROUTE_REQUEST_TIMEOUT_S) passed."""


async def _calls(state: AppState, ex: Exchange, call, failures: list[WorkerError]):
    """`first_success` within what is left of the request's deadline, booked when the request is
    cancelled meanwhile (the gateway shutting down: `_cut_at_shutdown`). The books stay pending in
    the gateway's background work from the first attempt until then (AppState.pending_books), so the
    shutdown, which cancels the request and then closes the ledger, waits for its record."""
    books = state.pending_books()
    try:
        return await _within(ex.remaining(state), first_success(state, ex, call, failures))
    except asyncio.CancelledError:
        await books.write(_cut_at_shutdown(state, ex, failures))
        raise
    finally:
        books.done()


async def _cut_at_shutdown(state: AppState, ex: Exchange, failures: list[WorkerError]) -> None:
    """Fast mode's calls were cancelled (the gateway shutting down) before an answer, as a workflow's
    steps are (gateway/compose.py `_ended_by`): the ledger records 503 with `trace.ended:
    "cancelled"`, and its attempts list the call the cancellation cut (outcome `cancelled`: it was
    sent, so the provider may bill it) after that worker's calls retried before it, and what the
    answered calls of the attempt cost (memory rounds) is billed. Nobody gets a response."""
    ex.cut = list(ex.calls.cut)  # labelled `cancelled` (503) by the retry loop
    trace = {**(_degraded_trace(ex, None, Usage(), failures) or {}), "ended": "cancelled"}
    status = 503
    tried = [*given_up(failures), *ex.cut]
    await ex.finish(state, None, status, failures, trace=trace)
    ex.trace.error(status, "cancelled")
    _count_unanswered(state, ex, "cancelled", None, status)  # as the ledger: nobody answered
    log.warning(
        "request %s: cancelled while calling workers (the gateway is shutting down); %d call(s) given up",
        ex.request_id,
        len(tried),
    )


async def _within(seconds: float, awaitable):
    """`awaitable` bounded by `seconds`; DeadlinePassed when the bound, not something inside, timed out."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            return await awaitable
    except TimeoutError:
        if limit.expired():
            raise DeadlinePassed from None
        raise


class StreamDeadline:
    """The request's deadline over a stream's reads: one timer for the whole stream, not one armed
    and cancelled per chunk (`asyncio.timeout` around each read). When the deadline
    passes while the stream waits on the worker, the read is cancelled; when it passes while a chunk
    is on its way to the client, the next read ends the stream. Create it in the task that reads."""

    def __init__(self, seconds: float) -> None:
        self._task = asyncio.current_task()
        self._reading = False
        self.expired = False
        self._timer = asyncio.get_running_loop().call_later(max(seconds, 0.0), self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self._reading and self._task is not None:
            self._task.cancel()

    async def read(self, chunks: AsyncIterator[dict]) -> dict:
        """The next chunk; DeadlinePassed once the deadline has passed; StopAsyncIteration at the end."""
        if self.expired:
            raise DeadlinePassed
        self._reading = True
        try:
            return await anext(chunks)
        except asyncio.CancelledError:
            if self.expired and self._task is not None and self._task.uncancel() == 0:
                raise DeadlinePassed from None  # our cancellation, and nobody else's
            raise
        finally:
            self._reading = False

    def close(self) -> None:
        self._timer.cancel()


def _deadline_error(state: AppState, failures: list[WorkerError], cut: list[Attempt]) -> APIError:
    tried = "; ".join(f"{f.worker}: {f.message}" for f in failures)
    cut_short = next(
        (f", which cut the call of {a.worker} short" for a in cut if a.outcome == "deadline"), ""
    )
    return APIError(
        504,
        f"No worker answered within the request's deadline of {state.settings.request_timeout_s:g} s "
        f"(retries and fallbacks included){cut_short}{'; before that: ' + tried if tried else ''}",
        type="server_error",
        code="request_timeout",
    )


LEFT_OUT_HEADER = "x-polyroute-left-out"  # workers a policy reload left out after admission
# the client's parameters the answering worker's request went without, as /v1/messages names the
# fields it accepts and does not forward (gateway/anthropic.py)
IGNORED_HEADER = "x-polyroute-ignored"


def note_ignored(state: AppState, ex: Exchange, worker) -> None:
    """Keep which of the client's parameters the answering ``worker``'s request went without,
    though litellm raised no error (`user` for an OpenAI-wire model outside OpenAI's catalog,
    `response_format: json_object` for Anthropic): the client is told (IGNORED_HEADER) and the
    ledger's trace says so (`ignored_params`). Named, not forced on the worker: a provider that
    refuses unknown fields (Mistral's API) would fail the request instead. A dict lookup once the
    worker's provider has met these parameters' shapes (wire.ignored_params); no provider call."""
    ex.ignored = state.client.ignored_params(worker, state.api_base(worker), ex.chat)


def _answered_headers(ex: Exchange, answer, failures: list[WorkerError]) -> dict[str, str]:
    headers = {**ex.headers, "x-polyroute-worker": answer.worker.name}
    if failures:
        headers["x-polyroute-fallbacks"] = ",".join(f.worker for f in failures)
    # in chat completions' names: the other APIs' wires rename them (gateway/anthropic.py, responses.py)
    if ex.ignored:
        headers[IGNORED_HEADER] = ",".join(ex.ignored)
    return headers | attempts_header(given_up(failures, answer)) | _left_out(ex)


def _left_out(ex: Exchange) -> dict[str, str]:
    """The header naming the workers a policy reload left out of this request's attempts (the
    reasons are in the ledger's trace, `excluded_by_policy`)."""
    return {LEFT_OUT_HEADER: ",".join(ex.excluded)} if ex.excluded else {}


def _left_out_note(ex: Exchange) -> str:
    return "; ".join(f"{name}: {why}" for name, why in ex.excluded.items())


def _nobody_left(ex: Exchange) -> APIError:
    """Every worker left to try was excluded by a policy reload since the request was admitted, so
    none was called: refused as the policy in force would have refused it (fail closed)."""
    return APIError(
        403,
        "The policy in force, reloaded since this request was admitted, admits none of its workers; "
        f"no worker was called. {_left_out_note(ex)}",
        type="permission_error",
        code="policy_denied",
    )


async def _complete(state: AppState, ex: Exchange) -> Response:
    failures: list[WorkerError] = []  # filled as attempts fail: the deadline's 504 names them

    async def call(worker, base) -> Completion:
        result = await memory.complete(state, ex, worker, base)
        if not result.body.get("choices"):
            raise no_choices(result)
        return result

    watcher = asyncio.create_task(_watch_client(ex)) if ex.request is not None else None
    late: APIError | None = None
    try:
        result, failures = await _calls(state, ex, call, failures)
    except DeadlinePassed:
        ex.cut_at_deadline()
        result, late = None, _deadline_error(state, failures, ex.cut)
    finally:
        if watcher is not None:  # its read of the connection ends before the response's begins
            watcher.cancel()
            await asyncio.wait([watcher])
    assert result is None or isinstance(result, Completion)
    if result is not None:
        note_ignored(state, ex, result.worker)
    if ex.gone:
        return await _client_gone(state, ex, result, failures)
    if result is None:
        return await _failed(state, ex, failures, late)
    headers = _answered_headers(ex, result, failures)
    headers["x-polyroute-cost-usd"] = format_cost(result.cost_usd + ex.settled.cost_usd)
    trace = _answer_trace(ex, result, failures)
    await ex.finish(
        state,
        result.worker.name,
        200,
        failures,
        result.prompt_tokens,
        result.completion_tokens,
        result.cost_usd,
        trace=trace,
    )
    if ex.cache is not None:  # its miss was counted at the lookup
        await caching.store(state.stores.cache, ex.cache, result.worker.name, result.body)
    body = result.body
    if trace is not None and ex.explain:  # after caching: a cached answer carries no stale trace
        body = {**body, "polyroute": {**(body.get("polyroute") or {}), "trace": trace}}
    state.metrics.requests.labels(result.worker.name, ex.decision.strategy, "200").inc()
    state.metrics.observe_latency(ex.started)
    judged = state.judge.sample(state, ex, result.worker.name, completion_text(result.body))
    return ex.wire.answer(
        body,
        headers,
        BackgroundTask(state.judge.start, state, judged) if judged else None,  # after sending
    )


def no_choices(result: Completion) -> WorkerError:
    """A 200 with empty `choices` is no answer (an SDK user's `choices[0]` fails): a failure `auto`
    falls back from, not retried (the worker answered, and billed it: it is on the books)."""
    err = WorkerError(
        result.worker.name, 502, "502 the worker answered with no choices (no message)", fallback=True
    )
    err.prompt_tokens, err.completion_tokens = result.prompt_tokens, result.completion_tokens
    err.cost_usd = result.cost_usd
    err.attempts = (*result.attempts, Attempt(result.worker.name, "empty_answer", 502, True))
    return err


def _degraded_trace(ex: Exchange, worker: str | None, usage, failures: list[WorkerError]) -> dict | None:
    """Fast mode's trace (ledger, and the client with explain): a workflow answered in fast mode is
    still traced as such, and the workers a policy reload left out are named, with why."""
    trace = None
    if ex.degraded is not None:
        trace = compose.degraded_trace(
            ex.degraded, worker, usage.prompt_tokens, usage.completion_tokens, usage.cost_usd, failures
        )
    if ex.excluded:
        trace = {**(trace or {}), "excluded_by_policy": dict(ex.excluded)}
    if ex.ignored:
        trace = {**(trace or {}), "ignored_params": list(ex.ignored)}
    return with_attempts(trace, [*given_up(failures, usage), *ex.cut])


def _answer_trace(ex: Exchange, result: Completion, failures: list[WorkerError]) -> dict | None:
    trace = _degraded_trace(ex, result.worker.name, result, failures)
    if result.usage_estimated:  # the ledger says the counts are not the provider's, as for a stream
        trace = {**(trace or {}), "usage": "estimated"}
    return trace


async def _watch_client(ex: Exchange) -> None:
    """Mark the request `gone` when its client hangs up while workers are called."""
    assert ex.request is not None
    if await compose.hung_up(ex.request):
        ex.gone = True
        log.info(
            "request %s: the client hung up before its answer; no further worker is tried", ex.request_id
        )


async def _client_gone(
    state: AppState, ex: Exchange, result: Completion | None, failures: list[WorkerError]
) -> Response:
    """The client hung up before its (plain) answer: the call in flight was let finish, as a workflow's
    steps are, so what it cost is known and billed, not guessed; no attempt started after the hang-up;
    nobody gets the answer, and the ledger says 499, as for a stream the client leaves."""
    ended = {"ended": "client_disconnected"}
    if result is not None:
        trace = {**(_answer_trace(ex, result, failures) or {}), **ended}
        worker, usage = result.worker.name, result
    else:
        trace = {**(_degraded_trace(ex, None, Usage(), failures) or {}), **ended}
        worker, usage = None, Usage()
    status = STREAM_STATUS["client_disconnected"]
    await ex.finish(
        state,
        worker,
        status,
        failures,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cost_usd,
        trace=trace,
    )
    ex.trace.error(status, "client_disconnected")
    _count_unanswered(state, ex, "client_disconnected", worker, status)
    err = APIError(status, "the client closed the request before its answer", code="client_disconnected")
    err.headers = {**ex.headers, **_left_out(ex)}
    return ex.wire.error(err)


async def _failed(
    state: AppState, ex: Exchange, failures: list[WorkerError], err: APIError | None = None
) -> Response:
    """No answer. What given-up attempts' answered calls cost (memory rounds) is still billed."""
    if err is None:
        err = final_error(failures) if failures else _nobody_left(ex)
        if failures and ex.excluded:  # why the workers after those are not in the message
            err.message += (
                f" Left out by a policy reload since the request was admitted: {_left_out_note(ex)}"
            )
    worker = failures[-1].worker if failures else "-"
    err.headers = {
        **ex.headers,
        **err.headers,
        **_left_out(ex),
        **attempts_header([*given_up(failures), *ex.cut]),
        "x-polyroute-cost-usd": format_cost(ex.settled.cost_usd),
        "x-polyroute-worker": worker,
    }
    ex.trace.error(err.status, err.code or err.type)
    # a workflow answered in fast mode, and nobody answered: traced as such (and who was left out)
    trace = _degraded_trace(ex, None, Usage(), failures)
    await ex.finish(state, None, err.status, failures, trace=trace)
    _count_unanswered(state, ex, err.code or err.type, None, err.status)  # as the ledger: nobody answered
    return ex.wire.error(err)


def _count_unanswered(state: AppState, ex: Exchange, error: str, worker: str | None, status: int) -> None:
    """Fast mode's request that ended without an answer for its client (failed, cut at shutdown, its
    client gone), in the error, request and latency metrics: the slowest requests are often these
    (retries, fallbacks, the deadline), so they count in the latency too. `worker` is the one its
    ledger record names (None: "-"), not the last that failed, so the metric and the books agree."""
    state.metrics.errors.labels(error).inc()
    state.metrics.requests.labels(worker or "-", ex.decision.strategy, str(status)).inc()
    state.metrics.observe_latency(ex.started, ex.chat.stream)


class EventStream(StreamingResponse):
    """SSE whose generator is closed the moment the response ends, however it ends. A client that
    hangs up is then billed at once (see `_sse`), not whenever the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def _stream(state: AppState, ex: Exchange) -> Response:
    failures: list[WorkerError] = []  # filled as attempts fail: the deadline's 504 names them

    def call(worker, base):
        return memory.open_stream(state, ex, worker, base)

    try:
        stream, failures = await _calls(state, ex, call, failures)
    except DeadlinePassed:  # before the first byte: a plain 504
        ex.cut_at_deadline()
        return await _failed(state, ex, failures, _deadline_error(state, failures, ex.cut))
    if stream is None:
        return await _failed(state, ex, failures)
    assert isinstance(stream, OpenStream)
    note_ignored(state, ex, stream.worker)
    headers = _answered_headers(ex, stream, failures)
    # Headers leave before the answer: this is the prompt-side cost; the final usage chunk carries
    # the actual total under "polyroute".
    headers |= {
        "x-polyroute-cost-usd": format_cost(stream.prompt_cost_usd + ex.settled.cost_usd),
        "x-polyroute-cost-basis": "prompt-estimate",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    body = _sse(state, ex, stream, failures, include_usage=_wants_usage(ex.chat))
    ex.trace.hold_open()  # the request's span ends when the stream is settled
    return ex.wire.stream(body, headers)


def _wants_usage(chat: ChatCompletionRequest) -> bool:
    return bool(chat.stream_options and chat.stream_options.include_usage)


# How a stream ended -> the ledger's status for it.
STREAM_STATUS = {"completed": 200, "mid_stream_error": 502, "deadline": 504, "client_disconnected": 499}


def _error_event(message: str, code: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


async def _sse(
    state: AppState, ex: Exchange, stream: OpenStream, failures: list[WorkerError], include_usage: bool
) -> AsyncIterator[bytes]:
    """The worker's chunks as SSE, each read within what is left of the request's deadline.

    However the stream ends, what was streamed is billed: the provider's usage when it arrived,
    otherwise the prompt and the text sent so far, counted here and marked as an estimate in the
    ledger (trace.usage). The ledger status says how it ended: 200, 502 (the worker failed
    mid-stream), 504 (the deadline passed: the client gets an error event) or 499 (the client hung up).
    """
    worker = stream.worker.name
    outcome = "completed"
    chunks = stream.__aiter__()
    deadline = StreamDeadline(ex.remaining(state))

    async def read() -> AsyncIterator[dict]:
        """The worker's chunks, each within the deadline; the usage chunk says what it cost."""
        while True:
            try:
                chunk = await deadline.read(chunks)
            except StopAsyncIteration:
                return
            if chunk.get("usage") and not chunk.get("choices"):
                chunk["polyroute"] = {
                    "worker": worker,
                    "cost_usd": format_cost(stream.cost_usd),
                    # the provider streamed no usage: these counts are litellm's tokenizer (or 4
                    # characters a token) over the prompt and the streamed text, not the worker's own
                    "usage": "estimated" if stream.usage_estimated else "reported",
                }
                if ex.explain and (trace := _degraded_trace(ex, worker, stream, failures)) is not None:
                    chunk["polyroute"]["trace"] = trace
            yield chunk

    feed = read()
    frames = ex.wire.frames(feed, worker, include_usage)
    try:
        async for frame in frames:
            yield frame
    except WorkerError as err:
        outcome = "mid_stream_error"
        log.warning("stream from %s failed mid-way: %s", worker, err.message)
        yield ex.wire.error_event(
            f"worker {worker} failed mid-stream: {err.message}", "upstream_stream_error"
        )
    except DeadlinePassed:
        outcome = "deadline"
        log.warning("stream from %s cut at the request's deadline", worker)
        yield ex.wire.error_event(
            f"the request's deadline of {state.settings.request_timeout_s:g} s passed mid-stream; "
            "what was streamed is billed",
            "request_timeout",
        )
    except (GeneratorExit, asyncio.CancelledError):  # the client hung up (closed, or cancelled by starlette)
        outcome = "client_disconnected"
        raise
    finally:
        deadline.close()
        trace = None
        if outcome != "completed":
            estimated = stream.account_cut()
            trace = {"stream": outcome, "usage": "estimated" if estimated else "reported"}
            state.metrics.errors.labels(outcome).inc()
        elif stream.usage_estimated:
            trace = {"usage": "estimated"}  # the ledger says the counts are not the provider's
        if (degraded := _degraded_trace(ex, worker, stream, failures)) is not None:
            trace = {**degraded, **(trace or {})}
        # The settle runs as its own task: a client that hangs up cancels this generator, not the books.
        state.spawn(
            ex.finish(
                state,
                worker,
                STREAM_STATUS[outcome],
                failures,
                stream.prompt_tokens,
                stream.completion_tokens,
                stream.cost_usd,
                trace=trace,
            )
        )
        if outcome == "completed" and (judged := state.judge.sample(state, ex, worker, stream.text)):
            await state.judge.start(state, judged)  # its own task: the stream has been sent
        # the HTTP status the ledger records (502, 504, 499), so an alert on 5xx sees streams cut mid-way
        state.metrics.requests.labels(worker, ex.decision.strategy, str(STREAM_STATUS[outcome])).inc()
        state.metrics.observe_latency(ex.started, stream=True)
        for closable in (frames, feed, chunks):  # the last releases the upstream connection now
            try:
                await closable.aclose()
            except Exception:
                log.debug("closing the stream of %s failed", worker, exc_info=True)
    if tail := ex.wire.done():
        yield tail
