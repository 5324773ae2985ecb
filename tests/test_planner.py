"""The cascade planner offline: evidence features, the replay's accounting, stop rules, the λ sweep,
the agreement rule, and a planner fitted on synthetic recorded answers that must learn from agreement."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from router.answers import Kind
from router.evidence import POSTHOC_FEATURES, posthoc_rows, read_answers
from router.offline.book import AnswerBook
from router.offline.planner_fit import Recorded, fit_planner
from router.offline.replay import agreement_rule, play, replay
from router.planner import Boosted, CascadePlanner, State

QUERY = "Which gas do plants take in?\nA) oxygen\nB) carbon dioxide\nC) helium\nD) neon\nAnswer:"


def constant(p: float) -> Boosted:
    """A post-hoc estimator that rates every answer ``p`` (fitted on labels that are all ``p``)."""
    return Boosted().fit(np.zeros((2, len(POSTHOC_FEATURES))), np.full(2, p))


def test_posthoc_features_count_agreement_by_class():
    answers = read_answers(QUERY, ["B", "The answer is B.", "A) oxygen", "I cannot help with that."])
    assert answers.kind is Kind.CHOICE and answers.keys == ("B", "B", "A", None)
    rows = posthoc_rows(answers, [0, 1, 2, 3], [2.0, 1.0, 0.5, 0.0])
    col = {name: i for i, name in enumerate(POSTHOC_FEATURES)}
    assert rows[0, col["agreeing"]] == 1 and rows[0, col["agreeing_prior_sum"]] == 1.0
    assert rows[0, col["class_prior_max"]] == 2.0
    assert rows[0, col["rival_size"]] == 1 and rows[0, col["rival_prior_max"]] == 0.5
    assert rows[2, col["agreeing"]] == 0 and rows[2, col["rival_prior_sum"]] == 3.0
    assert rows[3, col["well_formed"]] == 0 and rows[3, col["refusal"]] == 1
    assert rows[:, col["classes"]].tolist() == [3, 3, 3, 3]


# ---- replay accounting on a tiny book --------------------------------------------------------------
PRIORS = np.array([[0.6, 0.7, 0.95]])
LOG_ODDS = np.log(PRIORS / (1 - PRIORS))
PREDICTED = np.array([[1.0, 2.0, 20.0]])
RECORDED = np.array([[0.001, 0.002, 0.03]])
LABELS = np.array([[0.0, 1.0, 1.0]])


def tiny_book() -> AnswerBook:
    return AnswerBook([QUERY], [["A", "B", "B"]])


def test_replay_charges_every_worker_called_and_sweeps_lambda():
    # Myopic planner (no gain model) whose post-hoc rates every answer 0.5: a call adds
    # max(prior - 0.5, 0) and costs λ·predicted / the dearest predicted.
    planner = CascadePlanner(constant(0.5))
    run = replay(lambda i: planner, tiny_book(), [0], LOG_ODDS, PREDICTED, RECORDED, LABELS, [0.0, 10.0])
    # λ = 0: the frontier first (best prior), then every worker whose prior beats 0.5: all three called.
    assert run.calls[0, 0] == 3 and run.rounds[0, 0] == 3
    assert run.cost[0, 0] == pytest.approx(0.033)
    # λ = 10: 0.6 - 10·(1/20) beats the others at step 0; after it, no call pays for itself.
    assert run.calls[1, 0] == 1 and run.first[1, 0] == 0
    assert run.cost[1, 0] == pytest.approx(0.001) and run.score[1, 0] == 0.0
    assert run.mean_cost()[0] > run.mean_cost()[1]
    assert run.stop_shares(1) == {"1": 1.0}


def test_a_confident_answer_stops_the_plan():
    planner = CascadePlanner(constant(0.99))
    called, answer, rounds = play(planner, tiny_book(), 0, LOG_ODDS[0], PREDICTED[0], 0.0)
    assert called == [2] and answer == 0 and rounds == 1  # nothing can add to P = 0.99


def test_max_calls_bounds_the_plan_and_disallowed_workers_are_never_called():
    planner = CascadePlanner(constant(0.1), max_calls=2)
    called, _, _ = play(planner, tiny_book(), 0, LOG_ODDS[0], PREDICTED[0], 0.0)
    assert len(called) == 2
    decision = planner.decide(State.of(QUERY), LOG_ODDS[0], PREDICTED[0], 0.0, allowed=[True, True, False])
    assert decision.call == (1,)  # the frontier worker is over the ceiling: the best allowed instead
    stop = planner.decide(
        State.of(QUERY, (0,), read_answers(QUERY, ["A"])),
        LOG_ODDS[0],
        PREDICTED[0],
        0.0,
        allowed=[True, False, False],
    )
    assert stop.call == () and stop.answer == 0


def test_agreement_rule_accepts_agreement_and_pays_the_fallback_otherwise():
    book = AnswerBook([QUERY, QUERY], [["B", "B", "B"], ["A", "B", "B"]])
    labels = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    cost = np.array([[1.0, 2.0, 20.0], [1.0, 2.0, 20.0]])
    rule = agreement_rule(book, [0, 1], (0, 1), 2, cost, labels)
    assert rule == {"accuracy": 1.0, "cost_usd": (3.0 + 23.0) / 2, "escalated_share": 0.5}


# ---- a planner fitted on synthetic recorded answers ------------------------------------------------
def synthetic(n: int, seed: int) -> tuple[AnswerBook, np.ndarray, np.ndarray, np.ndarray]:
    """n multiple-choice questions; two cheap workers (0.65, 0.7 right) whose *wrong* answers are random
    letters, and a frontier worker (0.9) costing 20×. When the cheap two agree they are almost always
    right: a planner that reads answers should ask them first and the frontier only on disagreement."""
    rng = np.random.default_rng(seed)
    accuracy = np.array([0.65, 0.7, 0.9])
    texts, answers, labels = [], [], []
    for _ in range(n):
        right = "ABCD"[rng.integers(4)]
        row, lab = [], []
        for a in accuracy:
            ok = rng.random() < a
            row.append(right if ok else rng.choice([x for x in "ABCD" if x != right]))
            lab.append(float(ok))
        texts.append(QUERY)
        answers.append(row)
        labels.append(lab)
    costs = np.tile([1.0, 1.0, 20.0], (n, 1)) / 1000
    return AnswerBook(texts, answers), np.tile(accuracy, (n, 1)), np.array(labels), costs


@pytest.fixture(scope="module")
def fitted():
    book, priors, labels, costs = synthetic(400, seed=1)
    return fit_planner(Recorded.from_priors(book, priors, labels), k=3, seed=0)


def test_fitted_posthoc_trusts_agreement(fitted):
    planner = fitted.final
    lo = np.log(np.array([0.65, 0.7, 0.9]) / np.array([0.35, 0.3, 0.1]))
    agree = planner.answer_scores(State.of(QUERY, (0, 1), read_answers(QUERY, ["B", "B"])), lo)
    split = planner.answer_scores(State.of(QUERY, (0, 1), read_answers(QUERY, ["B", "C"])), lo)
    alone = planner.answer_scores(State.of(QUERY, (0,), read_answers(QUERY, ["B"])), lo)
    assert agree.min() > 0.85 > alone[0] > split.max()
    assert 0 <= split.min() and agree.max() <= 1 and not math.isnan(agree.sum())


def test_fitted_planner_beats_the_frontier_worker_at_a_fraction_of_its_cost(fitted):
    book, priors, labels, costs = synthetic(300, seed=2)
    lo = np.log(priors / (1 - priors))
    run = replay(lambda i: fitted.final, book, range(300), lo, costs, costs, labels, [0.02])
    frontier_accuracy, frontier_cost = labels[:, 2].mean(), costs[:, 2].mean()
    assert run.accuracy()[0] >= frontier_accuracy  # agreeing cheap answers beat the frontier worker alone
    assert run.mean_cost()[0] < 0.7 * frontier_cost  # ideal here: 0.6 (both cheap, the frontier on 51%)
    assert set(np.unique(run.first[0])) <= {0, 1}  # cheap workers first


def test_a_pair_worth_more_than_its_members_is_called_at_once_when_latency_counts(fitted):
    lo = np.log(np.array([0.65, 0.7, 0.9]) / np.array([0.35, 0.3, 0.1]))
    costs = np.array([1.0, 1.0, 20.0])
    start = State.of(QUERY)
    sequential = fitted.final.decide(start, lo, costs, 0.1)
    parallel = fitted.final.decide(start, lo, costs, 0.1, latency_weight=0.01)
    assert len(sequential.call) == 1 and sequential.call[0] in (0, 1)  # the cheaper of the pair first
    assert sorted(parallel.call) == [0, 1]  # the two cheap members of the set {0, 1, 2} in one round trip
    with pytest.raises(ValueError):
        fitted.final.decide(start, lo, costs, -1.0)


def test_the_routerbench_loader_keeps_every_answer_for_the_replay():
    from router.offline.routerbench import load_routerbench

    ds = load_routerbench([Path(__file__).parent / "fixtures" / "multi" / "routerbench_tiny.csv"])
    assert ds.responses is not None and len(ds.responses) == len(ds) and len(ds.responses[0]) == 3
    sub = ds.subset([2, 0]).in_worker_order(list(reversed(ds.workers)))
    assert sub.responses == [list(reversed(ds.responses[2])), list(reversed(ds.responses[0]))]
