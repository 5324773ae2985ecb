"""Offline evaluation of a weak/strong router with RouteLLM's metrics, baselines and held-out splits.

A router is represented by one number per test query, `strong_score` (higher = send to the strong model
sooner). Sweeping a threshold over it gives a curve of quality against the share of queries sent to the
strong model; the RouteLLM metrics summarize that curve:

- PGR (performance gap recovered) at a point: (acc - acc_weak) / (acc_strong - acc_weak);
- APGR: area under PGR over strong share in [0, 1] (trapezoid) — random routing scores 0.5;
- CPT(x%): the smallest strong share whose PGR reaches x% (how many expensive calls buy x% of the gain).

Labels may be 0/1 correctness (MMLU, GSM8K) or soft scores in [0, 1] (MT-Bench judge scores); "accuracy"
is simply the mean label of the model each query was routed to. Everything is plain numpy and seeded, so
two runs give the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from router.datasets import DEFAULT_ROOT, RoutingDataset, load_routellm

# Published list prices per 1M tokens (input, output) at the time of the data (see SOURCE.md).
PRICES_PER_M: dict[str, tuple[float, float]] = {
    "mixtral-8x7b": (0.24, 0.24),
    "gpt-4-1106-preview": (10.0, 30.0),
}
# Output tokens per turn when no recorded response is available: MMLU answers are a letter plus a few
# words, GSM8K answers are worked solutions, MT-Bench answers are essays/code.
DEFAULT_OUTPUT_TOKENS: dict[str, float] = {"mmlu": 5.0, "gsm8k": 200.0, "mt_bench": 400.0}
FALLBACK_OUTPUT_TOKENS = 200.0  # for a benchmark not listed above
CHARS_PER_TOKEN = 4.0
TIE_BREAK_SEED = 0
STRONG_SCORE_DOC = (
    "strong_score = P_strong - P_weak: the router's expected quality gain from paying for the strong "
    "model on this query, so the queries where the strong model helps most are upgraded first"
)

FitPredict = Callable[[RoutingDataset, RoutingDataset], np.ndarray]  # (train, test) -> P(success) [n_test, k]


# ----------------------------------------------------------------------------------------------- metrics


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
    yw, ys = _vector("y_weak", y_weak, n), _vector("y_strong", y_strong, n)
    cw, cs = _vector("cost_weak", cost_weak, n), _vector("cost_strong", cost_strong, n)
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


def _xy(curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([p.strong_share for p in curve], dtype=float)
    y = np.array([pgr(p.accuracy, acc_weak, acc_strong) for p in curve], dtype=float)
    return x, y


def apgr(curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float) -> float:
    """Average PGR: trapezoid area under PGR vs strong share, as RouteLLM's APGR (the curve spans [0, 1])."""
    x, y = _xy(curve, acc_weak, acc_strong)
    return float(np.trapezoid(y, x))


def cpt(curve: Sequence[CurvePoint], acc_weak: float, acc_strong: float, target: float) -> float | None:
    """Smallest strong share with PGR >= target, interpolating linearly between curve points; None if never.

    RouteLLM interpolates the share from the accuracy with np.interp, which assumes a monotone curve; taking
    the first crossing gives the same value on monotone curves and stays honest on noisy ones.
    """
    x, y = _xy(curve, acc_weak, acc_strong)
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
    yw, ys = _vector("y_weak", y_weak, n), _vector("y_strong", y_strong, n)
    cw, cs = _vector("cost_weak", cost_weak, n), _vector("cost_strong", cost_strong, n)
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
    yw, ys = _vector("y_weak", yw, n), _vector("y_strong", y_strong, n)
    cw, cs = _vector("cost_weak", cost_weak, n), _vector("cost_strong", cost_strong, n)
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


# ------------------------------------------------------------------------------------------------- costs


