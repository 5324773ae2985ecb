"""Observability audit, traces (docs/observability.md): what an operator's OTel collector receives
for the paths the tracing tests did not cover.

- A request answered with an error has its polyroute error code in the request span's `error.type`
  ("any request that ends in an error response has status ERROR with its error code"): a composed
  request whose workflow produced no answer said `502`, a refused `count_tokens` said `401`.
- A streamed worker call cut mid-way (the worker failed, or the client hung up) carries on its span
  the usage its ledger record has ("a streamed worker call's span ends when the stream ends (or is
  cut), with the usage then known"); it said 0 input and 0 output tokens.
- A streamed worker call's span has `gen_ai.response.id` (the worker's completion id) as a plain
  call's has; it had none.
- `service.name` follows the OTel spec's order: OTEL_SERVICE_NAME, else the `service.name` in
  OTEL_RESOURCE_ATTRIBUTES, else `polyroute`; the default hid the resource attribute's name.

Real parts only: a gateway on uvicorn (in this process, so the SDK's in-memory exporter, a real
exporter, receives its spans) in front of the loopback test upstream."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from gateway import tracing
from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway, stream_and_hang_up

MAX_WAIT_S = 60.0  # a generous cap: a stream's spans end in a task of their own; never a fixed sleep
MESSAGES = [{"role": "user", "content": "hello there friend"}]
LONG_TEXT = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(autouse=True)
def _clean(exporter, reset_fake):
    exporter.clear()
    tracing.setup(provider=exporter.provider, capture_content=False)
    yield


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory, exporter):
    catalog = parse_catalog(catalog_yaml_for(fake.url), "observe audit catalog")
    gateway = start_gateway(catalog, tmp_path_factory.mktemp("observe_traces"), retries=0)
    yield gateway
    gateway.server.stop()


def wait_for(condition, what: str):
    deadline = time.monotonic() + MAX_WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def request_span(exporter, request_id: str):
    def find():
        return next(
            (
                s
                for s in exporter.get_finished_spans()
                if s.kind == SpanKind.SERVER and s.attributes.get("polyroute.request_id") == request_id
            ),
            None,
        )

    return wait_for(find, f"the request span of {request_id}")


def worker_spans(exporter, root) -> list:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.CLIENT and s.context.trace_id == root.context.trace_id
    ]


def fail_every_worker(fake) -> None:
    for model in ("cheap-model", "mid-model", "pricey-model"):
        fake.behave(model, status=500)


# ---- error.type is the code the client was answered with --------------------------------------------
def test_a_workflow_without_an_answer_has_its_error_code_on_the_request_span(gw, fake, exporter):
    fail_every_worker(fake)
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "compose:cascade", "messages": MESSAGES},
        timeout=60,
    )
    assert response.status_code == 502, response.text
    code = response.json()["error"]["code"]
    assert code == "workflow_failed"
    root = request_span(exporter, response.headers["x-polyroute-request-id"])
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["error.type"] == code, dict(root.attributes)
    assert root.attributes["http.response.status_code"] == 502


def test_a_workflow_without_an_answer_on_messages_has_its_error_code(gw, fake, exporter):
    """Anthropic's wire has no `code`: polyroute's is in the body's `polyroute.code`."""
    fail_every_worker(fake)
    response = httpx.post(
        gw.v1 + "/messages",
        headers=gw.auth(),
        json={"model": "compose:cascade", "max_tokens": 50, "messages": MESSAGES},
        timeout=60,
    )
    assert response.status_code == 502, response.text
    assert response.json()["polyroute"]["code"] == "workflow_failed"
    root = request_span(exporter, response.headers["x-polyroute-request-id"])
    assert root.attributes["error.type"] == "workflow_failed", dict(root.attributes)


def test_a_refused_count_tokens_has_its_error_code_on_the_request_span(gw, exporter):
    response = httpx.post(
        gw.v1 + "/messages/count_tokens",
        headers={"x-api-key": "pr-not-a-key"},
        json={"model": "auto", "messages": MESSAGES},
        timeout=60,
    )
    assert response.status_code == 401, response.text
    code = response.json()["polyroute"]["code"]

    def refused_span():
        spans = exporter.get_finished_spans()
        return next((s for s in spans if s.name == "POST /v1/messages/count_tokens"), None)

    span = wait_for(refused_span, "the count_tokens request span")
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == code == "invalid_api_key", dict(span.attributes)


# ---- a cut stream's worker span has the usage of its books --------------------------------------------
def assert_span_usage_is_the_books(gw, exporter, request_id: str) -> None:
    record = ledger_record(gw, request_id)
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0, record
    root = request_span(exporter, request_id)
    (call,) = worker_spans(exporter, root)
    usage = (call.attributes["gen_ai.usage.input_tokens"], call.attributes["gen_ai.usage.output_tokens"])
    assert usage == (record["prompt_tokens"], record["completion_tokens"]), (usage, record)


def test_a_stream_cut_by_the_worker_has_the_books_usage_on_its_span(gw, fake, exporter):
    fake.behave("cheap-model", text=LONG_TEXT, drop_after_chunks=5)  # no usage chunk ever comes
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "cheap", "messages": MESSAGES, "stream": True},
        timeout=60,
    )
    assert response.status_code == 200 and b"upstream_stream_error" in response.content
    request_id = response.headers["x-polyroute-request-id"]
    assert ledger_record(gw, request_id)["status"] == 502
    assert_span_usage_is_the_books(gw, exporter, request_id)


def test_a_stream_the_client_hangs_up_on_has_the_books_usage_on_its_span(gw, fake, exporter):
    fake.behave("cheap-model", text=LONG_TEXT, chunk_delay_s=0.02)
    request_id, received = stream_and_hang_up(
        gw.v1 + "/chat/completions",
        gw.auth(),
        {"model": "cheap", "messages": MESSAGES, "stream": True},
        "word",
        after=3,
    )
    assert received == 3
    assert ledger_record(gw, request_id)["status"] == 499
    assert_span_usage_is_the_books(gw, exporter, request_id)


# ---- gen_ai.response.id on a streamed call ---------------------------------------------------------
def test_a_streamed_worker_call_has_the_workers_completion_id(gw, fake, exporter):
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "cheap", "messages": MESSAGES, "stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-polyroute-request-id"]
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    sent_ids = {orjson.loads(line[6:]).get("id") for line in lines}
    root = request_span(exporter, request_id)
    (call,) = worker_spans(exporter, root)
    assert call.attributes.get("gen_ai.response.id") in sent_ids, (dict(call.attributes), sent_ids)
    assert str(call.attributes["gen_ai.response.id"]).startswith("chatcmpl-")


# ---- service.name ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("service_env", "resource_env", "expected"),
    [
        (None, "service.name=gw-eu,k8s.namespace.name=ai", "gw-eu"),
        ("gw-from-env", "service.name=gw-eu", "gw-from-env"),
        (None, "k8s.namespace.name=ai", "polyroute"),
    ],
)
def test_service_name_follows_the_otel_order(monkeypatch, service_env, resource_env, expected):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing is exported
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", resource_env)
    if service_env is None:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    else:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_env)
    provider = tracing.setup()
    try:
        assert provider is not None
        assert provider.resource.attributes["service.name"] == expected
    finally:
        tracing.shutdown(provider)
