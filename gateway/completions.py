"""POST /v1/chat/completions: auth → validation → admission → routing → worker calls → response.

Fallback walks the router's ranking, which holds only admissible workers; a pinned worker gets
retries but no fallback (the client named it). A stream falls back only before its first byte;
after that, a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import caching, compose, memory, ratelimits
from gateway.body import read_model
from gateway.errors import APIError, error_response
from gateway.ledger import RequestRecord, storable_query
from gateway.schemas import ChatCompletionRequest
from gateway.state import AppState
from gateway.store import BudgetExceeded, Limit, Limits, Reservation, StoreUnavailable, to_micros
from gateway.upstream import Completion, OpenStream, WorkerError
from policies import Admission, PolicyRequest, PolicyRequestError, Spend, estimate_tokens, predicted_cost
from router import RouteDecision, RouteRequest, estimate_cost

log = logging.getLogger("polyroute.gateway")

AUTO = "auto"


def format_cost(cost: Decimal) -> str:
    return f"{cost.quantize(Decimal('0.000000001')):f}"


DATA_CLASS_HEADER = "x-polyroute-data-class"
COST_WEIGHT_HEADER = "x-polyroute-cost-weight"


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
    if engine is None:
        raise APIError(
            503,
            f"No valid policy is loaded, so no worker may be called: {state.policy.last_error}",
            type="server_error",
            code="policy_unavailable",
        )
    version = {"x-polyroute-policy-version": engine.version}
    # A workflow (compose:<name>) draws from the same pool as auto, under the same rules.
    model = AUTO if chat.model.startswith(compose.PREFIX) else chat.model
    known = model == AUTO or model in engine.policy.aliases or state.catalog.get(model)
    if not known:
        names = [
            "auto",
            *(compose.PREFIX + w for w in compose.WORKFLOWS),
            *engine.policy.aliases,
            *state.catalog.names,
        ]
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
    try:
        return engine.evaluate(policy_request, state.catalog, state.down_workers())
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
    """403 when rules emptied the pool (naming them), 503 when workers simply cannot be called."""
    listed = "; ".join(f"{e.worker}: {e.reason} [{e.rule}]" for e in admission.excluded)
    if admission.denied_by_policy:
        rules = sorted({e.rule for e in admission.denied_by_policy})
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


def _float_param(value: object, name: str, low: float, high: float | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not (number >= low and (high is None or number <= high)):
        bound = f"between {low:g} and {high:g}" if high is not None else f">= {low:g}"
        raise APIError(400, f"{name} must be a number {bound}", param=name, code="invalid_value")
    return number


def route_request(
    request: Request, chat: ChatCompletionRequest, admission: Admission, tenant_weight
) -> RouteRequest:
    """What the router sees: sizes, the last user message, λ (request > header > tenant) or a target."""
    metadata = chat.metadata or {}
    weight = _float_param(
        metadata.get("cost_weight", request.headers.get(COST_WEIGHT_HEADER)), "metadata.cost_weight", 0, None
    )
    return RouteRequest(
        prompt_chars=chat.prompt_chars(),
        max_output_tokens=chat.output_budget(),
        needs_tools=bool(chat.tools),
        prefer_fewer_active_params=admission.prefer_fewer_active_params,
        text=chat.last_user_text(),
        turns=chat.user_turns(),
        cost_weight=weight if weight is not None else tenant_weight,
        min_quality=_float_param(metadata.get("min_quality"), "metadata.min_quality", 0, 1),
    )


async def decide(
    state: AppState, route: RouteRequest, chat: ChatCompletionRequest, admission: Admission, router
):
    """The ordered workers to try, all from the pool, or the OpenAI error that explains why none."""
    worker = state.catalog.get(chat.model)
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
    if not last.fallback:  # the request itself was refused upstream: the client must change it
        return APIError(last.status if 400 <= last.status < 500 else 400, summary, code="upstream_rejected")
    if all(f.status == 429 for f in failures):
        return APIError(
            429,
            f"All workers are rate limited. {summary}",
            type="rate_limit_error",
            code="upstream_rate_limited",
            headers={"retry-after": "1"},
        )
    if all(f.status == 504 for f in failures):
        return APIError(
            504, f"All workers timed out. {summary}", type="server_error", code="upstream_timeout"
        )
    return APIError(
        502, f"All admissible workers failed. {summary}", type="server_error", code="upstream_failed"
    )


class BudgetRefusal(WorkerError):
    """A worker skipped because reserving its predicted cost would overspend (or cannot be checked)."""

    def __init__(self, worker: str, status: int, message: str, code: str) -> None:
        super().__init__(worker, status, message, fallback=status == 403)
        self.code = code


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
        raise _budget_store_down(exc) from None


def _budget_store_down(exc: Exception) -> APIError:
    return APIError(
        503,
        f"This tenant has a budget and the budget store cannot be reached, so no worker is called "
        f"(budgets fail closed): {exc}",
        type="server_error",
        code="budget_store_unavailable",
        headers={"retry-after": "1"},
    )


@dataclass
class Exchange:
    """One request's context from decision to ledger: its holds on budgets and limits included."""

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
    reservation: Reservation | None = None
    started: float = field(default_factory=time.perf_counter)
    memory: memory.MemoryPlan | None = None  # context from collections/session (gateway/memory.py)

    async def hold(self, state: AppState, worker, micros: int | None = None) -> None:
        """Reserve this worker's predicted cost (or `micros`) on the tenant's budget before calling it."""
        if not self.budget.any:
            return
        if micros is None:
            micros = to_micros(predicted_cost(worker, self.chat.prompt_chars(), self.chat.output_budget()))
        try:
            self.reservation = await state.stores.budgets.reserve(self.tenant, micros, self.budget)
        except BudgetExceeded as exc:
            raise BudgetRefusal(worker.name, 403, f"budget:{exc.period}: {exc}", "budget_exceeded") from None
        except StoreUnavailable as exc:
            state.metrics.store_unavailable.labels("budgets").inc()
            raise BudgetRefusal(
                worker.name, 503, _budget_store_down(exc).message, "budget_store_unavailable"
            ) from None

    async def release(self, state: AppState) -> None:
        if self.reservation is not None:
            reservation, self.reservation = self.reservation, None
            await state.stores.budgets.release(reservation)

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
        """Settle the budget hold with the actual cost, correct the token limits, write the ledger."""
        micros = to_micros(cost)
        if self.reservation is not None:
            reservation, self.reservation = self.reservation, None
            await state.stores.budgets.settle(reservation, micros)
        else:
            state.stores.budgets.record(self.tenant, micros)
        if self.limits:
            await ratelimits.correct_tokens(
                state.stores.limiter, self.tenant, self.limits, prompt_tokens + completion_tokens
            )
        state.ledger.record_request(
            RequestRecord(
                id=self.request_id,
                tenant=self.tenant,
                model=self.chat.model,
                worker=worker,
                strategy=strategy or self.decision.strategy,
                status=status,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cost_micros=micros,
                latency_ms=round((time.perf_counter() - self.started) * 1000, 2),
                policy_version=self.admission.policy_version,
                router_version=self.router_version,
                data_class=self.admission.data_class,
                fallbacks=tuple(f.worker for f in failures),
                query=storable_query(self.chat.last_user_text(), self.admission.data_class),
                turns=self.chat.user_turns(),
                trace=trace,
            )
        )


