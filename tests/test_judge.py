"""Judge-labelled traffic through a real gateway and the test upstream: the sampled share, the daily
budget, the data classes and admissibility that keep the judge away from what it must not see, and the
source=judge feedback it writes. Background grades are waited for by polling the ledger and the
metrics with a generous deadline, never by sleeping a fixed time."""

from __future__ import annotations

import json
import random
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.judge import JUDGE_MAX_TOKENS, RUBRIC, parse_score
from policies import PolicyError, parse_catalog, parse_policy
from tests.conftest import catalog_yaml_for, start_gateway

JUDGE = {"worker": "pricey", "sample": 1.0, "daily_budget_usd": 10}
INTERNAL_NOT_US = {
    "id": "internal-not-us",
    "when": {"data_classes": ["internal"]},
    "deny_jurisdictions": ["US"],
}
DEADLINE_S = 60.0  # a loaded 2-core machine: generous, and only reached when something is broken


def policy(judge: dict | None) -> dict:
    return {
        "version": "judge-test",
        "tenants": {"acme": {"judge": judge} if judge else {}},
        "rules": [INTERNAL_NOT_US],
    }


@pytest.fixture
def make_gateway(upstream, tmp_path):
    """A gateway whose policy gives tenant acme the given judge settings (pricey, the US worker, grades)."""
    started = []

    def make(judge: dict | None = JUDGE, seed: int = 0):
        data_dir = tmp_path / f"gw{len(started)}"
        data_dir.mkdir()
        (data_dir / "policy.yaml").write_text(yaml.safe_dump(policy(judge)))
        catalog = parse_catalog(catalog_yaml_for(upstream.url))
        gw = start_gateway(catalog, data_dir, policy_file=data_dir / "policy.yaml", judge_seed=seed)
        started.append(gw)
        upstream.behave("pricey-model", text="8")  # the judge's grade: 8/10
        return gw

    yield make
    for gw in started:
        gw.server.stop()


