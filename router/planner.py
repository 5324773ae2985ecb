"""Cascade routing: given the query and the answers so far, call another worker (or two at once), or stop.

One planner covers "pick one worker" and "compose several". At every step it compares

* **stopping** now, which returns the answer the post-hoc estimator rates best: P(right | query,
  every answer so far) from :class:`Posthoc` over router/evidence.py's features; and
* **calling** a worker k not asked yet, or a set of workers: the gain model predicts how much the
  call adds to P(the best answer held is right), so a cheap second opinion that would confirm or
  contradict the first answer is worth its price; at step 0, with no answer yet, the gain of a single
  call is the query-only router's prior for k, recalibrated (today's fast router is the plan of one
  step).

Each option is scored as expected quality − λ·(its predicted cost / the most expensive predicted
cost of the pool's workers the router's model knows, router/decide.py :func:`price_scale`) −
μ·(one more round trip), the same λ and prices as the fast router and an optional latency weight
μ. The best option wins; the plan ends when stopping beats every call. As in
Dekoninck et al.'s cascade routing, a set of workers is scored as a whole (a superset of the answers
held), but with μ = 0 only its cheapest member is called and the plan re-scored with the answer in
hand; with μ > 0 they are called at once. No depth is fixed: ``max_calls`` only bounds the worst case.

Both models are small gradient-boosted trees (LightGBM, one thread): a step costs well under a
millisecond of CPU besides the workers' calls (bench/router.py). Training lives in
router/offline/cascade.py; nothing here reads data files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from router.answers import Kind, choice_letters, detect_kind
from router.decide import price_scale
from router.evidence import KINDS, NO_PRIOR, Answers, classes, posthoc_rows

VALUE_FEATURES = (
    "answers",  # answers held
    "best",  # post-hoc P(right) of the best answer held (0 with none)
    "rival",  # best post-hoc P among answers outside the best one's class
    "best_class_size",
    "classes",
    "best_prior",  # the most trusted worker asked so far (log-odds; NO_PRIOR with none)
    "call_size",  # workers in the call (1, or a set of up to MAX_SET scored as a whole)
    "call_prior_max",  # their priors (log-odds)
    "call_prior_min",
    "call_over_best",  # call_prior_max − best_prior
    "call_gain",  # sigmoid(call_prior_max) − best
    "fallback_prior",  # the most trusted worker left open after the call (NO_PRIOR: none)
    "open",  # workers left open after the call
    "options",  # choices the query offers (0: not multiple choice)
    *(f"kind_{k.value}" for k in KINDS),
)
# The gain of a call can only fall as the best answer held gets better, and only rise with the
# called workers' priors: LightGBM keeps those directions, so the trees cannot fit noise against them.
GAIN_MONOTONE = {"best": -1, "best_prior": -1, "call_prior_max": 1, "call_over_best": 1, "call_gain": 1}
SET_CANDIDATES = 6  # sets are formed among the best single calls only (50 workers stay cheap)
MAX_SET = 3  # a call scored as a whole may hold up to this many workers
DEFAULT_MAX_CALLS = 6


def gain_model(seed: int = 0) -> Boosted:
    """The regression the planner values calls with, with :data:`GAIN_MONOTONE` enforced."""
    return Boosted(
        "regression",
        monotone={VALUE_FEATURES.index(name): sign for name, sign in GAIN_MONOTONE.items()},
        seed=seed,
    )


def known_mask(known: frozenset[str] | None, names: Sequence[str] | None) -> list[bool] | None:
    """Which pool workers (``names``) the router's model knows, for :func:`router.decide.price_scale`;
    None (all of them) when the pool is unnamed (the replay: the training workers) or the planner was
    not told (an older router file, or a planner used on its own)."""
    if known is None or names is None:
        return None
    return [name in known for name in names]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


class Boosted:
    """LightGBM with small trees: P(y = 1 | x) (``binary``) or E[y | x] (``regression``). Predicts on
    one thread by default: the request path must not contend for cores."""

    def __init__(
        self,
        objective: str = "binary",
        monotone: dict[int, int] | None = None,
        n_estimators: int = 200,
        num_leaves: int = 15,
        min_child_samples: int = 100,
        learning_rate: float = 0.05,
        seed: int = 0,
    ) -> None:
        if objective not in ("binary", "regression"):
            raise ValueError("objective must be binary or regression")
        self.objective = objective
        self.params = {
            "n_estimators": n_estimators,
            "num_leaves": num_leaves,
            "min_child_samples": min_child_samples,
            "learning_rate": learning_rate,
            "max_bin": 63,
            "subsample": 0.8,
            "subsample_freq": 1,
            "colsample_bytree": 0.9,
            "random_state": seed,
            "verbose": -1,
        }
        self.monotone = dict(monotone or {})
        self.booster: Any = None
        self.constant: float | None = None
        self.n_features: int | None = None

    def fit(self, X: np.ndarray, y: np.ndarray) -> Boosted:
        X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
        keep = ~np.isnan(y)
        X, y = X[keep], y[keep]
        if len(y) == 0:
            raise ValueError("no labelled rows to fit on")
        self.n_features = X.shape[1]
        if y.min() == y.max():  # nothing to learn: the constant is the honest estimate
            self.constant = float(y[0])
            return self
        import lightgbm

        # Leaves of at least 1/20 of the rows on small data (a few hundred queries), 100 on big data;
        # one thread on small data (OpenMP threads spinning against a busy core cost far more than
        # they save: 20-100x slower fits were seen on a loaded 2-core machine).
        params = {
            **self.params,
            "min_child_samples": min(self.params["min_child_samples"], max(5, len(y) // 20)),
            "n_jobs": 1 if len(y) < 50_000 else -1,
        }
        if self.monotone:
            params["monotone_constraints"] = [self.monotone.get(j, 0) for j in range(X.shape[1])]
        if self.objective == "binary":
            model = lightgbm.LGBMClassifier(**params).fit(X, (y >= 0.5).astype(int))
        else:
            model = lightgbm.LGBMRegressor(**params).fit(X, y)
        self.booster = model.booster_
        return self

    def predict(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"expected [n, {self.n_features}] features, got {X.shape}")
        if self.constant is not None:
            return np.full(len(X), self.constant)
        if self.booster is None:
            raise RuntimeError("fit the model first")
        if len(X) == 0:
            return np.zeros(0)
        return np.asarray(self.booster.predict(X, num_threads=threads), dtype=float)


@dataclass(frozen=True, slots=True)
class State:
    """What the plan holds for one query: the workers asked (pool indices, in call order) and their
    answers read by router/evidence.py (indexed like ``called``)."""

    kind: Kind
    called: tuple[int, ...] = ()
    answers: Answers | None = None
    options: int = 0  # letters a multiple-choice query offers (known before any answer)

    @classmethod
    def of(cls, query: str, called: Sequence[int] = (), answers: Answers | None = None) -> State:
        """The state of a plan for ``query`` holding ``answers`` from the workers ``called``."""
        kind = answers.kind if answers is not None else detect_kind(query)
        return cls(kind, tuple(called), answers, len(choice_letters(query)) if kind is Kind.CHOICE else 0)


@dataclass(frozen=True, slots=True)
class Decision:
    """The planner's choice: ``call`` these pool indices now, or (``call`` empty) stop and return
    the answer at position ``answer`` of ``State.called``."""

    call: tuple[int, ...]
    answer: int | None
    reason: str
    scores: tuple[float, ...] = ()  # post-hoc P(right) of each answer held


class Plans(Protocol):
    """What runs a plan: :class:`CascadePlanner` or a plan table (router/plan_table.py). The
    gateway's plan workflow (router/compose/planned.py) and the replay (router/offline/replay.py)
    need only this."""

    max_calls: int
    card: dict[str, Any]

    def decide(
        self,
        state: State,
        log_odds: Sequence[float],
        costs: Sequence[float],
        cost_weight: float,
        *,
        latency_weight: float = 0.0,
        parallel: int = 2,
        allowed: Sequence[bool] | None = None,
        memo: dict | None = None,
        names: Sequence[str] | None = None,
    ) -> Decision: ...


@dataclass
class CascadePlanner:
    """The per-request planner: the post-hoc estimator, the value of a call (None: myopic, the
    post-hoc estimate after the call is the prior of the worker), and the plan's limits."""

    posthoc: Boosted
    value: Boosted | None = None
    max_calls: int = DEFAULT_MAX_CALLS
    card: dict[str, Any] = field(default_factory=dict)
    # the workers the router's model has a column for, whose dearest sets the price scale (set by the
    # learned router when it loads; None: the pool's dearest, as older router files were trained)
    known: frozenset[str] | None = None

    def answer_scores(self, state: State, log_odds: np.ndarray, memo: dict | None = None) -> np.ndarray:
        """Post-hoc P(right) of each answer held (positions of ``state.called``)."""
        if memo is not None and "scores" in memo:
            return memo["scores"]
        if not state.called or state.answers is None:
            scores = np.zeros(0)
        else:
            held = np.asarray(log_odds, dtype=float)[list(state.called)]
            scores = self.posthoc.predict(posthoc_rows(state.answers, range(len(state.called)), held))
        if memo is not None:
            memo["scores"] = scores
        return scores

    def call_values(
        self,
        state: State,
        scores: np.ndarray,
        log_odds: np.ndarray,
        calls: Sequence[tuple[int, ...]],
        open_: Sequence[int],
        memo: dict | None = None,
    ) -> np.ndarray:
        """How much each call is expected to add to the quality of the best answer held: P(right)
        of the best answer once the call's answers are in, minus that of the best answer now (none:
        0). Every option of a step, a single first call included, is valued by the same model, so
        their errors do not favour one kind of option; the query-only prior is its main input at
        step 0. ``memo`` (one dict per state) keeps gains already predicted: they do not depend on
        λ, so a replay predicts them once."""
        memo = {} if memo is None else memo
        missing = [call for call in calls if call not in memo]
        if missing:
            if self.value is None:  # no gain model: the best prior in the call over the best answer held
                held = float(scores.max()) if len(scores) else 0.0
                gains = [max(sigmoid(max(float(log_odds[k]) for k in c)) - held, 0.0) for c in missing]
            else:
                gains = list(self.value.predict(value_rows(state, scores, log_odds, missing, open_)))
            for call, gain in zip(missing, gains, strict=True):
                memo[call] = float(gain)
        return np.array([memo[call] for call in calls], dtype=float)

    def decide(
        self,
        state: State,
        log_odds: Sequence[float],
        costs: Sequence[float],
        cost_weight: float,
        *,
        latency_weight: float = 0.0,
        parallel: int = 2,
        allowed: Sequence[bool] | None = None,
        memo: dict | None = None,
        names: Sequence[str] | None = None,
    ) -> Decision:
        """The next action for ``state``; ``log_odds``/``costs`` are per pool worker (prior and
        predicted USD); ``allowed`` masks workers that may not be called now (over the ceiling);
        ``names`` (per pool worker) name them in the reason, pool indices otherwise.

        A call is worth gain − λ·price − μ (price: predicted cost / the pool's most expensive); the plan
        stops, returning the answer the post-hoc estimator rates best, when no call is worth more than 0.
        Sets of up to :data:`MAX_SET` workers are scored as a whole (the superset the plan may grow
        into: "two cheap opinions, then the frontier model if they disagree"); with μ = 0 only the
        cheapest member is called and the plan re-scored with its answer in hand, with μ > 0 up to
        ``parallel`` members are called at once (one round trip)."""
        log_odds = np.asarray(log_odds, dtype=float)
        costs = np.asarray(costs, dtype=float)
        if cost_weight < 0 or latency_weight < 0:
            raise ValueError("cost_weight and latency_weight must be >= 0")
        memo = {} if memo is None else memo
        scores = self.answer_scores(state, log_odds, memo)
        best = int(np.argmax(scores)) if len(scores) else None
        held = float(scores[best]) if best is not None else 0.0
        open_ = [k for k in range(len(log_odds)) if k not in state.called and (allowed is None or allowed[k])]
        if not open_ or len(state.called) >= self.max_calls:
            why = "every admissible worker asked" if not open_ else f"{self.max_calls} calls made"
            return Decision((), best, f"stop: {why}", tuple(scores))
        top = float(price_scale(costs, known_mask(getattr(self, "known", None), names)))
        prices = costs / top if top > 0 else np.zeros_like(costs)
        calls: list[tuple[int, ...]] = [(k,) for k in open_]
        gains = self.call_values(state, scores, log_odds, calls, open_, memo)
        utility = list(gains - cost_weight * prices[open_] - latency_weight)
        room = min(MAX_SET, self.max_calls - len(state.called))
        if room >= 2 and len(open_) >= 2:
            ranked = sorted(
                open_[i] for i in np.argsort(-np.asarray(utility), kind="stable")[:SET_CANDIDATES]
            )
            sets = [c for size in range(2, room + 1) for c in itertools.combinations(ranked, size)]
            set_gains = self.call_values(state, scores, log_odds, sets, open_, memo)
            calls += sets
            gains = np.concatenate([gains, set_gains])
            utility += [
                float(g - cost_weight * prices[list(c)].sum() - latency_weight)
                for c, g in zip(sets, set_gains, strict=True)
            ]
        choice = int(np.argmax(utility))
        if best is not None and utility[choice] <= 0.0:
            return Decision(
                (), best, f"stop: no call adds more than it costs (best P={held:.2f})", tuple(scores)
            )
        call = calls[choice]
        gain = float(gains[choice])

        def named(ks: Sequence[int]) -> str:
            return "+".join(names[k] if names is not None else str(k) for k in ks)

        if len(call) > 1 and (latency_weight == 0 or parallel < 2):
            cheaper = min(call, key=lambda k: (costs[k], k))
            reason = (
                f"call {named([cheaper])}, the cheapest of {named(call)} (expected gain of all {gain:+.3f})"
            )
            call = (cheaper,)
        elif len(call) > parallel:
            call = tuple(sorted(call, key=lambda k: (costs[k], k))[:parallel])
            reason = f"call {named(call)} at once, the cheapest of a set (expected gain {gain:+.3f})"
        else:
            reason = f"call {named(call)} (expected gain {gain:+.3f})"
        return Decision(call, None, reason, tuple(scores))


