"""The answer-aware planner live in the gateway, against the test upstream: under model=auto (and
compose:plan) a learned router with a trained planner calls workers round by round and stops when
the best answer held beats any further call — steps in the trace and headers, parallel rounds,
failing members, the cost ceiling, policy confinement, streaming, and older router files."""

from __future__ import annotations

import pickle
from decimal import Decimal

import httpx
import numpy as np
import orjson
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

WORKERS = ("cheap", "mid", "pricey")
ACCURACY = (0.6, 0.7, 0.95)
QUESTION = "Which colour is right for the last item?\nA) red\nB) blue\nC) green\nD) black"


def multiple_choice(n: int, seed: int = 0) -> tuple[list[str], list[list[str]], np.ndarray]:
    """`n` synthetic four-option questions; worker j answers the right letter with P = ACCURACY[j],
    else a random wrong one."""
    rng = np.random.default_rng(seed)
    queries, texts, labels = [], [], []
    for i in range(n):
        options = rng.permutation(["red", "blue", "green", "black"])
        right = "ABCD"[int(rng.integers(4))]
        queries.append(
            f"Which colour is right for item {i}?\n"
            + "\n".join(f"{letter}) {option}" for letter, option in zip("ABCD", options, strict=True))
        )
        row, scored = [], []
        for accuracy in ACCURACY:
            good = rng.random() < accuracy
            row.append(right if good else str(rng.choice([x for x in "ABCD" if x != right])))
            scored.append(float(good))
        texts.append(row)
        labels.append(scored)
    return queries, texts, np.asarray(labels)


@pytest.fixture(scope="session")
def trained():
    """A planner fitted on 300 recorded multiple-choice queries, and the query-only router's artifact
    that will carry it. The router learns from the same labels on the test's own question, so its
    priors for it are the workers' accuracies, as in the planner's training. Fitted once per session
    (~2 s of CPU)."""
    from router import train_artifact
    from router.offline.book import AnswerBook
    from router.offline.planner_fit import Recorded, fit_planner

    queries, texts, labels = multiple_choice(300)
    recorded = Recorded.from_priors(AnswerBook(queries, texts), np.tile(ACCURACY, (300, 1)), labels)
    planner = fit_planner(recorded, k=3).final  # (tests/conftest.py keeps OpenMP from spinning)
    artifact = train_artifact(
        [QUESTION] * 300, [1] * 300, labels, list(WORKERS), backend="static", model="logreg"
    )
    return planner, artifact


def with_planner(artifact, planner):
    """A fresh copy of the trained artifact carrying `planner` (None: an artifact without one)."""
    copy = pickle.loads(pickle.dumps(artifact))
    copy.cascade = planner
    copy.version = ""
    return copy


def planned_gateway(upstream, tmp_path, artifact, **settings) -> Gateway:
    from router import save_artifact

    save_artifact(tmp_path / "data" / "router", artifact)
    # no transport retries: a worker's failure is seen by the plan at once (and called once)
    settings = {"retries": 0, **settings}
    return start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", **settings)


@pytest.fixture(scope="module")
def gateway_with_planner(upstream, trained, tmp_path_factory):
    planner, artifact = trained
    gw = planned_gateway(upstream, tmp_path_factory.mktemp("planned"), with_planner(artifact, planner))
    assert gw.state.router.current.planner is not None
    yield gw
    gw.server.stop()


def ask(gw: Gateway, model: str = "auto", *, cost_weight: float | None = None, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": extra.pop("content", QUESTION)}],
        "max_tokens": 20,
        **extra,
    }
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    if cost_weight is not None:
        headers["x-polyroute-cost-weight"] = str(cost_weight)
    return httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=60)


def trace_of(response: httpx.Response) -> dict:
    return response.json()["polyroute"]["trace"]


def header_steps(response: httpx.Response) -> list[list[str]]:
    """x-polyroute-plan's steps: one list of workers per round."""
    fields = dict(part.split("=", 1) for part in response.headers["x-polyroute-plan"].split("; "))
    return [r.split("+") for r in fields["steps"].split(",")] if fields["steps"] else []


def answered(upstream) -> dict[str, int]:
    """Upstream chat requests per worker (catalog name)."""
    counts: dict[str, int] = {}
    for model, _, _ in upstream.spans:
        counts[model.removesuffix("-model")] = counts.get(model.removesuffix("-model"), 0) + 1
    return counts


