"""Prometheus metrics that disagreed with the ledger (an observability audit; docs/api.md `GET /metrics`).

- `polyroute_worker_attempts_total` counted a stream cut mid-way twice, `ok` when it opened and
  `mid_stream_error` when it was cut: the sum over outcomes exceeded the calls the worker received.
  Each call now counts once, with its final outcome (a stream: when it ends).
- `POST /v1/messages/count_tokens` and `GET`/`DELETE /v1/responses/{id}` counted their errors in
  `polyroute_errors_total` but in neither `polyroute_requests_total` nor the latency histogram (nor
  their successes), which skewed an error ratio. Each now counts once in both.
- A fast-mode request that every worker failed was labelled with the last failed worker in
  `polyroute_requests_total` while its ledger record (and span) name none: the metric now says `-`.

Real parts only: a gateway on uvicorn in front of the loopback test upstream; counts are read from
/metrics before and after, and checked against the upstream's own record of calls and the ledger."""

from __future__ import annotations

import time

import httpx
import pytest

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway, stream_and_hang_up
from tests.test_compose_accounting import requests_in
from tests.test_cut_booking_shutdown import cut_cheaps_retry_at_shutdown
from tests.test_observe_audit_metrics import delta

MESSAGES = [{"role": "user", "content": "hello there friend"}]
LONG_TEXT = " ".join(f"word{i}" for i in range(60))
WAIT_S = 60.0  # a generous cap on a loaded 2-core machine; reached only when something is broken
ATTEMPTS = "polyroute_worker_attempts_total"


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory):
    catalog = parse_catalog(catalog_yaml_for(fake.url), "metrics agree")
    gateway = start_gateway(catalog, tmp_path_factory.mktemp("metrics_agree"), retries=1)
    yield gateway
    gateway.server.stop()


@pytest.fixture(autouse=True)
def _fresh(reset_fake):
    yield


def scrape(gw) -> dict[str, float]:
    """Every polyroute sample of /metrics: `name{labels}` -> value."""
    samples = {}
    for line in httpx.get(gw.url + "/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith("polyroute_") and not line.startswith(("polyroute_worker_up", "polyroute_ledger")):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def scrape_until(gw, done, what: str) -> dict[str, float]:
    """/metrics once `done(samples)` holds: a count made in a task of its own (a stream's end) may
    land after the response. Polled against a generous deadline, never a fixed sleep."""
    deadline = time.monotonic() + WAIT_S
    while not done(samples := scrape(gw)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return samples


def stream(gw, path: str, body: dict) -> httpx.Response:
    response = httpx.post(gw.v1 + path, headers=gw.auth(), json={**body, "stream": True}, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return response


# ---- 1. a worker call counts once in polyroute_worker_attempts_total, with its final outcome ---------
def test_a_stream_cut_by_its_worker_counts_once_as_a_mid_stream_error(gw, fake):
    fake.behave("cheap-model", text=LONG_TEXT, drop_after_chunks=5)
    before = scrape(gw)
    response = stream(gw, "/chat/completions", {"model": "cheap", "messages": MESSAGES})
    assert b"upstream_stream_error" in response.content
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 502 and record["trace"]["stream"] == "mid_stream_error"
    after = scrape(gw)
    calls = len(fake.requests_for("cheap-model"))
    assert calls == 1
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="mid_stream_error") == 1
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="ok") == 0
    assert delta(before, after, ATTEMPTS) == calls  # every outcome, every worker: the calls made


STREAMS = {
    "chat": ("/chat/completions", {"model": "cheap", "messages": MESSAGES}),
    "messages": ("/messages", {"model": "cheap", "max_tokens": 50, "messages": MESSAGES}),
    "responses": ("/responses", {"model": "cheap", "input": "hello there"}),
}


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_that_ends_counts_once_as_ok(gw, fake, api):
    path, body = STREAMS[api]
    before = scrape(gw)
    response = stream(gw, path, body)
    ledger_record(gw, response.headers["x-polyroute-request-id"])
    after = scrape_until(
        gw, lambda now: delta(before, now, ATTEMPTS) >= 1, "the stream's attempt to be counted"
    )
    assert len(fake.requests_for("cheap-model")) == 1
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="ok") == 1
    assert delta(before, after, ATTEMPTS) == 1


def test_a_stream_retried_before_its_first_chunk_counts_each_call_once(gw, fake):
    fake.behave("cheap-model", status=503, fail_times=1)  # refused once, then streams its answer
    before = scrape(gw)
    response = stream(gw, "/chat/completions", {"model": "cheap", "messages": MESSAGES})
    ledger_record(gw, response.headers["x-polyroute-request-id"])
    after = scrape_until(
        gw, lambda now: delta(before, now, ATTEMPTS, outcome="ok") >= 1, "the stream's attempt"
    )
    assert len(fake.requests_for("cheap-model")) == 2
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="error") == 1
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="ok") == 1
    assert delta(before, after, ATTEMPTS) == 2


