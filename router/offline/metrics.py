"""The numbers a routing curve is summarised by: RouteLLM's APGR/CPT for 2 workers, RouterBench's AIQ for N.

**Two workers (weak/strong).** A router is one number per query, `strong_score` (higher = send to the
strong model sooner). Sweeping a threshold over it gives quality against the share of queries sent to the
strong model (:func:`routing_curve`); RouteLLM's metrics summarise that curve:

- PGR (performance gap recovered) at a point: (acc - acc_weak) / (acc_strong - acc_weak);
- APGR: area under PGR over strong share in [0, 1] (trapezoid) — random routing scores 0.5;
- CPT(x%): the smallest strong share whose PGR reaches x% (how many expensive calls buy x% of the gain).

Labels may be 0/1 correctness (MMLU, GSM8K) or soft scores in [0, 1] (MT-Bench judge scores); "accuracy"
is simply the mean label of the model each query was routed to. A cascade fits the same frame: its
"strong" choice is an escalation that pays for both answers.

**N workers.** A router with a cost weight λ picks, per query, the worker maximizing predicted quality −
λ·cost; each λ gives one (mean cost, accuracy) point and sweeping λ traces a curve (:func:`route`,
:func:`score_choices`). RouterBench's summary is AIQ, the Average Improvement in Quality: the area under
the curve's non-decreasing convex hull (mixing two operating points at random reaches any point between
them, and paying more for less is never forced), extended flat to the largest cost among the routers
compared, divided by that cost. As in RouterBench's code, the area starts at the router's cheapest point:
a router gets no credit for costs it cannot go down to.

Everything is plain numpy and seeded, so two runs give the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from router.decide import choose_many

TIE_BREAK_SEED = 0
# λ = 0 (best predicted quality whatever the price) then log-spaced up to where the cheapest worker
# wins everything: normalized costs of cheap workers are ~1% of the most expensive one's.
DEFAULT_LAMBDAS: tuple[float, ...] = (0.0, *np.round(np.logspace(-3, 2, 41), 6).tolist())


# ------------------------------------------------------------------------------- two workers: APGR, CPT


@dataclass
class CurvePoint:
    strong_share: float  # fraction of queries routed to the strong model
    accuracy: float  # mean label of the chosen model
    cost_usd: float  # mean cost per query of the chosen model


def _vector(name: str, value: Any, n: int) -> np.ndarray:
    """A float array of length n from an array or a scalar; NaN is refused (it would bias every metric)."""
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{name} has shape {arr.shape}, expected ({n},)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN/inf; drop unlabelled rows before evaluating")
    return arr


def _outcomes(n: int, y_weak: Any, y_strong: Any, cost_weak: Any, cost_strong: Any) -> tuple[np.ndarray, ...]:
    """(y_weak, y_strong, cost_weak, cost_strong) as checked float vectors of length n."""
    return (
        _vector("y_weak", y_weak, n),
        _vector("y_strong", y_strong, n),
        _vector("cost_weak", cost_weak, n),
        _vector("cost_strong", cost_strong, n),
    )


def _routing_order(strong_score: np.ndarray) -> np.ndarray:
    """Query indices from most to least preferred for the strong model.

    Ties are broken by a fixed-seed permutation rather than by row order: the data is sorted by subject,
    so row order would turn a constant-score router into "upgrade the first subjects" instead of random.
    """
    tie_break = np.random.default_rng(TIE_BREAK_SEED).permutation(len(strong_score))
    return np.lexsort((tie_break, -strong_score))


def routing_curve(
    strong_score: np.ndarray,
    y_weak: np.ndarray,
    y_strong: np.ndarray,
    cost_weak: np.ndarray | float,
    cost_strong: np.ndarray | float,
    points: int = 101,
) -> list[CurvePoint]:
    """Quality and cost when the top-s fraction by score goes to the strong model, s in linspace(0, 1, points).

    The share actually used is round(s * n) / n, so the curve always starts at 0 and ends at 1.
    """
    score = np.asarray(strong_score, dtype=float)
    n = score.shape[0] if score.ndim == 1 else 0
    if n == 0:
        raise ValueError("strong_score must be a non-empty 1-D array")
    score = _vector("strong_score", score, n)
    yw, ys, cw, cs = _outcomes(n, y_weak, y_strong, cost_weak, cost_strong)
    if points < 2:
        raise ValueError("points must be >= 2")

    order = _routing_order(score)
    gain = np.concatenate([[0.0], np.cumsum((ys - yw)[order])])
    extra = np.concatenate([[0.0], np.cumsum((cs - cw)[order])])
    counts = np.floor(np.linspace(0.0, 1.0, points) * n + 0.5).astype(int)
    base_acc, base_cost = yw.sum(), cw.sum()
    return [
        CurvePoint(
            strong_share=k / n,
            accuracy=float((base_acc + gain[k]) / n),
            cost_usd=float((base_cost + extra[k]) / n),
        )
        for k in counts
    ]


def pgr(accuracy: float, acc_weak: float, acc_strong: float) -> float:
    """Performance gap recovered; 0.0 when the two models are equally good.

    With no gap there is nothing to recover, and returning 0 (rather than NaN or inf) keeps APGR and CPT
    well defined: such a split simply reports APGR 0 and no CPT.
    """
    gap = acc_strong - acc_weak
    if abs(gap) < 1e-12:
        return 0.0
    return float((accuracy - acc_weak) / gap)


def _share_pgr(
    curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float
) -> tuple[np.ndarray, np.ndarray]:
    """(strong shares, PGRs) of a curve."""
    x = np.array([p.strong_share for p in curve], dtype=float)
    y = np.array([pgr(p.accuracy, acc_weak, acc_strong) for p in curve], dtype=float)
    return x, y


def apgr(curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float) -> float:
    """Average PGR: trapezoid area under PGR vs strong share, as RouteLLM's APGR (the curve spans [0, 1])."""
    x, y = _share_pgr(curve, acc_weak, acc_strong)
    return float(np.trapezoid(y, x))


