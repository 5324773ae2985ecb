"""Fitting a plan table (router/plan_table.py) on recorded answers, and cross-fitting it.

For each cluster of training questions every plan of the family is scored at once: the agreement
of each voter set is read per question from the :class:`AnswerBook` (the keys the gateway computes
live), then accuracy and cost for every fallback follow from two matrix products. The plans kept
are the cluster's accuracy/cost frontier (by recorded mean cost) and every single worker. A blank
(NaN) score or cost is "not graded", not wrong or free: a plan's accuracy is the mean over the
questions where the answer it returns was graded, its cost over those where every worker it paid for
was priced; a plan graded on none is left out.

``cross_fit_tables`` fits the table on every question and one per fold on the other folds (the
planner's folds when given, router/offline/planner_fit.py), so a replay of the training files with
them (each question planned by a table that never saw it) measures the table as the held-out files
will — the comparison with the learned planner that picks a trained router's strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.offline.book import AnswerBook
from router.offline.split import fold_assignment
from router.plan_table import ANY, PlanSet, PlanTable, cluster_of

MIN_CLUSTER = 40  # training questions a cluster needs for a table of its own (else it uses ANY's)
MAX_VOTERS = 3
# Voters are drawn from at most this many workers (the most accurate and the best value per dollar
# on the cluster): 12 give 286 voter sets; 50 workers would give 19,600, for little more.
VOTER_POOL = 12


def _ratio(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sums / counts, NaN where a count is 0 (no warning)."""
    return np.divide(sums, counts, out=np.full(np.shape(sums), np.nan), where=counts > 0)


def _graded_mean(values: np.ndarray) -> np.ndarray:
    """Column means over the non-blank entries; NaN for a column with none."""
    graded = ~np.isnan(values)
    return _ratio(np.where(graded, values, 0.0).sum(0), graded.sum(0))


