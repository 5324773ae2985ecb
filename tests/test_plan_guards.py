"""The plan workflow's guards live in the gateway, against the test upstream: a small budget, an
operator's per-request cap, a client that sets no max_tokens, the request's deadline; and what the
client asked of the answer's form (JSON mode, logprobs, why it ended) survives the plan.

Each of these was a defect found by an audit of `compose:plan` / `auto`: a tenant with $0.05 left
was refused because the default $0.10 ceiling was reserved whole; a plan spent 4.4x its ceiling when
workers wrote more than the 256 tokens predicted; `max_request_cost_usd` held per worker but not per
request; a deadline let the plan "call" workers it never reached.
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import orjson
import pytest
import yaml

from tests.test_plan_table_gateway import pick, table, two_voters  # noqa: F401  (table: a fixture)
from tests.test_planner_gateway import (
    QUESTION,
    WORKERS,
    ask,
    behave_all,
    header_steps,
    planned_gateway,
    trace_of,
    trained,  # noqa: F401  (the session fixture: planner and artifact)
    with_planner,
)

THREE = {"cheap": "D", "mid": "C", "pricey": "B"}  # three answers that disagree


@pytest.fixture(scope="module")
def gw(upstream, trained, tmp_path_factory):  # noqa: F811
    planner, artifact = trained
    gateway = planned_gateway(upstream, tmp_path_factory.mktemp("guards"), with_planner(artifact, planner))
    yield gateway
    gateway.server.stop()


def gateway_with_policy(upstream, trained, tmp_path, policy: dict, **settings):  # noqa: F811
    planner, artifact = trained
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    return planned_gateway(
        upstream, tmp_path, with_planner(artifact, planner), policy_file=tmp_path / "policy.yaml", **settings
    )


def spent(response: httpx.Response) -> Decimal:
    return Decimal(response.headers["x-polyroute-cost-usd"])


# ---- money ------------------------------------------------------------------------------------
def test_a_budget_below_the_default_ceiling_still_gets_a_plan(upstream, trained, tmp_path):  # noqa: F811
    """$0.05 a day where the workflow's default ceiling is $0.10: the ceiling shrinks to what is left
    and the plan runs under it, instead of a 403 for a request that costs a few millionths."""
    gateway = gateway_with_policy(
        upstream, trained, tmp_path, {"version": "b", "tenants": {"acme": {"budget": {"daily_usd": "0.05"}}}}
    )
    try:
        behave_all(upstream, dict.fromkeys(WORKERS, "B"))
        answer = ask(gateway, "compose:plan")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-strategy"] == "compose:plan"
        assert Decimal(0) < spent(answer) <= Decimal("0.05")
    finally:
        gateway.server.stop()


def test_no_max_tokens_and_long_answers_stay_under_the_ceiling(gw, upstream):
    """No max_tokens from the client; the workers would write 2,000 tokens where 256 are predicted.
    Each step is sent the max_tokens its share of the ceiling affords, so the plan never passes it."""
    behave_all(upstream, THREE, completion_tokens=2000)
    body = {
        "model": "compose:plan",
        "messages": [{"role": "user", "content": QUESTION}],
        "metadata": {"max_cost_usd": 0.001},
    }
    headers = {**gw.auth(), "x-polyroute-trace": "1", "x-polyroute-cost-weight": "0"}
    answer = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert spent(answer) <= Decimal("0.001")
    sent = [request.get("max_tokens") for request in upstream.requests]
    # mid and pricey could pass the ceiling alone: they were bounded (cheap's 2,000 tokens fit it)
    assert any(isinstance(n, int) and 256 <= n < 2000 for n in sent), sent


def test_a_parallel_round_shares_the_ceiling(gw, upstream):
    """Two workers asked together, no max_tokens: each is bounded by its share, so together they
    stay under the ceiling although each alone could have written past it."""
    behave_all(upstream, THREE, completion_tokens=4000)  # unbounded: cheap $0.0008 + mid $0.008
    answer = ask(
        gw,
        "compose:plan",
        cost_weight=0.0,
        max_tokens=None,
        metadata={"latency_weight": 0.01, "max_cost_usd": 0.004},
    )
    assert answer.status_code == 200, answer.text
    assert any(len(r) == 2 for r in header_steps(answer))  # the round that asked two at once
    assert spent(answer) <= Decimal("0.004")


def test_the_policy_per_request_cap_holds_for_the_whole_plan(upstream, trained, tmp_path):  # noqa: F811
    """max_request_cost_usd 0.0004: every worker alone is predicted under it, so all are admitted,
    but the plan's calls together must stay under it too: a workflow is one request."""
    gateway = gateway_with_policy(
        upstream,
        trained,
        tmp_path,
        {"version": "c", "rules": [{"id": "cap", "max_request_cost_usd": "0.0004"}]},
    )
    try:
        behave_all(upstream, THREE, completion_tokens=20)
        answer = ask(gateway, "compose:plan", cost_weight=0.0, metadata={"latency_weight": 0.01})
        assert answer.status_code == 200, answer.text
        assert spent(answer) <= Decimal("0.0004")
        assert "cost ceiling" in answer.headers["x-polyroute-compose"]
    finally:
        gateway.server.stop()


