"""The route record a routed request leaves in the ledger, and how to read it back.

Off-policy evaluation (`polyroute router eval --from-ledger --candidate`) replays another router on
logged requests and re-weights their outcomes by how likely the logged choice was. That needs, per
request, what the router saw besides the query text (stored separately, and only for data classes
that may be stored): the admissible pool, λ and where it came from, or the quality target, the
policy's preference for fewer active parameters, the sizes that set predicted costs, and how the
choice was drawn (its propensity). Nothing here is personal data: worker names and numbers. One
module writes and reads the record, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from router.learned import COST_WEIGHT_SOURCES
from router.rules import Propensity, RouteDecision, RouteRequest

# The router's own single-worker choices (not pinned, cached or composed requests).
ROUTED_STRATEGIES = ("fast", "explore")
# Where a λ came from when something other than the model in force fixed it: a replay keeps these
# and lets the candidate resolve its own λ otherwise (its card's operating λ, else the default),
# as it would once put in force.
FIXED_COST_WEIGHT_SOURCES = ("request", "tenant", "setting")


def route_log(
    decision: RouteDecision,
    request: RouteRequest,
    pool: Iterable[str],
    cost_weight: float,
    cost_weight_source: str | None = None,
) -> dict[str, Any] | None:
    """The record for a request the router chose a worker for; None for any other request.

    `cost_weight` is the λ the router applied and `cost_weight_source` which of
    router.learned.COST_WEIGHT_SOURCES set it (router.learned.resolve_cost_weight): the replay needs
    to know whether the request, its tenant or the operator fixed λ, or the model in force chose it
    (None: unknown, replayed as fixed, as records from before sources were logged). Not checked
    here, on the request's path: :func:`route_problem` names a bad one when the record is read.
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
        "cost_weight_source": cost_weight_source,
        "min_quality": request.min_quality,
        "prefer_fewer_active_params": request.prefer_fewer_active_params,
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
    prefer = log.get("prefer_fewer_active_params", 0.0)
    if not is_number(prefer) or not 0 <= prefer <= 1:
        return f"route prefer_fewer_active_params {prefer!r} is not a number from 0 to 1"
    source = log.get("cost_weight_source")
    if source is not None and (not isinstance(source, str) or source not in COST_WEIGHT_SOURCES):
        return f"route cost_weight_source {source!r} is not one of {', '.join(COST_WEIGHT_SOURCES)}"
    return None


def logging_propensity(log: dict[str, Any]) -> Propensity:
    """How the logged choice was drawn, to ask how likely any other worker was (`.of(name)`)."""
    return Propensity(
        float(log["propensity"]), log["greedy"], float(log.get("epsilon", 0.0)), tuple(log.get("explore", ()))
    )


def replay_request(log: dict[str, Any], text: str, turns: int = 1) -> RouteRequest:
    """The request as the router saw it, for another router to decide on as it would in force.

    λ is replayed only where the request, its tenant or the operator fixed it; where the logging
    model chose it (its card's operating λ, or the default), the candidate resolves its own, since
    that is the λ it would run at. A record written before sources were logged has none: its λ is
    replayed as it was (the one thing it says). Records without a preference for fewer active
    parameters predate it, or the policy set none: 0."""
    source = log.get("cost_weight_source")
    fixed = source is None or source in FIXED_COST_WEIGHT_SOURCES
    weight = float(log["cost_weight"]) if fixed else None
    return RouteRequest(
        prompt_chars=int(log["prompt_chars"]),
        max_output_tokens=log.get("max_output_tokens"),
        needs_tools=bool(log.get("needs_tools", False)),
        prefer_fewer_active_params=float(log.get("prefer_fewer_active_params", 0.0)),
        text=text,
        turns=turns,
        cost_weight=None if source == "tenant" else weight,
        min_quality=log.get("min_quality"),
        tenant_cost_weight=weight if source == "tenant" else None,
    )