def value_rows(
    state: State,
    scores: np.ndarray,
    log_odds: np.ndarray,
    calls: Sequence[tuple[int, ...]],
    open_: Sequence[int],
) -> np.ndarray:
    """One row of :data:`VALUE_FEATURES` per candidate call from ``state`` (``open_``: workers that
    may still be called)."""
    kind_onehot = [float(state.kind is k) for k in KINDS]
    options = state.options
    if state.called and state.answers is not None:
        best = int(np.argmax(scores))
        groups = classes(state.answers.keys, range(len(state.called)))
        mine = next(m for m in groups.values() if best in m)
        outside = [float(scores[j]) for j in range(len(scores)) if j not in mine]
        summary = [
            len(state.called),
            float(scores[best]),
            max(outside, default=0.0),
            len(mine),
            len(groups),
            max(float(log_odds[k]) for k in state.called),
        ]
    else:
        summary = [0, 0.0, 0.0, 0, 0, NO_PRIOR]
    rows = []
    for call in calls:
        priors = [float(log_odds[k]) for k in call]
        top = max(priors)
        left = [float(log_odds[k]) for k in open_ if k not in call]
        rows.append(
            [
                *summary,
                len(call),
                top,
                min(priors),
                top - summary[5],
                sigmoid(top) - summary[1],
                max(left, default=NO_PRIOR),
                len(left),
                options,
                *kind_onehot,
            ]
        )
    return np.asarray(rows, dtype=float).reshape(len(calls), len(VALUE_FEATURES))
