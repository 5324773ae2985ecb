"""OpenTelemetry traces of the request pipeline (docs/observability.md).

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, or a test installs a
provider through `setup(provider=...)`. Off, every helper here returns at its first line (a shared
no-op object or the input unchanged): no span, no context, no header is made per request.

On, each request is one SERVER span (continuing the client's W3C `traceparent`) with children:
`polyroute.policy`, `polyroute.retrieval` (when memory applies), `polyroute.route`, an optional
`polyroute.compose` around a workflow's steps, and one CLIENT span per worker call
(`chat <model>` / `embeddings <model>`), GenAI semantic-convention attributes on it. A worker
call's span covers its retries (each failed attempt is an `attempt_failed` event on it); fallback to another
worker is another span. Outgoing worker HTTP requests carry the worker-call span's `traceparent`.

Prompt and answer text go into spans only with POLYROUTE_OTEL_CAPTURE_CONTENT=true, and only for
requests whose data class is public or internal (never pii, secret, or a class not known yet).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("polyroute.tracing")

CAPTURE_ENV = "POLYROUTE_OTEL_CAPTURE_CONTENT"
CONTENT_CLASSES = frozenset({"public", "internal"})  # the only classes whose text may be captured
DEFAULT_SERVICE = "polyroute"

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off
_provider: Any = None
_capture = False


# ------------------------------------------------------------------------------------ setup
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    return _tracer is not None


def setup(
    provider: Any = None, environ: Mapping[str, str] | None = None, capture_content: bool | None = None
):
    """Install a TracerProvider for the gateway's spans: `provider` as given (tests), else one built from
    the standard OTEL_* variables when an OTLP endpoint is set. Returns the provider it built or was
    given, or None (tracing stays off). The provider is the gateway's own: the global one is untouched."""
    global _tracer, _provider, _capture
    env = os.environ if environ is None else environ
    if provider is None:
        provider = _from_env(env)
        if provider is None:
            return None
    _capture = _truthy(env.get(CAPTURE_ENV)) if capture_content is None else capture_content
    _provider = provider
    _tracer = provider.get_tracer("polyroute")
    return provider


def _from_env(env: Mapping[str, str]):
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or _truthy(env.get("OTEL_SDK_DISABLED")):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning(
            "OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported; traces are sent as http/protobuf", protocol
        )
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        traces_url = endpoint  # the signal's own endpoint is used as given
    else:
        traces_url = endpoint.rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": _service_name(env)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url)))
    log.info("OpenTelemetry traces go to %s (service %s)", traces_url, resource.attributes["service.name"])
    return provider


def _service_name(env: Mapping[str, str]) -> str:
    """`service.name` as the OTel spec orders it: OTEL_SERVICE_NAME, else the one in
    OTEL_RESOURCE_ATTRIBUTES (an OTel Operator or a Helm value often sets only that), else polyroute."""
    if name := (env.get("OTEL_SERVICE_NAME") or "").strip():
        return name
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.name" and (value := unquote(value.strip())):
            return value
    return DEFAULT_SERVICE


def shutdown(provider: Any = None) -> None:
    """Flush and stop `provider` (default: the installed one); tracing is off after, if it was that one."""
    global _tracer, _provider
    provider = provider or _provider
    if provider is None:
        return
    if provider is _provider:
        _tracer, _provider = None, None
    try:
        provider.shutdown()
    except Exception:
        log.warning("shutting down the trace exporter failed", exc_info=True)


