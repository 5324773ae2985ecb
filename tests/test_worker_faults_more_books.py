"""Given-up worker calls the books lost: a call the request's deadline cut short, and an embeddings
call retried or failed (gateway/upstream.py `Attempt`, `CallScope`).

A cancellation carries no WorkerError, so the call the deadline cut (and the calls of that worker
retried before it) were in no `x-polyroute-attempts` header and no ledger `trace.attempts`, although
the provider may bill them. /v1/embeddings retried a worker as chat does but kept none of its
given-up calls. Now both are listed as chat's are, the cut call with what cut it: the deadline, 504
(the status a stream it cuts gets).

No timing bets: the worker's first call fails at once and its retry is held at the test upstream
(`FakeUpstream.hold(..., after=1)`) until the test ends, so the deadline passes with that retry in
flight; the test checks the retry reached the upstream. The deadline (DEADLINE_S) only has to be
longer than two loopback calls take on a loaded machine; the gateway answers a chat and an
embeddings request before the tests, so no first-request cost (imports, tokenizers) falls in it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from gateway.upstream import ATTEMPTS_HEADER
from policies import parse_catalog
from tests.conftest import (
    Gateway,
    catalog_yaml_for,
    ledger_record,
    start_gateway,
)
from tests.fakes.upstream import FakeUpstream
from tests.test_embeddings import REMOTE, REMOTE_MODEL, embedding_workers

DEADLINE_S = 10.0
MESSAGES = [{"role": "user", "content": "Say hello in five words"}]
EMBED, EMBED_MODEL = REMOTE, REMOTE_MODEL
REFUSED_503 = {"outcome": "http_503", "status": 503, "may_be_billed": False}
CUT = {"outcome": "deadline", "status": 504, "may_be_billed": True}


pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory) -> Iterator[Gateway]:
    """One retry per worker, and a request deadline of DEADLINE_S."""
    catalog = catalog_yaml_for(fake.url) + embedding_workers(fake.url)
    gateway = start_gateway(
        parse_catalog(catalog, "books"),
        tmp_path_factory.mktemp("worker-faults-books"),
        retries=1,
        request_timeout_s=DEADLINE_S,
    )
    warm_up = {"model": "cheap", "messages": MESSAGES}
    for path, body in (("/chat/completions", warm_up), ("/embeddings", {"model": EMBED, "input": "tea"})):
        answer = httpx.post(gateway.v1 + path, headers=gateway.auth(), json=body, timeout=120)
        assert answer.status_code == 200, answer.text
    yield gateway
    gateway.server.stop()


def entry(worker: str, kind: dict) -> dict:
    return {"worker": worker, **kind}


@contextmanager
def holding(fake: FakeUpstream, model: str, after: int = 0) -> Iterator[None]:
    """Hold ``model``'s calls after its first ``after`` (its behaviour set by the test first). On the
    way out the held call is let go and the upstream waits until it has taken it up: a held call
    that outlived its test would count against the next test's behaviour (`fail_times`)."""
    behaviour = fake.behaviours[model]
    gate = fake.hold(model, after)
    try:
        yield
    finally:
        gate.set()
        deadline = time.monotonic() + 60
        while len(fake.requests_for(model)) > after and behaviour.calls <= after:
            assert time.monotonic() < deadline, f"the held call of {model} was never taken up"
            time.sleep(0.02)


# ---- 2. a call the request's deadline cut ------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_call_the_deadline_cut_is_listed_with_the_retry_before_it(gw, fake, stream):
    """cheap refuses (503), its retry is in flight when the deadline passes: both calls are on the
    books, the cut one as may-be-billed (it was sent), with the deadline's 504."""
    fake.behave("cheap-model", status=503, fail_times=1)
    body = {"model": "cheap", "messages": MESSAGES, "stream": stream}
    with holding(fake, "cheap-model", after=1):
        response = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=120)
    assert len(fake.requests_for("cheap-model")) == 2  # the retry was in flight when the deadline came
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and "which cut the call of cheap short" in error["message"]
    assert response.headers[ATTEMPTS_HEADER] == "cheap:http_503,cheap:deadline:may-be-billed"
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 504
    assert record["trace"]["attempts"] == [entry("cheap", REFUSED_503), entry("cheap", CUT)]


def test_a_call_the_deadline_cut_after_a_fallback_follows_the_failed_workers_calls(gw, fake):
    """auto: cheap fails twice (its retry too) and falls back; mid's call is cut by the deadline."""
    fake.behave("cheap-model", status=500)
    fake.behave("mid-model")
    body = {"model": "auto", "messages": MESSAGES}
    with holding(fake, "mid-model"):
        response = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=120)
    assert len(fake.requests_for("mid-model")) == 1
    assert response.status_code == 504, response.text
    assert response.headers[ATTEMPTS_HEADER] == "cheap:http_500,cheap:http_500,mid:deadline:may-be-billed"
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["fallbacks"] == ["cheap"]  # mid did not fail: the deadline cut it
    refused = {"outcome": "http_500", "status": 500, "may_be_billed": False}
    assert record["trace"]["attempts"] == [entry("cheap", refused)] * 2 + [entry("mid", CUT)]


# ---- 3. embeddings' given-up calls -------------------------------------------------------------------
def _embed(gw: Gateway) -> httpx.Response:
    body = {"model": EMBED, "input": ["tea leaves", "coffee beans"]}
    return httpx.post(gw.v1 + "/embeddings", headers=gw.auth(), json=body, timeout=120)


def test_an_embeddings_call_retried_then_answered_keeps_its_refusal(gw, fake):
    fake.behave(EMBED_MODEL, status=503, fail_times=1)
    response = _embed(gw)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    assert response.headers[ATTEMPTS_HEADER] == f"{EMBED}:http_503"
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["endpoint"] == "embeddings"
    assert record["trace"]["attempts"] == [entry(EMBED, REFUSED_503)]
    assert record["trace"]["inputs"] == 2  # the trace it had is kept


def test_a_failed_embeddings_call_lists_every_call(gw, fake):
    fake.behave(EMBED_MODEL, status=503)
    response = _embed(gw)
    assert response.status_code == 502, response.text
    assert response.headers[ATTEMPTS_HEADER] == f"{EMBED}:http_503,{EMBED}:http_503"
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 502
    assert record["trace"]["attempts"] == [entry(EMBED, REFUSED_503)] * 2


def test_an_embeddings_call_the_deadline_cut_is_listed(gw, fake):
    fake.behave(EMBED_MODEL, status=503, fail_times=1)
    with holding(fake, EMBED_MODEL, after=1):
        response = _embed(gw)
    assert len(fake.requests_for(EMBED_MODEL)) == 2
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert response.headers[ATTEMPTS_HEADER] == f"{EMBED}:http_503,{EMBED}:deadline:may-be-billed"
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert record["trace"]["attempts"] == [entry(EMBED, REFUSED_503), entry(EMBED, CUT)]


def test_an_embeddings_call_answered_at_once_has_no_attempts(gw, fake):
    response = _embed(gw)
    assert response.status_code == 200, response.text
    assert ATTEMPTS_HEADER not in response.headers
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    assert "attempts" not in record["trace"]