def voter_candidates(Y: np.ndarray, C: np.ndarray) -> list[int]:
    """The workers voters are drawn from: half the most accurate, half the most accurate per dollar
    (means over graded questions; a worker graded nowhere ranks last)."""
    k = Y.shape[1]
    if k <= VOTER_POOL:
        return list(range(k))
    accuracy, cost = _graded_mean(Y), _graded_mean(C)
    value = np.nan_to_num(accuracy / np.maximum(cost, 1e-12), nan=-np.inf)
    accuracy = np.nan_to_num(accuracy, nan=-np.inf)
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
    [plans, folds] sums, ``graded``/``priced`` [plans, folds] the questions each of the first two
    sums is over (blank scores and costs left out), and ``counts`` [folds] (sums, not per-row
    matrices: 12 voter candidates and 50 fallbacks over thousands of questions would not fit in
    memory per row)."""

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
        Y, C = np.asarray(labels, float)[rows], np.asarray(costs, float)[rows]
        Yg, Cg = (~np.isnan(Y)).astype(float), (~np.isnan(C)).astype(float)  # graded / priced
        Y, C = np.nan_to_num(Y), np.nan_to_num(C)  # blanks are 0 only where the masks leave them out
        F = np.zeros((len(rows), n_folds))
        F[np.arange(len(rows)), fold] = 1.0  # row -> its fold, for per-fold sums by matrix product
        if candidates is None:
            candidates = voter_candidates(np.asarray(labels, float)[rows], np.asarray(costs, float)[rows])
        sets = [s for size in range(2, MAX_VOTERS + 1) for s in itertools.combinations(candidates, size)]
        voters: list[tuple[int, ...]] = [()] * k
        fallback = list(range(k))
        correct, graded = [(Y * Yg).T @ F], [Yg.T @ F]
        cost, priced = [(C * Cg).T @ F], [Cg.T @ F]
        agreed = [np.tile(F.sum(0), (k, 1))]
        for members in sets:
            a = np.array([_agree(book.read(int(i), list(members)).keys) for i in rows], dtype=float)
            others = [f for f in range(k) if f not in members]
            voters += [members] * len(others)
            fallback += others
            # [rows, others]: the answer returned is the first voter's where they agree, else the fallback's
            returned_graded = a[:, None] * Yg[:, [members[0]]] + (1 - a)[:, None] * Yg[:, others]
            returned_right = a[:, None] * Y[:, [members[0]]] + (1 - a)[:, None] * Y[:, others]
            correct.append((returned_right * returned_graded).T @ F)
            graded.append(returned_graded.T @ F)
            # priced where every voter is, and the fallback too when it was asked
            paid = Cg[:, list(members)].prod(1)[:, None] * (a[:, None] + (1 - a)[:, None] * Cg[:, others])
            spent = C[:, list(members)].sum(1)[:, None] + (1 - a)[:, None] * C[:, others]
            cost.append((spent * paid).T @ F)
            priced.append(paid.T @ F)
            agreed.append(np.tile(a @ F, (len(others), 1)))
        self.voters, self.fallback = voters, fallback
        self.correct, self.graded = np.vstack(correct), np.vstack(graded)
        self.cost, self.priced = np.vstack(cost), np.vstack(priced)
        self.agreed = np.vstack(agreed)
        self.counts = F.sum(0)

    def measured(self, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Every plan's mean accuracy (over the questions where its answer was graded), cost (where
        what it paid for was priced) and agreement without fold ``exclude`` (None: all folds), and
        the number of questions; NaN where a plan has no graded or priced question."""
        keep_folds = np.ones(len(self.counts), dtype=bool)
        if exclude is not None:
            keep_folds[exclude] = False
        n = float(self.counts[keep_folds].sum())

        def mean(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
            return _ratio(sums[:, keep_folds].sum(1), counts[:, keep_folds].sum(1))

        return (
            mean(self.correct, self.graded),
            mean(self.cost, self.priced),
            self.agreed[:, keep_folds].sum(1) * (1.0 / n if n else 0.0),
            n,
        )

    def plan_set(self, exclude: int | None, workers: int) -> PlanSet | None:
        """The frontier (and every single worker), measured without fold ``exclude`` (None: all);
        None when no question is left to measure it on. A plan (single workers too) graded or
        priced on none of the questions is left out: nothing says what it is worth."""
        accuracy, cost, agreed, n = self.measured(exclude)
        if n == 0:
            return None
        known = np.flatnonzero(~(np.isnan(accuracy) | np.isnan(cost)))
        if known.size == 0:
            return None
        order = known[np.lexsort((-accuracy[known], cost[known]))]  # cheapest first, then most accurate
        keep, best = [], -np.inf
        for p in order:
            if accuracy[p] > best + 1e-12:
                keep.append(int(p))
                best = accuracy[p]
        keep = sorted(set(keep) | (set(range(workers)) & set(known.tolist())))
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
    fold_of: np.ndarray  # fold index of each question (also for rows not fitted on)
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
    fold_of: np.ndarray | None = None,
    progress: Callable[[str], None] | None = None,
) -> FittedTables:
    """The table on all ``rows`` and ``k`` fold tables, the f-th fitted without fold f (k = 1: the
    one table serves as both). ``fold_of``: every question's fold, shared with the models stacked
    beside the table (default ``planner_fit.fold_assignment(len(book), k, seed)``, the planner's)."""
    say = progress or (lambda _: None)
    rows = np.arange(len(book)) if rows is None else np.asarray(list(rows))
    if len(rows) == 0:
        raise ValueError("a plan table needs training questions with every worker's label and cost")
    if k <= 1:
        fold_of = np.zeros(len(book), dtype=int)
    elif fold_of is None:
        fold_of = fold_assignment(len(book), k, seed)
    else:
        fold_of = np.asarray(fold_of, dtype=int)
        if fold_of.shape != (len(book),) or fold_of.min() < 0 or fold_of.max() >= k:
            raise ValueError(f"fold_of must give each of the {len(book)} questions one of {k} folds")
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