# ---- time -------------------------------------------------------------------------------------
def test_the_deadline_stops_the_plan_and_the_headers_list_only_real_calls(upstream, trained, tmp_path):  # noqa: F811
    """A 2.5 s request deadline and workers that take 1.5 s each, asked one per round: the second
    round cannot finish in time (the first has a second to spare on a loaded machine). The plan stops at the deadline with the best answer held and says so; the
    header lists only steps that were called (none the deadline skipped), and no step claims the
    60 s step timeout. (Whether the second call is cut or never starts depends on the machine's load:
    both are deadline stops.)"""
    planner, artifact = trained
    gateway = planned_gateway(upstream, tmp_path, with_planner(artifact, planner), request_timeout_s=2.5)
    try:
        behave_all(upstream, {"cheap": "A", "mid": "B", "pricey": "C"}, latency_s=1.5)
        answer = ask(gateway, "compose:plan", cost_weight=0.0)
        assert answer.status_code == 200, answer.text
        assert "deadline" in answer.headers["x-polyroute-compose"]
        steps = trace_of(answer)["steps"]
        called = {s["worker"] for s in steps if not (s.get("verdict") or "").startswith("skipped")}
        listed = {worker for round_ in header_steps(answer) for worker in round_}
        assert listed == called, (listed, steps)
        assert any(
            s.get("error") == "cut by the request's deadline"
            or s.get("verdict") == "skipped: request deadline"
            for s in steps
        ), steps
        assert "60 s" not in " ".join(s.get("error", "") for s in steps)
    finally:
        gateway.server.stop()


# ---- the answer's form ------------------------------------------------------------------------
def test_a_streamed_plan_says_why_its_answer_ended(gw, upstream):
    """The chosen answer was cut at max_tokens: the stream's last chunk says "length", as the JSON does."""
    behave_all(upstream, dict.fromkeys(WORKERS, "B because"), finish_reason="length")
    body = {"model": "compose:plan", "max_tokens": 20, "messages": [{"role": "user", "content": QUESTION}]}
    plain = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60)
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", headers=gw.auth(), json={**body, "stream": True}, timeout=60
    ) as streamed:
        chunks = [orjson.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    endings = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert endings == ["length"]


def test_json_mode_and_logprobs_reach_every_worker_of_the_plan(gw, upstream):
    """auto runs the plan: response_format, logprobs, top_logprobs and logit_bias go to each worker
    asked, as they do when the client names one worker."""
    behave_all(upstream, dict.fromkeys(WORKERS, '{"colour": "B"}'))
    answer = ask(
        gw,
        "auto",
        response_format={"type": "json_object"},
        logprobs=True,
        top_logprobs=2,
        logit_bias={"50256": -100},
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-strategy"] == "compose:plan"
    assert upstream.requests
    for sent in upstream.requests:
        assert sent.get("response_format") == {"type": "json_object"}, sent
        assert sent.get("logprobs") is True and sent.get("top_logprobs") == 2
        assert sent.get("logit_bias") == {"50256": -100}


def test_a_plan_table_trace_rates_no_answer_it_did_not_rate(upstream, trained, table, tmp_path):  # noqa: F811
    """A plan table returns its plan's answer without a post-hoc score: the trace says "chosen", not
    "chosen (P=nan)"."""
    _, artifact = trained
    gateway = planned_gateway(upstream, tmp_path, with_planner(artifact, table))
    try:
        texts = {"cheap": "A", "mid": "B", "pricey": "C"}
        cost_weight, _ = pick(gateway, texts, two_voters)
        behave_all(upstream, texts)
        answer = ask(gateway, cost_weight=cost_weight)
        assert answer.status_code == 200, answer.text
        verdicts = [step.get("verdict") or "" for step in trace_of(answer)["steps"]]
        assert any(v.startswith("chosen; ") for v in verdicts), verdicts
        assert not any("nan" in v for v in verdicts), verdicts
    finally:
        gateway.server.stop()


def test_a_worker_litellm_knows_is_bounded_by_its_output_limit(upstream, tmp_path):
    """The catalog gives no max_output_tokens; litellm's model map says gpt-4o writes at most 16,384.
    Its share of the $0.10 ceiling affords about 5,800 tokens at $15/M: above the 4,096 assumed for
    an unknown model (so no bound would be sent), below the known limit, so the step is sent that
    bound. The cheap worker, unknown to litellm and affording more than 4,096, is sent none."""
    from gateway.compose import known_output_limit
    from policies import parse_catalog
    from tests.conftest import catalog_yaml_for, start_gateway

    assert known_output_limit("openai/gpt-4o") == 16384 and known_output_limit("openai/cheap-model") is None
    # the test catalog with pricey ($15/M out) served as a model litellm's map knows
    catalog = parse_catalog(catalog_yaml_for(upstream.url).replace("openai/pricey-model", "openai/gpt-4o"))
    gateway = start_gateway(catalog, tmp_path / "data", compose_members=3)
    try:
        behave_all(upstream, {"cheap": "A", "mid": "A"})
        upstream.behave("gpt-4o", text="A")
        body = {"model": "compose:ensemble", "messages": [{"role": "user", "content": QUESTION}]}
        answer = httpx.post(gateway.v1 + "/chat/completions", headers=gateway.auth(), json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        bounds = {request["model"]: request.get("max_tokens") for request in upstream.requests}
        assert bounds["cheap-model"] is None
        assert isinstance(bounds["gpt-4o"], int) and 4096 < bounds["gpt-4o"] < 16384, bounds
    finally:
        gateway.server.stop()
