"""How fast probes teach the router a worker, on the training split alone: the onboarded quality
column's log loss per probe count, and the share of the full labels' gain it reaches
(router/offline/onboard_curve.py). It covers the same workers as bench/router_onboarding.py.

    .venv/bin/python bench/onboarding_curve.py --split-dir /tmp/polyroute-split \
        [--prices ../shared/data/llmrouter/default_llm.json] [--draws 20]

It reads only `<split-dir>/<format>/train/*`, never the validation files. Per data set it cross-fits
one model with every label (5 folds). Per worker it cross-fits one model of the other workers, so
about 15–20 fits of the `ensemble` quality model per data set: about 15 minutes on 2 cores. Writes
`bench/results/onboarding_curve.json`, rewritten after each worker so a stopped run keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router_onboarding import RUNS  # noqa: E402  the same workers as the AIQ runs (this script's folder)

from router.offline.formats import load_format  # noqa: E402
from router.offline.onboard_curve import (  # noqa: E402
    DEFAULT_DRAWS,
    DEFAULT_PROBE_COUNTS,
    known_worker_vectors,
    probe_curve,
)
from router.offline.pool import fit_quality_model  # noqa: E402
from router.offline.split import cross_fit  # noqa: E402
from router.quality import _logit  # noqa: E402
from router.training import feature_builder  # noqa: E402

OUT = ROOT / "bench" / "results" / "onboarding_curve.json"
MODEL = "ensemble"
FOLDS = 5


def cross_fitted(X: np.ndarray, Y: np.ndarray, seed: int) -> np.ndarray:
    """Each query's predicted P(success) per column of ``Y``, from a model fitted without its fold."""

    def fit_score(fit: np.ndarray, score: np.ndarray) -> np.ndarray:
        return fit_quality_model(MODEL, X[fit], Y[fit], seed).predict(X[score])

    return cross_fit(len(Y), FOLDS, seed, fit_score)


def _loss(loss: float, recovered: float | None) -> str:
    return f"{loss:.4f} ({'n/a' if recovered is None else f'{recovered:.2f}'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-dir", type=Path, required=True)
    parser.add_argument("--prices", type=Path, default=ROOT.parent / "shared/data/llmrouter/default_llm.json")
    parser.add_argument("--draws", type=int, default=DEFAULT_DRAWS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console(width=200)  # the table is wide; a log file keeps it whole
    results: list[dict] = []
    for fmt, workers in RUNS.items():
        train_dir = args.split_dir / fmt / "train"
        files = sorted(train_dir.iterdir()) if train_dir.is_dir() else []
        if not files:
            sys.exit(f"no training files under {train_dir}: run `polyroute router split`")
        data = load_format(fmt, files, args.prices if fmt == "llmrouter" else None)
        X = feature_builder("static").transform(data.texts, data.turns)
        Y = data.labels
        n = len(Y)
        console.print(f"[bold]{fmt}[/]: {n} training queries; cross-fitting the full model ({FOLDS} folds)")
        started = time.perf_counter()
        full = cross_fitted(X, Y, args.seed)
        for name in workers:
            w = data.workers.index(name)
            others = [j for j in range(len(data.workers)) if j != w]
            console.print(f"  {name}: cross-fitting the model of the other {len(others)} workers")
            Z = _logit(cross_fitted(X, Y[:, others], args.seed))
            curve = probe_curve(
                Z,
                Y[:, w],
                full[:, w],
                known_worker_vectors(Z, Y[:, others]),
                probe_counts=DEFAULT_PROBE_COUNTS,
                draws=args.draws,
                seed=args.seed,
                progress=lambda line: console.print(f"    {line}"),
            )
            results.append({"format": fmt, "worker": name, "n_train": n, "model": MODEL, **curve})
            OUT.write_text(json.dumps(results, indent=1) + "\n")
        console.print(f"  {fmt} done in {time.perf_counter() - started:.0f} s")
    table = Table(title="Onboarded column: log loss on the scoring half (share of full's gain recovered)")
    columns = ("data", "worker", "base", "full", "ceiling", *(f"{p} probes" for p in DEFAULT_PROBE_COUNTS))
    for column in (*columns, "EB − shifted @100"):
        table.add_column(column, justify="left" if column in ("data", "worker") else "right")
    for r in results:
        cells = [_loss(row["shifted"]["log_loss"], row["shifted"]["recovered"]) for row in r["curve"]]
        at100 = next(row for row in r["curve"] if row["probes"] == 100)["known_vectors_minus_shifted"]
        table.add_row(
            r["format"],
            r["worker"].split("/")[-1],
            f"{r['base_log_loss']:.4f}",
            f"{r['full_log_loss']:.4f}",
            _loss(r["ceiling_log_loss"], r["ceiling_recovered"]),
            *cells,
            f"{at100['mean']:+.4f} ± {at100['se']:.4f}",
        )
    console.print(table)
    console.print(f"written: {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