# ------------------------------------------------------------------------------ request span
class RequestTrace:
    """One request's SERVER span and what its children need to know (the data class)."""

    __slots__ = ("span", "data_class", "streaming", "errored", "code")

    def __init__(self, span) -> None:
        self.span = span
        self.data_class: str | None = None
        self.streaming = False
        self.errored = False
        self.code: str | None = None  # the span's error.type, once it has one

    def admitted(self, admission) -> None:
        """The policy's verdict: the data class (which decides content capture) and the version."""
        self.data_class = admission.data_class
        self.span.set_attribute("polyroute.data_class", admission.data_class)
        self.span.set_attribute("polyroute.policy_version", admission.policy_version)

    def error(self, status: int, code: str | None, request_id: str | None = None) -> None:
        self.errored = True
        self.code = code or str(status)
        if request_id:
            self.span.set_attribute("polyroute.request_id", request_id)
        self.span.set_attribute("error.type", self.code)
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_status(Status(StatusCode.ERROR, code or str(status)))

    def hold_open(self) -> None:
        """A stream: the span ends when the stream is settled (`settled`), not when the headers leave."""
        self.streaming = True

    def settled(self, ex, worker: str | None, status: int, strategy: str, cost_usd, trace=None) -> None:
        """The ledger's view of the request (completions.Exchange.finish) on the span."""
        span = self.span
        decision = ex.decision
        span.set_attribute("polyroute.request_id", ex.request_id)
        span.set_attribute("polyroute.tenant", ex.tenant)
        span.set_attribute("polyroute.worker", worker or "-")
        span.set_attribute("polyroute.strategy", strategy)
        span.set_attribute("polyroute.route_reason", decision.reason)
        span.set_attribute("polyroute.cost_usd", float(cost_usd))
        span.set_attribute("polyroute.policy_version", ex.admission.policy_version)
        span.set_attribute("polyroute.data_class", ex.admission.data_class)
        span.set_attribute("polyroute.status", status)
        span.set_attribute("gen_ai.request.model", ex.chat.model)
        if status >= 400 and not self.errored:
            code = (trace or {}).get("stream") if isinstance(trace, dict) else None
            self.error(status, code or str(status))
        if self.streaming:
            span.end()

    def settled_embedding(self, books, status: int, cost_usd) -> None:
        span = self.span
        span.set_attribute("polyroute.request_id", books.request_id)
        span.set_attribute("polyroute.tenant", books.tenant)
        span.set_attribute("polyroute.worker", books.worker.name)
        span.set_attribute("polyroute.strategy", "embedding")
        span.set_attribute("polyroute.route_reason", "named by the request (embeddings are never routed)")
        span.set_attribute("polyroute.cost_usd", float(cost_usd))
        span.set_attribute("polyroute.policy_version", books.admission.policy_version)
        span.set_attribute("polyroute.data_class", books.admission.data_class)
        span.set_attribute("polyroute.status", status)
        span.set_attribute("gen_ai.request.model", books.model)


