"""Fitting the cascade planner (router/planner.py) on recorded answers, cross-fitted.

Two models are learned from the training queries' recorded answers and labels:

* the **post-hoc** estimator, P(answer right | the state's answers): one sample per answer of each
  sampled state (every single answer, plus random sets of 2–5 answers), labelled with that answer's
  score;
* the **gain** of a call, P(right) of the best answer once the call's answers are in minus that of
  the best answer now (:func:`gain_samples`), for single workers and sets of 2–3. It is
  myopic, but a set is scored as a whole, so "a second opinion, then maybe the frontier model" is seen
  as the superset it may become (Dekoninck et al.), not as a sum of one-step gains. Fitted value
  iteration (the gain of a call *and* the plan after it, from rollouts, with λ as an input) was tried
  too and was worse on validation: its noise on cheap calls made plans call worker after worker;
  so was a second round fitted on the states the first round's planners visit (no clear gain).

Cross-fitting keeps it honest: each query is walked by models that never saw it (fold models), the
value targets come from those walks, and each fold keeps its own planner, so the training files can
be replayed as a validation set (:func:`fit_planner` returns the fold planners) without the replay
having seen its own labels. The models stacked under the planner — the priors (``log_odds``) and the
predicted costs — must be cross-fitted by the caller on the same folds (:func:`split.fold_assignment`,
:func:`split.cross_fit_on`, passed to :func:`fit_planner` as ``fold_of``): then every model that plans a
query of fold f (prior, cost, post-hoc, gain) was fitted on the other folds' rows only. What that
does not remove (plain stacking, not nested): the post-hoc and gain models of fold f learn from the
other folds' out-of-fold priors, and the gain models from targets judged by those folds' post-hoc
models — and those priors and judges were fitted on rows that include fold f. A query's own label
reaches its planner only that way, second-hand; a nested fit (priors and post-hoc models per pair of
folds) would close it, at several times the fitting time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.evidence import logit, posthoc_rows
from router.offline.book import AnswerBook
from router.offline.split import fold_assignment
from router.planner import Boosted, CascadePlanner, gain_model, value_rows

POSTHOC_STATES = 6  # random multi-answer states per query, besides every single answer
GAIN_STATES = 4  # random states with answers per query, besides "no answer yet"
PAIR_SHARE = 0.25  # share of the possible pairs sampled as calls from each state
TRIPLE_SHARE = 0.04  # and of the triples


@dataclass
class Recorded:
    """Training queries: their recorded answers, the workers' prior log-odds and the labels."""

    book: AnswerBook
    log_odds: np.ndarray  # [n, k], cross-fitted
    labels: np.ndarray  # [n, k], NaN where unscored

    @classmethod
    def from_priors(cls, book: AnswerBook, priors: np.ndarray, labels: np.ndarray) -> Recorded:
        return cls(book, logit(priors), np.asarray(labels, float))

    @property
    def workers(self) -> int:
        return self.labels.shape[1]


def _subset(rng: np.random.Generator, k: int, low: int, high: int) -> list[int]:
    size = int(rng.integers(low, min(high, k) + 1))
    return rng.choice(k, size=size, replace=False).tolist()