def walk(
    gw: Gateway, texts: dict[str, str], cost_weight: float, latency_weight: float = 0.0
) -> list[list[str]]:
    """The plan the gateway's planner makes for QUESTION when worker w answers ``texts[w]``, walked
    here from the same priors and predicted costs the gateway uses (no ceiling, no failures): the
    oracle the live plan must match, and how a test picks a λ for the behaviour it checks without
    depending on what one fit of the planner happens to prefer."""
    from gateway.schemas import ChatCompletionRequest
    from router import RouteRequest
    from router.evidence import logit, read_answers
    from router.planner import State

    router = gw.state.router.current
    chat = ChatCompletionRequest.model_validate(
        {"model": "auto", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20}
    )
    route = RouteRequest(chat.prompt_chars(), chat.output_budget(), text=QUESTION, cost_weight=cost_weight)
    # in the router's order, as the gateway hands the pool over (it settles the planner's exact ties)
    pool = list(router.route(route, tuple(gw.state.catalog.get(w) for w in WORKERS)).workers)
    estimates = router.estimates(route, pool)
    log_odds, costs = [logit(e.quality) for e in estimates], [float(e.cost_usd) for e in estimates]
    called: list[int] = []
    rounds: list[list[str]] = []
    while True:
        held = [texts[pool[k].name] for k in called]
        read = read_answers(QUESTION, held) if called else None
        state = State.of(QUESTION, called, read)
        decision = router.planner.decide(state, log_odds, costs, cost_weight, latency_weight=latency_weight)
        if not decision.call:
            return rounds
        rounds.append([pool[k].name for k in decision.call])
        called.extend(decision.call)


LAMBDAS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


def pick(gw: Gateway, texts: dict[str, str], wanted, latency_weight: float = 0.0) -> tuple[float, list]:
    """The first λ of LAMBDAS whose plan (:func:`walk`) satisfies ``wanted``, and that plan."""
    for cost_weight in LAMBDAS:
        rounds = walk(gw, texts, cost_weight, latency_weight)
        if wanted(rounds):
            return cost_weight, rounds
    pytest.fail(f"the fitted planner makes no such plan at any λ of {LAMBDAS} (μ={latency_weight})")


def behave_all(upstream, texts: dict[str, str], **settings) -> None:
    for worker, text in texts.items():
        upstream.behave(f"{worker}-model", text=text, **settings)


# ---- the plan under model=auto ---------------------------------------------------------------
def test_auto_runs_the_plan_and_reports_every_step(gateway_with_planner, upstream):
    """The workers disagree; at a λ where the planner reads the first answer and calls again, the
    live plan is the one the planner makes offline, every step is in the trace and the headers."""
    texts = {"cheap": "A", "mid": "B", "pricey": "C"}
    cost_weight, expected = pick(gateway_with_planner, texts, lambda rounds: len(rounds) >= 2)
    behave_all(upstream, texts)
    answer = ask(gateway_with_planner, cost_weight=cost_weight)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-strategy"] == "compose:plan"
    assert answer.headers["x-polyroute-route-reason"].startswith("answer-aware plan over 3 workers")
    trace = trace_of(answer)
    steps = trace["steps"]
    rounds = header_steps(answer)
    assert rounds == expected == trace["detail"]["rounds"]
    # the header lists every worker called, round by round, in the order of the trace
    assert [s["worker"] for s in steps] == [w for r in rounds for w in r]
    assert answer.headers["x-polyroute-plan"].startswith(f"rounds={len(rounds)}; calls={len(steps)}; ")
    assert all(s["role"] == "answer" and "round " in s["verdict"] for s in steps)
    assert [s["verdict"].split(": ")[0].split("round ")[1] for s in steps] == [
        str(i + 1) for i, r in enumerate(rounds) for _ in r
    ]
    chosen = [s for s in steps if s["verdict"].startswith("chosen (P=")]
    assert len(chosen) == 1 and chosen[0]["worker"] == answer.headers["x-polyroute-worker"]
    # the answer is one a worker gave, and every worker was called once at most
    assert answer.json()["choices"][0]["message"]["content"] == texts[answer.headers["x-polyroute-worker"]]
    assert answered(upstream) == {s["worker"]: 1 for s in steps}
    total = sum(Decimal(s["cost_usd"]) for s in steps)
    assert total > 0 and Decimal(answer.headers["x-polyroute-cost-usd"]) == pytest.approx(
        total, abs=Decimal("1e-9")
    )
    assert answer.headers["x-polyroute-compose"].startswith(f"stopped after {len(rounds)} rounds")


