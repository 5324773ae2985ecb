"""Prometheus metrics, the access log and the request span on paths other than the happy one: a failed
request and a cache hit are in the latency histogram, a cache miss is counted where it is looked up, a
stream cut mid-way is labelled with the HTTP status its ledger record has, polyroute_worker_up agrees
with /readyz, and a composed request refused while its workflow is set up is counted, logged and
traced as every refusal is."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from opentelemetry.trace import SpanKind

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway

MESSAGES = [{"role": "user", "content": "hello metrics"}]


def wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not (not labels and line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(gw) -> str:
    return httpx.get(gw.url + "/metrics").text


def test_failed_request_is_in_latency_histogram(gateway, upstream):
    """docs/composition.md: a composed failure counts 'in the latency histogram as a fast-mode failure
    does' -- so a fast-mode failure (502 upstream_failed after every worker failed) must be observed."""
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    before = _metrics(gateway)
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        json={"model": "auto", "messages": MESSAGES},
        headers=gateway.auth(),
        timeout=60,
    )
    assert r.status_code >= 500
    after = _metrics(gateway)
    assert (
        _sample(after, "polyroute_requests_total", strategy="fast", status=str(r.status_code))
        - _sample(before, "polyroute_requests_total", strategy="fast", status=str(r.status_code))
        == 1
    )
    d = _sample(after, "polyroute_request_latency_seconds_count", stream="false") - _sample(
        before, "polyroute_request_latency_seconds_count", stream="false"
    )
    assert d == 1, "a failed (502) request is missing from polyroute_request_latency_seconds"


def test_cache_hit_is_in_latency_histogram(gateway, upstream):
    body = {"model": "auto", "messages": [{"role": "user", "content": "cache latency"}]}
    headers = {**gateway.auth(), "x-polyroute-cache": "on"}
    first = httpx.post(gateway.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
    assert first.status_code == 200
    before = _metrics(gateway)
    second = httpx.post(gateway.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
    assert second.status_code == 200 and second.headers.get("x-polyroute-cache") == "hit"
    after = _metrics(gateway)
    assert (
        _sample(after, "polyroute_requests_total", strategy="cache", status="200")
        - _sample(before, "polyroute_requests_total", strategy="cache", status="200")
        == 1
    )
    d = _sample(after, "polyroute_request_latency_seconds_count", stream="false") - _sample(
        before, "polyroute_request_latency_seconds_count", stream="false"
    )
    assert d == 1, "a cache hit is a served chat request but is missing from the latency histogram"


def test_cache_miss_counted_when_the_miss_fails(gateway, upstream):
    """polyroute_cache_total counts lookups: a lookup that missed and then failed upstream is a miss."""
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    body = {"model": "auto", "messages": [{"role": "user", "content": "cache miss"}]}
    headers = {**gateway.auth(), "x-polyroute-cache": "on"}
    before = _metrics(gateway)
    r = httpx.post(gateway.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code >= 500 and r.headers.get("x-polyroute-cache") == "miss"
    after = _metrics(gateway)
    d = _sample(after, "polyroute_cache_total", outcome="miss") - _sample(
        before, "polyroute_cache_total", outcome="miss"
    )
    assert d == 1, (
        "the response said x-polyroute-cache: miss, but polyroute_cache_total{outcome=miss} did not count it"
    )


def test_stream_cut_mid_way_status_label_is_http_status(gateway, upstream):
    """A stream cut by the worker is a 502 in the ledger; requests_total's status label should say 502 like
    every other failure (not a free-text outcome name an operator's status=~"5.." query misses)."""
    upstream.behave("cheap-model", drop_after_chunks=2, text="one two three four five six")
    before = _metrics(gateway)
    with httpx.stream(
        "POST",
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        timeout=60,
        json={"model": "cheap", "messages": MESSAGES, "stream": True},
    ) as r:
        rid = r.headers["x-polyroute-request-id"]
        r.read()
    rec = ledger_record(gateway, rid)
    assert rec["status"] == 502
    after = _metrics(gateway)
    d = _sample(after, "polyroute_requests_total", worker="cheap", status="502") - _sample(
        before, "polyroute_requests_total", worker="cheap", status="502"
    )
    assert d == 1, (
        "a stream failed mid-way (ledger 502) is not counted as status=502 in polyroute_requests_total"
    )


def test_worker_up_reports_each_worker(gateway, upstream):
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        timeout=60,
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200
    text = httpx.get(gateway.url + "/metrics").text
    assert "# TYPE polyroute_worker_up gauge" in text  # the family is exported...
    ready = httpx.get(gateway.url + "/readyz").json()["workers"]
    for name, info in ready.items():  # ...so each worker should have a sample agreeing with /readyz
        want = 1.0 if info["ready"] else 0.0
        assert f'polyroute_worker_up{{worker="{name}"}} {want}' in text, f"no/incorrect sample for {name}"


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory, exporter):
    g = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path_factory.mktemp("metrics-compose")
    )
    yield g
    g.server.stop()


BODY = {
    "model": "compose:builder",
    "metadata": {"tests": 5},
    "messages": [{"role": "user", "content": "write a function"}],
}


def test_compose_refusal_is_counted(gw, upstream):
    before = httpx.get(gw.url + "/metrics").text
    r = httpx.post(gw.v1 + "/chat/completions", json=BODY, headers=gw.auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert not upstream.requests
    after = httpx.get(gw.url + "/metrics").text
    d_err = _sample(after, "polyroute_errors_total", type="invalid_value") - _sample(
        before, "polyroute_errors_total", type="invalid_value"
    )
    d_req = _sample(after, "polyroute_requests_total", status="400") - _sample(
        before, "polyroute_requests_total", status="400"
    )
    assert (d_err, d_req) == (1, 1), f"errors_total delta {d_err}, requests_total delta {d_req}"


def test_compose_refusal_has_one_access_line(gw, upstream, caplog):
    caplog.set_level(logging.INFO, logger="polyroute.access")
    r = httpx.post(gw.v1 + "/chat/completions", json=BODY, headers=gw.auth(), timeout=60)
    assert r.status_code == 400
    rid = r.headers["x-polyroute-request-id"]
    lines = [
        rec.getMessage()
        for rec in caplog.records
        if rec.name == "polyroute.access" and rid in rec.getMessage()
    ]
    assert len(lines) == 1, f"access lines for {rid}: {lines}"  # written before the answer is sent


def test_compose_refusal_span_has_error_code(gw, upstream, exporter):
    exporter.clear()
    r = httpx.post(gw.v1 + "/chat/completions", json=BODY, headers=gw.auth(), timeout=60)
    assert r.status_code == 400
    rid = r.headers["x-polyroute-request-id"]

    def root_span():
        spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        return next((s for s in spans if s.attributes.get("polyroute.request_id") == rid), None)

    root = wait_for(root_span, "the request span")
    assert root.attributes.get("error.type") == "invalid_value", dict(root.attributes)
    assert root.attributes.get("polyroute.request_id") == r.headers["x-polyroute-request-id"], dict(
        root.attributes
    )
