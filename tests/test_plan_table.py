"""The plan table: fitted on recorded answers it keeps the frontier plans of each cluster, and per
request it runs the best admissible one (voters together, the fallback on disagreement), in the
replay and with a live pool's names."""

from __future__ import annotations

import numpy as np
import pytest

from router.answers import Kind
from router.evidence import read_answers
from router.offline.book import AnswerBook
from router.offline.plan_table_fit import cross_fit_tables, fit_plan_table
from router.offline.replay import play, replay
from router.plan_table import ANY, PlanTable, cluster_of
from router.planner import State
from tests.test_planner import QUERY, synthetic

TWO = "Is it true?\nA) yes\nB) no\nAnswer:"


def test_clusters_are_kinds_and_choice_width():
    assert cluster_of(Kind.CHOICE, 2) == "choice-2" and cluster_of(Kind.CHOICE, 5) == "choice-3+"
    assert cluster_of(Kind.CODE, 0) == "code"
    assert (
        State.of(TWO).options == 2
        and cluster_of(State.of(QUERY).kind, State.of(QUERY).options) == "choice-3+"
    )


@pytest.fixture(scope="module")
def learned():
    book, _, labels, costs = synthetic(400, seed=3)  # cheap 0.65 and 0.7, frontier 0.9 at 20x
    return book, labels, costs, fit_plan_table(book, labels, costs, ["cheap-a", "cheap-b", "frontier"])


def test_the_table_keeps_the_frontier_and_every_single_worker(learned):
    book, labels, costs, table = learned
    plans = table.clusters["choice-3+"]
    assert set(table.clusters) == {"choice-3+", ANY}
    singles = {plans.fallback[p] for p in range(len(plans)) if not plans.voters[p]}
    assert singles == {0, 1, 2}
    cascade = next(p for p in range(len(plans)) if plans.voters[p] == (0, 1) and plans.fallback[p] == 2)
    # measured exactly: agreement of the two cheap workers, then the frontier's label otherwise
    agree = np.array([book.read(i, [0, 1]).keys[0] == book.read(i, [0, 1]).keys[1] for i in range(len(book))])
    expected = np.where(agree, labels[:, 0], labels[:, 2]).mean()
    assert plans.accuracy[cascade] == pytest.approx(expected) and plans.agree[cascade] == pytest.approx(
        agree.mean()
    )
    # on synthetic data the cascade is nearly as good as the frontier for far less
    assert plans.accuracy[cascade] > labels[:, 2].mean() - 0.05
    table.clusters["choice-3+"].as_dict(table.workers)  # serialisable for the card


def test_lambda_moves_the_plan_from_the_frontier_to_the_cascade_to_one_cheap_worker(learned):
    book, labels, costs, table = learned
    predicted = np.array([1.0, 1.0, 20.0])
    zero = np.zeros(3)
    first = {lam: table.decide(State.of(QUERY), zero, predicted, lam) for lam in (0.0, 0.2, 50.0)}
    assert first[0.0].call in (
        (2,),
        (0, 1),
        (0, 2),
        (1, 2),
        (0, 1, 2),
    )  # the most accurate plan, whatever it costs
    assert first[0.2].call == (0, 1) and "agree, else 2" in first[0.2].reason
    assert len(first[50.0].call) == 1 and first[50.0].call[0] in (0, 1)
    run = replay(
        lambda i: table,
        book,
        range(len(book)),
        np.zeros((len(book), 3)),
        np.tile(predicted, (len(book), 1)),
        costs,
        labels,
        [0.0, 0.2, 50.0],
    )
    assert run.mean_cost()[0] >= run.mean_cost()[1] > run.mean_cost()[2]
    assert run.accuracy()[1] > run.accuracy()[2]


def test_the_plan_runs_voters_then_fallback_then_stops(learned):
    *_, table = learned
    predicted, zero = np.array([1.0, 1.0, 20.0]), np.zeros(3)
    agreeing = State.of(QUERY, (0, 1), read_answers(QUERY, ["B", "B"]))
    stop = table.decide(agreeing, zero, predicted, 0.2)
    assert stop.call == () and stop.answer == 0 and "agree" in stop.reason
    split = State.of(QUERY, (0, 1), read_answers(QUERY, ["B", "C"]))
    assert table.decide(split, zero, predicted, 0.2).call == (2,)
    done = State.of(QUERY, (0, 1, 2), read_answers(QUERY, ["B", "C", "D"]))
    final = table.decide(done, zero, predicted, 0.2)
    assert final.call == () and final.answer == 2


