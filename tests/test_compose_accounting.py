"""What a composed request spends is accounted for however it ends, and bounded before it is spent.

Against the test upstream (its reported token counts set per model, so what each call cost is known
exactly): a workflow that ends by a fault or by the shutdown's cancellation still settles its paid
steps on the budget and writes them to the ledger; a workflow's ceiling and the tenant's budget
hold for text that tokenizes at about a token a character (Chinese), in composed and fast mode; a
502 and a step that times out are counted in the metrics; a judge call paid without a score leaves
its cost in the ledger and no label; and a cascade `auto` chose that produces no answer falls back
to fast mode over the workers it did not try. Background work is waited for by polling with a
generous deadline (a loaded 2-core machine), never by sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from gateway.ledger import UNSCORED_JUDGE, record_problem, training_rows
from policies import parse_catalog
from policies.cost import estimate_tokens, token_chars
from router.offline.ledger import counted_score
from tests.conftest import catalog_yaml_for, start_gateway

DEADLINE_S = 60.0  # reached only when something is broken
PRICES = {  # the test catalog's prices per million tokens (input, output)
    "cheap-model": (Decimal("0.10"), Decimal("0.20")),
    "mid-model": (Decimal("1.00"), Decimal("2.00")),
    "pricey-model": (Decimal("5.00"), Decimal("15.00")),
}
TOKENS = {model: (1000, 40) for model in PRICES}  # reported (prompt, completion) tokens per call
QUESTION = "What is six times seven?"
JUDGE = "How likely is the proposed answer"  # the cascade's judge prompt
# about a token a character, as real tokenizers count Chinese; the test upstream reports that count
CJK = "请详细解释为什么六乘以七等于四十二并给出推导过程" * 16  # 384 characters


# ---- helpers ---------------------------------------------------------------------------------------
def gateway_with(upstream, tmp_path: Path, tenants: dict, **settings):
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump({"version": "accounting", "tenants": tenants}))
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    return start_gateway(catalog, tmp_path / "data", policy_file=policy_file, **settings)


BUDGET = {"acme": {"budget": {"daily_usd": "5"}}}


def behave(upstream, tokens=TOKENS, **extra) -> None:
    for model, (prompt, completion) in tokens.items():
        upstream.behave(
            model,
            **{
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "text": "forty two",
                **extra.get(model, {}),
            },
        )


def paid(upstream, tokens=TOKENS, answered=None) -> Decimal:
    """What the upstream billed: each recorded call of a model in ``answered`` (default: all of
    ``tokens``) at its reported counts (the completion cut at the call's max_tokens) and list price."""
    total = Decimal(0)
    for body in list(upstream.requests):
        model = body.get("model")
        if model not in (answered if answered is not None else tokens):
            continue
        prompt, completion = tokens[model]
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None:
            completion = min(completion, int(limit))
        price_in, price_out = PRICES[model]
        total += (price_in * prompt + price_out * completion) / Decimal(1_000_000)
    return total


def records(data_dir: Path) -> list[dict]:
    path = Path(data_dir) / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def requests_in(data_dir: Path) -> list[dict]:
    return [r for r in records(data_dir) if r.get("type") == "request"]


def record_of(gw, request_id: str) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for record in requests_in(gw.data_dir):
            if record.get("id") == request_id:
                return record
        assert time.monotonic() < deadline, f"no ledger record for {request_id}"
        time.sleep(0.05)


def settled(gw) -> None:
    """Until no background bookkeeping (settles, grades) runs."""
    deadline = time.monotonic() + DEADLINE_S
    while gw.state.background:
        assert time.monotonic() < deadline, "background bookkeeping did not end"
        time.sleep(0.05)


def spend(gw, tenant: str = "acme") -> Decimal:
    """Settled spend plus what holds still reserve, today."""
    return asyncio.run(gw.state.stores.budgets.usage(tenant)).daily_usd


def metric(gw, name: str, **labels) -> float:
    total = 0.0
    for family in gw.state.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def chat(gw, model: str, content: str = QUESTION, headers=None, timeout=60, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 50, **extra}
    return httpx.post(
        gw.v1 + "/chat/completions",
        headers={**gw.auth(), "x-polyroute-trace": "1", **(headers or {})},
        json=body,
        timeout=timeout,
    )


# ---- 1. a workflow that ends by an exception still books its paid steps ----------------------------
def test_a_fault_after_a_paid_step_books_the_step(upstream, tmp_path):
    """The cascade's cheap answer is paid, then its verifier fails: the acceptance model in the
    router's directory is a file that holds no model (a wrong file put in place). The client gets a
    500; the budget is charged what cheap cost, and the ledger says so with the trace."""
    import joblib

    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0)
    try:
        root = Path(gw.state.router.root)
        root.mkdir(parents=True, exist_ok=True)
        joblib.dump({"not": "a model"}, root / "acceptance.joblib")
        behave(upstream)
        answer = chat(gw, "compose:cascade", metadata={"verifier": "model"})
        assert answer.status_code == 500, answer.text
        assert upstream.requests_for("cheap-model")  # answered, and billed by its provider
        deadline = time.monotonic() + DEADLINE_S
        while not requests_in(gw.data_dir):
            assert time.monotonic() < deadline, "the faulted workflow left no ledger record"
            time.sleep(0.05)
        settled(gw)
        [record] = requests_in(gw.data_dir)
        cost = paid(upstream)
        assert cost > 0
        assert record["status"] == 500 and record["strategy"] == "compose:cascade"
        assert Decimal(record["cost_micros"]) / 1_000_000 == cost
        assert record["trace"]["ended"] == "workflow_error"
        assert [s["worker"] for s in record["trace"]["steps"]] == ["cheap"]
        assert spend(gw) == cost  # settled to the step's cost: no hold of the ceiling is left
        assert metric(gw, "polyroute_requests_total", strategy="compose:cascade", status="500") == 1
        assert metric(gw, "polyroute_errors_total", type="workflow_error") == 1
    finally:
        gw.server.stop()


