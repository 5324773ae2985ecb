"""Fitting a plan table (router/plan_table.py) on recorded answers, and cross-fitting it.

For each cluster of training questions every plan of the family is scored at once: the agreement
of each voter set is read per question from the :class:`AnswerBook` (the keys the gateway computes
live), then accuracy and cost for every fallback follow from two matrix products. The plans kept
are the cluster's accuracy/cost frontier (by recorded mean cost) and every single worker.

``cross_fit_tables`` fits one table per fold on the other folds, so a replay of the training files
with them (each question planned by a table that never saw it) measures the table as the held-out
files will — the comparison with the learned planner that picks a trained router's strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from router.offline.book import AnswerBook
from router.offline.split import folds
from router.plan_table import ANY, PlanSet, PlanTable, cluster_of

MIN_CLUSTER = 40  # training questions a cluster needs for a table of its own (else it uses ANY's)
MAX_VOTERS = 3


class _Scored:
    """Every plan's outcome per question of some rows: ``correct``/``cost`` are [plans, rows]."""

    def __init__(self, book: AnswerBook, rows: np.ndarray, labels: np.ndarray, costs: np.ndarray) -> None:
        k = labels.shape[1]
        Y, C = np.nan_to_num(labels[rows]), np.nan_to_num(costs[rows])
        sets = [s for size in range(2, MAX_VOTERS + 1) for s in itertools.combinations(range(k), size)]
        agree = np.zeros((len(sets), len(rows)))
        for r, i in enumerate(rows):
            for s, voters in enumerate(sets):
                keys = book.read(int(i), list(voters)).keys
                agree[s, r] = keys[0] is not None and all(key == keys[0] for key in keys[1:])
        voters: list[tuple[int, ...]] = [()] * k
        fallback = list(range(k))
        correct, cost, agreed = [Y.T], [C.T], [np.ones((k, len(rows)))]
        for s, members in enumerate(sets):
            others = [f for f in range(k) if f not in members]
            voters += [members] * len(others)
            fallback += others
            a = agree[s]
            correct.append(a * Y[:, members[0]] + (1 - a) * Y[:, others].T)
            cost.append(C[:, list(members)].sum(1) + (1 - a) * C[:, others].T)
            agreed.append(np.broadcast_to(a, (len(others), len(rows))))
        self.voters, self.fallback = voters, fallback
        self.correct, self.cost = np.vstack(correct), np.vstack(cost)
        self.agreed = np.vstack(agreed)

    def plan_set(self, columns: np.ndarray, workers: int) -> PlanSet:
        """The frontier (and every single worker) measured on ``columns`` of these rows."""
        accuracy = self.correct[:, columns].mean(1)
        cost = self.cost[:, columns].mean(1)
        order = np.lexsort((-accuracy, cost))  # cheapest first, then most accurate
        keep, best = [], -np.inf
        for p in order:
            if accuracy[p] > best + 1e-12:
                keep.append(int(p))
                best = accuracy[p]
        keep = sorted(set(keep) | set(range(workers)))
        return PlanSet(
            [self.voters[p] for p in keep],
            [self.fallback[p] for p in keep],
            accuracy[keep],
            self.agreed[keep][:, columns].mean(1),
            int(len(columns)),
        )


def clusters_of(book: AnswerBook) -> np.ndarray:
    return np.array([cluster_of(*_kind_options(book, i)) for i in range(len(book))])


def _kind_options(book: AnswerBook, i: int):
    state = book.state(i, ())
    return state.kind, state.options


def fit_plan_table(
    book: AnswerBook,
    labels: np.ndarray,
    costs: np.ndarray,
    workers: Sequence[str],
    rows: Sequence[int] | None = None,
) -> PlanTable:
    """A table fitted on ``rows`` (default: all) of the recorded answers."""
    return cross_fit_tables(book, labels, costs, workers, k=1, rows=rows)[0][0]


def cross_fit_tables(
    book: AnswerBook,
    labels: np.ndarray,
    costs: np.ndarray,
    workers: Sequence[str],
    *,
    k: int = 5,
    seed: int = 0,
    rows: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[PlanTable], np.ndarray]:
    """``k`` tables, the f-th fitted without fold f, and each row's fold (k = 1: one table on all)."""
    say = progress or (lambda _: None)
    rows = np.arange(len(book)) if rows is None else np.asarray(list(rows))
    fold_of = np.zeros(len(book), dtype=int)
    if k > 1:
        for f, part in enumerate(folds(len(rows), k, seed + 11)):
            fold_of[rows[part]] = f
    cluster = clusters_of(book)
    groups = {name: rows[cluster[rows] == name] for name in sorted(set(cluster[rows]))}
    groups[ANY] = rows
    scored = {}
    for name, members in groups.items():
        if name != ANY and len(members) < MIN_CLUSTER:
            continue
        say(f"plan table: scoring every plan on {len(members)} '{name}' questions")
        scored[name] = (_Scored(book, members, labels, costs), members)
    tables = []
    for f in range(k):
        clusters = {}
        for name, (plans, members) in scored.items():
            columns = np.flatnonzero(fold_of[members] != f) if k > 1 else np.arange(len(members))
            clusters[name] = plans.plan_set(columns, len(workers))
        card = {
            "strategy": "plan_table",
            "clusters": {name: {"questions": s.questions, "plans": len(s)} for name, s in clusters.items()},
        }
        tables.append(PlanTable(list(workers), clusters, card=card))
    return tables, fold_of
