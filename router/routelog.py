"""The route record a routed request leaves in the ledger, and how to read it back.

Off-policy evaluation (`polyroute router eval --from-ledger --candidate`) replays another router on
logged requests and re-weights their outcomes by how likely the logged choice was. That needs, per
request, what the router saw besides the query text (stored separately, and only for data classes
that may be stored): the admissible pool, λ or the quality target, the sizes that set predicted
costs, and how the choice was drawn (its propensity). Nothing here is personal data: worker names
and numbers. One module writes and reads the record, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from router.rules import Propensity, RouteDecision, RouteRequest

# The router's own single-worker choices (not pinned, cached or composed requests).
ROUTED_STRATEGIES = ("fast", "explore")


def route_log(
    decision: RouteDecision, request: RouteRequest, pool: Iterable[str], cost_weight: float
) -> dict[str, Any] | None:
    """The record for a request the router chose a worker for; None for any other request.

    `cost_weight` is the λ the router applied (the request's, the tenant's or the gateway's default).
    A router without exploration (the rules, or ε = 0) chose deterministically: propensity 1.
    """
    if decision.strategy not in ROUTED_STRATEGIES or not decision.workers:
        return None
    chosen = decision.workers[0].name
    drawn = decision.propensity or Propensity(1.0, chosen)
    return {
        "chosen": chosen,
        "propensity": drawn.probability,
        "greedy": drawn.greedy,
        "epsilon": drawn.epsilon,
        "explore": list(drawn.explore),
        "pool": list(pool),
        "cost_weight": cost_weight,
        "min_quality": request.min_quality,
        "prompt_chars": request.prompt_chars,
        "max_output_tokens": request.max_output_tokens,
        "needs_tools": request.needs_tools,
    }


def is_number(value: Any) -> bool:
    """A finite int or float read from JSON (a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def route_problem(log: Any) -> str | None:
    """What makes a route record unusable by :func:`logging_propensity` and :func:`replay_request`
    (None: nothing), so a reader can name the record instead of failing on it mid-replay."""
    if not isinstance(log, dict):
        return f"route is {type(log).__name__}, not an object"
    missing = [
        k for k in ("chosen", "greedy", "pool", "propensity", "cost_weight", "prompt_chars") if k not in log
    ]
    if missing:
        return f"route lacks {', '.join(missing)}"
    if not isinstance(log["chosen"], str) or not isinstance(log["greedy"], str):
        return "route chosen and greedy must be worker names"
    if not _names(log.get("pool")) or not _names(log.get("explore", [])):
        return "route pool and explore must be lists of worker names"
    propensity = log.get("propensity")
    if not is_number(propensity) or not 0 < propensity <= 1:
        return f"route propensity {propensity!r} is not a probability in (0, 1]"
    if not is_number(log.get("epsilon", 0.0)) or not is_number(log.get("cost_weight")):
        return "route epsilon and cost_weight must be numbers"
    chars = log.get("prompt_chars")
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 0:
        return f"route prompt_chars {chars!r} is not a whole number >= 0"
    for name in ("max_output_tokens", "min_quality"):
        if log.get(name) is not None and not is_number(log[name]):
            return f"route {name} {log[name]!r} is not a number"
    return None


def logging_propensity(log: dict[str, Any]) -> Propensity:
    """How the logged choice was drawn, to ask how likely any other worker was (`.of(name)`)."""
    return Propensity(
        float(log["propensity"]), log["greedy"], float(log.get("epsilon", 0.0)), tuple(log.get("explore", ()))
    )


def replay_request(log: dict[str, Any], text: str, turns: int = 1) -> RouteRequest:
    """The request as the router saw it, for another router to decide on."""
    return RouteRequest(
        prompt_chars=int(log["prompt_chars"]),
        max_output_tokens=log.get("max_output_tokens"),
        needs_tools=bool(log.get("needs_tools", False)),
        text=text,
        turns=turns,
        cost_weight=float(log["cost_weight"]),
        min_quality=log.get("min_quality"),
    )