def cpt(curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float, target: float) -> float | None:
    """Smallest strong share with PGR >= target, interpolating linearly between curve points; None if never.

    RouteLLM interpolates the share from the accuracy with np.interp, which assumes a monotone curve; taking
    the first crossing gives the same value on monotone curves and stays honest on noisy ones.
    """
    x, y = _share_pgr(curve, acc_weak, acc_strong)
    hits = np.flatnonzero(y >= target - 1e-12)
    if hits.size == 0:
        return None
    i = int(hits[0])
    if i == 0 or y[i] == y[i - 1]:
        return float(x[i])
    return float(x[i - 1] + (target - y[i - 1]) / (y[i] - y[i - 1]) * (x[i] - x[i - 1]))


def _interp(curve: Sequence[CurvePoint], share: float, attr: str) -> float:
    x = np.array([p.strong_share for p in curve])
    return float(np.interp(share, x, np.array([getattr(p, attr) for p in curve])))


def _summary(name: str, curve: list[CurvePoint], yw: np.ndarray, ys: np.ndarray, cs: np.ndarray) -> dict:
    acc_w, acc_s = float(yw.mean()), float(ys.mean())
    c50, c80 = (cpt(curve, acc_w, acc_s, t) for t in (0.5, 0.8))
    strong_cost = float(cs.mean())

    def cost_at(share: float | None) -> float | None:
        return None if share is None else _interp(curve, share, "cost_usd")

    cost80 = cost_at(c80)
    return {
        "name": name,
        "apgr": apgr(curve, acc_w, acc_s),
        "cpt50": c50,
        "cpt80": c80,
        "acc_weak": acc_w,
        "acc_strong": acc_s,
        "accuracy_at": {s: _interp(curve, s, "accuracy") for s in (0.2, 0.5, 0.8)},
        "cost_at_cpt50": cost_at(c50),
        "cost_at_cpt80": cost80,
        # Share of the always-strong bill saved while still recovering 80% of the quality gap.
        "saving_vs_strong_at_cpt80": None
        if cost80 is None or strong_cost <= 0
        else 1.0 - cost80 / strong_cost,
        "curve": [asdict(p) for p in curve],
    }


