"""The pictures of a result: accuracy against strong-model share (2 workers), and against cost (N workers,
and the cascade, which pays for more than one answer).

Uses matplotlib's object API on an Agg canvas: no pyplot global state, no display, safe in threads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _save(fig: Any, path: str | Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=120)


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


# ------------------------------------------------------------------------- two workers: strong share


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


def plot_curves(results: dict[str, dict], path: str | Path, title: str) -> None:
    """Accuracy vs strong share for each result with a curve, plus weak/strong horizontal lines."""
    fig = _figure(7, 4.5)
    _draw(fig.add_subplot(), results, title)
    _save(fig, path)


def plot_splits(splits: Mapping[str, Mapping[str, Any]], path: str | Path, title: str) -> None:
    """One subplot per split of a `run_routellm_eval` result: our router and the baselines."""
    cols = min(2, max(1, len(splits)))
    rows = math.ceil(len(splits) / cols)
    fig = _figure(6.5 * cols, 4.3 * rows)
    fig.suptitle(title)
    for i, (name, split) in enumerate(splits.items(), start=1):
        results = {"ours": split, **split["baselines"]}
        label = f"{name} (n_test={split['n_test']}{', test only' if split.get('test_only') else ''})"
        _draw(fig.add_subplot(rows, cols, i), results, label)
    _save(fig, path)


# ------------------------------------------------------------------------------------- against cost


def plot_frontier(report: dict, path: str | Path) -> None:
    """The quality–cost plot of a `router eval --format ...` result: curves for the swept routers, points
    for single models and λ-free baselines, cost on a log axis (prices span two orders of magnitude)."""
    from matplotlib.ticker import NullFormatter

    fig = _figure(8, 5)
    ax = fig.add_subplot()
    for name, style in (("ours", "-"), ("single", "-."), ("knn", "--"), ("oracle", ":")):
        r = report["routers"].get(name)
        if r is None:
            continue
        pts = sorted((p["cost_usd"], p["accuracy"]) for p in r["curve"])
        ax.plot(
            [1000 * c for c, _ in pts],
            [a for _, a in pts],
            style,
            marker="." if name != "oracle" else None,
            label=f"{name} (AIQ {r['aiq']:.3f})",
        )
    for worker, s in report["singles"].items():
        ax.scatter(1000 * s["cost_usd"], s["accuracy"], s=18, color="grey", zorder=3)
        ax.annotate(worker.rsplit("/", 1)[-1], (1000 * s["cost_usd"], s["accuracy"]), fontsize=6, alpha=0.8)
    for name, marker in (("random", "x"), ("best_single", "*"), ("agreement_rule", "D")):
        r = report["routers"].get(name)
        if r is None:
            continue
        ax.scatter(
            1000 * r["cost_usd"],
            r["accuracy"],
            marker=marker,
            s=70,
            zorder=4,
            label=f"{name} (AIQ {r['aiq']:.3f})",
        )
    op = report["routers"]["ours"]["operating_point"]
    ax.scatter(
        1000 * op["test_cost_usd"],
        op["test_accuracy"],
        marker="o",
        facecolors="none",
        edgecolors="black",
        s=90,
        zorder=5,
        label=f"ours, λ={op['lambda']:g} chosen on validation",
    )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor tick labels overlap on a short log range
    ax.set_xlabel("mean cost per query (USD per 1,000 queries, log scale)")
    ax.set_ylabel("accuracy / mean score")
    ax.set_title(
        f"{report['format']}: {report['n_test']} held-out queries, {len(report['workers'])} workers",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)


def plot_cost_curves(report: dict[str, Any], path: str | Path) -> None:
    """Accuracy vs mean cost per query (log scale): the cascade pays for the cheap answer every time."""
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    styles = {"cascade": "-", "fast_router": "-", "cascade_oracle": ":", "oracle": ":", "random": "--"}
    for name, style in styles.items():
        res = report["results"][name]
        ax.plot(
            [p["cost_usd"] * 1000 for p in res["curve"]],
            [p["accuracy"] for p in res["curve"]],
            linestyle=style,
            label=f"{name} (APGR {res['apgr']:.3f})",
        )
    for name, marker in (("always_weak", "o"), ("always_strong", "s")):
        res = report["results"][name]
        ax.plot([res["cost_usd"] * 1000], [res["accuracy"]], marker=marker, linestyle="", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("mean cost per query (USD per 1,000 queries)")
    ax.set_ylabel("accuracy")
    ax.set_title(
        f"GSM8K: cascade Mixtral→GPT-4 vs fast routing ({report['queries']} queries, {report['folds']}-fold)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)
