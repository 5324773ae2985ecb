"""Onboarding from probes on our validation splits: every (data, worker, probes) row of the table in
docs/benchmarks.md, each by the exact CLI the issue names, then the table as one JSON.

    .venv/bin/python bench/router_onboarding.py --split-dir /tmp/polyroute-split \
        [--prices ../shared/data/llmrouter/default_llm.json]

The split directory holds `routerbench/{train,test}/*.csv` and `llmrouter/{train,test}/*` as written by
`polyroute router split` (seed 0). Writes `bench/results/onboarding/<rb|lr>_<worker>_<probes>.json`
(the CLI's reports) and `bench/results/router_onboarding.json` (one row per run, with the paired
bootstrap intervals). A run that fails stops the job with its output; rows already written stay.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
RUNS = {
    "routerbench": ("gpt-3.5-turbo-1106", "gpt-4-1106-preview", "zero-one-ai/Yi-34B-Chat"),
    "llmrouter": ("llama-3.1-nemotron-51b-instruct", "qwen2.5-7b-instruct"),
}
PROBES = (100, 25)
SHORT = {"routerbench": "rb", "llmrouter": "lr"}


def run(fmt: str, worker: str, probes: int, split: Path, prices: Path, cli: Path) -> dict:
    out = OUT / "onboarding" / f"{SHORT[fmt]}_{worker.split('/')[-1]}_{probes}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = [str(cli), "router", "eval", "--format", fmt]
    for side in ("train", "test"):
        for f in sorted((split / fmt / side).iterdir()):
            args += [f"--{side}", str(f)]
    if fmt == "llmrouter":
        args += ["--prices", str(prices)]
    args += ["--onboard", worker, "--probes", str(probes), "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    report = json.loads(out.read_text())
    ob = report["onboarding"]
    return {
        "format": fmt,
        "worker": worker,
        "probes": probes,
        "aiq_without": ob["aiq"]["without"],
        "aiq_ours": ob["aiq"]["ours"],
        "aiq_full": ob["aiq"]["full"],
        "gain_recovered": ob["gain_recovered"],
        "gain_recovered_interval": ob["gain_recovered_interval"],
        "full_minus_without_interval": ob["full_minus_without_interval"],
        "per_draw": [d["gain_recovered"] for d in ob["draws"]],
        "column_log_loss": ob["column_log_loss"],
        "n_test": report["n_test"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-dir", type=Path, required=True)
    parser.add_argument("--prices", type=Path, default=ROOT.parent / "shared/data/llmrouter/default_llm.json")
    args = parser.parse_args()
    cli = Path(sys.executable).parent / "polyroute"
    rows = []
    for fmt, workers in RUNS.items():
        for worker in workers:
            for probes in PROBES:
                row = run(fmt, worker, probes, args.split_dir, args.prices, cli)
                low, high = row["gain_recovered_interval"]
                column = row["column_log_loss"]["recovered"]
                share = "n/a" if column is None else f"{column:.2f}"
                print(
                    f"{fmt:12} {worker:34} {probes:4} probes: gain_recovered {row['gain_recovered']:.2f} "
                    f"(95% interval {low:.2f} to {high:.2f}); column log loss recovered {share}",
                    flush=True,
                )
                rows.append(row)
                (OUT / "router_onboarding.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