def _refused(state: AppState, err: APIError, headers: dict[str, str]) -> Response:
    err.headers = {**headers, **err.headers}
    state.metrics.errors.labels(err.code or err.type).inc()
    state.metrics.requests.labels("-", "-", str(err.status)).inc()
    return error_response(err)


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.polyroute
    request_id = "req_" + uuid.uuid4().hex
    headers = {"x-polyroute-request-id": request_id}
    router = state.router.current  # one router for the whole request, even if a new model lands now
    engine = state.policy.engine  # one policy snapshot for the whole decision, even if a reload lands now
    try:
        key = state.auth.client(request)
        chat = await read_model(request, ChatCompletionRequest, state.settings.max_body_bytes)
        tenant = engine.policy.tenants.get(key.tenant) if engine is not None else None
        rate = tenant.rate_limit if tenant is not None else None
        limits = ratelimits.limits_for(
            key,
            rate.rpm if rate else None,
            rate.tpm if rate else None,
            sum(estimate_tokens(chat.prompt_chars(), chat.output_budget())),
        )
        headers |= await ratelimits.enforce(state.stores.limiter, state.metrics, key.tenant, limits)
        budget = tenant_budget(engine, key.tenant)
        spend = await budget_usage(state, key.tenant, budget)
        recalled = await memory.plan(request, state, key.tenant, chat)  # retrieval memory, or None
        memory_texts = (recalled.injected_text(),) if recalled is not None else ()
        admission = admission_for(state, request, key.tenant, chat, engine, spend, memory_texts)
        if recalled is not None:
            recalled.withhold = withhold_above(engine, key.tenant, admission)
        headers = {**headers, **policy_headers(request_id, admission)}
        cache_plan = caching.plan(
            request,
            chat,
            key.tenant,
            tenant.cache if tenant is not None else None,
            admission.policy_version,
            admission.data_class,
        )
        if recalled is not None:  # an answer built on collections that change is not cached
            cache_plan = None
        if (
            cache_plan is not None
            and (hit := await caching.lookup(state.stores.cache, cache_plan)) is not None
        ):
            return await _from_cache(
                state, request_id, key.tenant, chat, admission, router, limits, headers, hit
            )
        route = route_request(request, chat, admission, tenant.cost_weight if tenant else None)
        decision = await decide(state, route, chat, admission, router)
        composition = await compose.plan(state, request, chat, route, decision, router)
    except APIError as err:
        return _refused(state, err, headers)
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
    )
    if cache_plan is not None:
        exchange.headers[caching.CACHE_HEADER] = "miss"
    if composition.note:
        exchange.headers[compose.COMPOSE_HEADER] = composition.note
    if composition.workflow is not None:
        return await compose.respond(state, request, exchange, composition)
    log.debug("request %s tenant=%s -> %s", request_id, key.tenant, [w.name for w in decision.workers])
    if chat.stream:
        return await _stream(state, exchange)
    return await _complete(state, exchange)