def test_parallel_round_calls_two_workers_at_once(gateway_with_planner, upstream):
    """With a latency weight the planner may call two workers in one round: they are called
    concurrently, i.e. both requests were in flight at once at the upstream (each takes 1 s)."""
    texts = dict.fromkeys(WORKERS, "C")
    cost_weight, expected = pick(gateway_with_planner, texts, lambda r: len(r[0]) == 2, latency_weight=5)
    behave_all(upstream, texts, latency_s=1.0)
    answer = ask(gateway_with_planner, cost_weight=cost_weight, metadata={"latency_weight": 5})
    assert answer.status_code == 200, answer.text
    first = header_steps(answer)[0]
    assert first == expected[0] and len(first) == 2
    spans = {model.removesuffix("-model"): (start, end) for model, start, end in upstream.spans}
    (a_start, a_end), (b_start, b_end) = spans[first[0]], spans[first[1]]
    assert a_start < b_end and b_start < a_end  # overlapping: neither waited for the other
    assert answer.headers["x-polyroute-plan"].split("steps=")[1].startswith("+".join(first))
    bad = ask(gateway_with_planner, metadata={"latency_weight": "fast"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.latency_weight"
    too_high = ask(gateway_with_planner, metadata={"latency_weight": 11})
    assert too_high.status_code == 400


@pytest.mark.parametrize("cost_weight", [0.0, 1.0])
def test_a_failing_worker_is_dropped_and_the_plan_goes_on(gateway_with_planner, upstream, cost_weight):
    """The worker the planner calls first fails (500): it is dropped, never called again, and the
    plan goes on with the others (with no answer yet, it must call one)."""
    texts = dict.fromkeys(WORKERS, "D")
    first = walk(gateway_with_planner, texts, cost_weight)[0][0]
    behave_all(upstream, texts)
    upstream.behave(f"{first}-model", status=500)
    answer = ask(gateway_with_planner, cost_weight=cost_weight)
    assert answer.status_code == 200, answer.text
    steps = trace_of(answer)["steps"]
    failed = [s for s in steps if s.get("error")]
    assert [s["worker"] for s in failed] == [first] and "500" in failed[0]["error"]
    assert (
        failed[0]["verdict"].startswith("round 1: ")
        and "failed, dropped from the plan" in failed[0]["verdict"]
    )
    assert answer.headers["x-polyroute-worker"] != first
    assert answer.json()["choices"][0]["message"]["content"] == "D"
    assert answered(upstream)[first] == 1  # never called again (and no transport retry either)
    assert [s["worker"] for s in steps].count(first) == 1
    assert len(header_steps(answer)) >= 2


def test_the_ceiling_mid_plan_returns_the_answer_so_far(gateway_with_planner, upstream):
    """The ceiling admits one cheap call (~$0.00001), not mid's (~$0.0001): the plan can only ask
    cheap; at λ = 0 any expected gain is worth a call, so it wants more, but stops with cheap's answer
    and says so."""
    texts = {"cheap": "A", "mid": "B", "pricey": "B"}
    behave_all(upstream, texts)
    answer = ask(gateway_with_planner, cost_weight=0.0, metadata={"max_cost_usd": 0.00003})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "cheap"
    assert answer.headers["x-polyroute-compose"].startswith("cost ceiling reached after 1 round, 1 call")
    assert answered(upstream) == {"cheap": 1}
    steps = trace_of(answer)["steps"]
    assert steps[0]["worker"] == "cheap" and steps[0]["verdict"].startswith("chosen (P=")
    assert steps[-1]["verdict"] == "skipped: cost ceiling" and steps[-1]["worker"] != "cheap"
    assert Decimal(answer.headers["x-polyroute-cost-usd"]) <= Decimal("0.00003")


def test_streaming_returns_the_final_answer_as_chunks(gateway_with_planner, upstream):
    upstream.behave("cheap-model", text="A) red, since the others do not fit the item at all")
    upstream.behave("mid-model", text="A")
    upstream.behave("pricey-model", text="A")
    with httpx.stream(
        "POST",
        gateway_with_planner.v1 + "/chat/completions",
        headers=gateway_with_planner.auth(),
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-polyroute-strategy"] == "compose:plan"
        worker = response.headers["x-polyroute-worker"]
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    given = {"cheap": "A) red, since the others do not fit the item at all", "mid": "A", "pricey": "A"}
    assert text == given[worker]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_compose_plan_by_name_and_a_quality_target_under_auto(gateway_with_planner, upstream):
    behave_all(upstream, dict.fromkeys(WORKERS, "B"))
    answer = ask(gateway_with_planner, "compose:plan")
    assert answer.status_code == 200 and answer.headers["x-polyroute-strategy"] == "compose:plan"
    assert answer.headers["x-polyroute-route-reason"].startswith("compose:plan requested")
    assert answer.json()["choices"][0]["message"]["content"] == "B"
    # a quality target asks for the cheapest worker predicted to reach it: fast mode, no plan
    target = ask(gateway_with_planner, metadata={"min_quality": 0.5})
    assert target.status_code == 200 and target.headers["x-polyroute-strategy"] == "fast"
    assert "x-polyroute-plan" not in target.headers


def test_every_worker_failing_is_a_502_and_each_is_called_once(gateway_with_planner, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    answer = ask(gateway_with_planner, cost_weight=0.0)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "workflow_failed"
    assert "no worker answered after" in answer.json()["error"]["message"]
    assert sorted(w for r in header_steps(answer) for w in r) == sorted(WORKERS)
    assert answered(upstream) == dict.fromkeys(WORKERS, 1)


def test_a_ceiling_no_worker_fits_calls_nobody(gateway_with_planner, upstream):
    answer = ask(gateway_with_planner, metadata={"max_cost_usd": 0.0000001})
    assert answer.status_code == 502 and "no worker fits" in answer.json()["error"]["message"]
    assert answer.headers["x-polyroute-plan"] == "rounds=0; calls=0; steps="
    assert not upstream.spans


def test_code_answers_compare_by_behaviour_when_code_may_run(trained):
    """plan_code_exec: two sources that behave alike agree (same key), the buggy one does not and
    fails the prompt's assert; without it, code is compared by canonical source."""
    import asyncio

    from gateway import Settings
    from gateway.compose import _code_keys
    from router.compose.planned import Planned

    planner, _ = trained
    question = "Write a Python function add(a, b) that returns the sum.\nassert add(2, 3) == 5"
    texts = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(x, y):\n    total = x\n    total += y\n    return total\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
    ]
    assert _code_keys(Settings()) is None
    running = Planned(planner, [0.0] * 3, [1.0] * 3, code_keys=_code_keys(Settings(plan_code_exec=True)))
    read = asyncio.run(running.read(question, texts))
    assert read.keys[0] == read.keys[1] != read.keys[2] and read.assert_pass == (1.0, 1.0, 0.0)
    by_source = asyncio.run(Planned(planner, [0.0] * 3, [1.0] * 3).read(question, texts))
    assert len(set(by_source.keys)) == 3 and by_source.assert_pass == (None, None, None)


def test_compose_plan_setting_off_keeps_auto_as_before(upstream, trained, tmp_path):
    planner, artifact = trained
    gw = planned_gateway(upstream, tmp_path, with_planner(artifact, planner), compose_plan=False)
    try:
        for model in ("cheap-model", "mid-model", "pricey-model"):
            upstream.behave(model, text="A")
        auto = ask(gw)
        assert auto.status_code == 200 and auto.headers["x-polyroute-strategy"] != "compose:plan"
        assert "x-polyroute-plan" not in auto.headers
        forced = ask(gw, "compose:plan")  # by name it still runs
        assert forced.status_code == 200 and forced.headers["x-polyroute-strategy"] == "compose:plan"
    finally:
        gw.server.stop()


# ---- confinement and refusals ----------------------------------------------------------------
def test_a_policy_that_admits_one_worker_skips_the_plan(upstream, trained, tmp_path):
    planner, artifact = trained
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        yaml.safe_dump({"version": "fr", "rules": [{"id": "fr-only", "allow_jurisdictions": ["FR"]}]})
    )
    gw = planned_gateway(upstream, tmp_path, with_planner(artifact, planner), policy_file=policy)
    try:
        upstream.behave("cheap-model", text="I cannot tell.")
        for model in ("auto", "compose:plan"):
            answer = ask(gw, model, cost_weight=0.0)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-polyroute-worker"] == "cheap"
            assert answer.headers["x-polyroute-strategy"] != "compose:plan"
            assert answer.headers["x-polyroute-compose"].startswith("degraded: only one admissible worker")
            assert "x-polyroute-plan" not in answer.headers
        assert {b["model"] for b in upstream.requests} == {"cheap-model"}
    finally:
        gw.server.stop()


def test_compose_plan_without_a_planner_is_a_400(gateway, upstream):
    answer = ask(gateway, "compose:plan")
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == "model"
    assert "polyroute router train --strategy cascade" in error["message"]
    assert not upstream.requests


def test_an_old_router_file_without_a_planner_loads_and_serves(upstream, trained, tmp_path):
    """A model saved before the planner existed (no `cascade` attribute at all) still loads: auto is
    routed as before, and compose:plan says a planner must be trained."""
    from router import LearnedRouter, load_version, save_artifact

    _, artifact = trained
    old = with_planner(artifact, None)
    del old.__dict__["cascade"]  # as pickled by a gateway whose RouterArtifact had no such field
    directory = save_artifact(tmp_path / "data" / "router", old)
    loaded = load_version(directory.parent, directory.name)
    assert "cascade" not in loaded.__dict__ and loaded.cascade is None
    assert LearnedRouter(loaded, features=None).planner is None
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data")
    try:
        assert gw.state.router.current.name == "learned"
        upstream.behave("cheap-model", text="A")
        upstream.behave("mid-model", text="A")
        upstream.behave("pricey-model", text="A")
        fast = ask(gw)
        assert fast.status_code == 200 and fast.headers["x-polyroute-strategy"] in ("fast", "compose:cascade")
        refused = ask(gw, "compose:plan")
        assert refused.status_code == 400 and "--strategy cascade" in refused.json()["error"]["message"]
    finally:
        gw.server.stop()


def test_a_planner_that_does_not_match_this_code_is_refused_at_load(upstream, trained, tmp_path):
    """A router file whose planner was fitted on other features fails when it loads (the gateway
    keeps the rule-based router and says why), not on a client's request."""
    from router.planner import Boosted, CascadePlanner

    _, artifact = trained
    stale = CascadePlanner(Boosted().fit(np.zeros((4, 2)), np.ones(4)))  # two features: not ours
    gw = planned_gateway(upstream, tmp_path, with_planner(artifact, stale))
    try:
        assert gw.state.router.current.name != "learned"
        assert "expected [n, 2] features" in gw.state.router.error
    finally:
        gw.server.stop()


# ---- the real local worker -------------------------------------------------------------------
@pytest.mark.slow
def test_plan_over_the_local_worker_and_an_upstream_worker(upstream, trained, tmp_path):
    """The free local Gemma (llama.cpp) and `pricey` on the test upstream under one plan. At λ = 0 any
    expected gain is worth a call, so the plan asks both whatever order it picks; `pricey` fails, so
    the local model's answer is the one returned."""
    from policies import load_catalog
    from router import save_artifact, train_artifact
    from tests.test_local_worker import wait_ready

    planner, _ = trained
    _, _, labels = multiple_choice(60)
    local_labels = labels[:, [0, 2]]  # the local model as the weak worker, pricey as the strong one
    artifact = train_artifact(
        [QUESTION] * 60,
        [1] * 60,
        local_labels,
        ["gemma-3-270m-local", "pricey"],
        backend="static",
        model="logreg",
    )
    artifact.cascade = planner
    save_artifact(tmp_path / "data" / "router", artifact)
    default = load_catalog()
    pricey = parse_catalog(catalog_yaml_for(upstream.url)).get("pricey")
    catalog = default.model_copy(update={"workers": (default.get("gemma-3-270m-local"), pricey)})
    gw = start_gateway(catalog, tmp_path / "data", local_workers=True, retries=0)
    try:
        assert wait_ready(gw)["ready"]
        upstream.behave("pricey-model", status=500)
        answer = ask(gw, "compose:plan", cost_weight=0.0, max_tokens=12, temperature=0)
        assert answer.status_code == 200, answer.text
        steps = {s["worker"]: s for s in trace_of(answer)["steps"]}
        assert set(steps) == {"gemma-3-270m-local", "pricey"}
        assert "500" in steps["pricey"]["error"] and len(upstream.requests_for("pricey-model")) == 1
        local = steps["gemma-3-270m-local"]
        assert local["completion_tokens"] > 0 and Decimal(local["cost_usd"]) == 0
        assert local["verdict"].startswith("chosen (P=")
        assert answer.headers["x-polyroute-worker"] == "gemma-3-270m-local"
        assert answer.json()["choices"][0]["message"]["content"].strip()
        assert sorted(w for r in header_steps(answer) for w in r) == ["gemma-3-270m-local", "pricey"]
    finally:
        gw.server.stop()
