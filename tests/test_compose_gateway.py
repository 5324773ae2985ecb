"""Composition through the gateway against the test upstream: cascade, ensemble + fuse,
builder/verifier and debate — ordering, bounds, cost stops, timeouts, failing members, policy
confinement, streaming of the final answer and the trace (client and ledger)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import orjson
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, Gateway, catalog_yaml_for, start_gateway

QUESTION = "What is six times seven?"
JUDGE = "How likely is the proposed answer"


def compose(gw: Gateway, workflow: str, trace: bool = True, **extra) -> httpx.Response:
    body = {
        "model": f"compose:{workflow}",
        "messages": [{"role": "user", "content": extra.pop("content", QUESTION)}],
        "max_tokens": 50,
        **extra,
    }
    headers = {**gw.auth(), **({"x-polyroute-trace": "1"} if trace else {})}
    return httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=60)


def steps(response: httpx.Response) -> list[dict]:
    return response.json()["polyroute"]["trace"]["steps"]


def sent_to(upstream, model: str) -> list[str]:
    return [b["messages"][-1]["content"] for b in upstream.requests_for(model)]


# ---- cascade ---------------------------------------------------------------------------------
def test_cascade_accepts_the_cheap_answer_when_the_judge_is_confident(gateway, upstream):
    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", text="The answer is 42.", replies={JUDGE: "9"})
    answer = compose(gateway, "cascade")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "cheap"
    assert answer.headers["x-polyroute-strategy"] == "compose:cascade"
    assert answer.json()["choices"][0]["message"]["content"] == "42"
    trace = steps(answer)
    assert [(s["role"], s["worker"]) for s in trace] == [("answer", "cheap"), ("judge", "pricey")]
    assert trace[0]["verdict"].startswith("accepted (judge 0.90")
    judged = sent_to(upstream, "pricey-model")
    assert len(judged) == 1 and QUESTION in judged[0] and "42" in judged[0] and "cheap" not in judged[0]
    total = sum(float(s["cost_usd"]) for s in trace)
    assert float(answer.headers["x-polyroute-cost-usd"]) == pytest.approx(total, abs=1e-9) and total > 0


@pytest.mark.parametrize("verdict", ["2", "no idea, sorry"])
def test_cascade_escalates_on_doubt_or_a_garbage_verdict(gateway, upstream, verdict):
    upstream.behave("cheap-model", text="41")
    upstream.behave("pricey-model", text="42", replies={JUDGE: verdict})
    answer = compose(gateway, "cascade")
    assert answer.status_code == 200 and answer.headers["x-polyroute-worker"] == "pricey"
    assert [s["role"] for s in steps(answer)] == ["answer", "judge", "answer"]
    assert steps(answer)[0]["verdict"].startswith("escalated")


def test_cascade_skips_a_failing_member(gateway, upstream):
    upstream.behave("cheap-model", status=500)
    upstream.behave("pricey-model", text="42")
    answer = compose(gateway, "cascade")
    assert answer.status_code == 200 and answer.headers["x-polyroute-worker"] == "pricey"
    first = steps(answer)[0]
    assert first["worker"] == "cheap" and "500" in first["error"]


def test_cascade_stops_at_the_cost_ceiling_with_the_best_answer_so_far(gateway, upstream):
    upstream.behave("cheap-model", text="41")
    upstream.behave("pricey-model", text="42", replies={JUDGE: "1"})
    # cheap's step is predicted at ~$0.00001; the judge and pricey's answer at ~$0.0008: over $0.0001
    answer = compose(gateway, "cascade", metadata={"max_cost_usd": 0.0001})
    assert answer.status_code == 200 and answer.headers["x-polyroute-worker"] == "cheap"
    assert "cost ceiling" in answer.headers["x-polyroute-compose"]
    assert not upstream.requests_for("pricey-model")  # never called: it would have passed the ceiling
    assert [s.get("verdict") for s in steps(answer)][1:] == ["skipped: cost ceiling", "skipped: cost ceiling"]
    assert float(answer.headers["x-polyroute-cost-usd"]) <= 0.0001


def test_cascade_asks_the_cheapest_first_when_the_router_cannot_tell_them_apart(upstream, tmp_path):
    """A paid copy of the free model (same tier, same predicted quality): the free one answers first."""
    from router import save_artifact, train_artifact

    common = f"api_base: {upstream.url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192"
    entry = """
  - name: {name}
    model: openai/{model}
    {common}
    input_price_per_m: {price}
    output_price_per_m: {price}
    tier: specialist
    license: Apache-2.0
    provider: fake
    jurisdiction: FR
    capabilities: [general]"""
    catalog = "version: 1\nworkers:" + "".join(
        entry.format(name=name, model=model, common=common, price=price)
        for name, model, price in (("paid-copy", "pricey-model", "0.10"), ("free", "cheap-model", "0"))
    )
    queries = [f"Question number {i} about the weather in town {i % 7}." for i in range(40)]
    right = [float(i % 3 != 0) for i in range(40)]
    # both workers labelled alike: the learned router predicts the same quality for both
    artifact = train_artifact(
        queries,
        [1] * 40,
        np.array([[r, r] for r in right]),
        ["paid-copy", "free"],
        backend="static",
        model="logreg",
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    gw = start_gateway(parse_catalog(catalog), tmp_path / "data")
    try:
        assert gw.state.router.current.name == "learned"
        upstream.behave("cheap-model", text="42")
        upstream.behave("pricey-model", text="42", replies={JUDGE: "9"})
        answer = compose(gw, "cascade")
        assert answer.status_code == 200, answer.text
        assert [(s["role"], s["worker"]) for s in steps(answer)] == [
            ("answer", "free"),
            ("judge", "paid-copy"),
        ]
        assert answer.headers["x-polyroute-worker"] == "free"
    finally:
        gw.server.stop()


# ---- ensemble --------------------------------------------------------------------------------
def test_ensemble_fuses_shuffled_anonymous_candidates(gateway, upstream):
    upstream.behave("cheap-model", text="cheap says 42", replies={"Several assistants answered": "FUSED: 42"})
    upstream.behave("mid-model", text="mid says 42")
    upstream.behave("pricey-model", text="pricey says 41")
    answer = compose(gateway, "ensemble")
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "FUSED: 42"
    assert answer.headers["x-polyroute-worker"] == "cheap"  # the fuser
    roles = [(s["role"], s["worker"]) for s in steps(answer)]
    assert sorted(roles[:3]) == [("member", "cheap"), ("member", "mid"), ("member", "pricey")]
    assert roles[3] == ("fuser", "cheap")
    fuse_prompt = sent_to(upstream, "cheap-model")[-1]
    assert all(f"Answer {i}:" in fuse_prompt for i in (1, 2, 3)) and "Answer 4:" not in fuse_prompt
    assert "mid-model" not in fuse_prompt and "pricey" not in fuse_prompt.replace("pricey says", "")
    usage = answer.json()["usage"]
    assert usage["completion_tokens"] == sum(s["completion_tokens"] for s in steps(answer))


def test_ensemble_drops_a_failing_member_and_streams_the_final_answer(gateway, upstream):
    upstream.behave(
        "cheap-model", text="a", replies={"Several assistants answered": "fused answer, streamed in chunks"}
    )
    upstream.behave("mid-model", status=503)
    upstream.behave("pricey-model", text="b")
    with httpx.stream(
        "POST",
        gateway.v1 + "/chat/completions",
        headers={**gateway.auth(), "x-polyroute-trace": "1"},
        json={
            "model": "compose:ensemble",
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "fused answer, streamed in chunks"
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["total_tokens"] > 0
    failed = [s for s in final["polyroute"]["trace"]["steps"] if s.get("error")]
    assert [s["worker"] for s in failed] == ["mid"]


def test_ensemble_member_timeout_is_bounded(upstream, tmp_path):
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path, compose_step_timeout_s=0.5)
    try:
        upstream.behave("cheap-model", text="a", replies={"Several assistants answered": "fused"})
        upstream.behave("mid-model", text="slow", latency_s=10)
        upstream.behave("pricey-model", text="b")
        answer = compose(gw, "ensemble")
        # the slow member (10 s) is cut at the step timeout (0.5 s), not waited for
        assert answer.status_code == 200 and answer.elapsed.total_seconds() < 8
        slow = next(s for s in steps(answer) if s["worker"] == "mid")
        assert "timed out" in slow["error"]
    finally:
        gw.server.stop()


# ---- builder/verifier ------------------------------------------------------------------------
def test_builder_revises_until_the_tests_pass(gateway, upstream):
    buggy = "```python\ndef add(a, b):\n    return a - b\n```"
    fixed = "```python\ndef add(a, b):\n    return a + b\n```"
    upstream.behave("cheap-model", text=buggy, replies={"A reviewer found": fixed})
    upstream.behave("mid-model", text="APPROVED")
    answer = compose(
        gateway, "builder", content="Write add(a, b).", metadata={"tests": "assert add(2, 3) == 5"}
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == fixed
    assert answer.headers["x-polyroute-compose"] == "approved in round 2"
    critique = sent_to(upstream, "mid-model")[0]
    assert "Test run:" in critique and "AssertionError" in critique
    assert [s["role"] for s in steps(answer)] == ["builder", "verifier", "builder", "verifier"]


def test_builder_is_bounded_and_keeps_the_last_draft(gateway, upstream):
    upstream.behave("cheap-model", text="draft")
    upstream.behave("mid-model", text="Still wrong: the edge case is missing.")
    answer = compose(gateway, "builder")
    assert (
        answer.status_code == 200 and "not approved after 2 rounds" in answer.headers["x-polyroute-compose"]
    )
    assert len(upstream.requests_for("cheap-model")) == 2 and len(upstream.requests_for("mid-model")) == 2


def test_builder_tests_that_hang_are_stopped():
    import asyncio

    from router.compose import run_tests

    passed, report = asyncio.run(run_tests("import time", "time.sleep(30)", timeout_s=0.5))
    assert not passed and "did not finish" in report


# ---- debate ----------------------------------------------------------------------------------
def test_debate_rebuts_then_the_judge_decides(gateway, upstream):
    upstream.behave(
        "cheap-model", text="41", replies={"Which answer is correct": "B", "Point out any errors": "still 41"}
    )
    upstream.behave("mid-model", text="42", replies={"Point out any errors": "42, and 41 is wrong"})
    answer = compose(gateway, "debate")
    assert answer.status_code == 200
    trace = answer.json()["polyroute"]["trace"]
    roles = [s["role"] for s in trace["steps"]]
    assert sorted(roles[:2]) == ["debater", "debater"] and sorted(roles[2:4]) == ["rebuttal", "rebuttal"]
    assert roles[4] == "judge"
    chosen = trace["steps"][4]["verdict"].removeprefix("chose ")
    assert answer.headers["x-polyroute-worker"] == chosen == trace["final_worker"]
    rebuttal = next(m for m in sent_to(upstream, "mid-model") if "Point out any errors" in m)
    assert "41" in rebuttal and "cheap" not in rebuttal  # it sees the other answer, not who wrote it


# ---- degradation, errors, ledger -------------------------------------------------------------
def _one_worker_gateway(upstream, tmp_path):
    """A gateway whose policy admits only the French worker ("cheap"): every workflow degrades."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        yaml.safe_dump({"version": "fr", "rules": [{"id": "fr-only", "allow_jurisdictions": ["FR"]}]})
    )
    return start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "d", policy_file=policy)


