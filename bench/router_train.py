"""How long `polyroute router train --dataset routellm` takes, where the time goes, and what it costs in quality.

Issue 15 measured 460 s for this command; the target is under 60 s on 2 cores. Three measurements:

1. The command itself, end to end, in a fresh interpreter (wall time; the data dir is a temp dir, the
   model is not activated).
2. Its stages in this process: loading RouteLLM's MMLU + GSM8K rows, embedding them (static backend,
   cold cache), and fitting. Fitting is timed twice on the same 80% of the rows: today's selection
   (both candidates scored out of fold; the chosen one reuses those folds for calibration; LightGBM
   with 63 bins) and the procedure before it (both candidates fit and calibrated on a train split,
   scored on a validation split, the chosen one refit and recalibrated on all rows; 255 bins). The
   ratio old/new is the figure to read on a shared, noisy machine.
3. Quality: both final models scored on the held-out 20% (Brier, AUC), so a faster fit that predicts
   worse would show.

    .venv/bin/python bench/router_train.py [--data ../shared/data/routellm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "router_train.json"
sys.path.insert(0, str(ROOT))


def command_seconds(data: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "polyroute.cli", "router", "train", "--dataset", "routellm"]
            + ["--data", str(data), "--data-dir", tmp, "--no-activate"],
            check=True,
            capture_output=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        )
        return time.perf_counter() - started


def previous_procedure(X: np.ndarray, Y: np.ndarray) -> tuple[object, str]:
    """Selection as it was before issue 15: holdout scoring of two calibrated fits, then a calibrated refit."""
    from router.quality import PerWorkerClassifier, _train_val_split, score_predictions

    train, val = _train_val_split(Y, 0.2, 0)
    briers = {}
    for kind in ("logreg", "lightgbm"):
        params = {"max_bin": 255} if kind == "lightgbm" else {}
        model = PerWorkerClassifier(kind, **params).fit(X[train], Y[train])
        briers[kind] = score_predictions(model.predict(X[val]), Y[val])["brier"]
    chosen = min(briers, key=briers.get)
    params = {"max_bin": 255} if chosen == "lightgbm" else {}
    return PerWorkerClassifier(chosen, **params).fit(X, Y), chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "routellm")
    args = parser.parse_args()
    console = Console()
    if not (args.data / "mmlu").is_dir():
        console.print(f"[red]no RouteLLM data at {args.data}[/] (pass --data)")
        raise SystemExit(2)

    from router.offline import load_routellm
    from router.quality import score_predictions, select_quality_model
    from router.training import feature_builder

    console.print("1/4 the command, end to end")
    command_s = command_seconds(args.data)
    console.print("2/4 load and embed")
    started = time.perf_counter()
    ds = load_routellm(args.data, parts=("mmlu", "gsm8k"))
    load_s = time.perf_counter() - started
    started = time.perf_counter()  # the cache is cold: the command ran in its own interpreter
    builder = feature_builder("static")
    X = builder.transform(list(ds.texts), list(ds.turns))
    embed_s = time.perf_counter() - started
    Y = np.asarray(ds.labels, dtype=float)
    order = np.random.default_rng(0).permutation(len(X))
    cut = int(0.8 * len(X))
    fit_rows, test_rows = order[:cut], order[cut:]

    console.print("3/4 fit: today's selection")
    started = time.perf_counter()
    new_model, report = select_quality_model(X[fit_rows], Y[fit_rows])
    new_s = time.perf_counter() - started
    console.print("4/4 fit: the procedure before")
    started = time.perf_counter()
    old_model, old_chosen = previous_procedure(X[fit_rows], Y[fit_rows])
    old_s = time.perf_counter() - started
    new_q = score_predictions(new_model.predict(X[test_rows]), Y[test_rows])
    old_q = score_predictions(old_model.predict(X[test_rows]), Y[test_rows])

    result = {
        "rows": len(X),
        "workers": list(ds.workers),
        "command_seconds": round(command_s, 1),
        "stages_seconds": {"load": round(load_s, 2), "embed": round(embed_s, 2)},
        "fit_seconds_on_80pct": {"now": round(new_s, 1), "before": round(old_s, 1)},
        "fit_speedup": round(old_s / new_s, 2),
        "held_out_20pct": {
            "now": {"model": report["chosen"], "brier": new_q["brier"], "auc": new_q["auc"]},
            "before": {"model": old_chosen, "brier": old_q["brier"], "auc": old_q["auc"]},
        },
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg()[0],
    }
    table = Table(title=f"router train --dataset routellm ({len(X)} queries × {len(ds.workers)} workers)")
    for column in ("measure", "now", "before", "before / now"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    table.add_row("command end to end (s)", f"{command_s:.1f}", "460 (issue 15)", "")
    table.add_row("load rows (s)", f"{load_s:.2f}", "", "")
    table.add_row("embed, static, cold (s)", f"{embed_s:.2f}", "", "")
    table.add_row("fit on 80% of rows (s)", f"{new_s:.1f}", f"{old_s:.1f}", f"{old_s / new_s:.2f}×")
    table.add_row("chosen model", report["chosen"], old_chosen, "")
    table.add_row("held-out Brier", f"{new_q['brier']:.4f}", f"{old_q['brier']:.4f}", "")
    table.add_row("held-out AUC", f"{new_q['auc']:.4f}", f"{old_q['auc']:.4f}", "")
    console.print(table)
    console.print(f"load average at the end: {result['load_average_at_end']:.2f} on {os.cpu_count()} cores")
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
