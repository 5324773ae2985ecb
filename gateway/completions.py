"""POST /v1/chat/completions: auth → validation → admission → routing → worker calls → response.

Fallback walks the router's ranking, which holds only admissible workers; a pinned worker gets
retries but no fallback (the client named it). A stream falls back only before its first byte;
after that, a failure ends the stream with an error event.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.body import read_model
from gateway.errors import APIError, error_response
from gateway.schemas import ChatCompletionRequest
from gateway.state import AppState
from gateway.upstream import Completion, OpenStream, WorkerError
from policies import Admission, PolicyRequest, PolicyRequestError
from router import RouteDecision, RouteRequest

log = logging.getLogger("polyroute.gateway")

AUTO = "auto"


def format_cost(cost: Decimal) -> str:
    return f"{cost.quantize(Decimal('0.000000001')):f}"


DATA_CLASS_HEADER = "x-polyroute-data-class"


def admission_for(state: AppState, request: Request, tenant: str, chat: ChatCompletionRequest) -> Admission:
    """Ask the policy in force which workers may serve this request. Fails closed."""
    engine = state.policy.engine  # one snapshot for the whole decision, even if a reload lands now
    if engine is None:
        raise APIError(
            503,
            f"No valid policy is loaded, so no worker may be called: {state.policy.last_error}",
            type="server_error",
            code="policy_unavailable",
        )
    version = {"x-polyroute-policy-version": engine.version}
    known = chat.model == AUTO or chat.model in engine.policy.aliases or state.catalog.get(chat.model)
    if not known:
        names = ["auto", *engine.policy.aliases, *state.catalog.names]
        raise APIError(
            404,
            f"The model '{chat.model}' does not exist. Use one of: {', '.join(names)}",
            code="model_not_found",
            param="model",
            headers=version,
        )
    policy_request = PolicyRequest(
        tenant=tenant,
        model=chat.model,
        texts=chat.texts(),
        data_class=chat.metadata_str("data_class") or request.headers.get(DATA_CLASS_HEADER),
        prompt_chars=chat.prompt_chars(),
        max_output_tokens=chat.output_budget(),
        spend=state.spend.spend(tenant),
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


def decide(state: AppState, chat: ChatCompletionRequest, admission: Admission) -> RouteDecision:
    """The ordered workers to try, all from the pool, or the OpenAI error that explains why none."""
    route = RouteRequest(
        chat.prompt_chars(), chat.output_budget(), bool(chat.tools), admission.prefer_fewer_active_params
    )
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
        cost = state.router.route(route, (worker,)).predicted_cost_usd
        return RouteDecision((worker,), "pinned", "pinned by the request", cost)
    if not admission.pool:
        raise _denied(admission, "this request")
    return state.router.route(route, admission.pool)


def route_headers(request_id: str, decision: RouteDecision, admission: Admission) -> dict[str, str]:
    return {
        **policy_headers(request_id, admission),
        "x-polyroute-strategy": decision.strategy,
        "x-polyroute-route-reason": decision.reason,
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


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.polyroute
    started = time.perf_counter()
    request_id = "req_" + uuid.uuid4().hex
    headers = {"x-polyroute-request-id": request_id}
    try:
        key = state.auth.client(request)
        chat = await read_model(request, ChatCompletionRequest, state.settings.max_body_bytes)
        admission = admission_for(state, request, key.tenant, chat)
        headers = policy_headers(request_id, admission)
        decision = decide(state, chat, admission)
    except APIError as err:
        err.headers = {**headers, **err.headers}
        state.metrics.errors.labels(err.code or err.type).inc()
        state.metrics.requests.labels("-", "-", str(err.status)).inc()
        return error_response(err)
    headers = route_headers(request_id, decision, admission)
    log.debug("request %s tenant=%s -> %s", request_id, key.tenant, [w.name for w in decision.workers])
    if chat.stream:
        return await _stream(state, key.tenant, chat, decision, headers, started)
    return await _complete(state, key.tenant, chat, decision, headers, started)


async def first_success(
    state: AppState, decision: RouteDecision, call
) -> tuple[object | None, list[WorkerError]]:
    """Try the decision's workers in order (all admissible) until one answers or one refuses for good."""
    failures: list[WorkerError] = []
    for worker in decision.workers:
        try:
            return await call(worker, state.api_base(worker)), failures
        except WorkerError as err:
            failures.append(err)
            if not err.fallback:
                break
    return None, failures


def _answered_headers(headers: dict[str, str], worker: str, failures: list[WorkerError]) -> dict[str, str]:
    headers = {**headers, "x-polyroute-worker": worker}
    if failures:
        headers["x-polyroute-fallbacks"] = ",".join(f.worker for f in failures)
    return headers


async def _complete(state, tenant, chat, decision, headers, started) -> Response:
    result, failures = await first_success(
        state, decision, lambda worker, base: state.client.complete(worker, base, chat)
    )
    if result is None:
        return _failed(state, failures, decision, headers)
    assert isinstance(result, Completion)
    headers = _answered_headers(headers, result.worker.name, failures)
    headers["x-polyroute-cost-usd"] = format_cost(result.cost_usd)
    state.spend.record(tenant, result.cost_usd)
    state.metrics.requests.labels(result.worker.name, decision.strategy, "200").inc()
    state.metrics.latency.labels("false").observe(time.perf_counter() - started)
    return Response(orjson.dumps(result.body), media_type="application/json", headers=headers)


def _failed(state: AppState, failures: list[WorkerError], decision: RouteDecision, headers) -> Response:
    err = final_error(failures)
    worker = failures[-1].worker if failures else "-"
    err.headers = {**headers, **err.headers, "x-polyroute-cost-usd": "0", "x-polyroute-worker": worker}
    state.metrics.errors.labels(err.code or err.type).inc()
    state.metrics.requests.labels(worker, decision.strategy, str(err.status)).inc()
    return error_response(err)


async def _stream(state, tenant, chat, decision, headers, started) -> Response:
    stream, failures = await first_success(
        state, decision, lambda worker, base: state.client.open_stream(worker, base, chat)
    )
    if stream is None:
        return _failed(state, failures, decision, headers)
    assert isinstance(stream, OpenStream)
    headers = _answered_headers(headers, stream.worker.name, failures)
    # Headers leave before the answer: this is the prompt-side cost; the final usage chunk carries
    # the actual total under "polyroute".
    headers |= {
        "x-polyroute-cost-usd": format_cost(stream.prompt_cost_usd),
        "x-polyroute-cost-basis": "prompt-estimate",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    body = _sse(state, tenant, stream, decision, started, include_usage=_wants_usage(chat))
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def _wants_usage(chat: ChatCompletionRequest) -> bool:
    return bool(chat.stream_options and chat.stream_options.include_usage)


async def _sse(
    state: AppState,
    tenant: str,
    stream: OpenStream,
    decision: RouteDecision,
    started: float,
    include_usage: bool,
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
        state.spend.record(tenant, stream.cost_usd)  # what was streamed is spent, even if cut short
        state.metrics.requests.labels(worker, decision.strategy, status).inc()
        state.metrics.latency.labels("true").observe(time.perf_counter() - started)
    yield b"data: [DONE]\n\n"
