"""Off-policy evaluation: the IPS estimators on synthetic logs whose true value is known, the router's
propensities, and `router eval --from-ledger --candidate` replaying a candidate on a logged ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from decimal import Decimal

import numpy as np
import pytest

from gateway.ledger import FeedbackRecord, RequestRecord, training_rows
from policies import parse_catalog
from router import (
    LearnedRouter,
    Propensity,
    RouteDecision,
    RouteRequest,
    feature_builder_for,
    save_artifact,
    train_artifact,
)
from router.offline.ips import effective_sample_size, importance_weights, ips, on_policy, snips
from router.offline.ledger import LEFT_CATALOG, NOT_ROUTED, evaluate_candidate
from router.routelog import route_log
from tests.conftest import catalog_yaml_for
from tests.test_router_learned import CHAT, MATH, synthetic

MEANS = np.array([0.2, 0.5, 0.8])  # Bernoulli mean reward of each arm
LOGGING = np.array([0.7, 0.2, 0.1])  # the logging policy's known propensities
LOGGING_VALUE = float(LOGGING @ MEANS)  # 0.32


@pytest.fixture(scope="module")
def trained():
    """pricey answers everything, cheap fails the arithmetic (tests/test_router_learned.py's data)."""
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


def bandit_log(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(actions, rewards) of n rounds of the logging policy on the 3-armed Bernoulli bandit."""
    actions = rng.choice(3, size=n, p=LOGGING)
    rewards = (rng.random(n) < MEANS[actions]).astype(float)
    return actions, rewards


def test_ips_recovers_a_known_value_and_excludes_a_wrong_one():
    actions, rewards = bandit_log(20_000, np.random.default_rng(7))
    target = (actions == 2).astype(float)  # the candidate always pulls the best arm: true value 0.8
    logged = LOGGING[actions]
    for estimator in (ips, snips):
        estimate = estimator(rewards, target, logged)
        assert estimate.covers(0.8), (estimator.__name__, estimate)
        assert not estimate.covers(0.5) and not estimate.covers(LOGGING_VALUE)
        assert estimate.high - estimate.low < 0.1 and estimate.n == 20_000
    baseline = on_policy(rewards)
    assert baseline.covers(LOGGING_VALUE) and not baseline.covers(0.8)


def test_a_context_dependent_candidate():
    """Two kinds of query; the best arm differs by kind, and the candidate knows it."""
    rng = np.random.default_rng(11)
    n = 30_000
    kind = rng.integers(0, 2, size=n)
    means = np.array([[0.9, 0.3, 0.1], [0.2, 0.4, 0.7]])  # [kind, arm]
    actions = rng.choice(3, size=n, p=LOGGING)
    rewards = (rng.random(n) < means[kind, actions]).astype(float)
    policy = np.array([0, 2])  # kind 0 -> arm 0, kind 1 -> arm 2
    truth = 0.5 * 0.9 + 0.5 * 0.7
    target = (actions == policy[kind]).astype(float)
    estimate = snips(rewards, target, LOGGING[actions])
    assert estimate.covers(truth) and not estimate.covers(truth - 0.1)
    assert ips(rewards, target, LOGGING[actions]).covers(truth)


def test_intervals_cover_the_truth_at_about_their_level():
    """Over many independent logs, a 95% interval holds the true value about 95% of the time."""
    rng = np.random.default_rng(2024)
    covered = Counter()
    runs = 300
    for _ in range(runs):
        actions, rewards = bandit_log(2_000, rng)
        target = (actions == 1).astype(float)  # true value 0.5
        covered["ips"] += ips(rewards, target, LOGGING[actions]).covers(0.5)
        covered["snips"] += snips(rewards, target, LOGGING[actions]).covers(0.5)
    for name, count in covered.items():
        assert 0.90 <= count / runs <= 0.99, (name, count / runs)


def test_effective_sample_size_and_no_support():
    assert effective_sample_size(np.ones(50)) == pytest.approx(50)
    assert effective_sample_size([0.0, 0.0, 4.0]) == pytest.approx(1)
    assert effective_sample_size([0.0, 0.0]) == 0
    none = snips([1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5])
    assert np.isnan(none.value)  # no logged choice is the candidate's: the log says nothing about it
    assert ips([1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]).value == 0.0


@pytest.mark.parametrize(
    ("rewards", "target", "logged", "message"),
    [
        ([1.0, 0.0], [1.0, 0.0], [0.0, 0.5], "logging_probs must lie in"),
        ([1.0, 0.0], [1.0, 0.0], [1.2, 0.5], "logging_probs must lie in"),
        ([1.0, 0.0], [2.0, 0.0], [0.5, 0.5], "target_probs must lie in"),
        ([1.0, float("nan")], [1.0, 0.0], [0.5, 0.5], "rewards contains NaN"),
        ([1.0, 0.0, 1.0], [1.0, 0.0], [0.5, 0.5], "differ in length"),
        ([1.0], [1.0], [0.5], "at least 2"),
        ([[1.0, 0.0]], [1.0, 0.0], [0.5, 0.5], "one-dimensional"),
    ],
)
def test_bad_input_is_refused_clearly(rewards, target, logged, message):
    for estimator in (ips, snips):
        with pytest.raises(ValueError, match=message):
            estimator(rewards, target, logged)


def test_confidence_must_be_a_probability():
    with pytest.raises(ValueError, match="confidence"):
        ips([1.0, 0.0], [1.0, 1.0], [0.5, 0.5], confidence=1.0)
    with pytest.raises(ValueError, match="target_probs"):
        importance_weights([1.0, 0.5], [0.5])


# ---- the router's propensities ------------------------------------------------------------------
def test_propensity_of_every_worker_sums_to_one():
    drawn = Propensity.of_choice("pricey", "cheap", 0.2, ("pricey", "mid"))
    assert drawn.probability == pytest.approx(0.1)
    assert drawn.of("cheap") == pytest.approx(0.8) and drawn.of("mid") == pytest.approx(0.1)
    greedy_under = Propensity.of_choice("cheap", "cheap", 0.2, ("cheap", "mid"))  # greedy is under-observed
    assert greedy_under.probability == pytest.approx(0.9) and greedy_under.of("mid") == pytest.approx(0.1)
    nothing_to_explore = Propensity.of_choice("cheap", "cheap", 0.2, ())
    assert nothing_to_explore.probability == 1.0 and nothing_to_explore.of("mid") == 0.0


def test_the_logged_propensity_is_the_router_s_real_frequency(trained):
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    pool = tuple(catalog.workers[:3])  # cheap, mid (never seen, so explored), pricey
    router = LearnedRouter(
        trained, feature_builder_for(trained.features), exploration=0.3, min_examples=50, seed=5
    )
    text = CHAT[3]
    decisions = [router.route(RouteRequest(len(text), text=text), pool) for _ in range(2000)]
    frequency = Counter(d.workers[0].name for d in decisions)
    for decision in decisions[:50]:
        chosen = decision.workers[0].name
        assert decision.propensity.probability == pytest.approx(decision.propensity.of(chosen))
        assert sum(decision.propensity.of(w.name) for w in pool) == pytest.approx(1.0)
    drawn = decisions[0].propensity
    assert drawn.greedy == "cheap" and drawn.explore == ("mid",) and drawn.epsilon == 0.3
    for worker in ("cheap", "mid"):  # binomial, n=2000: 4 standard deviations is about 0.04
        assert abs(frequency[worker] / 2000 - drawn.of(worker)) < 0.045
    assert frequency["pricey"] == 0 and drawn.of("pricey") == 0
    quiet = LearnedRouter(trained, feature_builder_for(trained.features))
    assert quiet.route(RouteRequest(len(text), text=text), pool).propensity.probability == 1.0


# ---- a candidate replayed on a logged ledger -------------------------------------------------------
# Outcome means per (kind of query, worker) and costs per worker: the truth a candidate is scored against.
QUALITY = {("math", "cheap"): 0.1, ("math", "pricey"): 0.9, ("chat", "cheap"): 0.9, ("chat", "pricey"): 0.95}
QUALITY |= {("math", "mid"): 0.5, ("chat", "mid"): 0.5}
COST_MICROS = {"cheap": 10, "mid": 100, "pricey": 1000}
LOGGER = {"epsilon": 0.4, "greedy": "cheap", "explore": ("mid", "pricey")}  # P: cheap .6, mid .2, pricey .2


def logged_ledger(n: int, seed: int, cost_weight: float = 0.1) -> tuple[list[dict], list[str]]:
    """A ledger of n routed requests (math and chat queries) with a judge or user score each, logged by
    an ε-greedy policy whose propensities are known; returns (records, the queries' kinds)."""
    rng = np.random.default_rng(seed)
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    pool = tuple(w for w in catalog.workers if w.name in ("cheap", "mid", "pricey"))
    by_name = {w.name: w for w in pool}
    records: list[dict] = []
    kinds: list[str] = []
    workers = ["cheap", "mid", "pricey"]
    logger = Propensity(0.0, LOGGER["greedy"], LOGGER["epsilon"], LOGGER["explore"])
    probabilities = [logger.of(w) for w in workers]
    for i in range(n):
        kind = "math" if rng.random() < 0.5 else "chat"
        text = (MATH if kind == "math" else CHAT)[int(rng.integers(0, 50))] + f" (case {i})"
        chosen = workers[int(rng.choice(3, p=probabilities))]
        request = RouteRequest(len(text), text=text, cost_weight=cost_weight)
        ranked = (by_name[chosen], *(w for w in pool if w.name != chosen))
        drawn = Propensity.of_choice(chosen, logger.greedy, logger.epsilon, logger.explore)
        decision = RouteDecision(ranked, "explore" if chosen != "cheap" else "fast", "", Decimal(0), drawn)
        record = RequestRecord(
            id=f"req_{i}",
            tenant="acme",
            model="auto",
            worker=chosen,
            strategy=decision.strategy,
            status=200,
            cost_micros=COST_MICROS[chosen],
            data_class="public",
            query=text,
            route=route_log(decision, request, [w.name for w in pool], cost_weight),
        )
        score = float(rng.random() < QUALITY[(kind, chosen)])
        source = "judge" if i % 2 else "user"
        feedback = FeedbackRecord(f"req_{i}", "acme", score, chosen, source=source)
        records += [json.loads(json.dumps(asdict(record))), json.loads(json.dumps(asdict(feedback)))]
        kinds.append(kind)
    return records, kinds


def candidate_truth(router, records: list[dict], kinds: list[str]) -> tuple[float, float]:
    """The candidate's true mean quality and cost on these queries (it is deterministic)."""
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    pool = tuple(w for w in catalog.workers if w.name in ("cheap", "mid", "pricey"))
    requests = [r for r in records if r["type"] == "request"]
    quality, cost = [], []
    for record, kind in zip(requests, kinds, strict=True):
        request = RouteRequest(len(record["query"]), text=record["query"], cost_weight=0.1)
        pick = router.route(request, pool).workers[0].name
        quality.append(QUALITY[(kind, pick)])
        cost.append(COST_MICROS[pick] / 1e6)
    return float(np.mean(quality)), float(np.mean(cost))


def test_candidate_replayed_on_the_ledger_matches_its_true_value(trained):
    records, kinds = logged_ledger(3000, seed=3)
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    router = LearnedRouter(trained, feature_builder_for(trained.features))
    quality, cost = candidate_truth(router, records, kinds)
    assert 0.85 < quality  # the candidate sends math to pricey and chat to cheap
    weights = {"user": 1.0, "judge": 1.0, "calibration": 1.0}
    report = evaluate_candidate(router, training_rows(iter(records), weights), catalog)
    assert report["requests"] == 3000 and report["skipped"] == {}
    assert report["support"] == 1.0 and 0.2 < report["agreement"] < 0.8
    snips_quality = report["quality"]["snips"]
    assert snips_quality["low"] <= quality <= snips_quality["high"]
    assert not snips_quality["low"] <= report["quality"]["logging_policy"]["value"] <= snips_quality["high"]
    assert report["cost_usd"]["snips"]["low"] <= cost <= report["cost_usd"]["snips"]["high"]
    assert report["quality"]["ips"]["low"] <= quality <= report["quality"]["ips"]["high"]
    assert 0 < report["effective_sample_size"] < 3000
    with pytest.raises(ValueError, match="without exploration"):
        evaluate_candidate(
            LearnedRouter(trained, feature_builder_for(trained.features), exploration=0.1),
            training_rows(iter(records)),
            catalog,
        )


def test_requests_that_cannot_be_replayed_are_counted_not_guessed(trained):
    records, _ = logged_ledger(20, seed=4)
    pinned = dict(records[0], route=None)  # pinned or composed: the router did not choose
    gone = dict(records[2], route=dict(records[2]["route"], pool=["cheap", "retired-worker"]))
    rows = training_rows(iter([pinned, records[1], gone, records[3], *records[4:]]))
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    router = LearnedRouter(trained, feature_builder_for(trained.features))
    report = evaluate_candidate(router, rows, catalog)
    assert report["skipped"] == {NOT_ROUTED: 1, LEFT_CATALOG: 1} and report["requests"] == 18
    with pytest.raises(ValueError, match="at least 2 are needed"):
        evaluate_candidate(router, rows[:1], catalog)


def test_router_eval_cli_on_a_ledger_file(trained, tmp_path):
    records, _ = logged_ledger(400, seed=5)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    catalog = tmp_path / "workers.yaml"
    catalog.write_text(catalog_yaml_for("http://127.0.0.1:9"))
    version = save_artifact(tmp_path / "router", trained, activate=False).name
    out = tmp_path / "report.json"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "polyroute.cli", "router", "eval", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "COLUMNS": "200"},
        )

    common = ("--router-dir", str(tmp_path / "router"), "--workers-file", str(catalog))
    ok = run("--from-ledger", "--candidate", version, "--ledger", str(ledger), "--out", str(out), *common)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(out.read_text())
    assert report["candidate"] == version and report["requests"] == 400
    assert report["weights"] == {"calibration": 1.0, "judge": 0.5, "user": 1.0}
    assert set(report["quality"]) == {"ips", "snips", "logging_policy"}
    assert "SNIPS" in ok.stdout and "effective sample size" in ok.stdout

    missing = run("--from-ledger", "--ledger", str(ledger), *common)
    assert missing.returncode == 2 and "--candidate" in missing.stderr
    unknown = run("--from-ledger", "--candidate", "nope", "--ledger", str(ledger), *common)
    assert unknown.returncode == 1 and "no such file" not in unknown.stderr.lower()
    assert "nope" in unknown.stderr
    no_file = run("--from-ledger", "--candidate", version, "--ledger", str(tmp_path / "x.jsonl"), *common)
    assert no_file.returncode == 1 and "no ledger file" in no_file.stderr
    not_ledger = tmp_path / "not-ledger.jsonl"
    not_ledger.write_text('{"hello": 1}\n{"hello": 2}\n')
    wrong = run("--from-ledger", "--candidate", version, "--ledger", str(not_ledger), *common)
    assert wrong.returncode == 1 and "not-ledger.jsonl:1" in wrong.stderr
    level = run(
        "--from-ledger", "--candidate", version, "--ledger", str(ledger), "--confidence", "2", *common
    )
    assert level.returncode == 2 and "--confidence" in level.stderr
    zero = run(
        "--from-ledger",
        "--candidate",
        version,
        "--ledger",
        str(ledger),
        "--weight-judge",
        "0",
        "--weight-feedback",
        "0",
        "--weight-calibration",
        "0",
        *common,
    )
    assert zero.returncode == 2 and "not all 0" in zero.stderr