def test_a_live_pool_places_plans_by_name_and_skips_what_it_lacks(learned):
    *_, table = learned
    names = ["frontier", "other", "cheap-b", "cheap-a"]  # another order, and a worker the table never saw
    predicted = np.array([20.0, 5.0, 1.0, 1.0])
    decision = table.decide(State.of(QUERY), np.zeros(4), predicted, 0.2, names=names)
    assert sorted(decision.call) == [2, 3] and "cheap-a" in decision.reason
    # the fallback over the ceiling: a plan without it (or a single worker) instead
    no_frontier = table.decide(
        State.of(QUERY), np.zeros(4), predicted, 0.2, names=names, allowed=[False, True, True, True]
    )
    assert 0 not in no_frontier.call and no_frontier.call
    # nothing of the table admissible: the admissible worker with the best prior, then its answer
    only_other = [False, True, False, False]
    fallback = table.decide(State.of(QUERY), np.zeros(4), predicted, 0.2, names=names, allowed=only_other)
    assert fallback.call == (1,) and "no plan" in fallback.reason
    held = State.of(QUERY, (1,), read_answers(QUERY, ["B"]))
    stop = table.decide(held, np.zeros(4), predicted, 0.2, names=names, allowed=[False] * 4)
    assert stop.call == () and stop.answer == 0
    nothing = table.decide(State.of(QUERY), np.zeros(4), predicted, 0.2, names=names, allowed=[False] * 4)
    assert nothing.call == () and nothing.answer is None and "no admissible worker" in nothing.reason


def test_a_failed_voter_changes_the_plan_instead_of_waiting_for_it(learned):
    *_, table = learned
    predicted, zero = np.array([1.0, 1.0, 20.0]), np.zeros(3)
    # worker 1 was asked and failed: it is neither called nor allowed any more
    state = State.of(QUERY, (0,), read_answers(QUERY, ["B"]))
    decision = table.decide(state, zero, predicted, 0.2, allowed=[True, False, True])
    assert 1 not in decision.call


def test_the_replay_plays_a_disagreement_to_the_fallback(learned):
    *_, table = learned
    disagreeing = AnswerBook([QUERY], [["B", "C", "D"]])
    called, answer, rounds = play(table, disagreeing, 0, np.zeros(3), np.array([1.0, 1.0, 20.0]), 0.2)
    assert called == [0, 1, 2] and answer == 2 and rounds == 2
    agreeing = AnswerBook([QUERY], [["B", "B", "D"]])
    called, answer, rounds = play(table, agreeing, 0, np.zeros(3), np.array([1.0, 1.0, 20.0]), 0.2)
    assert called == [0, 1] and answer == 0 and rounds == 1


def test_no_training_questions_is_a_clear_error():
    book, _, labels, costs = synthetic(10, seed=5)
    with pytest.raises(ValueError, match="needs training questions"):
        fit_plan_table(book, labels, costs, ["a", "b", "c"], rows=[])


def test_cross_fitted_tables_leave_each_fold_out():
    book, _, labels, costs = synthetic(200, seed=5)
    fitted = cross_fit_tables(book, labels, costs, ["a", "b", "c"], k=4, seed=0)
    tables, fold_of = fitted.by_fold, fitted.fold_of
    assert len(tables) == 4 and sorted(set(fold_of)) == [0, 1, 2, 3]
    sizes = [t.clusters["choice-3+"].questions for t in tables]
    assert all(size == 200 - int((fold_of == f).sum()) for f, size in enumerate(sizes))


def test_a_bad_weight_is_refused(learned):
    *_, table = learned
    with pytest.raises(ValueError):
        table.decide(State.of(QUERY), np.zeros(3), np.ones(3), -1.0)
    assert isinstance(table, PlanTable)


def test_a_large_pool_draws_voters_from_a_bounded_set():
    """50 workers would make 19,600 voter sets: voters come from the 12 most accurate and best value
    per dollar, fallbacks from everyone, and every single worker stays in the table."""
    from router.offline.plan_table_fit import VOTER_POOL, voter_candidates

    rng = np.random.default_rng(0)
    accuracy = np.linspace(0.5, 0.9, 20)
    cost = np.linspace(1.0, 40.0, 20)
    cost[3] = 0.01  # a weak but nearly free worker: the best value per dollar
    Y = (rng.random((300, 20)) < accuracy).astype(float)
    C = np.tile(cost, (300, 1)) / 1000
    chosen = voter_candidates(Y, C)
    assert len(chosen) == VOTER_POOL and 3 in chosen and int(np.argmax(Y.mean(0))) in chosen
    texts = [["ABCD"[int(j) % 4] if Y[i, j] else "D" for j in range(20)] for i in range(300)]
    book = AnswerBook([QUERY] * 300, texts)
    table = fit_plan_table(book, Y, C, [f"w{j}" for j in range(20)])
    plans = table.clusters["choice-3+"]
    assert {plans.fallback[p] for p in range(len(plans)) if not plans.voters[p]} == set(range(20))
    assert all(set(v) <= set(chosen) for v in plans.voters)