async def _from_cache(
    state: AppState, request_id, tenant, chat, admission, router, limits, headers, hit: caching.CachedAnswer
) -> Response:
    state.metrics.cache.labels("hit").inc()
    decision = RouteDecision((), "cache", "exact-match response cache", Decimal(0))
    exchange = Exchange(request_id, tenant, chat, admission, decision, router.version, headers, limits=limits)
    await exchange.finish(state, hit.worker, 200, [])
    state.metrics.requests.labels(hit.worker, "cache", "200").inc()
    headers = {
        **headers,
        "x-polyroute-worker": hit.worker,
        "x-polyroute-strategy": "cache",
        "x-polyroute-route-reason": decision.reason,
        "x-polyroute-cost-usd": "0",
        caching.CACHE_HEADER: "hit",
    }
    return Response(hit.body, media_type="application/json", headers=headers)


async def first_success(state: AppState, ex: Exchange, call) -> tuple[object | None, list[WorkerError]]:
    """Try the decision's workers in order (all admissible) until one answers or one refuses for good.

    Each attempt first reserves the worker's predicted cost; a failed attempt releases it, so only
    the answering worker's hold is left for `Exchange.finish` to settle.
    """
    failures: list[WorkerError] = []
    for worker in ex.decision.workers:
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
            await ex.release(state)
            failures.append(err)
            if not err.fallback:
                break
        except BaseException:  # cancelled (client gone) or a bug: the hold must not outlive the request
            await asyncio.shield(ex.release(state))
            raise
    return None, failures


def _answered_headers(headers: dict[str, str], worker: str, failures: list[WorkerError]) -> dict[str, str]:
    headers = {**headers, "x-polyroute-worker": worker}
    if failures:
        headers["x-polyroute-fallbacks"] = ",".join(f.worker for f in failures)
    return headers