def posthoc_samples(
    rec: Recorded, rows: Sequence[int], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, labels, query of each sample) for the post-hoc estimator."""
    rng = np.random.default_rng(seed)
    X, y, owner = [], [], []
    k = rec.workers
    for i in rows:
        states = [[j] for j in range(k)] + [_subset(rng, k, 2, 5) for _ in range(POSTHOC_STATES)]
        for members in states:
            X.append(posthoc_rows(rec.book.read(i, members), range(len(members)), rec.log_odds[i, members]))
            y.extend(rec.labels[i, members])
            owner.extend([i] * len(members))
    return np.vstack(X), np.asarray(y, dtype=float), np.asarray(owner)


def gain_samples(
    rec: Recorded,
    rows: Sequence[int],
    posthoc_for: Callable[[int], Boosted],
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, targets, query of each sample) for the gain of a call.

    States are "no answer yet" and random sets of 1–3 answers; calls are every worker not asked and a
    share of the pairs and triples. The target is the score of the answer the post-hoc estimator picks once the
    call's answers are in, minus the score of the one it picks now (0 with none): a difference of
    outcomes, so the planner never compares two models' errors. ``posthoc_for(i)`` is the post-hoc
    model that judges query i (one that never saw it)."""
    rng = np.random.default_rng(seed)
    X, y, owner = [], [], []
    k = rec.workers
    for i in rows:
        posthoc = posthoc_for(i)
        lo = rec.log_odds[i]
        states = [[]] + [_subset(rng, k, 1, 3) for _ in range(GAIN_STATES)]
        plans: list[tuple[list[int], list[tuple[int, ...]]]] = []
        blocks: list[np.ndarray] = []
        for members in states:  # every judgement this query needs, predicted in one batch
            rest = [j for j in range(k) if j not in members]
            pairs = [c for c in itertools.combinations(rest, 2) if rng.random() < PAIR_SHARE]
            triples = [c for c in itertools.combinations(rest, 3) if rng.random() < TRIPLE_SHARE]
            plans.append((members, [(j,) for j in rest] + pairs + triples))
            for after in [members] + [members + list(c) for c in plans[-1][1]]:
                if after:
                    blocks.append(posthoc_rows(rec.book.read(i, after), range(len(after)), lo[after]))
        judged = posthoc.predict(np.vstack(blocks))
        at = 0
        for members, calls in plans:
            scores = judged[at : at + len(members)]
            at += len(members)
            now = rec.labels[i, members[int(np.argmax(scores))]] if members else 0.0
            state = rec.book.state(i, members)
            open_ = [j for j in range(k) if j not in members]
            X.append(value_rows(state, scores, lo, calls, open_))
            for call in calls:
                after = members + list(call)
                picked = after[int(np.argmax(judged[at : at + len(after)]))]
                at += len(after)
                y.append(rec.labels[i, picked] - now)
                owner.append(i)
    return np.vstack(X), np.asarray(y, dtype=float), np.asarray(owner)


@dataclass
class FittedPlanners:
    """The planner fitted on every training query, and per fold one that never saw the fold."""

    final: CascadePlanner
    fold_of: np.ndarray  # fold index of each training query
    by_fold: list[CascadePlanner]

    def for_row(self, i: int) -> CascadePlanner:
        return self.by_fold[int(self.fold_of[i])]

    def myopic(self) -> FittedPlanners:
        """The same planners without their gain model: a call is worth the best prior in it over
        the best answer held (router/planner.py, ``value=None``). Where the gain model's noise is
        above what it learns (two workers, a query-only prior that knows little), this is the better
        planner; which one a router uses is chosen on the training files (pool_cascade.py)."""

        def strip(planner: CascadePlanner) -> CascadePlanner:
            return CascadePlanner(
                planner.posthoc, None, planner.max_calls, {**planner.card, "value": "myopic"}
            )

        return FittedPlanners(strip(self.final), self.fold_of, [strip(p) for p in self.by_fold])


def fit_planner(
    rec: Recorded,
    *,
    k: int = 5,
    seed: int = 0,
    fold_of: np.ndarray | None = None,
    progress: Callable[[str], None] | None = None,
) -> FittedPlanners:
    """Cross-fitted post-hoc estimator and gain model; see the module docstring. ``fold_of``: the
    fold of each query, the one the priors were cross-fitted on (default
    ``split.fold_assignment(n, k, seed)``)."""
    say = progress or (lambda _: None)
    n = len(rec.book)
    if fold_of is None:
        fold_of = fold_assignment(n, k, seed)
    fold_of = np.asarray(fold_of, dtype=int)
    if fold_of.shape != (n,) or set(np.unique(fold_of).tolist()) != set(range(k)):
        raise ValueError(f"fold_of must give each of the {n} queries one of {k} folds, each used")
    say("post-hoc samples")
    X, y, owner = posthoc_samples(rec, range(n), seed)
    posthoc_by_fold = []
    for f in range(k):
        say(f"post-hoc estimator, fold {f + 1}/{k}")
        posthoc_by_fold.append(Boosted(seed=seed).fit(X[fold_of[owner] != f], y[fold_of[owner] != f]))
    say("post-hoc estimator, all queries")
    posthoc = Boosted(seed=seed).fit(X, y)
    say("gain samples")
    GX, gy, gowner = gain_samples(rec, range(n), lambda i: posthoc_by_fold[fold_of[i]], seed + 1)
    by_fold = []
    for f in range(k):
        say(f"gain model, fold {f + 1}/{k}")
        keep = fold_of[gowner] != f
        by_fold.append(CascadePlanner(posthoc_by_fold[f], gain_model(seed).fit(GX[keep], gy[keep])))
    say("gain model, all queries")
    final = CascadePlanner(
        posthoc,
        gain_model(seed).fit(GX, gy),
        card={"posthoc_samples": len(y), "gain_samples": len(gy), "queries": n, "folds": k},
    )
    return FittedPlanners(final, fold_of, by_fold)