def evaluate_router(
    name: str,
    strong_score: np.ndarray,
    y_weak: np.ndarray,
    y_strong: np.ndarray,
    cost_weak: np.ndarray | float,
    cost_strong: np.ndarray | float,
    points: int = 101,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict:
    """APGR, CPT(50%), CPT(80%), accuracy at 20/50/80% strong calls, costs and the full curve of one router.

    With `bootstrap` > 0, also a 95% percentile interval of APGR over test rows resampled with replacement
    (`apgr_ci95`): on small test sets such as MT-Bench (80 questions) APGR moves by several points between
    resamples, and the README should say so.
    """
    curve = routing_curve(strong_score, y_weak, y_strong, cost_weak, cost_strong, points)
    n = np.asarray(strong_score).shape[0]
    score = _vector("strong_score", strong_score, n)
    yw, ys, cw, cs = _outcomes(n, y_weak, y_strong, cost_weak, cost_strong)
    result = _summary(name, curve, yw, ys, cs)
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(bootstrap):
            i = rng.integers(0, n, n)
            c = routing_curve(score[i], yw[i], ys[i], cw[i], cs[i], points)
            draws.append(apgr(c, float(yw[i].mean()), float(ys[i].mean())))
        result["apgr_ci95"] = [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]
    return result


def baselines(
    y_weak: np.ndarray,
    y_strong: np.ndarray,
    cost_weak: np.ndarray | float,
    cost_strong: np.ndarray | float,
    random_state: int = 0,
    random_repeats: int = 20,
    points: int = 101,
) -> dict[str, dict]:
    """RouteLLM's reference points: random routing, always weak, always strong, and the oracle.

    - random: uniform random scores, curves averaged over `random_repeats` seeds (APGR ~ 0.5);
    - always_weak / always_strong: single points (strong share 0 / 1);
    - oracle: knows the labels and upgrades queries by y_strong - y_weak, i.e. first exactly those the weak
      model gets wrong and the strong one right. It is the best any ranking can do at every share; it
      reaches its maximum accuracy at `min_strong_share_at_max_accuracy`, and (being a ranking) ends at the
      strong model's accuracy at share 1.
    """
    yw = np.asarray(y_weak, dtype=float)
    n = yw.shape[0] if yw.ndim == 1 else 0
    if n == 0:
        raise ValueError("y_weak must be a non-empty 1-D array")
    yw, ys, cw, cs = _outcomes(n, yw, y_strong, cost_weak, cost_strong)
    acc_w, acc_s = float(yw.mean()), float(ys.mean())

    rng = np.random.default_rng(random_state)
    curves = [routing_curve(rng.random(n), yw, ys, cw, cs, points) for _ in range(max(1, random_repeats))]
    mean_curve = [
        CurvePoint(
            strong_share=pts[0].strong_share,
            accuracy=float(np.mean([p.accuracy for p in pts])),
            cost_usd=float(np.mean([p.cost_usd for p in pts])),
        )
        for pts in zip(*curves, strict=True)
    ]
    random = _summary("random", mean_curve, yw, ys, cs)
    per_repeat = [apgr(c, acc_w, acc_s) for c in curves]
    random.update(repeats=len(curves), apgr_std=float(np.std(per_repeat)))

    gain = ys - yw
    oracle = _summary("oracle", routing_curve(gain, yw, ys, cw, cs, points), yw, ys, cs)
    oracle.update(
        max_accuracy=float(np.maximum(yw, ys).mean()),
        min_strong_share_at_max_accuracy=float((gain > 0).mean()),
    )
    return {
        "random": random,
        "always_weak": {
            "name": "always_weak",
            "strong_share": 0.0,
            "accuracy": acc_w,
            "cost_usd": float(cw.mean()),
            "pgr": 0.0,
        },
        "always_strong": {
            "name": "always_strong",
            "strong_share": 1.0,
            "accuracy": acc_s,
            "cost_usd": float(cs.mean()),
            "pgr": pgr(acc_s, acc_w, acc_s),
        },
        "oracle": oracle,
    }


# ------------------------------------------------------------------------------------- N workers: AIQ


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


def summed_frontier(cells: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The (cost, accuracy) frontier of choosing one option per cell, each cell's options given as
    (accuracy, cost) arrays of their contributions to the whole's means.

    The frontier of a sum of independent choices is the sum of the cells' concave hulls: start at
    every cell's cheapest corner and take the cells' hull segments steepest first (any point between
    two corners is a mix of two options). Exact, where a λ sweep only finds the corners it hits.
    """
    if not cells:
        raise ValueError("no cells")
    hulls = [upper_hull(np.column_stack([cost, accuracy])) for accuracy, cost in cells]
    start = np.sum([hull[0] for hull in hulls], axis=0)
    steps = sorted((step for hull in hulls for step in np.diff(hull, axis=0)), key=lambda d: -d[1] / d[0])
    return np.vstack([start, start + np.cumsum(steps, axis=0)]) if steps else start[None, :]


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


def aiq_within(points: np.ndarray, max_cost: float) -> float:
    """:func:`aiq` on the axis ending at ``max_cost``, points dearer than it left out (a cascade can
    pay for several answers and spend more than any single worker; it is credited nothing for it);
    0 when no point is within."""
    points = np.asarray(points, dtype=float).reshape(-1, 2)
    within = points[points[:, 0] <= max_cost * (1 + 1e-9)]
    return aiq(within, max_cost) if len(within) else 0.0


def route(quality: np.ndarray, cost: np.ndarray, lambdas: Sequence[float]) -> np.ndarray:
    """Chosen worker per (λ, query): ``[len(lambdas), n]`` indices, by :func:`router.decide.choose_many`."""
    return np.stack([choose_many(quality, cost, float(lam)) for lam in lambdas])


def score_choices(
    choices: np.ndarray, labels: np.ndarray, costs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mean true label and mean true cost of the chosen workers, per row of ``choices``."""
    rows = np.arange(labels.shape[0])
    return labels[rows, choices].mean(axis=-1), costs[rows, choices].mean(axis=-1)


def lambda_curve(accuracy: np.ndarray, cost: np.ndarray, lambdas: Sequence[float]) -> list[dict]:
    """The JSON curve of a λ sweep: one {lambda, accuracy, cost_usd} point per λ."""
    return [
        {"lambda": float(lam), "accuracy": float(a), "cost_usd": float(c)}
        for lam, a, c in zip(lambdas, accuracy, cost, strict=True)
    ]


def cost_accuracy(curve: list[dict]) -> np.ndarray:
    """``[n, 2]`` (cost, accuracy) points of a JSON curve, for :func:`aiq` and the goal metrics."""
    return np.array([[p["cost_usd"], p["accuracy"]] for p in curve], dtype=float)


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