def ask(gw, text: str, model: str = "cheap", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    response = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response


def outcomes(gw, tenant: str = "acme") -> dict[str, int]:
    found: dict[str, int] = {}
    for metric in gw.state.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "polyroute_judge_total" and sample.labels["tenant"] == tenant:
                found[sample.labels["outcome"]] = int(sample.value)
    return found


def wait_for_outcomes(gw, total: int) -> dict[str, int]:
    """Every answer so far has its judge outcome (grades run in the background)."""
    deadline = time.monotonic() + DEADLINE_S
    while sum((found := outcomes(gw)).values()) < total:
        assert time.monotonic() < deadline, f"judge outcomes {found}, expected {total} in all"
        time.sleep(0.02)
    return found


def judge_feedback(data_dir: Path) -> list[dict]:
    lines = (data_dir / "ledger.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r["type"] == "feedback" and r.get("source") == "judge"]


def test_the_judge_grades_the_sampled_share_with_a_seeded_draw(make_gateway, upstream):
    gw = make_gateway({**JUDGE, "sample": 0.25}, seed=7)
    draws = random.Random(7)
    expected = sum(draws.random() < 0.25 for _ in range(120))  # one draw per eligible answer, in order
    ids = [
        ask(gw, f"What is the capital of country number {i}?").headers["x-polyroute-request-id"]
        for i in range(120)
    ]
    found = wait_for_outcomes(gw, 120)
    assert found == {"judged": expected, "not_sampled": 120 - expected}
    assert 15 <= expected <= 45  # the share honoured: Binomial(120, 0.25) is 30 ± 4.7
    grades = judge_feedback(gw.data_dir)
    assert len(grades) == expected == len(upstream.requests_for("pricey-model"))
    for grade in grades:
        assert grade["request_id"] in ids and grade["tenant"] == "acme"
        assert grade["worker"] == "cheap" and grade["judge"] == "pricey" and grade["score"] == 0.8
        assert grade["cost_micros"] > 0
    call = upstream.requests_for("pricey-model")[0]
    assert call["messages"][0] == {"role": "system", "content": RUBRIC}
    assert "<answer>\nHello from the test upstream.\n</answer>" in call["messages"][1]["content"]
    assert call["max_tokens"] == JUDGE_MAX_TOKENS and call["temperature"] == 0
    spent = sum(g["cost_micros"] for g in grades) / 1e6
    metric = gw.state.metrics.registry.get_sample_value("polyroute_judge_cost_usd_total", {"tenant": "acme"})
    assert metric == pytest.approx(spent, rel=1e-6)


def test_the_judge_stops_at_its_daily_budget(make_gateway, upstream):
    budget = Decimal("0.005")  # a few grades of pricey ($5/M in, $15/M out; a grade holds ~$0.0024)
    gw = make_gateway({**JUDGE, "daily_budget_usd": str(budget)})
    seen: list[dict[str, int]] = []
    for i in range(12):  # one at a time: each grade settles before the next is reserved
        ask(gw, f"Explain rate limiting with a token bucket, case {i}.")
        seen.append(wait_for_outcomes(gw, i + 1))
    judged = seen[-1]["judged"]
    assert judged >= 1 and seen[-1]["budget"] == 12 - judged
    assert [s.get("budget", 0) for s in seen][judged:] == list(range(1, 13 - judged))  # then never again
    assert len(upstream.requests_for("pricey-model")) == judged == len(judge_feedback(gw.data_dir))
    spent = sum(g["cost_micros"] for g in judge_feedback(gw.data_dir))
    assert 0 < spent <= budget * 1_000_000
    judge_spend = httpx.get(gw.url + "/admin/spend/judge:acme", headers=gw.auth(gw.admin_key)).json()
    assert Decimal(judge_spend["daily_usd"]) == Decimal(spent) / 1_000_000
    records = [json.loads(line) for line in (gw.data_dir / "ledger.jsonl").read_text().splitlines()]
    own = sum(r["cost_micros"] for r in records if r["type"] == "request")
    tenant_spend = httpx.get(gw.url + "/admin/spend/acme", headers=gw.auth(gw.admin_key)).json()
    assert Decimal(tenant_spend["daily_usd"]) == Decimal(own) / 1_000_000  # not charged for the judge


def test_private_data_and_an_inadmissible_judge_are_never_graded(make_gateway, upstream):
    gw = make_gateway()
    ask(gw, "Please e-mail the summary to jane.doe@example.com")  # detected: pii
    ask(gw, "hello", metadata={"data_class": "secret"})
    ask(gw, "our roadmap for next quarter", metadata={"data_class": "internal"})  # pricey is US: denied
    assert wait_for_outcomes(gw, 3) == {"data_class": 2, "inadmissible": 1}
    upstream.behave("cheap-model", text="Write to jane.doe@example.com for details.")
    ask(gw, "Who do I ask about the offsite?")  # a public question, but the answer carries pii
    assert wait_for_outcomes(gw, 4) == {"data_class": 3, "inadmissible": 1}
    assert not upstream.requests_for("pricey-model") and not judge_feedback(gw.data_dir)
    upstream.behave("cheap-model", text="Ask the events team.")
    ask(gw, "Who organises the offsite?")
    assert wait_for_outcomes(gw, 5)["judged"] == 1
    assert len(upstream.requests_for("pricey-model")) == 1


def test_unparsable_or_failed_grades_write_nothing(make_gateway, upstream):
    gw = make_gateway()
    upstream.behave("pricey-model", text="The answer seems fine, maybe an 8 or a Score: 10.")
    ask(gw, "What is GCRA?")
    assert wait_for_outcomes(gw, 1) == {"unparsable": 1}
    upstream.behave("pricey-model", status=500)
    ask(gw, "What is a leaky bucket?")
    assert wait_for_outcomes(gw, 2) == {"unparsable": 1, "worker_error": 1}
    assert not judge_feedback(gw.data_dir)
    spend = httpx.get(gw.url + "/admin/spend/judge:acme", headers=gw.auth(gw.admin_key)).json()
    assert Decimal(spend["daily_usd"]) > 0  # the unparsable grade was paid for; the failed one held nothing


def test_streamed_answers_are_graded_and_routed_requests_log_their_propensity(make_gateway, upstream):
    gw = make_gateway()
    upstream.behave("cheap-model", text="A token bucket refills at a steady rate.")
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        timeout=30,
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": "What is a token bucket?"}],
            "stream": True,
        },
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-polyroute-request-id"]
        response.read()
    assert wait_for_outcomes(gw, 1) == {"judged": 1}
    [grade] = judge_feedback(gw.data_dir)
    assert grade["request_id"] == request_id and grade["worker"] == "cheap"
    prompt = upstream.requests_for("pricey-model")[0]["messages"][1]["content"]
    assert "A token bucket refills at a steady rate." in prompt
    records = [json.loads(line) for line in (gw.data_dir / "ledger.jsonl").read_text().splitlines()]
    request = next(r for r in records if r.get("id") == request_id)
    route = request["route"]  # the rule-based router chose: deterministically
    assert route["chosen"] == "cheap" and route["propensity"] == 1.0 and route["epsilon"] == 0
    assert set(route["pool"]) == {"cheap", "mid", "pricey"} and route["cost_weight"] == 0.5
    pinned = ask(gw, "pinned, not routed", model="mid").headers["x-polyroute-request-id"]
    records = [json.loads(line) for line in (gw.data_dir / "ledger.jsonl").read_text().splitlines()]
    assert next(r for r in records if r.get("id") == pinned)["route"] is None


def test_tenants_without_a_judge_are_untouched(make_gateway, upstream):
    gw = make_gateway(judge=None)
    ask(gw, "What is GCRA?")
    ask(gw, "What is a token bucket?")
    assert outcomes(gw) == {}
    assert not upstream.requests_for("pricey-model")


@pytest.mark.parametrize(
    ("judge", "message"),
    [
        ({"worker": "pricey", "sample": 0, "daily_budget_usd": 1}, "sample"),
        ({"worker": "pricey", "sample": 1.5, "daily_budget_usd": 1}, "sample"),
        ({"worker": "pricey", "sample": 0.1}, "daily_budget_usd"),
        ({"worker": "pricey", "sample": 0.1, "daily_budget_usd": -1}, "daily_budget_usd"),
        ({"worker": "pricey", "daily_budget_usd": 1, "rate": 2}, "rate"),
        ({"sample": 0.1, "daily_budget_usd": 1}, "worker"),
    ],
)
def test_bad_judge_settings_are_refused_by_name(judge, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(yaml.safe_dump(policy(judge)), "judge.yaml")


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("8", 0.8),
        ("10", 1.0),
        ("0", 0.0),
        ("7/10", 0.7),
        ("Score: 6", 0.6),
        ("score = 9.5", 0.95),
        ("  \n7\nBecause it is right.", 0.7),
        ("11", None),
        ("The answer is good, Score: 10", None),
        ("eight", None),
        ("", None),
        (None, None),
    ],
)
def test_scores_are_read_strictly(reply, score):
    assert parse_score(reply) == (pytest.approx(score) if score is not None else None)


