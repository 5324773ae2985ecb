"""When composing pays: the router's choice between fast mode and a workflow, and forced workflows.

`model="compose:<workflow>"` forces one. Under `model="auto"` the router compares the best
single worker's utility (quality − λ·cost, as in fast mode) with a cascade's predicted utility,
from the same per-worker quality predictions. With a verifier that decides right with
probability α, a cheap worker a (quality q_a) escalating to the strongest b (q_b):

    Q  = q_a·(α + (1 − α)·q_b) + (1 − q_a)·α·q_b
    P(escalate) = q_a·(1 − α) + (1 − q_a)·α
    C  = c_a + P(escalate)·c_b

The cascade is chosen when Q − λ·C/c_max beats the best single worker by `margin`. Ensemble,
builder/verifier and debate have no offline data to predict their gain from, so `auto` never
picks them; they run when asked for by name. When the router in force has a trained planner
(router/planner.py), `auto` runs the answer-aware plan instead (router/compose/planned.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from router.decide import Estimate, price_scale, utility

WORKFLOWS = ("cascade", "ensemble", "builder", "debate", "plan")
PREFIX = "compose:"


def requested_workflow(model: str) -> str | None:
    """'compose:cascade' -> 'cascade'; None for any other model name; ValueError for an unknown one."""
    if not model.startswith(PREFIX):
        return None
    name = model[len(PREFIX) :]
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r}: use one of " + ", ".join(PREFIX + w for w in WORKFLOWS))
    return name


@dataclass(frozen=True, slots=True)
class CascadePrediction:
    cheap: str
    strong: str
    quality: float
    cost_usd: Decimal
    utility: float
    fast_worker: str
    fast_utility: float

    @property
    def reason(self) -> str:
        return (
            f"cascade {self.cheap}->{self.strong} predicted utility {self.utility:.3f} vs "
            f"{self.fast_utility:.3f} for {self.fast_worker} alone"
        )


def predict_cascade(
    estimates: list[Estimate], cost_weight: float, verifier_accuracy: float
) -> CascadePrediction | None:
    """The cascade from the cheapest worker predicted cheaper than the strongest to the strongest,
    with its predicted quality, cost and utility next to the best single worker's; None when there
    is no such pair (fewer than two workers, or the strongest is predicted cheapest)."""
    if len(estimates) < 2:
        return None
    max_cost = price_scale([e.cost_usd for e in estimates], [e.known for e in estimates])  # as fast mode
    fast = max(estimates, key=lambda e: utility(e, cost_weight, max_cost))
    strong = max(estimates, key=lambda e: (e.quality, -e.cost_usd))
    # the cascade runs cheaper workers before the strongest (cascade.chain leaves dearer ones out):
    # when the strongest is also the cheapest, there is no cascade to run, only a one-level chain
    # with no fallback, so fast mode answers (its retries and fallback included)
    cheaper = [e for e in estimates if e is not strong and e.cost_usd < strong.cost_usd]
    if not cheaper:
        return None
    cheap = min(cheaper, key=lambda e: (e.cost_usd, -e.quality))
    a, qa, qb = verifier_accuracy, cheap.quality, strong.quality
    quality = qa * (a + (1 - a) * qb) + (1 - qa) * a * qb
    escalate = qa * (1 - a) + (1 - qa) * a
    cost = cheap.cost_usd + Decimal(repr(escalate)) * strong.cost_usd
    as_estimate = Estimate("cascade", quality, cost)
    return CascadePrediction(
        cheap.worker,
        strong.worker,
        quality,
        cost,
        utility(as_estimate, cost_weight, max_cost),
        fast.worker,
        utility(fast, cost_weight, max_cost),
    )


def should_cascade(prediction: CascadePrediction | None, margin: float = 0.01) -> bool:
    return prediction is not None and prediction.utility > prediction.fast_utility + margin
