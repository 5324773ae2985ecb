"""A workflow step sent to a worker whose provider has no such parameter (an Anthropic worker's
`seed`, which the steps get with the client's other sampling parameters), as fast mode treats one:
the worker is not called, its call is booked `not_sent` (once: a refusal is not retried), and the
workflow goes on as it does past a failed member — an ensemble without it, a cascade with its next
level. A workflow the client named that no step could answer for that reason alone is the 400
`unsupported_parameter` a pinned worker gets, naming the parameter, not a 502 `workflow_failed`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Gateway, gateway_with, ledger_record
from tests.fakes.upstream import FakeUpstream
from tests.test_params_audit_unsupported import CLAUDE

# claude is the cheaper of the two, so the rule-based router ranks it first: the builder, the first
# ensemble member, the cascade's first level.
PRICEY = """
  - name: pricey
    model: openai/pricey-model
    api_base: {url}/v1
    api_key_env: {key_env}
    context_window: 8192
    input_price_per_m: 5.00
    output_price_per_m: 15.00
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
"""
QUESTION = [{"role": "user", "content": "What is six times seven?"}]


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(
        up, tmp_path_factory.mktemp("params_dropped_workflow"), (CLAUDE + PRICEY), base="version: 1\nworkers:"
    ) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(up: FakeUpstream) -> None:
    up.reset()
    up.behave("claude-fake", text="42")
    up.behave("pricey-model", text="42")


def _compose(gw: Gateway, workflow: str, **params) -> httpx.Response:
    body = {"model": f"compose:{workflow}", "messages": QUESTION, "max_tokens": 50, **params}
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    return httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=120)


@pytest.mark.parametrize("workflow", ["ensemble", "cascade"])
def test_a_step_whose_worker_lacks_a_parameter_is_not_sent_and_the_workflow_goes_on(gw, up, workflow):
    answer = _compose(gw, workflow, seed=7)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "pricey"
    assert answer.json()["choices"][0]["message"]["content"] == "42"
    assert not up.requests_for("claude-fake")  # never built, never sent
    assert all(sent["seed"] == 7 for sent in up.requests_for("pricey-model"))  # the others get it
    # booked once, as not sent (nothing to bill): no retry of a request that cannot be built
    assert answer.headers["x-polyroute-attempts"] == "claude:not_sent"
    trace = answer.json()["polyroute"]["trace"]
    (refused,) = [s for s in trace["steps"] if s["worker"] == "claude"]
    assert "cannot take seed" in refused["error"] and refused["cost_usd"] == "0"
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["trace"]["attempts"] == [
        {"worker": "claude", "outcome": "not_sent", "status": 400, "may_be_billed": False}
    ]


def test_a_named_workflow_no_step_could_take_the_parameter_for_is_a_clear_400(gw, up):
    """builder/verifier: claude drafts, and cannot take seed; without a draft there is no answer."""
    answer = _compose(gw, "builder", seed=7)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == "seed"
    assert "claude cannot take seed" in error["message"] and "leave it out" in error["message"]
    assert not up.requests  # no worker was called
    assert answer.headers["x-polyroute-attempts"] == "claude:not_sent"
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 400 and record["cost_micros"] == 0


def test_the_same_workflow_answers_without_the_parameter(gw, up):
    answer = _compose(gw, "builder", temperature=0.2)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "claude"
    assert up.requests_for("claude-fake")[0]["temperature"] == 0.2
