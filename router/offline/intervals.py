"""How sure a router comparison is: paired bootstrap intervals over the test queries.

An AIQ difference of 0.005–0.03 on a few hundred test queries is close to what a different draw of
those queries would change, and a ratio of two such differences (onboarding's ``gain_recovered``)
even more so. Reporting the figure alone invites reading noise as progress, so the N-worker reports
carry a 95% interval next to it.

The bootstrap is *paired*: each draw resamples the test queries once, with replacement, and every
router is scored on that same resample, so what the routers share (hard queries, a dear task) cancels
in their difference. A router's outcome per (λ, query) — the score of the answer it returned and the
cost it paid — is all that is needed: the curve of a resample is the mean over its queries at each λ,
scored by :func:`router.offline.metrics.aiq_within` on the report's own cost axis, as
:func:`router.offline.pool.score_aiq` scores the full curves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from router.offline.metrics import aiq_within

DRAWS = 1000
CONFIDENCE = 0.95
METHOD = (
    f"paired bootstrap over the test queries ({DRAWS} resamples, every router scored on the same "
    f"resample), {CONFIDENCE:.0%} percentile interval"
)


@dataclass(frozen=True)
class PerQuery:
    """One router's outcome per (λ, test query): the score of the answer it returned and the cost paid."""

    score: np.ndarray  # [λ, n]
    cost: np.ndarray  # [λ, n]

    def __post_init__(self) -> None:
        if self.score.shape != self.cost.shape or self.score.ndim != 2:
            raise ValueError(
                f"score and cost must be [λ, n] alike, got {self.score.shape} and {self.cost.shape}"
            )

    @classmethod
    def from_choices(cls, choices: np.ndarray, labels: np.ndarray, costs: np.ndarray) -> PerQuery:
        """From a λ sweep's chosen worker per (λ, query) and the test labels and costs."""
        rows = np.arange(labels.shape[0])
        return cls(np.asarray(labels[rows, choices], float), np.asarray(costs[rows, choices], float))

    @property
    def queries(self) -> int:
        return self.score.shape[1]


def curve_aiq(score: np.ndarray, cost: np.ndarray, max_cost: float) -> float:
    """AIQ of the λ curve of mean ``score``/``cost`` per λ, points dearer than ``max_cost`` left out."""
    return aiq_within(np.c_[cost, score], max_cost)


def resampled_aiq(
    routers: Mapping[str, PerQuery], max_cost: float, *, draws: int = DRAWS, seed: int = 0
) -> dict[str, np.ndarray]:
    """Each router's AIQ on ``draws`` resamples of the test queries, the same resamples for all."""
    if not routers:
        return {}
    sizes = {r.queries for r in routers.values()}
    if len(sizes) != 1:
        raise ValueError(f"the routers were scored on different query sets: {sorted(sizes)}")
    n = sizes.pop()
    rng = np.random.default_rng(seed)
    out = {name: np.empty(draws) for name in routers}
    for d in range(draws):
        picked = rng.integers(0, n, n)
        for name, r in routers.items():
            score = np.nanmean(r.score[:, picked], axis=1)
            out[name][d] = curve_aiq(score, r.cost[:, picked].mean(axis=1), max_cost)
    return out


def interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> list[float]:
    """The percentile interval of bootstrap ``samples`` (NaNs — an undefined ratio — left out)."""
    finite = np.asarray(samples, float)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return [float("nan"), float("nan")]
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(finite, [tail, 100 - tail])
    return [round(float(low), 4), round(float(high), 4)]


def differences(
    samples: Mapping[str, np.ndarray], pairs: list[tuple[str, str]], point: Callable[[str], float]
) -> dict[str, dict]:
    """``"a - b"`` → the difference of the reported AIQs (``point``), its interval and the share of
    resamples in which a is ahead."""
    return {
        f"{a} - {b}": {
            "difference": round(point(a) - point(b), 4),
            "interval": interval(samples[a] - samples[b]),
            "share_ahead": round(float(np.mean(samples[a] > samples[b])), 3),
        }
        for a, b in pairs
    }
