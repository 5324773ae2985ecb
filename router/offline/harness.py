"""The entry points of offline evaluation: load → evaluate a strategy → write JSON → plot → print a table.

Three runs, one per kind of data (`polyroute router eval` calls them; each returns the JSON it wrote):

* :func:`run_routellm_eval` — RouteLLM, 2 workers, the single strategy on four held-out splits (APGR/CPT);
* :func:`run_gsm8k_cascade` — RouteLLM's GSM8K answers, 2 workers, the cascade replayed (APGR/CPT);
* :func:`run_pool_eval` — RouterBench / LLMRouter files, N workers (AIQ), with the strategy looked up in
  :data:`POOL_STRATEGIES` by the CLI's ``--strategy`` name: ``fast`` is the single strategy
  (router/offline/single.py), ``cascade`` the answer-aware planner replayed on the recorded answers
  (router/offline/pool_cascade.py); files without answers fall back to ``fast`` and say so.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.offline.cascade import evaluate_gsm8k_cascade
from router.offline.dataset import RoutingDataset
from router.offline.formats import load_format
from router.offline.plots import plot_cost_curves, plot_frontier, plot_splits
from router.offline.pool_cascade import DECISION as CASCADE_DECISION
from router.offline.pool_cascade import evaluate_cascade
from router.offline.report import (
    console_for,
    jsonable,
    print_cascade_table,
    print_pool_summary,
    print_routellm_table,
    stage_printer,
    write_json,
)
from router.offline.routellm import DEFAULT_OUTPUT_TOKENS, DEFAULT_ROOT, PRICES_PER_M, load_routellm
from router.offline.single import (
    DECISION,
    STRONG_SCORE_DOC,
    FitPredict,
    evaluate_pair,
    evaluate_pool,
    group_mean_fit_predict,
)
from router.offline.split import routellm_splits

# ------------------------------------------------------------------------------------ RouteLLM, single


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
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = console or console_for()
    ds = load_routellm(root)
    for worker in (weak, strong):
        ds.worker_index(worker)
    plan = routellm_splits(ds, seed)

    splits: dict[str, dict] = {}
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=True,
    ) as bar:
        task = bar.add_task("splits", total=len(plan))
        for split in plan:
            bar.update(task, description=f"split {split.name}")
            result = evaluate_pair(
                fit_predict,
                ds.subset(split.train),
                ds.subset(split.test),
                weak,
                strong,
                seed,
                points,
                random_repeats,
                bootstrap,
            )
            splits[split.name] = {
                "description": split.description,
                "test_only": split.test_only,
                **split.extra,
                **result,
            }
            bar.advance(task)

    report = jsonable(
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
    write_json(report, out_json)
    if out_png is not None:
        plot_splits(
            report["splits"], out_png, "Routing curves: Mixtral-8x7B (weak) vs GPT-4-1106-preview (strong)"
        )
    print_routellm_table(report["splits"], console)
    return report


# ----------------------------------------------------------------------------------- GSM8K, cascade


def run_gsm8k_cascade(
    path: str | Path, out_json: Path, out_png: Path | None, *, seed: int = 0, console: Any = None
) -> dict:
    """Replay the cascade on GSM8K's recorded answers; write JSON (and a PNG), print a table, return the JSON."""
    console = console or console_for()
    with console_for(stderr=True).status("cross-fitting the acceptance model and the fast router (5 folds)"):
        report = jsonable(evaluate_gsm8k_cascade(path, seed=seed))
    write_json(report, out_json)
    if out_png is not None:
        plot_cost_curves(report, out_png)
    print_cascade_table(report, console)
    return report


# ------------------------------------------------------------------------------------ files, N workers


@dataclass(frozen=True)
class PoolStrategy:
    """An N-worker strategy: ``evaluate(train, test, features, *, model, seed, progress, say)`` returns the
    result body (``workers``, ``routers`` with ``ours``, ``singles``, ...); ``decision`` says in one
    sentence how it picks, for the report's definitions."""

    evaluate: Callable[..., dict]
    decision: str


# Keyed by `router eval --strategy`.
POOL_STRATEGIES: dict[str, PoolStrategy] = {
    "fast": PoolStrategy(evaluate_pool, DECISION),
    "cascade": PoolStrategy(evaluate_cascade, CASCADE_DECISION),
}


def load_sides(
    fmt: str,
    train_files: Sequence[str | Path],
    test_files: Sequence[str | Path],
    prices: str | Path | None = None,
) -> tuple[RoutingDataset, RoutingDataset]:
    """The train and test files, both priced from one price file: ``prices`` when given, else the
    one the train side was priced from (LLMRouter: ``default_llm.json`` beside the first --train
    score file). Pricing the test files from a file beside them would charge the two sides
    different prices without a word."""
    train = load_format(fmt, train_files, prices)
    test = load_format(fmt, test_files, prices if prices is not None else train.meta.get("prices_file"))
    return train, test