class _Off(RequestTrace):
    """Tracing off (or outside a request): every method does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        self.span = trace.INVALID_SPAN
        self.data_class = None
        self.streaming = False
        self.errored = False
        self.code = None

    def admitted(self, admission) -> None:
        pass

    def error(self, status: int, code: str | None, request_id: str | None = None) -> None:
        pass

    def hold_open(self) -> None:
        pass

    def settled(self, *args, **kwargs) -> None:
        pass

    def settled_embedding(self, *args, **kwargs) -> None:
        pass


OFF = _Off()
_current: ContextVar[RequestTrace] = ContextVar("polyroute_request_trace", default=OFF)


def current() -> RequestTrace:
    """The request being served in this context (OFF when tracing is off)."""
    return _current.get() if _tracer is not None else OFF


def traced(endpoint):
    """Wrap a route's handler `(request, ...) -> Response` in the request's SERVER span."""

    @functools.wraps(endpoint)
    async def handler(request, *args, **kwargs):
        tracer = _tracer
        if tracer is None:
            return await endpoint(request, *args, **kwargs)
        parent = _PROPAGATOR.extract(request.headers)
        span = tracer.start_span(
            f"{request.method} {request.url.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "url.path": request.url.path,
                "server.address": request.url.hostname or "",
            },
        )
        handle = RequestTrace(span)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        mine = _current.set(handle)
        try:
            response = await endpoint(request, *args, **kwargs)
        except BaseException as exc:
            status = getattr(exc, "status", None)  # an APIError: the handler renders it with this status
            if isinstance(status, int):  # marked as a returned error response is
                handle.error(status, getattr(exc, "code", None) or str(status))
            else:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.set_attribute("error.type", type(exc).__name__)
            span.end()
            raise
        finally:
            _current.reset(mine)
            otel_context.detach(token)
        status = response.status_code
        span.set_attribute("http.response.status_code", status)
        # A path that answered an error without naming its code to the span (or only its status, as
        # `settled` does) gets the code its client was answered with: the documented error.type.
        if status >= 400 and (not handle.errored or handle.code == str(status)):
            handle.error(status, _answered_code(response) or str(status))
        if not handle.streaming:
            span.end()
        return response

    return handler


def _answered_code(response) -> str | None:
    """The error code in an error response's JSON body: polyroute's code on Anthropic's wire
    (`polyroute.code`), else OpenAI's `error.code`, else `error.type`. None for a body that has none
    (a stream, not JSON, not an error object)."""
    body = getattr(response, "body", None)
    if not body or not isinstance(body, bytes | bytearray | memoryview):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    ours, error = data.get("polyroute"), data.get("error")
    for holder, key in ((ours, "code"), (error, "code"), (error, "type")):
        if isinstance(holder, dict) and isinstance(value := holder.get(key), str) and value:
            return value
    return None


@contextmanager
def _step(name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    with _tracer.start_as_current_span(name, attributes=attributes) as span:  # type: ignore[union-attr]
        yield span


def step(name: str, **attributes: Any):
    """An INTERNAL child span of the current one (`polyroute.<name>`); a no-op context when off."""
    if _tracer is None:
        return nullcontext()
    return _step("polyroute." + name, attributes)


def origin(request_trace: RequestTrace) -> trace.SpanContext | None:
    """A request's span context, kept by work it starts that runs after its response (a judge's
    grade: `follow_up`); None when tracing is off or the request has no span."""
    if _tracer is None:
        return None
    context = request_trace.span.get_span_context()
    return context if context.is_valid else None


@contextmanager
def _follow_up(name: str, cause: trace.SpanContext | None, attributes: dict[str, Any]) -> Iterator[Any]:
    links = [trace.Link(cause)] if cause is not None else []
    root = otel_context.Context()  # a trace of its own, whatever context the task inherited
    with _tracer.start_as_current_span(  # type: ignore[union-attr]
        name, context=root, kind=SpanKind.INTERNAL, links=links, attributes=attributes
    ) as span:
        yield span


def follow_up(name: str, cause: trace.SpanContext | None, **attributes: Any):
    """An INTERNAL span (`polyroute.<name>`) that roots a trace of its own, linked to `cause` (the
    request whose work it does after that request's response: `origin`), current while the block
    runs, so the worker calls in it are its children. A link, not a parent: the work starts once the
    request's span has ended and may run long after (a judge waits on its budget and its worker);
    as a child it would stretch the request's trace past what its client waited, and arrive after a
    tail sampler's decision on that trace. Yields the span; None (a no-op context) when off."""
    if _tracer is None:
        return nullcontext()
    return _follow_up("polyroute." + name, cause, attributes)


def admitted(admission) -> None:
    """The policy's verdict on the request span (and the data class for content capture)."""
    if _tracer is not None:
        current().admitted(admission)


def error(err, headers: Mapping[str, str] | None = None) -> None:
    """An APIError the request ends with: ERROR status and the error code on the request span."""
    if _tracer is not None:
        current().error(err.status, err.code or err.type, (headers or {}).get("x-polyroute-request-id"))


# -------------------------------------------------------------------------------- worker calls
def _provider_of(worker) -> str:
    model = getattr(worker, "model", "") or ""
    return model.split("/", 1)[0] if "/" in model else (getattr(worker, "provider", None) or "openai")


def _model_of(worker) -> str:
    model = getattr(worker, "model", "") or ""
    return model.split("/", 1)[1] if "/" in model else model


def _content_allowed() -> bool:
    return _capture and current().data_class in CONTENT_CLASSES


def _json(value: Any) -> str:
    import orjson

    return orjson.dumps(value, default=str).decode()


class WorkerCall:
    """One worker call's CLIENT span (all its retries)."""

    __slots__ = ("span", "capture", "ended")

    def __init__(self, span, capture: bool) -> None:
        self.span = span
        self.capture = capture
        self.ended = False

    def usage(self, prompt_tokens: int, completion_tokens: int | None = None) -> None:
        self.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        if completion_tokens is not None:
            self.span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)

    def completed(self, body: dict, prompt_tokens: int, completion_tokens: int) -> None:
        """A chat answer: usage, finish reasons, the answer (content capture only)."""
        self.usage(prompt_tokens, completion_tokens)
        choices = body.get("choices") or []
        reasons = [c.get("finish_reason") for c in choices if c.get("finish_reason")]
        if reasons:
            self.span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if body.get("id"):
            self.span.set_attribute("gen_ai.response.id", str(body["id"]))
        if self.capture:
            messages = [c.get("message") for c in choices if c.get("message")]
            self.span.set_attribute("gen_ai.output.messages", _json(messages))

    def failed(self, err) -> None:
        status = getattr(err, "status", None)
        code = str(status) if status is not None else type(err).__name__
        self.span.set_attribute("error.type", code)
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        self.span.set_status(Status(StatusCode.ERROR, code))

    def stream_ended(self, stream) -> None:
        """A stream's span ends when the stream does (or is cut): its usage and reasons then."""
        if self.ended:
            return
        self.ended = True
        self.usage(*_stream_counts(stream))
        if stream.finish_reasons:
            self.span.set_attribute("gen_ai.response.finish_reasons", list(stream.finish_reasons))
        if self.capture:
            message = {"role": "assistant", "content": stream.text}
            self.span.set_attribute("gen_ai.output.messages", _json([message]))
        self.span.end()