def estimate_costs(
    texts: Sequence[str],
    price_in_per_m: float,
    price_out_per_m: float,
    output_tokens: np.ndarray | float,
    turns: np.ndarray | int = 1,
) -> np.ndarray:
    """Estimated USD per query: prompt tokens ~ chars / 4, `output_tokens` per turn (scalar or per query).

    For a T-turn conversation of which only the first prompt is known, every later turn resends the history,
    approximated as T prompts plus T - 1 earlier answers of input, and T answers of output.
    """
    n = len(texts)
    prompt = np.array([len(t) for t in texts], dtype=float) / CHARS_PER_TOKEN
    out = np.broadcast_to(np.asarray(output_tokens, dtype=float), (n,))
    t = np.broadcast_to(np.asarray(turns, dtype=float), (n,))
    tokens_in = t * prompt + (t - 1.0) * out
    tokens_out = t * out
    return (tokens_in * price_in_per_m + tokens_out * price_out_per_m) / 1e6


def dataset_costs(
    ds: RoutingDataset,
    worker: str,
    prices: Mapping[str, tuple[float, float]] = PRICES_PER_M,
    default_output_tokens: Mapping[str, float] = DEFAULT_OUTPUT_TOKENS,
) -> np.ndarray:
    """Per-query cost of `worker` on `ds`: the recorded response length / 4 where the data has it (GSM8K),
    else the per-benchmark default output length."""
    if worker not in prices:
        raise KeyError(f"no price for worker {worker!r}; known: {sorted(prices)}")
    j = ds.worker_index(worker)
    assert ds.response_chars is not None
    recorded = ds.response_chars[:, j] / CHARS_PER_TOKEN
    default = np.array([default_output_tokens.get(p, FALLBACK_OUTPUT_TOKENS) for p in ds.parts], dtype=float)
    output = np.where(np.isfinite(recorded), recorded, default)
    price_in, price_out = prices[worker]
    return estimate_costs(ds.texts, price_in, price_out, output, np.asarray(ds.turns, dtype=float))


# ------------------------------------------------------------------------------------------------ splits


