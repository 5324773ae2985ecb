"""Observability audit, Prometheus metrics (docs/api.md `GET /metrics`): what a Prometheus scraping a
gateway sees for each request path, checked against the ledger.

- Every request path counts once in `polyroute_requests_total`, once in the latency histogram and,
  when it ends in an error, once in `polyroute_errors_total`; its token and cost deltas, summed
  over workers, are what its ledger record says (a workflow's steps and a given-up attempt included).
- Label cardinality is bounded: clients sending ever new `model` values (chat, Messages, Responses,
  embeddings, count_tokens, `compose:<name>`), data classes and keys create no new series.

These held when audited; they guard the bounds and the agreement with the books. Real parts only:
a gateway on uvicorn in front of the loopback test upstream."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway, stream_and_hang_up
from tests.test_embeddings import embedding_workers

MESSAGES = [{"role": "user", "content": "hello there friend"}]
LONG_TEXT = " ".join(f"word{i}" for i in range(60))
SKIPPED_FAMILIES = ("python_", "process_", "polyroute_worker_up", "polyroute_ledger_buffered")


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory):
    catalog = parse_catalog(catalog_yaml_for(fake.url) + embedding_workers(fake.url), "observe audit")
    gateway = start_gateway(catalog, tmp_path_factory.mktemp("observe_metrics"), retries=1)
    yield gateway
    gateway.server.stop()


@pytest.fixture(autouse=True)
def _fresh(reset_fake):
    yield


def scrape(gw) -> dict[str, float]:
    """Every sample of /metrics: `name{labels}` -> value."""
    samples = {}
    for line in httpx.get(gw.url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#") and not line.startswith(SKIPPED_FAMILIES):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    return sum(
        value
        for series, value in samples.items()
        if series.startswith(name + "{") and all(f'{k}="{v}"' in series for k, v in labels.items())
    )


def delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


# ---- each path: once in the request metrics, tokens and cost as in its ledger record ------------------
def post(gw, path: str, body: dict) -> str:
    response = httpx.post(gw.v1 + path, headers=gw.auth(), json=body, timeout=60)
    assert "x-polyroute-request-id" in response.headers, response.text
    return response.headers["x-polyroute-request-id"]


def chat_plain(gw, fake) -> str:
    fake.behave("cheap-model", prompt_tokens=300, completion_tokens=40)
    return post(gw, "/chat/completions", {"model": "auto", "messages": MESSAGES})


def chat_stream(gw, fake) -> str:
    fake.behave("cheap-model", prompt_tokens=120, completion_tokens=7)
    return post(gw, "/chat/completions", {"model": "auto", "messages": MESSAGES, "stream": True})


def fallback_after_retries(gw, fake) -> str:
    fake.behave("cheap-model", status=503)
    fake.behave("mid-model", prompt_tokens=50, completion_tokens=5)
    return post(gw, "/chat/completions", {"model": "auto", "messages": MESSAGES})


def every_worker_failing(gw, fake) -> str:
    for model in ("cheap-model", "mid-model", "pricey-model"):
        fake.behave(model, status=500)
    return post(gw, "/chat/completions", {"model": "auto", "messages": MESSAGES})


def stream_cut_by_the_worker(gw, fake) -> str:
    fake.behave("cheap-model", text=LONG_TEXT, drop_after_chunks=5)
    return post(gw, "/chat/completions", {"model": "cheap", "messages": MESSAGES, "stream": True})


def stream_the_client_hangs_up_on(gw, fake) -> str:
    fake.behave("cheap-model", text=LONG_TEXT, chunk_delay_s=0.02)
    body = {"model": "cheap", "messages": MESSAGES, "stream": True}
    request_id, _ = stream_and_hang_up(gw.v1 + "/chat/completions", gw.auth(), body, "word", after=3)
    return request_id


def messages(gw, fake) -> str:
    fake.behave("cheap-model", prompt_tokens=80, completion_tokens=9)
    return post(gw, "/messages", {"model": "auto", "max_tokens": 50, "messages": MESSAGES})


def messages_stream(gw, fake) -> str:
    fake.behave("cheap-model", prompt_tokens=81, completion_tokens=8)
    body = {"model": "auto", "max_tokens": 50, "messages": MESSAGES, "stream": True}
    return post(gw, "/messages", body)


def responses(gw, fake) -> str:
    fake.behave("cheap-model", prompt_tokens=70, completion_tokens=6)
    return post(gw, "/responses", {"model": "auto", "input": "hello there"})


def embeddings(gw, fake) -> str:
    return post(gw, "/embeddings", {"model": "embed-remote", "input": ["one two", "three four five"]})


def cascade(gw, fake) -> str:
    return post(gw, "/chat/completions", {"model": "compose:cascade", "messages": MESSAGES})


def workflow_failing(gw, fake) -> str:
    for model in ("cheap-model", "mid-model", "pricey-model"):
        fake.behave(model, status=500)
    return post(gw, "/chat/completions", {"model": "compose:cascade", "messages": MESSAGES})


PATHS: list[Callable] = [
    chat_plain,
    chat_stream,
    fallback_after_retries,
    every_worker_failing,
    stream_cut_by_the_worker,
    stream_the_client_hangs_up_on,
    messages,
    messages_stream,
    responses,
    embeddings,
    cascade,
    workflow_failing,
]


@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_a_request_counts_once_and_its_usage_is_its_ledger_records(gw, fake, path):
    before = scrape(gw)
    request_id = path(gw, fake)
    record = ledger_record(gw, request_id)  # a stream's is settled (and counted) after its last byte
    after = scrape(gw)
    status = str(record["status"])
    assert delta(before, after, "polyroute_requests_total") == 1
    assert delta(before, after, "polyroute_requests_total", status=status) == 1
    assert delta(before, after, "polyroute_request_latency_seconds_count") == 1
    assert delta(before, after, "polyroute_errors_total") == (1 if record["status"] >= 400 else 0)
    tokens = (
        delta(before, after, "polyroute_tokens_total", kind="prompt"),
        delta(before, after, "polyroute_tokens_total", kind="completion"),
    )
    assert tokens == (record["prompt_tokens"], record["completion_tokens"]), (tokens, record)
    cost = delta(before, after, "polyroute_cost_usd_total")
    assert cost == pytest.approx(record["cost_micros"] / 1e6, abs=2e-6), (cost, record)


REFUSALS = {
    "unknown_model": ("/chat/completions", {"model": "no-such-model", "messages": MESSAGES}, 404),
    "unknown_embedding_model": ("/embeddings", {"model": "no-such-model", "input": "hi"}, 404),
    "bad_messages_body": ("/messages", {"model": "auto", "messages": "not a list"}, 400),
    "bad_responses_body": ("/responses", {"model": "auto"}, 400),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_counts_once_with_no_usage(gw, fake, case):
    """Refused before any worker call: no ledger record, so its metrics are its own books."""
    path, body, status = REFUSALS[case]
    before = scrape(gw)
    response = httpx.post(gw.v1 + path, headers=gw.auth(), json=body, timeout=60)
    after = scrape(gw)
    assert response.status_code == status, response.text
    assert delta(before, after, "polyroute_requests_total") == 1
    assert delta(before, after, "polyroute_requests_total", status=str(status), worker="-") == 1
    assert delta(before, after, "polyroute_request_latency_seconds_count") == 1
    assert delta(before, after, "polyroute_errors_total") == 1
    assert delta(before, after, "polyroute_tokens_total") == 0
    assert delta(before, after, "polyroute_cost_usd_total") == 0
    assert not fake.requests


# ---- bounded labels ----------------------------------------------------------------------------------
def distinct_requests(gw, marker: str, count: int) -> None:
    """Requests that each name a model (and a data class) never seen before, on every endpoint."""
    bad_key = {"authorization": f"Bearer pr-{marker}-key"}
    with httpx.Client(timeout=60) as http:
        for i in range(count):
            model = f"{marker}-{i}-{uuid.uuid4().hex[:6]}"
            headers = {**gw.auth(), "x-polyroute-data-class": model}
            sent = [
                http.post(gw.v1 + "/chat/completions", headers=headers, json={"model": model, "messages": MESSAGES}),
                http.post(gw.v1 + "/chat/completions", headers=headers, json={"model": f"compose:{model}", "messages": MESSAGES}),
                http.post(gw.v1 + "/messages", headers=headers, json={"model": model, "max_tokens": 5, "messages": MESSAGES}),
                http.post(gw.v1 + "/messages/count_tokens", headers=headers, json={"model": model, "messages": MESSAGES}),
                http.post(gw.v1 + "/responses", headers=headers, json={"model": model, "input": "hi"}),
                http.post(gw.v1 + "/embeddings", headers=headers, json={"model": model, "input": "hi"}),
                http.post(gw.v1 + "/chat/completions", headers=bad_key, json={"model": model, "messages": MESSAGES}),
            ]  # fmt: skip
            assert all(400 <= r.status_code < 500 for r in sent), [(r.status_code, r.text) for r in sent]


def test_new_model_names_create_no_new_series(gw):
    distinct_requests(gw, "warm", 3)  # every refusal's series exists from here on
    series_before = set(scrape(gw))
    started = time.monotonic()
    distinct_requests(gw, "bogus", 40)
    series_after = set(scrape(gw))
    assert time.monotonic() - started < 600  # not a timing assertion: a bound against a hung gateway
    assert series_after == series_before, sorted(series_after - series_before)
    text = httpx.get(gw.url + "/metrics", timeout=60).text
    assert "bogus" not in text and "warm" not in text