def _meta(ds: RoutingDataset) -> dict:
    return {k: v for k, v in ds.meta.items() if k != "prompt_chars"}


def run_pool_eval(
    fmt: str,
    train_files: Sequence[str | Path],
    test_files: Sequence[str | Path],
    out_json: str | Path,
    out_png: str | Path | None = None,
    *,
    strategy: str = "fast",
    prices: str | Path | None = None,
    backend: str = "static",
    model: str = "mf",
    seed: int = 0,
    progress: bool = True,
    console: Any = None,
) -> dict:
    """Load, evaluate, write RESULT.json (and the plot), print the table; returns the JSON."""
    from router.training import feature_builder

    if strategy not in POOL_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} for --format; known: {', '.join(POOL_STRATEGIES)}")
    chosen = POOL_STRATEGIES[strategy]
    console = console or console_for(stderr=True)
    train, test = load_sides(fmt, train_files, test_files, prices)
    note = None
    features = feature_builder(backend)
    if strategy == "cascade" and (train.responses is None or test.responses is None):
        note = (
            f"{fmt} files record no worker answers: an answer-aware plan cannot be replayed on them, "
            "so single routing (strategy fast) was evaluated instead"
        )
        console.print(f"[yellow]{note}[/]")
        strategy, chosen = "fast", POOL_STRATEGIES["fast"]
    say = stage_printer(console, progress)
    body = chosen.evaluate(train, test, features, model=model, seed=seed, progress=progress, say=say)
    report = jsonable(
        {
            "format": fmt,
            "strategy": strategy,
            **({"note": note} if note else {}),
            "train_files": [str(f) for f in train_files],
            "test_files": [str(f) for f in test_files],
            "backend": backend,
            "seed": seed,
            **body,
            "definitions": {
                "aiq": "area under the non-decreasing convex hull of (cost, accuracy) points from the "
                "router's cheapest point, extended flat to max_cost_usd (the dearest single model's mean "
                "cost; a cascade's points beyond it are left out), divided by max_cost_usd (RouterBench)",
                "best_accuracy_at_cost_of_best_single": "best test accuracy among our λ points costing at most "
                "best_single's cost (no mixing of points)",
                "cost_ratio_at_best_single_accuracy": "lowest cost among our λ points reaching best_single's "
                "accuracy, divided by best_single's cost; null if no point reaches it",
                "decision": chosen.decision,
                "random": "expected accuracy and cost of a uniformly random worker per query",
                "text": train.meta.get("text", "the query as given"),
            },
            "data": {"train": _meta(train), "test": _meta(test)},
        }
    )
    write_json(report, out_json)
    if out_png is not None:
        plot_frontier(report, out_png)
    print_pool_summary(report, console)
    return report


def run_onboard_eval(
    fmt: str,
    train_files: Sequence[str | Path],
    test_files: Sequence[str | Path],
    out_json: str | Path,
    *,
    worker: str,
    probes: int,
    repeats: int = 3,
    prices: str | Path | None = None,
    backend: str = "static",
    model: str = "ensemble",
    seed: int = 0,
    progress: bool = True,
    console: Any = None,
) -> dict:
    """`router eval --onboard WORKER --probes N`: onboarding from N probes against all labels and none
    (router/offline/onboard_eval.py); writes RESULT.json, prints the table, returns the JSON."""
    from router.offline.onboard_eval import evaluate_onboarding
    from router.offline.report import print_onboarding
    from router.training import feature_builder

    console = console or console_for(stderr=True)
    train, test = load_sides(fmt, train_files, test_files, prices)
    say = stage_printer(console, progress)
    body = evaluate_onboarding(
        train,
        test,
        feature_builder(backend),
        worker=worker,
        probes=probes,
        model=model,
        seed=seed,
        repeats=repeats,
        progress=progress,
        say=say,
    )
    report = jsonable(
        {
            "format": fmt,
            "strategy": "fast",
            "train_files": [str(f) for f in train_files],
            "test_files": [str(f) for f in test_files],
            "backend": backend,
            "seed": seed,
            **body,
            "data": {"train": _meta(train), "test": _meta(test)},
        }
    )
    write_json(report, out_json)
    print_onboarding(report, console_for())
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m router.offline`: the RouteLLM harness with the text-free group-mean reference router."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=DEFAULT_ROOT)
    parser.add_argument("--out-json", type=Path, required=True)
    parser.add_argument("--out-png", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run_routellm_eval(group_mean_fit_predict, args.root, args.out_json, args.out_png, seed=args.seed)