def test_a_policy_rule_cannot_take_the_id_of_a_budget_exclusion():
    """The judge waives the tenant's budget exclusions (budget:daily, budget:monthly) and nothing
    else; a rule named like one would be waived with them, sending data the rule keeps away."""
    for reserved in ("budget:us-free-internal", "BUDGET:daily", "unavailable"):
        with pytest.raises(PolicyError, match="reserved"):
            parse_policy(yaml.safe_dump({**policy(JUDGE), "rules": [{**INTERNAL_NOT_US, "id": reserved}]}))


def judge_answering(make_gateway, upstream, latency_s: float):
    """A gateway whose judge has been sent a grade and takes ``latency_s`` to answer it."""
    gw = make_gateway()
    upstream.behave("pricey-model", text="8", latency_s=latency_s)
    ask(gw, "what is a leaky bucket")
    deadline = time.monotonic() + DEADLINE_S
    while not upstream.requests_for("pricey-model"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return gw


def test_a_grade_whose_judge_answers_after_judging_is_turned_off_is_dropped(make_gateway, upstream):
    gw = judge_answering(make_gateway, upstream, latency_s=2.0)
    off = httpx.put(
        gw.url + "/admin/policies",
        headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
        content=yaml.safe_dump({**policy(None), "version": "judging-off"}),
        timeout=30,
    )
    assert off.status_code == 200, off.text
    assert wait_for_outcomes(gw, 1) == {"disabled": 1}
    assert judge_feedback(gw.data_dir) == []


def test_the_judge_holds_the_most_a_grade_can_cost(make_gateway, upstream):
    """Chinese text is about one token per character, four times the usual chars/4 prediction: held
    at that prediction, 24 concurrent grades each fitted the budget and together spent 3.6 times it.
    The hold counts every UTF-8 byte a token, which no tokenizer exceeds."""
    import concurrent.futures

    from gateway.judge import judge_chat, most_cost

    question = "我们的路线图包括新的产品发布和市场扩展计划。请总结。" * 30
    answer = "总结：新产品将在下个季度发布，市场扩展将首先覆盖亚洲地区。" * 40
    chat = judge_chat("pricey", question, answer)
    tokens = sum(len(text) for text in chat.texts()) + 8  # ~1 token per CJK character, as cl100k counts
    assert most_cost(gw_worker(upstream), chat) >= Decimal(tokens) * 5 / 1_000_000
    budget = Decimal("0.05")
    gw = make_gateway({**JUDGE, "daily_budget_usd": str(budget)})
    upstream.behave("cheap-model", text=answer)
    upstream.behave("pricey-model", text="8", latency_s=0.5, prompt_tokens=tokens, completion_tokens=1)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: ask(gw, f"{i}: {question}"), range(24)))
    found = wait_for_outcomes(gw, 24)
    assert found.get("judged", 0) >= 1 and found.get("budget", 0) >= 1, found
    spend = httpx.get(gw.url + "/admin/spend/judge:acme", headers=gw.auth(gw.admin_key)).json()
    assert Decimal(spend["daily_usd"]) <= budget


