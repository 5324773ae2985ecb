"""OpenTelemetry traces (gateway/tracing.py): the span tree of each kind of request, the GenAI
attributes, W3C traceparent from the client and to the workers, content capture only by opt-in and
never for PII, and the spans arriving at a real OTLP/HTTP receiver on loopback.

The gateway runs in this process (a thread), so the tests install an SDK TracerProvider with the
in-memory exporter through `tracing.setup(provider=...)`; spans are exported as they end."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import tracing
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, start_gateway
from tests.fakes.server import serve_in_thread

QUESTION = "What is six times seven?"
SECRET_PROMPT = "Please e-mail the summary to jane.doe@example.com"
JUDGE = "How likely is the proposed answer"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
POLICY = {
    "version": "traces",
    "rules": [{"id": "pii-eu-only", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU"]}],
}
MAX_WAIT_S = 60.0  # a generous cap for a stream's span (settled in its own task); never a fixed sleep


def embedding_worker(upstream_url: str) -> str:
    return f"""
  - name: embed-remote
    kind: embedding
    model: openai/embed-model
    api_base: {upstream_url}/v1
    api_key_env: {FAKE_KEY_ENV}
    dimensions: 8
    input_price_per_m: 1.00
    tier: specialist
    license: proprietary
    provider: fake
    jurisdiction: US
    context_window: 8192
  - name: claude
    model: anthropic/claude-fake
    api_base: {upstream_url}
    api_key_env: {FAKE_KEY_ENV}
    context_window: 200000
    input_price_per_m: 3.00
    output_price_per_m: 15.00
    tier: frontier
    license: proprietary
    provider: anthropic
    jurisdiction: US
"""


@pytest.fixture(autouse=True)
def _clean(exporter):
    exporter.clear()
    tracing.setup(provider=exporter.provider, capture_content=False)
    yield


@pytest.fixture(scope="module")
def tgw(upstream, tmp_path_factory, exporter):
    data_dir = tmp_path_factory.mktemp("traces")
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + embedding_worker(upstream.url), "test catalog")
    gw = start_gateway(catalog, data_dir, policy_file=policy_file, retrieval_embedder="minilm-static")
    yield gw
    gw.server.stop()


def chat(gw, content: str = QUESTION, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 20, **extra}
    return httpx.post(
        gw.v1 + "/chat/completions", headers={**gw.auth(), **(headers or {})}, json=body, timeout=60
    )


def stream_chat(gw) -> tuple[str, bytes]:
    """A streamed chat request read to its end: the request id and the body."""
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "auto", "messages": [{"role": "user", "content": QUESTION}], "stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        return response.headers["x-polyroute-request-id"], response.read()


def request_tree(exporter, request_id: str) -> tuple[object, list]:
    """The request's SERVER span and every span of its trace, once the request span has ended."""
    deadline = time.monotonic() + MAX_WAIT_S
    while True:
        spans = exporter.get_finished_spans()
        root = next(
            (
                s
                for s in spans
                if s.kind == SpanKind.SERVER and s.attributes.get("polyroute.request_id") == request_id
            ),
            None,
        )
        if root is not None:
            return root, [s for s in spans if s.context.trace_id == root.context.trace_id]
        assert time.monotonic() < deadline, f"no request span for {request_id}: {[s.name for s in spans]}"
        time.sleep(0.02)


def children(spans, parent) -> list:
    return sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
        key=lambda s: s.start_time,
    )


def worker_calls(spans) -> list:
    return sorted((s for s in spans if s.kind == SpanKind.CLIENT), key=lambda s: s.start_time)


def traceparent_of(span) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