def test_a_workflow_cancelled_at_shutdown_books_its_paid_steps(upstream, tmp_path):
    """Cheap answers (paid), then the judge's step on pricey hangs; the gateway is stopped and the
    server cancels the request after its graceful timeout. What cheap cost is on the budget (no hold
    left) and in the ledger, with status 503."""
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0, compose_verifier="judge")
    behave(upstream, **{"pricey-model": {"latency_s": 40}})
    result: dict = {}

    def client() -> None:
        try:
            result["response"] = chat(gw, "compose:cascade")
        except httpx.HTTPError as exc:  # the connection goes with the server
            result["error"] = exc

    thread = threading.Thread(target=client)
    thread.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not upstream.requests_for("pricey-model"):  # cheap answered, the judge is asked
            assert time.monotonic() < deadline, "the judge was never asked"
            time.sleep(0.05)
    finally:
        gw.server.stop()  # the request is cancelled after the graceful timeout (5 s)
        thread.join(DEADLINE_S)
    assert not gw.server.thread.is_alive()
    cost = paid(upstream, answered={"cheap-model"})  # the judge never answered
    assert cost > 0
    assert spend(gw) == cost
    saved = json.loads((Path(gw.data_dir) / "spend.json").read_text())  # what the next start reads
    assert [v for k, v in saved["settled"].items() if k.startswith("acme|d:")] == [int(cost * 1_000_000)]
    [record] = requests_in(gw.data_dir)
    assert record["status"] == 503 and record["trace"]["ended"] == "cancelled"
    assert Decimal(record["cost_micros"]) / 1_000_000 == cost


# ---- 2. the ceiling and the budget bound what text that tokenizes densely spends ---------------------
def test_token_chars_counts_a_non_ascii_character_as_a_token():
    assert token_chars(["What is six times seven?"]) == len("What is six times seven?")
    assert estimate_tokens(token_chars([CJK]), None)[0] == len(CJK)
    assert estimate_tokens(token_chars(["abcd", "四十二"]), None)[0] == 1 + 3