def test_a_policy_that_admits_one_worker_degrades_to_fast_mode(upstream, tmp_path):
    gw = _one_worker_gateway(upstream, tmp_path)
    try:
        answer = compose(gw, "debate")
        assert answer.status_code == 200 and answer.headers["x-polyroute-worker"] == "cheap"
        assert answer.headers["x-polyroute-compose"].startswith("degraded: only one admissible worker")
        assert answer.headers["x-polyroute-strategy"] != "compose:debate"
        assert {b["model"] for b in upstream.requests} == {"cheap-model"}
    finally:
        gw.server.stop()


def test_a_degraded_composition_still_returns_its_trace(upstream, tmp_path):
    """README's example with one admissible worker: `composed.trace["steps"]` must not be None."""
    from polyroute import Client

    gw = _one_worker_gateway(upstream, tmp_path)
    try:
        upstream.behave("cheap-model", text="42")
        with Client(gw.url, api_key=gw.api_key) as client:
            messages = [{"role": "user", "content": QUESTION}]
            composed = client.chat(messages, model="compose:cascade", explain=True)
            assert composed.route.compose.startswith("degraded: only one admissible worker")
            trace = composed.trace
            assert trace["degraded"] is True and trace["mode"] == "fast" and trace["workflow"] == "cascade"
            assert trace["note"] == composed.route.compose and trace["final_worker"] == "cheap"
            [step] = trace["steps"]
            assert step["worker"] == "cheap" and "degraded" in step["verdict"]
            assert float(step["cost_usd"]) == float(composed.route.cost_usd) > 0
            stream = client.chat(messages, model="compose:cascade", stream=True, explain=True)
            assert stream.text() == "42" and stream.trace["steps"][0]["worker"] == "cheap"
            assert stream.trace["degraded"] is True
            plain = client.chat(messages, model="compose:cascade")
            assert plain.trace is None  # the trace is for explain=True only
        lines = (gw.data_dir / "ledger.jsonl").read_text().splitlines()
        record = next(json.loads(line) for line in lines if composed.route.request_id in line)
        assert record["trace"]["degraded"] is True and record["trace"]["workflow"] == "cascade"
    finally:
        gw.server.stop()


