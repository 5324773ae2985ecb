"""Fitting a plan table (router/plan_table.py) on recorded answers, and cross-fitting it.

For each cluster of training questions every plan of the family is scored at once: the agreement
of each voter set is read per question from the :class:`AnswerBook` (the keys the gateway computes
live), then accuracy and cost for every fallback follow from two matrix products. The plans kept
are the cluster's accuracy/cost frontier (by recorded mean cost) and every single worker.

``cross_fit_tables`` fits the table on every question and one per fold on the other folds, so a
replay of the training files with them (each question planned by a table that never saw it)
measures the table as the held-out files will — the comparison with the learned planner that picks
a trained router's strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.offline.book import AnswerBook
from router.offline.split import folds
from router.plan_table import ANY, PlanSet, PlanTable, cluster_of

MIN_CLUSTER = 40  # training questions a cluster needs for a table of its own (else it uses ANY's)
MAX_VOTERS = 3
# Voters are drawn from at most this many workers (the most accurate and the best value per dollar
# on the cluster): 12 give 286 voter sets; 50 workers would give 19,600, for little more.
VOTER_POOL = 12


def voter_candidates(Y: np.ndarray, C: np.ndarray) -> list[int]:
    """The workers voters are drawn from: half the most accurate, half the most accurate per dollar."""
    k = Y.shape[1]
    if k <= VOTER_POOL:
        return list(range(k))
    accuracy, cost = Y.mean(0), C.mean(0)
    value = accuracy / np.maximum(cost, 1e-12)
    chosen: list[int] = []
    for ranking in (np.argsort(-accuracy), np.argsort(-value)):
        for j in ranking[: VOTER_POOL // 2]:
            if int(j) not in chosen:
                chosen.append(int(j))
    for j in np.argsort(-accuracy):  # fill up if the two rankings overlapped
        if len(chosen) >= VOTER_POOL:
            break
        if int(j) not in chosen:
            chosen.append(int(j))
    return sorted(chosen)


class PlanScores:
    """Every plan's summed outcome per fold over some rows: ``correct``/``cost``/``agreed`` are
    [plans, folds] sums and ``counts`` [folds] (sums, not per-row matrices: 12 voter candidates and
    50 fallbacks over thousands of questions would not fit in memory per row)."""

    def __init__(
        self,
        book: AnswerBook,
        rows: np.ndarray,
        labels: np.ndarray,
        costs: np.ndarray,
        fold: np.ndarray,
        n_folds: int,
        candidates: Sequence[int] | None = None,
    ) -> None:
        k = labels.shape[1]
        Y, C = np.nan_to_num(labels[rows]), np.nan_to_num(costs[rows])
        F = np.zeros((len(rows), n_folds))
        F[np.arange(len(rows)), fold] = 1.0  # row -> its fold, for per-fold sums by matrix product
        candidates = voter_candidates(Y, C) if candidates is None else list(candidates)
        sets = [s for size in range(2, MAX_VOTERS + 1) for s in itertools.combinations(candidates, size)]
        voters: list[tuple[int, ...]] = [()] * k
        fallback = list(range(k))
        correct, cost, agreed = [Y.T @ F], [C.T @ F], [np.tile(F.sum(0), (k, 1))]
        for members in sets:
            a = np.array([_agree(book.read(int(i), list(members)).keys) for i in rows], dtype=float)
            others = [f for f in range(k) if f not in members]
            voters += [members] * len(others)
            fallback += others
            base = (a * Y[:, members[0]]) @ F  # [folds]: the voters' answer where they agree
            correct.append(base + ((1 - a)[:, None] * Y[:, others]).T @ F)
            spent = C[:, list(members)].sum(1) @ F
            cost.append(spent + ((1 - a)[:, None] * C[:, others]).T @ F)
            agreed.append(np.tile(a @ F, (len(others), 1)))
        self.voters, self.fallback = voters, fallback
        self.correct, self.cost, self.agreed = np.vstack(correct), np.vstack(cost), np.vstack(agreed)
        self.counts = F.sum(0)

    def measured(self, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Every plan's mean accuracy, cost and agreement without fold ``exclude`` (None: all
        folds), and the number of questions they are measured on."""
        keep_folds = np.ones(len(self.counts), dtype=bool)
        if exclude is not None:
            keep_folds[exclude] = False
        n = float(self.counts[keep_folds].sum())
        scale = 1.0 / n if n else 0.0
        return (
            self.correct[:, keep_folds].sum(1) * scale,
            self.cost[:, keep_folds].sum(1) * scale,
            self.agreed[:, keep_folds].sum(1) * scale,
            n,
        )

    def plan_set(self, exclude: int | None, workers: int) -> PlanSet | None:
        """The frontier (and every single worker), measured without fold ``exclude`` (None: all);
        None when no question is left to measure it on."""
        accuracy, cost, agreed, n = self.measured(exclude)
        if n == 0:
            return None
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
            agreed[keep],
            int(n),
        )


def _agree(keys: Sequence[str | None]) -> bool:
    return keys[0] is not None and all(key == keys[0] for key in keys[1:])


def clusters_of(book: AnswerBook) -> np.ndarray:
    return np.array([cluster_of(*_kind_options(book, i)) for i in range(len(book))])


def _kind_options(book: AnswerBook, i: int):
    state = book.state(i, ())
    return state.kind, state.options


@dataclass
class FittedTables:
    """The plan table fitted on every training question, and per fold one that never saw the fold
    (the shape of planner_fit.FittedPlanners): one scoring of the plans serves them all."""

    final: PlanTable
    fold_of: np.ndarray  # fold index of each question (0 for rows not fitted on)
    by_fold: list[PlanTable]

    def for_row(self, i: int) -> PlanTable:
        return self.by_fold[int(self.fold_of[i])]


def fit_plan_table(
    book: AnswerBook,
    labels: np.ndarray,
    costs: np.ndarray,
    workers: Sequence[str],
    rows: Sequence[int] | None = None,
) -> PlanTable:
    """A table fitted on ``rows`` (default: all) of the recorded answers."""
    return cross_fit_tables(book, labels, costs, workers, k=1, rows=rows).final


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
) -> FittedTables:
    """The table on all ``rows`` and ``k`` fold tables, the f-th fitted without fold f (k = 1: the
    one table serves as both)."""
    say = progress or (lambda _: None)
    rows = np.arange(len(book)) if rows is None else np.asarray(list(rows))
    if len(rows) == 0:
        raise ValueError("a plan table needs training questions with every worker's label and cost")
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
        scored[name] = PlanScores(book, members, labels, costs, fold_of[members], max(k, 1))

    def table(exclude: int | None) -> PlanTable:
        measured = {name: plans.plan_set(exclude, len(workers)) for name, plans in scored.items()}
        clusters = {name: plan_set for name, plan_set in measured.items() if plan_set is not None}
        card = {
            "strategy": "plan_table",
            "clusters": {name: {"questions": s.questions, "plans": len(s)} for name, s in clusters.items()},
        }
        return PlanTable(list(workers), clusters, card=card)

    final = table(None)
    return FittedTables(final, fold_of, [table(f) for f in range(k)] if k > 1 else [final])
