"""The quality–cost plot of a `router eval --format ...` result: curves for the swept routers, points for
single models and λ-free baselines, cost on a log axis (prices span two orders of magnitude)."""

from __future__ import annotations

from pathlib import Path

from router.evaluate import _save


def plot_frontier(report: dict, path: str | Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for name, style in (("ours", "-"), ("knn", "--"), ("oracle", ":")):
        r = report["routers"][name]
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
    for name, marker in (("random", "x"), ("best_single", "*")):
        r = report["routers"][name]
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