def test_unknown_workflow_and_tools(gateway, upstream):
    unknown = compose(gateway, "tournament")
    assert unknown.status_code == 404 and "compose:cascade" in unknown.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    degraded = compose(gateway, "ensemble", tools=tools)
    assert degraded.status_code == 200 and "does not take tools" in degraded.headers["x-polyroute-compose"]
    trace = degraded.json()["polyroute"]["trace"]
    assert trace["workflow"] == "ensemble" and "does not take tools" in trace["note"]
    assert trace["steps"][-1]["worker"] == degraded.headers["x-polyroute-worker"]
    bad = compose(gateway, "cascade", metadata={"max_cost_usd": "lots"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.max_cost_usd"


def test_every_member_failing_is_a_502_with_the_trace(gateway, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    answer = compose(gateway, "ensemble")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "workflow_failed"
    assert "trace" in answer.json()["error"]["message"]


def test_the_trace_is_kept_in_the_ledger(gateway, upstream):
    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", replies={JUDGE: "10"})
    answer = compose(gateway, "cascade", trace=False)
    assert "polyroute" in answer.json() and "trace" not in answer.json()["polyroute"]
    request_id = answer.headers["x-polyroute-request-id"]
    lines = (gateway.data_dir / "ledger.jsonl").read_text().splitlines()
    record = next(json.loads(line) for line in lines if request_id in line)
    assert record["strategy"] == "compose:cascade" and record["trace"]["workflow"] == "cascade"
    assert [s["worker"] for s in record["trace"]["steps"]] == ["cheap", "pricey"]


# ---- the SDK and the router's own choice -----------------------------------------------------
def test_sdk_explain_returns_the_trace(gateway, upstream):
    from polyroute import Client

    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", replies={JUDGE: "8"})
    with Client(gateway.url, api_key=gateway.api_key) as client:
        result = client.chat([{"role": "user", "content": QUESTION}], model="compose:cascade", explain=True)
        assert result.text == "42" and result.route.strategy == "compose:cascade"
        assert result.route.compose.startswith("accepted") and result.trace["final_worker"] == "cheap"
        stream = client.chat(
            [{"role": "user", "content": QUESTION}], model="compose:cascade", stream=True, explain=True
        )
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in stream if c["choices"]) == "42"
        assert stream.trace["workflow"] == "cascade" and stream.cost_usd > 0
        plain = client.chat([{"role": "user", "content": QUESTION}], model="compose:cascade")
        assert plain.trace is None


def test_auto_chooses_a_cascade_when_its_predicted_utility_wins(upstream, tmp_path):
    """A learned router that finds cheap right on 2/3 of estimates and pricey always right:
    (calibrated: ≈ 0.74 and ≈ 0.99) a cascade, predicted ≈ 0.93 at ≈ 40% of pricey's cost, beats
    both alone at λ = 0.3."""
    import numpy as np

    from router import save_artifact, train_artifact

    estimates = [
        f"Estimate the number of {thing} in a typical city, roughly."
        for thing in (
            "cars",
            "trees",
            "dogs",
            "bikes",
            "shops",
            "schools",
            "parks",
            "bridges",
            "buses",
            "cats",
        )
    ] * 6
    greetings = [f"Say hello to my friend number {i} in a warm and friendly tone." for i in range(60)]
    cheap_right = [float(i // 10 in (0, 1, 2, 5)) for i in range(len(estimates))]  # 4 of each 6 copies
    labels = np.array([[c, 1.0] for c in cheap_right] + [[1.0, 1.0]] * len(greetings))
    artifact = train_artifact(
        estimates + greetings, [1] * 120, labels, ["cheap", "pricey"], backend="static", model="logreg"
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data")
    try:
        upstream.behave("cheap-model", text="about 40000")
        upstream.behave("pricey-model", replies={JUDGE: "9"})
        body = {
            "model": "auto",
            "messages": [
                {"role": "user", "content": "Estimate the number of cars in a typical city, roughly."}
            ],
        }
        answer = httpx.post(
            gw.v1 + "/chat/completions", headers={**gw.auth(), "x-polyroute-cost-weight": "0.3"}, json=body
        )
        assert answer.status_code == 200 and answer.headers["x-polyroute-strategy"] == "compose:cascade"
        assert "cascade cheap->pricey predicted utility" in answer.headers["x-polyroute-route-reason"]
        greeting = {**body, "messages": [{"role": "user", "content": greetings[0]}]}
        fast = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=greeting)
        assert (
            fast.headers["x-polyroute-strategy"] == "fast" and fast.headers["x-polyroute-worker"] == "cheap"
        )
    finally:
        gw.server.stop()
