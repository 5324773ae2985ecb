"""The routing decision: maximize predicted quality − λ·cost over the admissible pool.

Cost enters normalized by the most expensive worker of the pool that the model knows (has a column
for; the pool's most expensive when it knows none: :func:`price_scale`), so λ is unitless and means
the same whatever the prices: λ = 0 picks the best predicted quality regardless of cost; λ = 1 lets
the most expensive known worker win only if it is predicted a full 1.0 (0 → 1) better than a free one.
An expensive worker the model never saw, added to the catalog, is priced above 1 rather than
rescaling every other worker's price (and with it the choices the model was validated on); the
planner and the plan table price their calls by the same function.
A target (`min_quality`) instead picks the cheapest worker predicted to reach it, or the best
predicted worker when none does. Ties go to the cheaper worker, then fewer active parameters,
then the name, so the decision is deterministic. Workers the model has never seen get a prior
(router/learned.py) and are named as such in the reason. The policy's preference for fewer active
parameters blends them into the price term, as the rule-based router ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


@dataclass(frozen=True, slots=True)
class Estimate:
    worker: str
    quality: float  # predicted P(success), or the prior for an unknown worker
    cost_usd: Decimal
    active_params_b: float | None = None
    known: bool = True


@dataclass(frozen=True, slots=True)
class Choice:
    ranked: tuple[Estimate, ...]  # best first; the rest are fallbacks in order
    reason: str


def price_scale(costs: Sequence[Any], known: Sequence[bool] | None = None) -> Any:
    """The cost a price is a share of: the dearest of the ``costs`` whose worker the model knows
    (``known``, aligned with ``costs``; None: all known), else the dearest of all (a pool of workers the
    model never saw, as under the shipped prior); 0 for no costs. The fast router (:func:`choose`), the
    planner and the plan table all normalise by it, so they price a pool alike."""
    if known is not None:
        mine = [c for c, k in zip(costs, known, strict=True) if k]
        if mine:
            return max(mine)
    if not len(costs):
        return 0
    return costs.max() if hasattr(costs, "max") else max(costs)  # a numpy array: its own max


def _tiebreak(e: Estimate) -> tuple:
    return (e.cost_usd, e.active_params_b if e.active_params_b is not None else float("inf"), e.worker)


def blended_price(cost_share: float, active: float | None, max_active: float, active_weight: float) -> float:
    """A worker's price for ranking, as both routers rank: its cost as a share of the pool's dearest,
    blended with its active parameters as a share of the pool's largest when the policy prefers fewer,
    (1 − w)·cost share + w·active/max active (a worker of unknown size counts as the largest)."""
    if not active_weight:
        return cost_share
    size = active if active is not None else max_active
    return (1 - active_weight) * cost_share + active_weight * size / max_active


def utility(
    e: Estimate, cost_weight: float, max_cost: Decimal, active_weight: float = 0.0, max_active: float = 1.0
) -> float:
    """quality − λ·price, the price by :func:`blended_price`."""
    normalized = float(e.cost_usd / max_cost) if max_cost > 0 else 0.0
    return e.quality - cost_weight * blended_price(normalized, e.active_params_b, max_active, active_weight)


def choose(
    estimates: list[Estimate],
    cost_weight: float,
    min_quality: float | None = None,
    active_weight: float = 0.0,
) -> Choice:
    """``active_weight``: the policy's ``prefer_fewer_active_params`` (0..1), see :func:`utility`."""
    if not estimates:
        raise ValueError("no worker to choose from")
    if cost_weight < 0:
        raise ValueError("cost_weight must be >= 0")
    if not 0 <= active_weight <= 1:
        raise ValueError("active_weight must be between 0 and 1")
    max_cost = price_scale([e.cost_usd for e in estimates], [e.known for e in estimates])
    max_active = max((e.active_params_b for e in estimates if e.active_params_b is not None), default=1.0)
    if min_quality is not None:
        reaching = sorted((e for e in estimates if e.quality >= min_quality), key=_tiebreak)
        rest = sorted(
            (e for e in estimates if e.quality < min_quality), key=lambda e: (-e.quality, *_tiebreak(e))
        )
        ranked = tuple(reaching + rest)
        top = ranked[0]
        if reaching:
            reason = f"cheapest predicted to reach quality {min_quality:g} (q={top.quality:.3f}, ${top.cost_usd:.6f})"
        else:
            reason = f"none predicted to reach {min_quality:g}; best predicted (q={top.quality:.3f})"
    else:
        ranked = tuple(
            sorted(
                estimates,
                key=lambda e: (
                    -round(utility(e, cost_weight, max_cost, active_weight, max_active), 12),
                    *_tiebreak(e),
                ),
            )
        )
        top = ranked[0]
        price = f"(cost vs active params, weight {active_weight:g})" if active_weight else "cost"
        reason = f"max quality - {cost_weight:g}*{price} (q={top.quality:.3f}, ${top.cost_usd:.6f})"
    if not top.known:
        reason += "; no data for this worker yet, prior used"
    return Choice(ranked, reason)


def choose_many(quality, cost, cost_weight: float):
    """:func:`choose` for many queries at once, as worker indices: row-wise argmax of
    quality − λ·cost / (the row's most expensive worker), ties to the cheaper worker, then the lower
    index. The offline evaluation sweeps λ over thousands of queries; this is the same rule, vectorized.
    """
    import numpy as np

    quality = np.asarray(quality, dtype=float)
    cost = np.asarray(cost, dtype=float)
    if quality.shape != cost.shape or quality.ndim != 2 or quality.shape[1] == 0:
        raise ValueError(f"quality {quality.shape} and cost {cost.shape} must be the same [n, k>0] shape")
    if cost_weight < 0:
        raise ValueError("cost_weight must be >= 0")
    max_cost = cost.max(axis=1, keepdims=True)
    normalized = np.divide(cost, max_cost, out=np.zeros_like(cost), where=max_cost > 0)
    value = np.round(quality - cost_weight * normalized, 12)
    best = value == value.max(axis=1, keepdims=True)
    return np.argmin(np.where(best, cost, np.inf), axis=1)
