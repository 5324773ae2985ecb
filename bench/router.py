"""Routing decision time: a ~200-token query, cold (not yet embedded) and cached, 2/10/50 workers.

Times `LearnedRouter.route` end to end — features (embedding + lexical), every worker's quality
prediction, cost estimates, the decision — for each embedding backend and quality model. The
2-worker models are trained on RouteLLM queries (Mixtral vs GPT-4 labels); for 10 and 50 workers
the extra workers' labels are derived from those two with seeded noise (only the timing matters
here, not what they learn). Writes bench/results/router.json.

    .venv/bin/python bench/router.py [--data ../shared/data/routellm] [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from policies import parse_catalog  # noqa: E402
from router import LearnedRouter, RouteRequest  # noqa: E402
from router.offline import load_routellm  # noqa: E402
from router.training import train_artifact  # noqa: E402

QUERY = (
    "I am designing a service that stores user sessions. Explain how a hash map handles collisions, "
    "compare separate chaining with open addressing, and tell me the amortised cost of insertion when "
    "the table doubles. Then suggest which one suits a read-heavy cache with 10 million keys, and how "
    "the load factor should be chosen so that lookups stay fast while memory stays bounded. "
) * 2


def catalog(n: int):
    workers = [
        {
            "name": f"w{i:02d}",
            "model": f"openai/w{i}",
            "api_base": "http://127.0.0.1:9/v1",
            "input_price_per_m": round(0.1 * (i + 1), 2),
            "output_price_per_m": round(0.3 * (i + 1), 2),
            "tier": "open-moe",
            "license": "MIT",
            "provider": "p",
            "context_window": 32768,
            "active_params_b": 7 + i,
        }
        for i in range(n)
    ]
    return parse_catalog(yaml.safe_dump({"version": 1, "workers": workers}))


def labels_for(base: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    columns = [base[:, i % 2] for i in range(n)]
    out = np.stack(columns, axis=1)
    flip = rng.random(out.shape) < 0.15
    return np.where(flip, 1 - out, out)


def timed(router: LearnedRouter, request_for, pool, runs: int) -> tuple[float, float]:
    samples = []
    for i in range(runs):
        request = request_for(i)
        start = time.perf_counter()
        router.route(request, pool)
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "routellm")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--train-rows", type=int, default=3000)
    parser.add_argument("--backends", default="static,transformer")
    parser.add_argument("--models", default="logreg,lightgbm")
    parser.add_argument(
        "--lightgbm-max-workers",
        type=int,
        default=10,
        help="LightGBM fits one calibrated booster per worker: slow",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ds = load_routellm(args.data, parts=("mmlu", "gsm8k"))
    pick = rng.choice(len(ds.texts), size=min(args.train_rows, len(ds.texts)), replace=False)
    texts = [ds.texts[i] for i in pick]
    turns = [ds.turns[i] for i in pick]
    base = np.nan_to_num(ds.labels[pick], nan=0.0)
    words = len(QUERY.split())
    rows = []
    for backend in args.backends.split(","):
        for model in args.models.split(","):
            for n in (2, 10, 50):
                if model == "lightgbm" and n > args.lightgbm_max_workers:
                    continue
                cat = catalog(n)
                artifact = train_artifact(
                    texts,
                    turns,
                    labels_for(base, n, rng),
                    cat.names,
                    backend=backend,
                    model=model,
                    random_state=0,
                )
                router = LearnedRouter(artifact, _builder(artifact), default_cost_weight=0.5)
                pool = cat.workers
                router.route(RouteRequest(len(QUERY), text=QUERY), pool)  # load the embedder and warm up
                cold_runs = max(20, args.runs // 4) if backend == "transformer" else args.runs
                tag = f"{backend}-{model}-{n}"  # the embedding cache is per process: cold texts must be new
                cold = timed(
                    router,
                    lambda i, tag=tag: RouteRequest(len(QUERY), text=f"{tag}-{i} {QUERY}"),
                    pool,
                    cold_runs,
                )
                cached = timed(router, lambda i: RouteRequest(len(QUERY), text=QUERY), pool, args.runs)
                rows.append(
                    {
                        "backend": backend,
                        "model": artifact.card["model"],
                        "workers": n,
                        "cold_p50_ms": round(cold[0], 2),
                        "cold_p99_ms": round(cold[1], 2),
                        "cached_p50_ms": round(cached[0], 2),
                        "cached_p99_ms": round(cached[1], 2),
                    }
                )
                print(rows[-1], flush=True)
    table = Table(title=f"routing decision time, {words}-word query (ms)")
    for column in ("backend", "model", "workers", "cold p50", "cold p99", "cached p50", "cached p99"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["backend"],
            r["model"],
            str(r["workers"]),
            f"{r['cold_p50_ms']:.2f}",
            f"{r['cold_p99_ms']:.2f}",
            f"{r['cached_p50_ms']:.2f}",
            f"{r['cached_p99_ms']:.2f}",
        )
    Console().print(table)
    out = ROOT / "bench" / "results" / "router.json"
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "query_words": words,
        "train_rows": len(texts),
        "runs": args.runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def _builder(artifact):
    from router import feature_builder_for

    return feature_builder_for(artifact.features)


if __name__ == "__main__":
    main()
