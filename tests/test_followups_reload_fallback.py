"""A policy reload while fast mode falls back: a worker the reloaded policy excludes is not called by
a later attempt of a request admitted before, as a workflow's later step does not call it
(tests/test_router_live_change_plan.py); the header and the ledger say who was left out, and why.

No timing bets: the test upstream holds the first worker's call until the test has reloaded the
policy (the reload the watcher would make on its next tick), then lets it fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Gateway, ledger_record
from tests.fakes.upstream import FakeUpstream
from tests.test_router_live_change_plan import deny, during_first_step, edit_policy, reloading


@pytest.fixture
def gw(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    """The rule-based router's fast mode (cheapest first: cheap, mid, pricey), no retries, a policy
    file the test reloads itself."""
    gateway = reloading(held, tmp_path, {"version": "open"})
    try:
        yield gateway
    finally:
        gateway.server.stop()


def body(stream: bool) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "stream": stream}


def read(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        assert "data: [DONE]" in response.text
    else:
        assert response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_fast_mode_does_not_fall_back_to_a_worker_a_reload_excluded(gw, held, stream):
    """cheap is held, then fails; meanwhile the policy is reloaded to exclude mid. The request was
    admitted with mid in its pool; it falls back past mid to pricey, and says so."""
    held.behave("cheap-model", status=500)
    admitted = gw.state.policy.engine.version
    answer = during_first_step(gw, held, "cheap", edit_policy(gw, deny(gw, "mid")), body(stream), gw.auth())
    read(answer)
    assert not held.requests_for("mid-model")  # excluded since admission: never called
    assert answer.headers["x-polyroute-worker"] == "pricey"
    assert answer.headers["x-polyroute-strategy"] == "fast"
    assert answer.headers["x-polyroute-fallbacks"] == "cheap"
    assert answer.headers["x-polyroute-left-out"] == "mid"
    assert answer.headers["x-polyroute-policy-version"] == admitted
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["worker"] == "pricey" and record["fallbacks"] == ["cheap"]
    why = record["trace"]["excluded_by_policy"]["mid"]
    closed = gw.state.policy.engine.version
    assert closed != admitted and closed in why and "deny-late" in why


def test_no_worker_left_after_a_reload_is_the_first_failure_naming_who_was_left_out(gw, held):
    """cheap fails and the reload excluded both other workers: nobody else is called, and the 502
    says why the fallbacks stopped."""
    held.behave("cheap-model", status=500)
    answer = during_first_step(
        gw, held, "cheap", edit_policy(gw, deny(gw, "mid", "pricey")), body(False), gw.auth()
    )
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_failed" and "cheap" in error["message"]
    assert "Left out by a policy reload" in error["message"] and "deny-late" in error["message"]
    assert answer.headers["x-polyroute-left-out"] == "mid,pricey"
    assert {b["model"] for b in held.requests} == {"cheap-model"}
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 502 and set(record["trace"]["excluded_by_policy"]) == {"mid", "pricey"}


def test_a_reload_that_excludes_nobody_leaves_the_fallbacks_as_they_were(gw, held):
    """The same rules under a new label: the request is evaluated again, and falls back to mid."""
    held.behave("cheap-model", status=500)
    answer = during_first_step(
        gw, held, "cheap", edit_policy(gw, {"version": "open-again"}), body(False), gw.auth()
    )
    read(answer)
    assert answer.headers["x-polyroute-worker"] == "mid"
    assert "x-polyroute-left-out" not in answer.headers
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert "excluded_by_policy" not in (record["trace"] or {})
