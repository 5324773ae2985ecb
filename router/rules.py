"""The rule-based router: cheapest admissible worker first, the rest as ordered fallbacks.

It is the router of last resort: the learned router falls back to it when no model is loaded,
so it must never fail on a non-empty pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from policies import Worker, predicted_cost
from router.decide import blended_price


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about a request (no HTTP, no pydantic)."""

    prompt_chars: int
    max_output_tokens: int | None = None
    needs_tools: bool = False
    prefer_fewer_active_params: float = 0.0  # the policy's preference, 0..1
    text: str = ""  # the query the learned router reads (the last user message)
    turns: int = 1
    cost_weight: float | None = None  # λ the request asks for; None: router/learned.py resolve_cost_weight
    min_quality: float | None = None  # a target instead of λ: cheapest worker predicted to reach it
    tenant_cost_weight: float | None = None  # the tenant policy's λ, below the request's own


@dataclass(frozen=True, slots=True)
class Propensity:
    """How a learned router drew its choice, so another policy can be evaluated on the logged traffic.

    With exploration ε the router keeps its greedy choice with probability 1 − ε and otherwise draws
    uniformly among the under-observed workers (keeping the greedy one when there are none), so the
    probability of any worker is known exactly: :meth:`of`. `probability` is that of the worker chosen.
    """

    probability: float
    greedy: str  # the choice without exploration
    epsilon: float = 0.0
    explore: tuple[str, ...] = ()  # the under-observed workers exploration draws from

    @classmethod
    def of_choice(
        cls, chosen: str, greedy: str, epsilon: float = 0.0, explore: tuple[str, ...] = ()
    ) -> Propensity:
        """The propensity of the worker actually chosen, computed from how it was drawn."""
        return cls(cls(0.0, greedy, epsilon, explore).of(chosen), greedy, epsilon, explore)

    def of(self, worker: str) -> float:
        """P(the router picks `worker` first) for this request."""
        p = (1.0 - self.epsilon) if worker == self.greedy else 0.0
        if self.explore:
            p += self.epsilon / len(self.explore) if worker in self.explore else 0.0
        elif worker == self.greedy:
            p += self.epsilon
        return p


@dataclass(frozen=True, slots=True)
class RouteDecision:
    workers: tuple[Worker, ...]  # first is the choice, the rest are fallbacks, all from the pool
    strategy: str
    reason: str
    predicted_cost_usd: Decimal
    propensity: Propensity | None = None  # a learned router's draw; None: deterministic (probability 1)


def estimate_cost(worker: Worker, request: RouteRequest) -> Decimal:
    return predicted_cost(worker, request.prompt_chars, request.max_output_tokens)


def tool_capable(request: RouteRequest, pool: tuple[Worker, ...]) -> tuple[list[Worker], bool]:
    """With tools in the request, only tool-capable workers — unless none is (then all, and say so)."""
    if request.needs_tools:
        capable = [w for w in pool if "tools" in w.capabilities]
        if capable:
            return capable, True
    return list(pool), False


class CheapestRouter:
    """Ranks the admissible pool by predicted cost; ties go to fewer active parameters, then name.

    With the policy's `prefer_fewer_active_params` weight w > 0 the score is
    (1 - w) * cost / max cost + w * active params / max active params, so w = 1 ranks by size alone
    (a worker of unknown size counts as the largest).
    """

    name = "rules-cheapest"
    version = "rules"

    def route(self, request: RouteRequest, pool: tuple[Worker, ...]) -> RouteDecision:
        if not pool:
            raise ValueError("the admissible pool is empty; the gateway must not call the router")
        ranked_pool, candidates = tool_capable(request, pool)
        costs = {w.name: estimate_cost(w, request) for w in ranked_pool}
        weight = request.prefer_fewer_active_params
        max_cost = max(costs.values()) or Decimal(1)
        known = [w.active_params_b for w in ranked_pool if w.active_params_b is not None]
        max_active = max(known, default=1.0)

        def active(w: Worker) -> float:
            return w.active_params_b if w.active_params_b is not None else max_active

        def score(w: Worker) -> tuple:
            blended = blended_price(float(costs[w.name] / max_cost), w.active_params_b, max_active, weight)
            return (blended if weight else 0.0, costs[w.name], active(w), w.name)

        ranked = sorted(ranked_pool, key=score)
        choice = ranked[0]
        reason = f"cheapest admissible (predicted ${costs[choice.name]:.6f})"
        if weight:
            reason = f"cost vs active params (weight {weight:g}): predicted ${costs[choice.name]:.6f}"
        if candidates:
            reason += ", tool-capable"
        return RouteDecision(tuple(ranked), "fast", reason, costs[choice.name])
