"""A policy reload between two calls of the SAME worker: its retry is not made.

Fast mode asks the policy in force before each attempt at another worker (gateway/readmit.py,
tests/test_followups_reload_fallback.py), but a worker's retries ran inside gateway/upstream.py's
retry loop, which asked nothing: a worker the operator excluded while its first call failed was
called again. Now the loop asks the same check before each retry (`CallScope.readmit`) and gives the
worker up instead; the response and the ledger say it was left out, and why, as for a fallback.

No timing bets: the test upstream holds the worker's first call until the test has reloaded the
policy (the reload the watcher would make on its next tick), then lets it fail with a 503.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.fakes.upstream import FakeUpstream
from tests.test_router_live_change_plan import deny, during_first_step, edit_policy


def reloading_gateway(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    """A gateway on ``held`` with two retries per worker and a policy file the test reloads itself
    (its own reload interval never comes); stopped on exit."""
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump({"version": "open"}))
    gateway = start_gateway(
        parse_catalog(catalog_yaml_for(held.url)),
        tmp_path / "data",
        retries=2,
        policy_file=tmp_path / "policy.yaml",
        policy_reload_interval_s=3600,
    )
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture
def gw(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    """The rule-based router's fast mode (cheapest first: cheap, mid, pricey)."""
    yield from reloading_gateway(held, tmp_path)


def body(model: str, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "stream": stream}


def test_a_pinned_worker_excluded_while_its_call_failed_is_not_retried(gw, held):
    """cheap answers 503 once, then would answer: the old loop retried it and the client got cheap's
    answer, under a policy that no longer admits cheap. Now: no retry, the 503 is final, and says why."""
    held.behave("cheap-model", status=503, fail_times=1)
    answer = during_first_step(
        gw, held, "cheap", edit_policy(gw, deny(gw, "cheap")), body("cheap"), gw.auth()
    )
    assert len(held.requests_for("cheap-model")) == 1  # the retry never reached the upstream
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_failed" and "cheap: 503" in error["message"]
    assert "not retried: the policy in force no longer admits it" in error["message"]
    assert "Left out by a policy reload" in error["message"] and "deny-late" in error["message"]
    assert answer.headers["x-polyroute-left-out"] == "cheap"
    assert answer.headers["x-polyroute-attempts"] == "cheap:http_503"
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 502 and record["fallbacks"] == ["cheap"]
    why = record["trace"]["excluded_by_policy"]["cheap"]
    assert gw.state.policy.engine.version in why and "deny-late" in why
    assert record["trace"]["attempts"] == [
        {"worker": "cheap", "outcome": "http_503", "status": 503, "may_be_billed": False}
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_auto_falls_back_instead_of_retrying_a_worker_a_reload_excluded(gw, held, stream):
    held.behave("cheap-model", status=503, fail_times=1)
    answer = during_first_step(
        gw, held, "cheap", edit_policy(gw, deny(gw, "cheap")), body("auto", stream), gw.auth()
    )
    assert answer.status_code == 200, answer.text
    assert len(held.requests_for("cheap-model")) == 1
    assert answer.headers["x-polyroute-worker"] == "mid"
    assert answer.headers["x-polyroute-fallbacks"] == "cheap"
    assert answer.headers["x-polyroute-left-out"] == "cheap"
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["worker"] == "mid"
    assert "deny-late" in record["trace"]["excluded_by_policy"]["cheap"]


def test_a_reload_that_excludes_nobody_leaves_the_retry_as_it_was(gw, held):
    """The same rules under a new label: the worker is asked about again, and retried."""
    held.behave("cheap-model", status=503, fail_times=1, text="four")
    answer = during_first_step(
        gw, held, "cheap", edit_policy(gw, {"version": "open-again"}), body("cheap"), gw.auth()
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "four"
    assert len(held.requests_for("cheap-model")) == 2
    assert "x-polyroute-left-out" not in answer.headers
    assert answer.headers["x-polyroute-attempts"] == "cheap:http_503"


def test_a_retry_after_no_reload_asks_nothing_and_is_made(gw, held):
    held.behave("cheap-model", status=503, fail_times=1, text="four")
    answer = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body("cheap"), timeout=120)
    assert answer.status_code == 200, answer.text
    assert len(held.requests_for("cheap-model")) == 2
