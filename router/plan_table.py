"""A plan table: per kind of question, a few fixed cascades learned offline, chosen per request by λ.

The learned planner (router/planner.py) values every possible next call with a gain model, and that
model's noise (about 0.01–0.02 in quality) is above the price of a cheap call: it asks for second
opinions that do not pay. A plan table asks less of the data. Offline
(router/offline/plan_table_fit.py), for each cluster of questions — the answer kind the question
asks for and, for multiple choice, how many options it offers; no task names — every plan of a small
family is scored on the recorded answers:

* ``e`` — ask one worker;
* ``a b → e`` / ``a b c → e`` — ask the voters at once; if their normalised answers agree
  (router/answers.py, code by behaviour) return the first voter's, else ask ``e`` and return its.

Only the plans on the cluster's accuracy/cost frontier are kept, with every single worker (so a
pool that lacks a frontier plan's workers still has a choice). Per request, the plan with the
highest accuracy − λ·price − μ·rounds among those whose workers are all admissible is run, where
price is the plan's expected predicted cost (the fallback weighted by how often the voters
disagreed in training) over the most expensive of the pool's workers the router's model knows
(router/decide.py :func:`price_scale`, as the fast router and the planner price) — the planner's λ,
on the planner's scale. It implements the planner's ``decide``, so the replay
(router/offline/replay.py) and the gateway's plan workflow (router/compose/planned.py) run either.

Which of the two a trained router uses is chosen on the training files by cross-fitted AIQ
(router/offline/pool_cascade.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router.answers import Kind
from router.decide import price_scale
from router.planner import Decision, State, known_mask

ANY = "*"  # the table for a cluster that had too few training questions of its own


def cluster_of(kind: Kind, options: int) -> str:
    """The plan table's key for a question: its answer kind, and for choices 2 vs 3+ options (with two
    options, agreement by chance is 50%)."""
    if kind is Kind.CHOICE:
        return "choice-2" if options == 2 else "choice-3+"
    return kind.name.lower()


@dataclass
class PlanSet:
    """One cluster's plans: ``voters[p]`` (empty: ask ``fallback[p]`` alone), the accuracy they had
    in training and how often their voters agreed."""

    voters: list[tuple[int, ...]]
    fallback: list[int]
    accuracy: np.ndarray
    agree: np.ndarray
    questions: int

    def __len__(self) -> int:
        return len(self.voters)

    def as_dict(self, workers: Sequence[str]) -> list[dict[str, Any]]:
        return [
            {
                "voters": [workers[v] for v in self.voters[p]],
                "fallback": workers[self.fallback[p]],
                "accuracy": round(float(self.accuracy[p]), 4),
                "agree": round(float(self.agree[p]), 4),
            }
            for p in range(len(self))
        ]


@dataclass
class PlanTable:
    """Plans per cluster over ``workers`` (the training workers: plans hold their indices). Live, the
    pool's ``names`` place them; a plan with a worker the pool lacks is never chosen."""

    workers: list[str]
    clusters: dict[str, PlanSet]
    max_calls: int = 4
    card: dict[str, Any] = field(default_factory=dict)
    # the workers the router's model has a column for, whose dearest sets the price scale (set by the
    # learned router when it loads; None: the pool's dearest)
    known: frozenset[str] | None = None

    def plans_for(self, state: State) -> PlanSet:
        return self.clusters.get(cluster_of(state.kind, state.options)) or self.clusters[ANY]

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
        """The next action for ``state`` (the :class:`~router.planner.Plans` contract): pick the best plan
        whose workers are admissible or already asked, then call its voters, then its fallback when
        they disagree, then stop. ``parallel`` and ``memo`` are accepted for the interface: a plan's
        voters are always asked together, and nothing here is worth memoising."""
        if cost_weight < 0 or latency_weight < 0:
            raise ValueError("cost_weight and latency_weight must be >= 0")
        costs = np.asarray(costs, dtype=float)
        where = self._positions(names, len(costs))  # training worker -> pool index (or -1)
        called = list(state.called)
        usable = {k for k in range(len(costs)) if allowed is None or allowed[k]} | set(called)
        plans = self.plans_for(state)
        top = float(price_scale(costs, known_mask(getattr(self, "known", None), names)))
        best, best_utility = None, -np.inf
        for p in range(len(plans)):
            members = [*plans.voters[p], plans.fallback[p]]
            pool = [int(where[w]) for w in members]
            if any(k < 0 or k not in usable for k in pool):
                continue
            *voters, fallback = pool
            disagree = 1.0 - float(plans.agree[p]) if voters else 1.0
            spent = float(costs[voters].sum()) + disagree * float(costs[fallback])
            rounds = 1.0 + (disagree if voters else 0.0)
            utility = float(plans.accuracy[p]) - cost_weight * (spent / top if top > 0 else 0.0)
            utility -= latency_weight * rounds
            if np.isfinite(utility) and utility > best_utility:
                best, best_utility = (tuple(voters), fallback, p), utility
        if best is None:  # no plan fits the admissible pool (workers the table never saw)
            if called:  # return the answer of the best prior held
                pick = max(range(len(called)), key=lambda j: float(log_odds[called[j]]))
                return Decision((), pick, "stop: no plan of the table fits the admissible pool")
            open_ = sorted(usable)
            if not open_:
                return Decision((), None, "stop: no admissible worker")
            price = costs / top if top > 0 else np.zeros_like(costs)
            k = max(open_, key=lambda j: float(log_odds[j]) - cost_weight * float(price[j]))
            return Decision((k,), None, "no plan of the table fits the admissible pool: the best prior")
        voters, fallback, p = best
        label = self._label(voters, fallback, names)
        missing = [k for k in voters if k not in called] if voters else []
        if missing:
            return Decision(tuple(missing), None, f"plan {label}: ask the voters")
        if voters and self._agree(state, voters):
            return Decision((), called.index(voters[0]), f"plan {label}: the voters agree")
        if fallback not in called:
            why = "the voters disagree" if voters else "one worker"
            return Decision((fallback,), None, f"plan {label}: {why}, ask {self._name(fallback, names)}")
        return Decision((), called.index(fallback), f"plan {label}: done")

    # ---------------------------------------------------------------------------------------------
    def _positions(self, names: Sequence[str] | None, pool_size: int) -> np.ndarray:
        if names is None:  # the replay: pool indices are the training workers' (those the pool has)
            return np.array([w if w < pool_size else -1 for w in range(len(self.workers))])
        index = {name: k for k, name in enumerate(names)}
        return np.array([index.get(w, -1) for w in self.workers])

    @staticmethod
    def _agree(state: State, voters: Sequence[int]) -> bool:
        if state.answers is None:
            return False
        keys = [state.answers.keys[state.called.index(k)] for k in voters]
        return keys[0] is not None and all(key == keys[0] for key in keys[1:])

    @staticmethod
    def _name(k: int, names: Sequence[str] | None) -> str:
        return names[k] if names is not None else str(k)

    def _label(self, voters: Sequence[int], fallback: int, names: Sequence[str] | None) -> str:
        if not voters:
            return self._name(fallback, names)
        return f"{'+'.join(self._name(k, names) for k in voters)} agree, else {self._name(fallback, names)}"