@pytest.mark.parametrize("daily_usd", ["0.002", "1"])
def test_a_cjk_prompt_stays_inside_the_workflow_ceiling_and_the_budget(upstream, tmp_path, daily_usd):
    """A 384-character Chinese question bills 392 prompt tokens on every worker. At four characters a
    token pricey's member step was predicted $0.00078 and ran, for $0.00226: past the client's
    $0.0015 and the $0.002 budget. At a token a character ($0.00222) the budget's policy rule leaves
    pricey out of the pool ($0.002), or the ceiling skips its step ($1)."""
    budget = {"acme": {"budget": {"daily_usd": daily_usd}}}
    gw = gateway_with(upstream, tmp_path, budget, retries=0)
    try:
        tokens = {model: (len(CJK) + 8, 20) for model in PRICES}
        behave(upstream, tokens, **{m: {"text": "四十二 " * 20} for m in PRICES})
        answer = chat(gw, "compose:ensemble", CJK, max_tokens=20, metadata={"max_cost_usd": "0.0015"})
        assert answer.status_code == 200, answer.text
        record = record_of(gw, answer.headers["x-polyroute-request-id"])
        settled(gw)
        cost = paid(upstream, tokens)
        assert cost > 0
        assert cost <= Decimal("0.0015"), f"the client's max_cost_usd was passed: {cost}"
        booked = Decimal(record["cost_micros"]) / 1_000_000  # rounded up to a micro-dollar per settle
        assert booked == spend(gw) and abs(booked - cost) < Decimal("0.000001")
        assert spend(gw) <= Decimal(daily_usd)
        assert not upstream.requests_for("pricey-model")
        skipped = {
            s["worker"] for s in record["trace"]["steps"] if s.get("verdict") == "skipped: cost ceiling"
        }
        assert skipped == (set() if daily_usd == "0.002" else {"pricey"})
    finally:
        gw.server.stop()


def test_later_steps_are_predicted_from_the_tokens_the_run_was_billed(upstream, tmp_path):
    """The cheap answer bills 1,000 prompt tokens for a 425-character question: the judge's and
    pricey's steps, predicted at that rate, would pass the $0.002 ceiling, so neither starts and the
    cascade returns cheap's answer (at four characters a token both were predicted to fit, and the
    run spent $0.005). The question is long enough to teach a rate (base.MIN_OBSERVED_CHARS): a
    short one's billed tokens are mostly the chat template's."""
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0, compose_verifier="judge")
    try:
        behave(upstream, **{"pricey-model": {"replies": {JUDGE: "2"}}})
        question = " ".join([QUESTION] * 17)
        answer = chat(gw, "compose:cascade", question, metadata={"max_cost_usd": "0.002"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-worker"] == "cheap"
        settled(gw)
        cost = paid(upstream)
        assert cost <= Decimal("0.002"), cost
        assert not upstream.requests_for("pricey-model")
        assert Decimal(answer.headers["x-polyroute-cost-usd"]) == cost == spend(gw)
        steps = answer.json()["polyroute"]["trace"]["steps"]
        assert [(s["worker"], s.get("verdict")) for s in steps][1:] == [
            ("pricey", "skipped: cost ceiling"),
            ("pricey", "skipped: cost ceiling"),
        ]
    finally:
        gw.server.stop()


def test_an_english_workflow_is_not_refused_by_the_observed_rate(upstream, tmp_path):
    """The upstream's default counts (a token a word) are fewer than four characters a token: the
    cascade runs its judge and escalates as before."""
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0, compose_verifier="judge")
    try:
        upstream.behave("cheap-model", text="about 41")
        upstream.behave("pricey-model", text="42", replies={JUDGE: "1"})
        answer = chat(gw, "compose:cascade", metadata={"max_cost_usd": "0.01"})
        assert answer.status_code == 200, answer.text
        steps = answer.json()["polyroute"]["trace"]["steps"]
        assert [(s["role"], s["worker"]) for s in steps] == [
            ("answer", "cheap"),
            ("judge", "pricey"),
            ("answer", "pricey"),
        ]
    finally:
        gw.server.stop()


def test_fast_mode_holds_a_cjk_prompt_at_a_token_a_character(upstream, tmp_path):
    """Pinned to pricey, a 384-character Chinese prompt costs $0.00226 (392 prompt tokens, 20 out);
    at four characters a token it was predicted $0.00078 and let through a $0.002 budget, which it
    then overspent. Predicted at a token a character ($0.00222), the policy's budget rule refuses it."""
    gw = gateway_with(upstream, tmp_path, {"acme": {"budget": {"daily_usd": "0.002"}}}, retries=0)
    try:
        upstream.behave("pricey-model", prompt_tokens=len(CJK) + 8, completion_tokens=20, text="四十二")
        answer = chat(gw, "pricey", CJK, max_tokens=20)
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["code"] == "budget_exceeded"  # the budget rule emptied the pool
        assert not upstream.requests_for("pricey-model")
        assert spend(gw) == 0
    finally:
        gw.server.stop()


# ---- 3. and 4. the metrics count a composed 502 and a step that timed out ---------------------------
def test_every_member_failing_is_counted_in_the_request_metrics(upstream, tmp_path):
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0)
    try:
        behave(upstream, **{m: {"status": 500} for m in PRICES})
        answer = chat(gw, "compose:ensemble")
        assert answer.status_code == 502, answer.text
        assert record_of(gw, answer.headers["x-polyroute-request-id"])["status"] == 502
        assert metric(gw, "polyroute_requests_total", strategy="compose:ensemble", status="502") == 1
        assert metric(gw, "polyroute_errors_total", type="workflow_failed") == 1
        assert metric(gw, "polyroute_request_latency_seconds_count", stream="false") == 1
    finally:
        gw.server.stop()


