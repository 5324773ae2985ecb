"""Writing what the harness measured: the result JSON and the tables printed beside it.

One JSON writer for every evaluation (numpy unpacked, NaN/inf as null since JSON has neither), one
console rule (a pipe or CI log is not a terminal: rich would squeeze a table into 80 columns), and one
table per kind of result: the RouteLLM splits, the N-worker comparison, the GSM8K cascade.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays unpacked, NaN/inf -> null (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(report: dict, path: str | Path) -> None:
    """``report`` (already :func:`jsonable`) as indented JSON; parent folders are created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.writing")  # a Ctrl-C or a full disk leaves no half JSON
    staging.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    staging.replace(out)


def console_for(stderr: bool = False) -> Any:
    """A rich console on stdout (or stderr): the terminal's width, or 130 columns when piped."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=130)


def stage_printer(console: Any, enabled: bool = True) -> Callable[[str], None]:
    """A ``say(stage)`` for long jobs: each stage on its own line, after the seconds since it was made."""
    started = time.perf_counter()

    def say(stage: str) -> None:
        if enabled:
            console.print(f"[dim]{time.perf_counter() - started:6.1f}s[/] {stage}")

    return say


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.3f}"


def print_routellm_table(splits: Mapping[str, Mapping[str, Any]], console: Any) -> None:
    """APGR with its interval, the baselines and CPT per RouteLLM split."""
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


def print_pool_summary(report: dict, console: Any) -> None:
    """Single models, baselines and ours as one table, then the goal metrics (N-worker file evaluation)."""
    from rich.table import Table

    table = Table(
        title=f"{report['format']}: {report['n_test']} test queries, {len(report['workers'])} workers"
    )
    for col in ("router", "accuracy", "cost $/1k queries", "AIQ", "AIQ 95% interval"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for name, s in sorted(report["singles"].items(), key=lambda kv: kv[1]["cost_usd"]):
        table.add_row(name, f"{s['accuracy']:.3f}", f"{1000 * s['cost_usd']:.4f}", f"{s['aiq']:.4f}", "")
    names = ("random", "cheapest", "best_single", "agreement_rule", "knn", "single", "oracle")
    for name in (*names, "planner", "myopic_planner", "plan_table", "ours"):
        r = report["routers"].get(name)
        if r is None:
            continue
        if r.get("lambda_independent"):
            acc, cost = f"{r['accuracy']:.3f}", f"{1000 * r['cost_usd']:.4f}"
        else:
            accs = [p["accuracy"] for p in r["curve"]]
            costs = [p["cost_usd"] for p in r["curve"]]
            acc, cost = f"{min(accs):.3f}–{max(accs):.3f}", f"{1000 * min(costs):.4f}–{1000 * max(costs):.4f}"
        label = f"{name} = {r['chosen']}" if r.get("chosen") else name
        band = r.get("aiq_interval")
        table.add_row(
            f"[bold]{label}[/]", acc, cost, f"{r['aiq']:.4f}", f"{band[0]:.4f}–{band[1]:.4f}" if band else ""
        )
    console.print(table)
    intervals = report.get("intervals", {})
    for pair, d in intervals.items():
        if pair != "method":
            console.print(
                f"AIQ {pair}: {d['difference']:+.4f} (95% interval {d['interval'][0]:+.4f} to "
                f"{d['interval'][1]:+.4f}; ahead in {d['share_ahead']:.0%} of resamples)"
            )
    if intervals:
        console.print(f"intervals: {intervals['method']}")
    ours = report["routers"]["ours"]
    if ours.get("chosen_because"):
        console.print(f"ours is the {ours['chosen']}: {ours['chosen_because']}")
    op = ours["operating_point"]
    ratio = ours["cost_ratio_at_best_single_accuracy"]
    best = report["routers"]["best_single"]
    console.print(
        f"best single ({best['worker']}): {best['accuracy']:.3f} at ${best['cost_usd']:.6f}; "
        f"ours at that cost: {ours['best_accuracy_at_cost_of_best_single']}; "
        f"cost ratio at its accuracy: {'never reached' if ratio is None else f'{ratio:.3f}'}; "
        f"validated λ={op['lambda']:g}: accuracy {op['test_accuracy']:.3f} at ${op['test_cost_usd']:.6f}"
    )
    if "calls_per_query" in op:
        console.print(
            f"at that λ: {op['calls_per_query']:.2f} workers called per query, "
            f"{op['rounds_per_query']:.2f} rounds; plans stopping after n rounds: "
            + ", ".join(f"{k}: {v:.1%}" for k, v in op["stop_shares"].items())
        )


def print_cascade_table(report: dict, console: Any) -> None:
    """APGR, its interval and the cost of recovering 80% of the gap, for the cascade replay."""
    from rich.table import Table

    from router.offline.cascade import LEARNED

    table = Table("router", "APGR", "95% CI", "strong share for 80% of gap", "cost there / always-strong")
    strong_cost = report["results"]["always_strong"]["cost_usd"]
    for name in (*LEARNED, "cascade_oracle", "random", "oracle"):
        r = report["results"].get(name)
        if r is None:  # a report written before the row existed
            continue
        ci = r.get("apgr_ci95")
        table.add_row(
            name,
            f"{r['apgr']:.3f}",
            f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "",
            f"{r['cpt80']:.0%}" if r.get("cpt80") is not None else "never",
            f"{r['cost_at_cpt80'] / strong_cost:.0%}" if r.get("cost_at_cpt80") is not None else "",
        )
    console.print(table)


def print_onboarding(report: dict, console: Any) -> None:
    """The onboarding table: AIQ of full, ours and without, and the share of the gain recovered."""
    from rich.table import Table

    ob = report["onboarding"]
    table = Table(
        title=f"Onboarding {ob['worker']} from {ob['probes']} probes ({report['n_test']} test queries)"
    )
    for column in ("router", "AIQ", "what it knows about " + ob["worker"]):
        table.add_column(column)
    table.add_row("full", f"{ob['aiq']['full']:.4f}", "every training label")
    table.add_row(
        "ours",
        f"{ob['aiq']['ours']:.4f}",
        f"{ob['probes']} random training labels (mean of {ob['repeats']} draws)",
    )
    table.add_row("without", f"{ob['aiq']['without']:.4f}", "out of the pool")
    console.print(table)
    gain = ob["gain_recovered"]
    draws = ", ".join(
        "n/a" if d["gain_recovered"] is None else f"{d['gain_recovered']:.2f}" for d in ob["draws"]
    )
    console.print(
        f"gain_recovered = {'n/a' if gain is None else f'{gain:.2f}'} (per draw: {draws}); {ob['formula']}"
    )
    column = ob.get("column_log_loss")
    if column:
        share = "n/a" if column["recovered"] is None else f"{column['recovered']:.2f}"
        console.print(
            f"{ob['worker']}'s column, log loss on the test queries: ours {column['ours']:.4f}, "
            f"full {column['full']:.4f}, its mean label alone {column['base']:.4f} (recovered {share})"
        )
    band, span = ob.get("gain_recovered_interval"), ob.get("full_minus_without_interval")
    if band and span and None not in (*band, *span):  # None: the ratio was undefined on every resample
        console.print(
            f"95% interval of gain_recovered: {band[0]:.2f} to {band[1]:.2f}; of full − without: "
            f"{span[0]:+.4f} to {span[1]:+.4f} ({ob['interval_method']})"
        )