def _stream_counts(stream) -> tuple[int, int]:
    """A stream's token counts as its ledger record will have them. A stream cut mid-way (the worker
    failed, the client hung up) ends here before the pipeline counts what was streamed
    (`OpenStream.account_cut`, after the cut has unwound to it): when the provider's usage never came
    and nothing was counted yet, count the prompt and the text streamed the same way, without
    touching the stream (its books, and the metrics, stay the pipeline's)."""
    if getattr(stream, "_usage", None) is not None or getattr(stream, "_estimated", True):
        return stream.prompt_tokens, stream.completion_tokens
    from gateway.upstream import count_tokens  # gateway.upstream imports this module

    try:
        return count_tokens(stream.worker, stream.messages, stream.text)
    except Exception:  # a span must never break the stream's settling
        log.debug("counting a cut stream's tokens for its span failed", exc_info=True)
        return stream.prompt_tokens, stream.completion_tokens


def _start_call(operation: str, worker, api_base: str | None, chat=None) -> WorkerCall:
    model = _model_of(worker)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": _provider_of(worker),
        "gen_ai.provider.name": _provider_of(worker),
        "gen_ai.request.model": model,
        "polyroute.worker": worker.name,
    }
    if api_base:
        from urllib.parse import urlsplit

        parts = urlsplit(api_base)
        if parts.hostname:
            attributes["server.address"] = parts.hostname
        if parts.port:
            attributes["server.port"] = parts.port
    capture = False
    if chat is not None:
        if (max_tokens := chat.output_budget()) is not None:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        for name in ("temperature", "top_p"):
            if (value := getattr(chat, name, None)) is not None:
                attributes[f"gen_ai.request.{name}"] = value
        capture = _content_allowed()
        if capture:
            attributes["gen_ai.input.messages"] = _json(chat.messages_payload())
    span = _tracer.start_span(f"{operation} {model}", kind=SpanKind.CLIENT, attributes=attributes)  # type: ignore[union-attr]
    return WorkerCall(span, capture)


@contextmanager
def _call(operation: str, worker, api_base: str | None, chat, end: bool) -> Iterator[WorkerCall]:
    call = _start_call(operation, worker, api_base, chat)
    token = otel_context.attach(trace.set_span_in_context(call.span))
    try:
        yield call
    except BaseException as exc:
        call.failed(exc)
        call.ended = True
        call.span.end()
        raise
    finally:
        otel_context.detach(token)
    if end:
        call.ended = True
        call.span.end()


def worker_call(operation: str, worker, api_base: str | None, chat=None, end: bool = True):
    """A worker call's CLIENT span, current while the call runs (so `inject` sends its traceparent).
    `end=False`: a stream's span outlives the block (`WorkerCall.stream_ended` ends it). Off: yields None."""
    if _tracer is None:
        return nullcontext()
    return _call(operation, worker, api_base, chat, end)


def responded(raw: Any) -> None:
    """The provider's own response model and id (from a completion or a stream's first chunk, a dict
    or litellm's object) on the current worker-call span."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    for field, attribute in (("model", "gen_ai.response.model"), ("id", "gen_ai.response.id")):
        value = raw.get(field) if isinstance(raw, Mapping) else getattr(raw, field, None)
        if value:
            span.set_attribute(attribute, str(value))


def attempt_failed(exc: BaseException) -> None:
    """One failed attempt of a worker call (retried or not): an event on its span."""
    if _tracer is not None:
        status = getattr(exc, "status_code", None)
        trace.get_current_span().add_event(
            "attempt_failed", {"error.type": str(status) if status is not None else type(exc).__name__}
        )


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current span's `traceparent` (a copy); `headers` itself when off."""
    if _tracer is None:
        return headers
    carrier = dict(headers)
    _PROPAGATOR.inject(carrier)
    return carrier


def inject_kwargs(kwargs: dict[str, Any]) -> None:
    """litellm's calls: the current span's `traceparent` as extra_headers."""
    if _tracer is not None:
        kwargs["extra_headers"] = inject(dict(kwargs.get("extra_headers") or {}))