def _drop_text_overlap(ds: RoutingDataset, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Train rows whose prompt also appears in test removed: MMLU repeats some questions across subjects."""
    test_texts = {ds.texts[i] for i in test}
    return np.array([i for i in train if ds.texts[i] not in test_texts], dtype=int)


def split_random(
    ds: RoutingDataset, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random (train, test) row indices, sorted; identical prompts always land on the same side.

    Splitting unique prompts rather than rows keeps duplicated MMLU questions from leaking into test, so the
    test share is `test_fraction` of unique prompts (of rows, up to the few duplicates).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError("test_fraction must be in (0, 1)")
    unique = list(dict.fromkeys(ds.texts))
    order = np.random.default_rng(seed).permutation(len(unique))
    n_test = max(1, int(round(test_fraction * len(unique))))
    test_texts = {unique[i] for i in order[:n_test]}
    is_test = np.array([t in test_texts for t in ds.texts], dtype=bool)
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def split_by_group(
    ds: RoutingDataset,
    test_groups: Sequence[str] | None = None,
    test_fraction: float = 0.25,
    seed: int = 0,
    prefix: str = "mmlu/",
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(train, test, test groups) over the rows whose group starts with `prefix`: whole groups are held out.

    This measures whether the router generalizes to unseen subjects instead of memorizing per-subject
    priors. Without `test_groups`, round(test_fraction * groups) groups are drawn with `seed`. Train rows
    whose prompt also occurs in a test group are dropped.
    """
    in_scope = [g.startswith(prefix) for g in ds.groups]
    groups = sorted({g for g, keep in zip(ds.groups, in_scope, strict=True) if keep})
    if len(groups) < 2:
        raise ValueError(f"need at least two groups starting with {prefix!r}, found {groups}")
    if test_groups is None:
        n_test = min(len(groups) - 1, max(1, int(round(test_fraction * len(groups)))))
        pick = np.random.default_rng(seed).permutation(len(groups))[:n_test]
        chosen = sorted(groups[i] for i in pick)
    else:
        chosen = sorted(set(test_groups))
        unknown = [g for g in chosen if g not in groups]
        if unknown or not chosen or len(chosen) == len(groups):
            raise ValueError(f"test_groups must be a proper, non-empty subset of {groups}; bad: {unknown}")
    held = set(chosen)
    test = np.array([i for i, g in enumerate(ds.groups) if in_scope[i] and g in held], dtype=int)
    train = np.array([i for i, g in enumerate(ds.groups) if in_scope[i] and g not in held], dtype=int)
    return _drop_text_overlap(ds, train, test), test, chosen


def split_train_test_parts(
    ds: RoutingDataset,
    train_prefix: str | tuple[str, ...] = "mmlu/",
    test_prefix: str | tuple[str, ...] = "gsm8k",
) -> tuple[np.ndarray, np.ndarray]:
    """Train on one benchmark, test on another (distribution shift), by group prefix; overlap removed."""
    train = np.array([i for i, g in enumerate(ds.groups) if g.startswith(train_prefix)], dtype=int)
    test = np.array([i for i, g in enumerate(ds.groups) if g.startswith(test_prefix)], dtype=int)
    if train.size == 0 or test.size == 0:
        raise ValueError(
            f"empty split: {train.size} rows match {train_prefix!r}, {test.size} match {test_prefix!r}"
        )
    test = np.setdiff1d(test, train)
    return _drop_text_overlap(ds, train, test), test


# --------------------------------------------------------------------------------------------- reference


def group_mean_fit_predict(train: RoutingDataset, test: RoutingDataset) -> np.ndarray:
    """A text-free reference router: each worker's mean train label in the query's group, else its benchmark,
    else overall. Any learned router should beat it on held-out subjects, where it only knows the benchmark."""
    k = len(train.workers)
    overall = np.nan_to_num(np.nanmean(train.labels, axis=0) if len(train) else np.zeros(k), nan=0.5)

    def means(keys: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for key in set(keys):
            rows = train.labels[[i for i, g in enumerate(keys) if g == key]]
            with np.errstate(all="ignore"):
                m = np.nanmean(rows, axis=0) if np.isfinite(rows).any() else np.full(k, np.nan)
            out[key] = np.where(np.isfinite(m), m, overall)
        return out

    by_group, by_part = means(train.groups), means(train.parts)
    return np.array(
        [by_group.get(g, by_part.get(p, overall)) for g, p in zip(test.groups, test.parts, strict=True)],
        dtype=float,
    ).reshape(len(test), k)


# ------------------------------------------------------------------------------------------------- plots


def _draw(ax: Any, results: Mapping[str, Mapping[str, Any]], title: str) -> None:
    acc_w = acc_s = None
    for name, res in results.items():
        if "curve" in res:
            x = [100 * p["strong_share"] for p in res["curve"]]
            y = [p["accuracy"] for p in res["curve"]]
            style = {"oracle": ":", "random": "--"}.get(name, "-")
            label = f"{name} (APGR {res['apgr']:.3f})"
            ax.plot(x, y, linestyle=style, linewidth=1.6 if style == "-" else 1.1, label=label)
            acc_w = res.get("acc_weak", acc_w)
            acc_s = res.get("acc_strong", acc_s)
    if "always_weak" in results:
        acc_w = results["always_weak"]["accuracy"]
    if "always_strong" in results:
        acc_s = results["always_strong"]["accuracy"]
    if acc_w is not None:
        ax.axhline(acc_w, color="grey", linestyle="--", linewidth=0.9, label=f"weak only ({acc_w:.3f})")
    if acc_s is not None:
        ax.axhline(acc_s, color="red", linestyle="--", linewidth=0.9, label=f"strong only ({acc_s:.3f})")
    ax.set_xlabel("strong model calls (%)")
    ax.set_ylabel("accuracy / mean score")
    ax.set_xlim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _save(fig: Any, path: str | Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=120)


def plot_curves(results: dict[str, dict], path: str | Path, title: str) -> None:
    """Accuracy vs strong share for each result with a curve, plus weak/strong horizontal lines.

    Uses matplotlib's object API on an Agg canvas: no pyplot global state, no display, safe in threads.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    _draw(fig.add_subplot(), results, title)
    _save(fig, path)


def plot_splits(splits: Mapping[str, Mapping[str, Any]], path: str | Path, title: str) -> None:
    """One subplot per split of a `run_routellm_eval` result: our router and the baselines."""
    from matplotlib.figure import Figure

    cols = min(2, max(1, len(splits)))
    rows = math.ceil(len(splits) / cols)
    fig = Figure(figsize=(6.5 * cols, 4.3 * rows), layout="constrained")
    fig.suptitle(title)
    for i, (name, split) in enumerate(splits.items(), start=1):
        results = {"ours": split, **split["baselines"]}
        label = f"{name} (n_test={split['n_test']}{', test only' if split.get('test_only') else ''})"
        _draw(fig.add_subplot(rows, cols, i), results, label)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------- pipeline


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays unpacked, NaN/inf -> null (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _split_plan(ds: RoutingDataset, seed: int) -> list[tuple[str, str, bool, np.ndarray, np.ndarray, dict]]:
    """(name, description, test_only, train idx, test idx, extra) for the four RouteLLM splits."""
    core = np.flatnonzero([p in ("mmlu", "gsm8k") for p in ds.parts])
    tr, te = split_random(ds.subset(core), 0.2, seed)
    held_tr, held_te, held_groups = split_by_group(ds, None, 0.25, seed, "mmlu/")
    shift_tr, shift_te = split_train_test_parts(ds, "mmlu/", "gsm8k")
    mt_tr, mt_te = split_train_test_parts(ds, ("mmlu/", "gsm8k"), "mt_bench/")
    return [
        (
            "random",
            "random 80/20 over MMLU+GSM8K (identical prompts kept on one side)",
            False,
            core[tr],
            core[te],
            {},
        ),
        (
            "held_out_subjects",
            "25% of MMLU subjects held out whole; train on the other subjects",
            False,
            held_tr,
            held_te,
            {"test_groups": held_groups},
        ),
        (
            "mmlu_to_gsm8k",
            "train on all of MMLU, test on GSM8K (distribution shift)",
            False,
            shift_tr,
            shift_te,
            {},
        ),
        (
            "mt_bench",
            "TEST ONLY: train on MMLU+GSM8K, test on MT-Bench (soft labels = normalized judge scores, "
            "routed on the first turn)",
            True,
            mt_tr,
            mt_te,
            {},
        ),
    ]


def _blind(test: RoutingDataset) -> RoutingDataset:
    """The test set as fit_predict sees it: labels and recorded answers (whose length hints at correctness)
    replaced by NaN, so a router cannot peek at what it is scored on."""
    return dataclasses.replace(
        test,
        labels=np.full_like(test.labels, np.nan),
        response_chars=np.full_like(test.labels, np.nan),
        meta={**test.meta, "blinded": True},
    )


def _evaluate_split(
    fit_predict: FitPredict,
    train: RoutingDataset,
    test: RoutingDataset,
    weak: str,
    strong: str,
    seed: int,
    points: int,
    random_repeats: int,
    bootstrap: int,
) -> dict:
    w, s = test.worker_index(weak), test.worker_index(strong)
    started = time.perf_counter()
    pred = np.asarray(fit_predict(train, _blind(test)), dtype=float)
    fit_seconds = time.perf_counter() - started
    if pred.shape != (len(test), len(test.workers)):
        raise ValueError(
            f"fit_predict returned shape {pred.shape}, expected ({len(test)}, {len(test.workers)})"
        )

    labelled = np.isfinite(test.labels[:, w]) & np.isfinite(test.labels[:, s])
    scored = test.subset(labelled)
    score = pred[labelled, s] - pred[labelled, w]
    if not np.all(np.isfinite(score)):
        raise ValueError("fit_predict returned NaN/inf for a labelled test row")
    yw, ys = scored.labels[:, w], scored.labels[:, s]
    cw, cs = dataset_costs(scored, weak), dataset_costs(scored, strong)
    result = evaluate_router("ours", score, yw, ys, cw, cs, points, bootstrap=bootstrap, seed=seed)
    result.update(
        n_train=len(train),
        n_test=len(scored),
        n_test_unlabelled=int((~labelled).sum()),
        cost_weak_usd=float(cw.mean()),
        cost_strong_usd=float(cs.mean()),
        fit_predict_seconds=fit_seconds,
        baselines=baselines(yw, ys, cw, cs, random_state=seed, random_repeats=random_repeats, points=points),
    )
    return result


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.3f}"


def _print_table(splits: Mapping[str, Mapping[str, Any]], console: Any) -> None:
    from rich.table import Table

    table = Table(
        title="RouteLLM evaluation: Mixtral-8x7B (weak) vs GPT-4-1106-preview (strong)",
        caption="* test only: router trained on MMLU+GSM8K. CPT = strong-call share for 50/80% of the gap.",
    )
    table.add_column("split", no_wrap=True)
    for col in (
        "n_test",
        "APGR ours",
        "95% CI",
        "APGR random",
        "APGR oracle",
        "CPT50",
        "CPT80",
        "acc weak",
        "acc strong",
    ):
        table.add_column(col, justify="right")
    for name, r in splits.items():
        b = r["baselines"]
        ci = r.get("apgr_ci95")
        table.add_row(
            name + ("*" if r.get("test_only") else ""),
            str(r["n_test"]),
            _fmt(r["apgr"]),
            "-" if not ci else f"{ci[0]:.2f}-{ci[1]:.2f}",
            _fmt(b["random"]["apgr"]),
            _fmt(b["oracle"]["apgr"]),
            _fmt(r["cpt50"], pct=True),
            _fmt(r["cpt80"], pct=True),
            _fmt(r["acc_weak"]),
            _fmt(r["acc_strong"]),
        )
    console.print(table)


def run_routellm_eval(
    fit_predict: FitPredict,
    root: str | Path,
    out_json: Path,
    out_png: Path | None,
    weak: str = "mixtral-8x7b",
    strong: str = "gpt-4-1106-preview",
    seed: int = 0,
    progress: bool = True,
    *,
    points: int = 101,
    random_repeats: int = 20,
    bootstrap: int = 200,
    console: Any = None,
) -> dict:
    """Evaluate `fit_predict` on the four RouteLLM splits; write JSON (and a PNG), print a table, return the JSON.

    fit_predict(train, test) must return predicted P(success) per worker, shape [len(test), k] in the
    dataset's worker order. It sees train labels (NaN where missing); the test set it gets has its labels
    and recorded responses blanked to NaN. Test rows missing either model's label are then left out of
    the metrics (counted as `n_test_unlabelled`).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # A pipe or CI log is not a terminal: rich would squeeze the table into 80 columns.
    console = console or (Console() if sys.stdout.isatty() else Console(width=130))
    ds = load_routellm(root)
    for worker in (weak, strong):
        ds.worker_index(worker)
    plan = _split_plan(ds, seed)

    splits: dict[str, dict] = {}
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=not progress,
        transient=True,
    ) as bar:
        task = bar.add_task("splits", total=len(plan))
        for name, description, test_only, tr, te, extra in plan:
            bar.update(task, description=f"split {name}")
            result = _evaluate_split(
                fit_predict,
                ds.subset(tr),
                ds.subset(te),
                weak,
                strong,
                seed,
                points,
                random_repeats,
                bootstrap,
            )
            splits[name] = {"description": description, "test_only": test_only, **extra, **result}
            bar.advance(task)

    report = _jsonable(
        {
            "dataset": "routellm",
            "splits": splits,
            "meta": {
                "weak": weak,
                "strong": strong,
                "seed": seed,
                "points": points,
                "random_repeats": random_repeats,
                "bootstrap": bootstrap,
                "strong_score": STRONG_SCORE_DOC,
                "prices_per_m_tokens": PRICES_PER_M,
                "output_tokens_default": DEFAULT_OUTPUT_TOKENS,
                "cost_model": "prompt tokens = chars/4; output tokens = recorded response chars/4 (GSM8K) else "
                "the per-benchmark default per turn; MT-Bench counts 2 turns",
                "metrics": "APGR = trapezoid area of PGR over strong share [0,1]; CPT(x) = smallest strong "
                "share with PGR >= x (linear interpolation)",
                "data": ds.meta,
            },
        }
    )
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if out_png is not None:
        plot_splits(
            report["splits"], out_png, "Routing curves: Mixtral-8x7B (weak) vs GPT-4-1106-preview (strong)"
        )
    _print_table(report["splits"], console)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m router.evaluate`: the harness with the text-free group-mean reference router."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=DEFAULT_ROOT)
    parser.add_argument("--out-json", type=Path, required=True)
    parser.add_argument("--out-png", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run_routellm_eval(group_mean_fit_predict, args.root, args.out_json, args.out_png, seed=args.seed)


if __name__ == "__main__":
    main()