def test_a_step_that_times_out_is_counted_as_an_attempt(upstream, tmp_path):
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0, compose_step_timeout_s=3.0)
    try:
        behave(upstream, **{"mid-model": {"latency_s": 40}})
        answer = chat(gw, "compose:ensemble")
        assert answer.status_code == 200, answer.text
        steps = answer.json()["polyroute"]["trace"]["steps"]
        assert any(s["worker"] == "mid" and "timed out" in (s.get("error") or "") for s in steps), steps
        assert len(upstream.requests_for("mid-model")) == 1
        assert metric(gw, "polyroute_worker_attempts_total", worker="mid", outcome="cancelled") == 1
        assert metric(gw, "polyroute_worker_attempts_total", worker="mid") == 1
    finally:
        gw.server.stop()


# ---- 5. a judge call paid without a score: in the ledger, not a label --------------------------------
def test_a_paid_judge_call_without_a_score_is_in_the_ledger_and_no_label(upstream, tmp_path):
    judge = {"worker": "pricey", "sample": 1.0, "daily_budget_usd": "1"}
    gw = gateway_with(upstream, tmp_path, {"acme": {"judge": judge}}, judge_seed=0)
    try:
        upstream.behave("cheap-model", text="42", prompt_tokens=100, completion_tokens=5)
        upstream.behave("pricey-model", text="I think it is fine", prompt_tokens=300, completion_tokens=6)
        answer = chat(gw, "cheap")
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + DEADLINE_S
        while metric(gw, "polyroute_judge_total", tenant="acme", outcome="unparsable") < 1:
            assert time.monotonic() < deadline, "the judge never graded"
            time.sleep(0.05)
        settled(gw)
        judge_cost = paid(upstream, {"pricey-model": (300, 6)})
        assert spend(gw, "judge:acme") == judge_cost
        written = records(gw.data_dir)
        [unscored] = [r for r in written if r["type"] == "feedback"]
        assert unscored["source"] == UNSCORED_JUDGE and unscored["score"] is None
        assert unscored["request_id"] == answer.headers["x-polyroute-request-id"]
        assert unscored["judge"] == "pricey" and unscored["worker"] == "cheap"
        assert Decimal(unscored["cost_micros"]) / 1_000_000 == judge_cost
        # every reader of `router train --from-ledger` takes it as a valid record, and no label
        assert all(record_problem(r) is None for r in written)
        assert training_rows(iter(written)) == []
        assert counted_score(unscored, {"user": 1.0, "judge": 1.0, "calibration": 1.0}) is None
    finally:
        gw.server.stop()


# ---- 6. a cascade auto chose that produces no answer falls back to fast mode ------------------------
ESTIMATES = [
    f"Estimate the number of {thing} in a typical city, roughly."
    for thing in ("cars", "trees", "dogs", "bikes", "shops", "schools", "parks", "bridges", "buses", "cats")
] * 6
GREETINGS = [f"Say hello to my friend number {i} in a warm and friendly tone." for i in range(60)]