def test_a_stream_its_client_hangs_up_on_counts_once_as_cancelled(gw, fake):
    """The gateway closes the worker's stream when its client leaves: the call was cut, as a call the
    request's deadline cuts is (`cancelled`), not answered to its end."""
    fake.behave("cheap-model", text=LONG_TEXT, chunk_delay_s=0.02)
    before = scrape(gw)
    body = {"model": "cheap", "messages": MESSAGES, "stream": True}
    request_id, _ = stream_and_hang_up(gw.v1 + "/chat/completions", gw.auth(), body, "word", after=3)
    assert ledger_record(gw, request_id)["status"] == 499
    after = scrape_until(
        gw, lambda now: delta(before, now, ATTEMPTS) >= 1, "the cut stream's attempt to be counted"
    )
    assert len(fake.requests_for("cheap-model")) == 1
    assert delta(before, after, ATTEMPTS, worker="cheap", outcome="cancelled") == 1
    assert delta(before, after, ATTEMPTS) == 1


# ---- 2. count_tokens and GET/DELETE /v1/responses/{id} count as every request does -------------------
def assert_counted_once(before, after, status: int, strategy: str) -> None:
    assert delta(before, after, "polyroute_requests_total") == 1
    assert (
        delta(before, after, "polyroute_requests_total", worker="-", strategy=strategy, status=str(status))
        == 1
    )
    assert delta(before, after, "polyroute_request_latency_seconds_count") == 1
    assert delta(before, after, "polyroute_errors_total") == (1 if status >= 400 else 0)
    assert delta(before, after, "polyroute_tokens_total") == 0
    assert delta(before, after, "polyroute_cost_usd_total") == 0


COUNT_TOKENS = {
    "answered": ({}, {"model": "cheap", "messages": MESSAGES}, 200),
    "bad_key": ({"authorization": "Bearer pr-not-a-key"}, {"model": "cheap", "messages": MESSAGES}, 401),
    "unknown_model": ({}, {"model": "no-such-model", "messages": MESSAGES}, 404),
    "bad_body": ({}, {"model": "cheap", "messages": "not a list"}, 400),
}


@pytest.mark.parametrize("case", sorted(COUNT_TOKENS))
def test_count_tokens_counts_once_in_the_request_metrics(gw, fake, case):
    headers, body, status = COUNT_TOKENS[case]
    before = scrape(gw)
    response = httpx.post(
        gw.v1 + "/messages/count_tokens", headers={**gw.auth(), **headers}, json=body, timeout=WAIT_S
    )
    after = scrape(gw)
    assert response.status_code == status, response.text
    assert_counted_once(before, after, status, "count_tokens")
    assert not fake.requests  # nothing is sent to a worker


def stored_response_id(gw) -> str:
    response = httpx.post(
        gw.v1 + "/responses", headers=gw.auth(), json={"model": "cheap", "input": "hello"}, timeout=WAIT_S
    )
    assert response.status_code == 200, response.text
    ledger_record(gw, response.headers["x-polyroute-request-id"])  # its own counts are done
    return response.json()["id"]


@pytest.mark.parametrize(("method", "strategy"), [("GET", "response_get"), ("DELETE", "response_delete")])
@pytest.mark.parametrize("case", ["answered", "not_found", "bad_key"])
def test_a_stored_responses_get_and_delete_count_once(gw, fake, method, strategy, case):
    response_id = stored_response_id(gw) if case != "not_found" else "resp_no_such_response"
    headers = {"authorization": "Bearer pr-not-a-key"} if case == "bad_key" else gw.auth()
    status = {"answered": 200, "not_found": 404, "bad_key": 401}[case]
    before = scrape(gw)
    response = httpx.request(method, f"{gw.v1}/responses/{response_id}", headers=headers, timeout=WAIT_S)
    after = scrape(gw)
    assert response.status_code == status, response.text
    assert_counted_once(before, after, status, strategy)


# ---- 3. a request nobody answered is labelled with the worker its ledger record names: none -----------
def test_every_worker_failing_is_labelled_with_no_worker_as_in_the_ledger(gw, fake):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        fake.behave(model, status=500)
    before = scrape(gw)
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "auto", "messages": MESSAGES},
        timeout=WAIT_S,
    )
    assert response.status_code == 502, response.text
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    after = scrape(gw)
    assert record["worker"] is None and record["strategy"] == "fast", record
    assert delta(before, after, "polyroute_requests_total") == 1
    assert delta(before, after, "polyroute_requests_total", worker="-", strategy="fast", status="502") == 1


def test_a_call_cut_at_shutdown_is_labelled_with_no_worker_as_in_the_ledger(fake, tmp_path):
    """cheap refuses (503) and its retry is held at the upstream when the gateway stops: the ledger's
    503 record names no worker, and so does the request metric (it named cheap)."""
    gw = start_gateway(parse_catalog(catalog_yaml_for(fake.url)), tmp_path / "data", retries=1)
    body = {"model": "auto", "messages": [{"role": "user", "content": "Say hello"}]}
    cut_cheaps_retry_at_shutdown(fake, gw, body)
    [record] = requests_in(gw.data_dir)
    assert record["status"] == 503 and record["worker"] is None, record
    counted = {
        (sample.labels["worker"], sample.labels["status"]): sample.value
        for metric in gw.state.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "polyroute_requests_total"
    }
    assert counted == {("-", "503"): 1.0}, counted
