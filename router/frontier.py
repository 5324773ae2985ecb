"""Quality–cost curves of an N-worker router and RouterBench's AIQ, in plain numpy.

A router with a cost weight λ picks, per query, the worker maximizing predicted quality − λ·cost; each λ
gives one (mean cost, accuracy) point on the test set and sweeping λ traces a curve. RouterBench's
summary of such a curve is AIQ, the Average Improvement in Quality: the area under the curve's
non-decreasing convex hull (mixing two operating points at random reaches any point between them, and
paying more for less is never forced), extended flat to the largest cost among the routers compared,
divided by that cost. As in RouterBench's code, the area starts at the router's cheapest point: a router
gets no credit for costs it cannot go down to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.decide import choose_many

# λ = 0 (best predicted quality whatever the price) then log-spaced up to where the cheapest worker
# wins everything: normalized costs of cheap workers are ~1% of the most expensive one's.
DEFAULT_LAMBDAS: tuple[float, ...] = (0.0, *np.round(np.logspace(-3, 2, 41), 6).tolist())


def upper_hull(points: np.ndarray) -> np.ndarray:
    """The non-decreasing concave upper hull of (cost, quality) points, sorted by cost.

    Starts at the cheapest point (the best quality among equally cheap ones) and stops at the best
    quality: everything to the right of it is dominated and replaced by the flat extension in :func:`aiq`.
    """
    pts = np.asarray(points, dtype=float).reshape(-1, 2)
    if pts.size == 0:
        raise ValueError("no points")
    if not np.all(np.isfinite(pts)):
        raise ValueError("points must be finite")
    order = np.lexsort((-pts[:, 1], pts[:, 0]))  # by cost, best quality first among equal costs
    pts = pts[order]
    top = int(np.argmax(pts[:, 1]))  # first (cheapest) point reaching the best quality
    hull: list[np.ndarray] = []
    for p in pts[: top + 1]:
        if hull and p[0] == hull[-1][0]:
            continue  # same cost, no better quality (sorted)
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # drop the middle point when it lies on or below the chord from hull[-2] to p
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return np.array(hull)


def aiq(points: np.ndarray, max_cost: float) -> float:
    """Area under the hull of ``points``, extended flat to ``max_cost``, divided by ``max_cost``."""
    if max_cost <= 0:
        raise ValueError("max_cost must be > 0")
    hull = upper_hull(points)
    most = float(np.asarray(points, dtype=float).reshape(-1, 2)[:, 0].max())
    if most > max_cost * (1 + 1e-9):
        raise ValueError(f"a point costs {most} > max_cost {max_cost}")
    xs = np.append(hull[:, 0], max_cost)
    ys = np.append(hull[:, 1], hull[-1, 1])
    return float(np.trapezoid(ys, xs) / max_cost)


def route(quality: np.ndarray, cost: np.ndarray, lambdas: Sequence[float]) -> np.ndarray:
    """Chosen worker per (λ, query): ``[len(lambdas), n]`` indices, by :func:`router.decide.choose_many`."""
    return np.stack([choose_many(quality, cost, float(lam)) for lam in lambdas])


def score_choices(
    choices: np.ndarray, labels: np.ndarray, costs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mean true label and mean true cost of the chosen workers, per row of ``choices``."""
    rows = np.arange(labels.shape[0])
    return labels[rows, choices].mean(axis=-1), costs[rows, choices].mean(axis=-1)


def best_accuracy_within(points: np.ndarray, budget: float) -> float | None:
    """The best accuracy among operating points costing at most ``budget`` (no mixing); None if none."""
    pts = np.asarray(points, dtype=float)
    ok = pts[:, 0] <= budget * (1 + 1e-9)
    return float(pts[ok, 1].max()) if ok.any() else None


def cheapest_reaching(points: np.ndarray, accuracy: float) -> float | None:
    """The lowest cost among operating points with at least ``accuracy``; None if no point reaches it."""
    pts = np.asarray(points, dtype=float)
    ok = pts[:, 1] >= accuracy - 1e-12
    return float(pts[ok, 0].min()) if ok.any() else None