def save_cascading_router(data_dir: Path) -> None:
    """A learned router that finds cheap right on 2/3 of estimates and pricey always right, so `auto`
    at λ = 0.3 chooses a cascade cheap -> pricey for an estimate (tests/test_compose_gateway.py);
    mid, in the test catalog's pool too, is unknown to it."""
    from router import save_artifact, train_artifact

    cheap_right = [float(i // 10 in (0, 1, 2, 5)) for i in range(len(ESTIMATES))]
    labels = np.array([[c, 1.0] for c in cheap_right] + [[1.0, 1.0]] * len(GREETINGS))
    artifact = train_artifact(
        ESTIMATES + GREETINGS, [1] * 120, labels, ["cheap", "pricey"], backend="static", model="logreg"
    )
    save_artifact(data_dir / "router", artifact)


@pytest.fixture
def cascading(upstream, tmp_path):
    """The cascading router (`save_cascading_router`) in a gateway; tenant acme has a budget."""
    save_cascading_router(tmp_path / "data")
    gw = gateway_with(upstream, tmp_path, BUDGET, retries=0)
    yield gw
    gw.server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_falls_back_to_fast_mode_when_its_cascade_fails(cascading, upstream, stream):
    """Cheap answers nothing (an empty answer, billed) and pricey fails: every level of the cascade
    failed. Fast mode answers from mid, the admissible worker the cascade did not try; the empty
    answer is billed with mid's, and the headers and the trace say what happened."""
    gw = cascading
    behave(
        upstream,
        **{
            "cheap-model": {"text": ""},
            "pricey-model": {"status": 500},
            "mid-model": {"text": "about 40000"},
        },
    )
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    answer = chat(gw, "auto", ESTIMATES[0], headers={"x-polyroute-cost-weight": "0.3"}, **extra)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "mid"
    assert answer.headers["x-polyroute-strategy"] == "fast"
    assert answer.headers["x-polyroute-compose"] == (
        "degraded: the cascade workflow produced no answer (every level failed); fast mode"
    )
    assert "40000" in answer.text  # mid's answer (streamed a word a chunk)
    record = record_of(gw, answer.headers["x-polyroute-request-id"])
    settled(gw)
    assert [r["model"] for r in upstream.requests] == ["cheap-model", "pricey-model", "mid-model"]
    cost = paid(upstream, answered={"cheap-model", "mid-model"})
    assert record["status"] == 200 and record["worker"] == "mid"
    assert record["route"] is None  # the router chose a cascade: no single-worker choice to replay
    assert Decimal(record["cost_micros"]) / 1_000_000 == cost == spend(gw)
    if not stream:
        assert Decimal(answer.headers["x-polyroute-cost-usd"]) == cost
    trace = record["trace"]
    assert trace["degraded"] is True and trace["workflow"] == "cascade" and trace["mode"] == "fast"
    assert Decimal(trace["cost_usd"]) == cost
    assert [(s["worker"], s.get("error")) for s in trace["steps"]][:2] == [
        ("cheap", "empty answer"),
        ("pricey", trace["steps"][1]["error"]),
    ]
    assert trace["steps"][1]["error"] and trace["steps"][-1]["worker"] == "mid"


def test_a_cascade_the_client_asked_for_is_not_answered_in_fast_mode(cascading, upstream):
    gw = cascading
    behave(upstream, **{"cheap-model": {"status": 500}, "pricey-model": {"status": 500}})
    answer = chat(gw, "compose:cascade", ESTIMATES[0])
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "workflow_failed"
    assert not upstream.requests_for("mid-model")


def test_no_untried_worker_leaves_the_cascade_failure_a_502(upstream, tmp_path):
    """A policy that admits only cheap and pricey: the cascade tried both, fast mode has nobody left."""
    from router import save_artifact, train_artifact

    cheap_right = [float(i // 10 in (0, 1, 2, 5)) for i in range(len(ESTIMATES))]
    labels = np.array([[c, 1.0] for c in cheap_right] + [[1.0, 1.0]] * len(GREETINGS))
    artifact = train_artifact(
        ESTIMATES + GREETINGS, [1] * 120, labels, ["cheap", "pricey"], backend="static", model="logreg"
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    only = {"id": "no-cn", "deny_jurisdictions": ["CN"]}  # mid is processed in CN
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump({"version": "two", "rules": [only]}))
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    gw = start_gateway(catalog, tmp_path / "data", policy_file=policy_file, retries=0)
    try:
        behave(upstream, **{"cheap-model": {"status": 500}, "pricey-model": {"status": 500}})
        answer = chat(gw, "auto", ESTIMATES[0], headers={"x-polyroute-cost-weight": "0.3"})
        assert answer.status_code == 502, answer.text
        assert answer.headers["x-polyroute-strategy"] == "compose:cascade"
        assert not upstream.requests_for("mid-model")
        assert metric(gw, "polyroute_requests_total", strategy="compose:cascade", status="502") == 1
    finally:
        gw.server.stop()
