"""Routing decision time: a ~200-token query, cold (not yet embedded) and cached, 2/10/50 workers.

Times `LearnedRouter.route` end to end — features (embedding + lexical), every worker's quality
prediction, cost estimates, the decision — for each embedding backend and quality model. The
2-worker models are trained on RouteLLM queries (Mixtral vs GPT-4 labels); for 10 and 50 workers
the extra workers' labels are derived from those two with seeded noise (only the timing matters
here, not what they learn). Writes bench/results/router.json.

The cascade planner's own time per step (everything but the worker calls): reading the answers held
(kind, keys, form), the post-hoc estimate, the gain of every candidate call and set, the decision —
for a plan holding 0 to 3 answers, with 11 and 50 workers, next to the fast router's decision
(`router.decide.choose`) timed in the same run as the baseline. Running code answers to compare their
behaviour (a subprocess, opt-in live) is timed apart: it is a verification step, like a worker call.
The planner is fitted on synthetic recorded answers with the production model sizes (the timing
depends on the trees' size and the pool, not on what they learned).

    .venv/bin/python bench/router.py [--data ../shared/data/routellm] [--runs 200] [--planner-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from decimal import Decimal
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
    parser.add_argument("--planner-only", action="store_true", help="only the planner's per-step time")
    args = parser.parse_args()
    out = ROOT / "bench" / "results" / "router.json"
    planner = planner_rows(args.runs)
    if args.planner_only:
        saved = json.loads(out.read_text()) if out.exists() else {}
        saved["planner"] = planner
        out.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
        return
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
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "query_words": words,
        "train_rows": len(texts),
        "runs": args.runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows, "planner": planner}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


MC_QUERY = "Which gas do plants take in?\nA) oxygen\nB) carbon dioxide\nC) helium\nD) neon\nAnswer:"
CODE_QUERY = "Write a function to remove all elements from a given list present in another list."
CODE_ANSWERS = [
    "```python\ndef remove(a, b):\n    return [x for x in a if x not in b]\n\nprint(remove([1, 2, 3], [2]))\n```",
    "[PYTHON]\ndef f(xs, ys):\n    out = []\n    for x in xs:\n        if x not in ys:\n            out.append(x)\n"
    "    return out\n[/PYTHON]\n[TESTS]\nassert f([1, 2], [1]) == [2]\n[/TESTS]",
    "```python\ndef g(a, b):\n    return list(set(a) - set(b))\n```",
]


def _percentiles(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 99))


def planner_rows(runs: int) -> list[dict]:
    """The planner's per-step time by answers held and pool size, with the fast decision as baseline."""
    from router.code_behaviour import behaviour_keys
    from router.decide import Estimate, choose
    from router.evidence import read_answers
    from router.offline.book import AnswerBook
    from router.offline.plan_table_fit import fit_plan_table
    from router.offline.planner_fit import Recorded, fit_planner
    from router.planner import State

    rows = []
    rng = np.random.default_rng(0)
    for n_workers in (11, 50):
        accuracy = np.linspace(0.55, 0.95, n_workers)
        answers, labels = [], []
        for _ in range(120 if n_workers == 11 else 60):
            right = "ABCD"[rng.integers(4)]
            ok = rng.random(n_workers) < accuracy
            answers.append([right if o else "ABCD"[rng.integers(4)] for o in ok])
            labels.append(ok.astype(float))
        book = AnswerBook([MC_QUERY] * len(answers), answers)
        rec = Recorded.from_priors(book, np.tile(accuracy, (len(answers), 1)), np.array(labels))
        planner = fit_planner(rec, k=2, seed=0).final
        log_odds = np.log(accuracy / (1 - accuracy))
        costs = np.linspace(0.1, 20.0, n_workers)
        estimates = [
            Estimate(f"w{k}", float(a), Decimal(str(c)))
            for k, (a, c) in enumerate(zip(accuracy, costs, strict=True))
        ]
        baseline = []
        for _ in range(runs):
            started = time.perf_counter()
            choose(estimates, 0.5)
            baseline.append(1000 * (time.perf_counter() - started))
        base_p50, _ = _percentiles(baseline)
        table = fit_plan_table(
            book, np.array(labels), np.tile(costs, (len(answers), 1)), [f"w{k}" for k in range(n_workers)]
        )
        for strategy, deciding in (("planner", planner), ("plan_table", table)):
            for held in range(4):
                called = tuple(int(k) for k in rng.choice(n_workers, size=held, replace=False))
                texts = ["ABCD"[k % 4] for k in called]
                samples = []
                for _ in range(runs):
                    started = time.perf_counter()
                    read = read_answers(MC_QUERY, texts)
                    state = State.of(MC_QUERY, called, read if held else None)
                    deciding.decide(state, log_odds, costs, 0.1)
                    samples.append(1000 * (time.perf_counter() - started))
                p50, p99 = _percentiles(samples)
                rows.append(
                    {
                        "strategy": strategy,
                        "workers": n_workers,
                        "answers_held": held,
                        "step_p50_ms": round(p50, 3),
                        "step_p99_ms": round(p99, 3),
                        "fast_decision_p50_ms": round(base_p50, 3),
                        "ratio_to_fast_decision": round(p50 / base_p50, 1),
                    }
                )
                print(rows[-1], flush=True)
    samples = []
    for _ in range(max(5, runs // 20)):
        started = time.perf_counter()
        behaviour_keys(CODE_QUERY, CODE_ANSWERS)
        samples.append(1000 * (time.perf_counter() - started))
    p50, p99 = _percentiles(samples)
    rows.append(
        {"code_behaviour_3_answers_p50_ms": round(p50, 1), "code_behaviour_3_answers_p99_ms": round(p99, 1)}
    )
    print(rows[-1], flush=True)
    table = Table(title="cascade planner: own time per step (ms), worker calls excluded")
    for column in ("strategy", "workers", "answers held", "p50", "p99", "fast decision p50", "ratio"):
        table.add_column(column, justify="right")
    for r in rows[:-1]:
        table.add_row(
            r["strategy"],
            str(r["workers"]),
            str(r["answers_held"]),
            f"{r['step_p50_ms']:.3f}",
            f"{r['step_p99_ms']:.3f}",
            f"{r['fast_decision_p50_ms']:.3f}",
            f"{r['ratio_to_fast_decision']:.1f}x",
        )
    Console().print(table)
    Console().print(
        f"running 3 code answers to compare behaviour (subprocess): p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    return rows


def _builder(artifact):
    from router import feature_builder_for

    return feature_builder_for(artifact.features)


if __name__ == "__main__":
    main()
