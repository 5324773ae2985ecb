"""The rule-based router: cheapest admissible worker first, the rest as ordered fallbacks.

It is the router of last resort: the learned router falls back to it when no model is loaded,
so it must never fail on a non-empty pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from policies import Worker

DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
CHARS_PER_TOKEN = 4  # a cheap, provider-independent estimate; exact counts come from usage


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about a request (no HTTP, no pydantic)."""

    prompt_chars: int
    max_output_tokens: int | None = None
    needs_tools: bool = False


@dataclass(frozen=True, slots=True)
class RouteDecision:
    workers: tuple[Worker, ...]  # first is the choice, the rest are fallbacks, all from the pool
    strategy: str
    reason: str
    predicted_cost_usd: Decimal


def estimate_cost(worker: Worker, request: RouteRequest) -> Decimal:
    prompt_tokens = max(1, request.prompt_chars // CHARS_PER_TOKEN)
    output_tokens = request.max_output_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS
    return worker.cost_usd(prompt_tokens, output_tokens)


class CheapestRouter:
    """Ranks the admissible pool by predicted cost; ties go to fewer active parameters, then name."""

    name = "rules-cheapest"

    def route(self, request: RouteRequest, pool: tuple[Worker, ...]) -> RouteDecision:
        if not pool:
            raise ValueError("the admissible pool is empty; the gateway must not call the router")
        candidates = [w for w in pool if "tools" in w.capabilities] if request.needs_tools else []
        ranked_pool = candidates or list(pool)
        costs = {w.name: estimate_cost(w, request) for w in ranked_pool}
        ranked = sorted(
            ranked_pool,
            key=lambda w: (costs[w.name], w.active_params_b or float("inf"), w.name),
        )
        choice = ranked[0]
        reason = f"cheapest admissible (predicted ${costs[choice.name]:.6f})"
        if candidates:
            reason += ", tool-capable"
        return RouteDecision(tuple(ranked), "fast", reason, costs[choice.name])