def gw_worker(upstream):
    return parse_catalog(catalog_yaml_for(upstream.url)).get("pricey")


def test_grades_beyond_the_in_flight_cap_are_dropped_as_busy(make_gateway, upstream):
    """A judge that hangs holds an upstream connection per grade: past the cap, answers are not
    graded (``busy``) and client requests are not held up."""
    gw = make_gateway()
    gw.state.judge.max_in_flight = 2
    upstream.behave("pricey-model", text="8", latency_s=3.0)
    for i in range(5):
        ask(gw, f"question {i}")
    found = wait_for_outcomes(gw, 5)
    assert found == {"busy": 3, "judged": 2}, found
    assert len(upstream.requests_for("pricey-model")) == 2


def test_a_judge_outside_the_catalog_is_refused_when_the_policy_is_put(make_gateway, upstream):
    gw = make_gateway()
    before = httpx.get(gw.url + "/admin/policies", headers=gw.auth(gw.admin_key), timeout=30).text
    put = httpx.put(
        gw.url + "/admin/policies",
        headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
        content=yaml.safe_dump({**policy({**JUDGE, "worker": "no-such-worker"}), "version": "typo"}),
        timeout=30,
    )
    assert put.status_code == 400
    assert (
        "tenants.acme.judge.worker: 'no-such-worker' is not in the catalog" in put.json()["error"]["message"]
    )
    after = httpx.get(gw.url + "/admin/policies", headers=gw.auth(gw.admin_key), timeout=30).text
    assert after == before  # the policy in force is unchanged


def test_a_grade_cut_by_shutdown_is_charged_to_the_judge_budget(make_gateway, upstream):
    """A rolling deploy stops the gateway while the judge is answering. The call was sent and its
    provider may bill it: the judge's budget is charged its hold (the most the grade can cost), and
    the charge is in spend.json, where it used to be released and lost."""
    gw = judge_answering(make_gateway, upstream, latency_s=30.0)
    gw.server.stop()  # waits 5 s for bookkeeping, then cancels the grade
    settled = json.loads((gw.data_dir / "spend.json").read_text())["settled"]
    charged = [micros for key, micros in settled.items() if key.startswith("judge:acme|d:")]
    assert charged and charged[0] > 0, settled
    assert judge_feedback(gw.data_dir) == []  # no grade came back: no label