async def _complete(state: AppState, ex: Exchange) -> Response:
    result, failures = await first_success(
        state, ex, lambda worker, base: memory.complete(state, ex, worker, base)
    )
    if result is None:
        return await _failed(state, ex, failures)
    assert isinstance(result, Completion)
    headers = _answered_headers(ex.headers, result.worker.name, failures)
    headers["x-polyroute-cost-usd"] = format_cost(result.cost_usd)
    await ex.finish(
        state,
        result.worker.name,
        200,
        failures,
        result.prompt_tokens,
        result.completion_tokens,
        result.cost_usd,
    )
    if ex.cache is not None:
        state.metrics.cache.labels("miss").inc()
        await caching.store(state.stores.cache, ex.cache, result.worker.name, result.body)
    state.metrics.requests.labels(result.worker.name, ex.decision.strategy, "200").inc()
    state.metrics.latency.labels("false").observe(time.perf_counter() - ex.started)
    return Response(orjson.dumps(result.body), media_type="application/json", headers=headers)


async def _failed(state: AppState, ex: Exchange, failures: list[WorkerError]) -> Response:
    err = final_error(failures)
    worker = failures[-1].worker if failures else "-"
    err.headers = {**ex.headers, **err.headers, "x-polyroute-cost-usd": "0", "x-polyroute-worker": worker}
    await ex.finish(state, None, err.status, failures)
    state.metrics.errors.labels(err.code or err.type).inc()
    state.metrics.requests.labels(worker, ex.decision.strategy, str(err.status)).inc()
    return error_response(err)


async def _stream(state: AppState, ex: Exchange) -> Response:
    stream, failures = await first_success(
        state, ex, lambda worker, base: memory.open_stream(state, ex, worker, base)
    )
    if stream is None:
        return await _failed(state, ex, failures)
    assert isinstance(stream, OpenStream)
    headers = _answered_headers(ex.headers, stream.worker.name, failures)
    # Headers leave before the answer: this is the prompt-side cost; the final usage chunk carries
    # the actual total under "polyroute".
    headers |= {
        "x-polyroute-cost-usd": format_cost(stream.prompt_cost_usd),
        "x-polyroute-cost-basis": "prompt-estimate",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    body = _sse(state, ex, stream, failures, include_usage=_wants_usage(ex.chat))
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def _wants_usage(chat: ChatCompletionRequest) -> bool:
    return bool(chat.stream_options and chat.stream_options.include_usage)


async def _sse(
    state: AppState, ex: Exchange, stream: OpenStream, failures: list[WorkerError], include_usage: bool
) -> AsyncIterator[bytes]:
    worker = stream.worker.name
    status = "200"
    try:
        async for chunk in stream:
            if chunk.get("usage") and not chunk.get("choices"):
                if not include_usage:
                    continue
                chunk["polyroute"] = {"worker": worker, "cost_usd": format_cost(stream.cost_usd)}
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    except WorkerError as err:
        status = "mid_stream_error"
        state.metrics.errors.labels("mid_stream_error").inc()
        log.warning("stream from %s failed mid-way: %s", worker, err.message)
        error = {
            "message": f"worker {worker} failed mid-stream: {err.message}",
            "type": "server_error",
            "param": None,
            "code": "upstream_stream_error",
        }
        yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
    finally:
        # What was streamed is spent, even if cut short (the ledger marks a cut stream as 502). The
        # settle runs as its own task: a client that hangs up cancels this generator, not the books.
        state.spawn(
            ex.finish(
                state,
                worker,
                200 if status == "200" else 502,
                failures,
                stream.prompt_tokens,
                stream.completion_tokens,
                stream.cost_usd,
            )
        )
        state.metrics.requests.labels(worker, ex.decision.strategy, status).inc()
        state.metrics.latency.labels("true").observe(time.perf_counter() - ex.started)
    yield b"data: [DONE]\n\n"