# ---- the span tree ------------------------------------------------------------------------------
def test_a_chat_request_is_one_trace_policy_route_and_the_worker_call(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="forty-two", prompt_tokens=11, completion_tokens=3)
    response = chat(tgw)
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.name == "POST /v1/chat/completions" and root.parent is None
    assert [s.name for s in children(spans, root)] == [
        "polyroute.policy",
        "polyroute.route",
        "chat cheap-model",
    ]
    attributes = root.attributes
    assert attributes["polyroute.worker"] == "cheap"
    assert attributes["polyroute.strategy"] == response.headers["x-polyroute-strategy"]
    assert attributes["polyroute.route_reason"] == response.headers["x-polyroute-route-reason"]
    assert attributes["polyroute.policy_version"] == response.headers["x-polyroute-policy-version"]
    assert attributes["polyroute.data_class"] == "public"
    assert attributes["polyroute.tenant"] == "acme"
    assert attributes["polyroute.cost_usd"] == pytest.approx(float(response.headers["x-polyroute-cost-usd"]))
    assert attributes["http.response.status_code"] == 200
    (call,) = worker_calls(spans)
    assert call.attributes["gen_ai.operation.name"] == "chat"
    assert call.attributes["gen_ai.provider.name"] == call.attributes["gen_ai.system"] == "openai"
    assert call.attributes["gen_ai.request.model"] == "cheap-model"
    assert call.attributes["gen_ai.response.model"] == "cheap-model"
    assert call.attributes["gen_ai.usage.input_tokens"] == 11
    assert call.attributes["gen_ai.usage.output_tokens"] == 3
    assert call.attributes["gen_ai.request.max_tokens"] == 20
    assert tuple(call.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert call.attributes["polyroute.worker"] == "cheap"
    assert call.status.status_code != StatusCode.ERROR


def test_a_stream_has_its_worker_span_end_with_the_stream(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="one two three", prompt_tokens=5, completion_tokens=3)
    request_id, body = stream_chat(tgw)
    assert b"[DONE]" in body
    root, spans = request_tree(exporter, request_id)
    (call,) = worker_calls(spans)
    assert call.parent.span_id == root.context.span_id
    assert call.attributes["gen_ai.usage.input_tokens"] == 5
    assert call.attributes["gen_ai.usage.output_tokens"] == 3
    assert tuple(call.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert call.end_time <= root.end_time
    assert root.attributes["polyroute.worker"] == "cheap" and root.attributes["polyroute.status"] == 200


def test_a_request_with_memory_has_a_retrieval_span(tgw, upstream, exporter):
    documents = [{"id": "d1", "text": "Vacation policy: employees get 30 days of paid leave a year."}]
    added = httpx.post(
        tgw.v1 + "/collections/handbook/documents",
        headers=tgw.auth(),
        json={"documents": documents},
        timeout=60,
    )
    assert added.status_code == 200, added.text
    upstream.behave("cheap-model", text="30 days")
    response = chat(tgw, content="How many vacation days?", metadata={"collections": ["handbook"]})
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    names = [s.name for s in children(spans, root)]
    # recall comes first: the policy classifies the recalled text too, since the worker will see it
    assert names == ["polyroute.retrieval", "polyroute.policy", "polyroute.route", "chat cheap-model"]
    (retrieval,) = [s for s in spans if s.name == "polyroute.retrieval"]
    assert retrieval.attributes["polyroute.collections"] == 1


def test_fallback_is_one_span_per_worker_the_failed_one_in_error(tgw, upstream, exporter):
    upstream.behave("cheap-model", status=500)
    upstream.behave("mid-model", text="mid saved the day")
    response = chat(tgw)
    assert response.status_code == 200 and response.headers["x-polyroute-worker"] == "mid"
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    failed, answered = worker_calls(spans)
    assert (
        failed.attributes["polyroute.worker"] == "cheap" and answered.attributes["polyroute.worker"] == "mid"
    )
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["error.type"] == "500"
    retries = tgw.state.settings.retries
    assert [e.name for e in failed.events] == ["attempt_failed"] * (retries + 1)  # each attempt failed
    assert answered.status.status_code != StatusCode.ERROR
    assert {failed.parent.span_id, answered.parent.span_id} == {root.context.span_id}
    assert root.attributes["polyroute.worker"] == "mid"


def test_all_workers_failing_marks_the_request_span_with_the_error_code(tgw, upstream, exporter):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    response = chat(tgw)
    assert response.status_code == 502
    root, _ = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["error.type"] == response.json()["error"]["code"] == "upstream_failed"


def test_a_refused_request_is_an_error_span_with_its_code(tgw, upstream, exporter):
    response = httpx.post(
        tgw.v1 + "/chat/completions",
        headers=tgw.auth(),
        json={"model": "no-such-model", "messages": [{"role": "user", "content": QUESTION}]},
        timeout=60,
    )
    assert response.status_code == 404
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.status.status_code == StatusCode.ERROR and root.attributes["error.type"] == "model_not_found"
    assert not worker_calls(spans)


def test_a_cascade_has_one_worker_span_per_step_under_the_workflow(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", text="The answer is 42.", replies={JUDGE: "9"})
    response = chat(tgw, model="compose:cascade", max_tokens=50)
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.attributes["polyroute.strategy"] == "compose:cascade"
    (workflow,) = [s for s in spans if s.name == "polyroute.compose"]
    assert workflow.parent.span_id == root.context.span_id
    assert workflow.attributes["polyroute.workflow"] == "cascade"
    steps = worker_calls(spans)
    assert [s.attributes["polyroute.worker"] for s in steps] == ["cheap", "pricey"]  # answer, then judge
    assert all(s.parent.span_id == workflow.context.span_id for s in steps)


def test_an_anthropic_messages_request_is_traced_the_same_way(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="hello there", prompt_tokens=4, completion_tokens=2)
    response = httpx.post(
        tgw.url + "/v1/messages",
        headers={"x-api-key": tgw.api_key, "anthropic-version": "2023-06-01"},
        json={"model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.name == "POST /v1/messages"
    assert [s.name for s in children(spans, root)] == [
        "polyroute.policy",
        "polyroute.route",
        "chat cheap-model",
    ]
    (call,) = worker_calls(spans)
    assert call.attributes["gen_ai.usage.output_tokens"] == 2
    assert call.attributes["gen_ai.request.max_tokens"] == 16


def server_span(exporter, name: str):
    """The SERVER span called ``name``, once it has ended."""
    deadline = time.monotonic() + MAX_WAIT_S
    while True:
        found = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER and s.name == name]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no span {name!r}"
        time.sleep(0.02)


def test_count_tokens_and_the_model_list_have_their_request_spans(tgw, upstream, exporter):
    counted = httpx.post(
        tgw.url + "/v1/messages/count_tokens",
        headers={"x-api-key": tgw.api_key, "anthropic-version": "2023-06-01"},
        json={"model": "cheap", "messages": [{"role": "user", "content": QUESTION}]},
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    span = server_span(exporter, "POST /v1/messages/count_tokens")
    assert span.attributes["http.response.status_code"] == 200
    models = httpx.get(tgw.v1 + "/models", headers=tgw.auth(), timeout=60)
    assert models.status_code == 200
    assert server_span(exporter, "GET /v1/models").attributes["http.response.status_code"] == 200
    refused = httpx.get(tgw.v1 + "/models", headers={"authorization": "Bearer nope"}, timeout=60)
    assert refused.status_code == 401
    failed = [s for s in exporter.get_finished_spans() if s.name == "GET /v1/models"][-1]
    assert failed.attributes["http.response.status_code"] == 401
    assert not upstream.requests_for("cheap-model")  # neither reaches a worker


def test_a_responses_api_request_is_traced_the_same_way(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="hello there")
    response = httpx.post(
        tgw.v1 + "/responses", headers=tgw.auth(), json={"model": "auto", "input": QUESTION}, timeout=60
    )
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert root.name == "POST /v1/responses"
    assert [s.name for s in children(spans, root)] == [
        "polyroute.policy",
        "polyroute.route",
        "chat cheap-model",
    ]


def test_an_embeddings_request_has_an_embeddings_worker_span(tgw, upstream, exporter):
    response = httpx.post(
        tgw.v1 + "/embeddings",
        headers={**tgw.auth(), "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        json={"model": "embed-remote", "input": ["one two three", "four"]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert [s.name for s in children(spans, root)] == ["polyroute.policy", "embeddings embed-model"]
    (call,) = worker_calls(spans)
    assert call.attributes["gen_ai.operation.name"] == "embeddings"
    assert call.attributes["gen_ai.request.model"] == "embed-model"
    assert call.attributes["gen_ai.usage.input_tokens"] == response.json()["usage"]["prompt_tokens"] > 0
    assert root.attributes["polyroute.worker"] == "embed-remote"
    assert root.attributes["polyroute.strategy"] == "embedding"
    assert upstream.headers_for("embed-model")[-1]["traceparent"] == traceparent_of(call)


# ---- propagation -------------------------------------------------------------------------------
def test_traceparent_from_the_client_is_continued_and_sent_to_the_worker(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="hi")
    response = chat(tgw, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert response.status_code == 200
    root, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID and root.parent.is_remote
    (call,) = worker_calls(spans)
    assert upstream.headers_for("cheap-model")[-1]["traceparent"] == traceparent_of(call)


def test_a_streamed_worker_call_carries_its_traceparent_too(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="streamed words")
    request_id, _ = stream_chat(tgw)
    _, spans = request_tree(exporter, request_id)
    (call,) = worker_calls(spans)
    assert upstream.headers_for("cheap-model")[-1]["traceparent"] == traceparent_of(call)


def test_a_worker_called_through_litellm_gets_the_traceparent_too(tgw, upstream, exporter):
    """Anthropic's provider goes through litellm.acompletion, not the pooled fast path."""
    upstream.behave("claude-fake", text="Bonjour", prompt_tokens=6, completion_tokens=1)
    response = chat(tgw, model="claude")
    assert response.status_code == 200, response.text
    _, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    (call,) = worker_calls(spans)
    assert call.attributes["gen_ai.provider.name"] == "anthropic"
    assert call.attributes["gen_ai.request.model"] == "claude-fake"
    assert call.attributes["gen_ai.usage.input_tokens"] == 6
    assert upstream.headers_for("claude-fake")[-1]["traceparent"] == traceparent_of(call)


# ---- content --------------------------------------------------------------------------------------
def _all_values(spans) -> str:
    return " ".join(str(v) for s in spans for v in s.attributes.values())


def test_no_prompt_or_answer_text_in_spans_by_default(tgw, upstream, exporter):
    upstream.behave("cheap-model", text="the secret answer")
    response = chat(tgw)
    _, spans = request_tree(exporter, response.headers["x-polyroute-request-id"])
    values = _all_values(spans)
    assert QUESTION not in values and "the secret answer" not in values
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)


def test_content_is_captured_with_the_opt_in_but_never_for_pii(tgw, upstream, exporter):
    tracing.setup(provider=exporter.provider, capture_content=True)
    upstream.behave("cheap-model", text="the captured answer")
    public = chat(tgw)
    _, spans = request_tree(exporter, public.headers["x-polyroute-request-id"])
    (call,) = worker_calls(spans)
    assert QUESTION in call.attributes["gen_ai.input.messages"]
    assert "the captured answer" in call.attributes["gen_ai.output.messages"]

    pii = chat(tgw, content=SECRET_PROMPT)
    assert pii.status_code == 200 and pii.headers["x-polyroute-data-class"] == "pii"
    _, spans = request_tree(exporter, pii.headers["x-polyroute-request-id"])
    assert worker_calls(spans)
    values = _all_values(spans)
    assert "jane.doe@example.com" not in values and "the captured answer" not in values
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)


def test_the_env_opt_in_is_read_at_setup(exporter):
    tracing.setup(provider=exporter.provider, environ={tracing.CAPTURE_ENV: "true"})
    assert tracing._capture is True
    tracing.setup(provider=exporter.provider, environ={})
    assert tracing._capture is False


def test_without_an_endpoint_nothing_is_set_up():
    assert tracing.setup(environ={}) is None
    assert (
        tracing.setup(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
        is None
    )


# ---- a real OTLP/HTTP receiver ------------------------------------------------------------------------
class Receiver:
    """POST /v1/traces with OTLP protobuf bodies, decoded and kept."""

    def __init__(self) -> None:
        self.spans: list = []
        self.resources: list = []
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])

    async def _traces(self, request: Request) -> Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.body())
        with self._lock:
            self.content_types.append(request.headers.get("content-type", ""))
            for resource_spans in message.resource_spans:
                self.resources.append(resource_spans.resource)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return Response(b"", media_type="application/x-protobuf")


def test_spans_arrive_at_an_otlp_http_receiver(upstream, tmp_path, monkeypatch, exporter):
    receiver = Receiver()
    running = serve_in_thread(receiver.app)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", running.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "polyroute-otlp-test")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    try:
        upstream.behave("cheap-model", text="over the wire")
        gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path)
        try:
            response = chat(gw, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert response.status_code == 200
            request_id = response.headers["x-polyroute-request-id"]
        finally:
            gw.server.stop()  # the lifespan's shutdown flushes the batch processor: the spans are sent
        deadline = time.monotonic() + MAX_WAIT_S
        while not any(s.kind == s.SPAN_KIND_SERVER for s in receiver.spans):
            assert time.monotonic() < deadline, "no span reached the receiver"
            time.sleep(0.05)
    finally:
        running.stop()
        tracing.setup(provider=exporter.provider, capture_content=False)
    with receiver._lock:
        spans = list(receiver.spans)
    assert all(t.startswith("application/x-protobuf") for t in receiver.content_types)
    services = {
        a.value.string_value for r in receiver.resources for a in r.attributes if a.key == "service.name"
    }
    assert services == {"polyroute-otlp-test"}
    (root,) = [s for s in spans if s.kind == s.SPAN_KIND_SERVER]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["polyroute.request_id"].string_value == request_id
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    names = {s.name for s in spans if s.trace_id == root.trace_id}
    assert {"polyroute.policy", "polyroute.route", "chat cheap-model"} <= names
    (call,) = [s for s in spans if s.kind == s.SPAN_KIND_CLIENT]
    assert call.parent_span_id == root.span_id
    assert upstream.headers_for("cheap-model")[-1]["traceparent"].startswith(
        f"00-{TRACE_ID}-{call.span_id.hex()}-"
    )
