"""The shipped prior: its size on disk, the time to put it in force, and its decision time per request.

Load time is what a gateway's first start adds: copy the prior into the router dir, unpickle it, build
its features (the embedding model) and predict once. Each repeat runs in a fresh interpreter so nothing
is cached; the same interpreter's import of the gateway package is timed as the baseline, so the figure
reads as "x times the gateway's own import" on a shared, noisy machine. The per-request figure is
LearnedRouter.route on a ~40-word query over the 7 default catalog workers, next to the embedding alone.

    .venv/bin/python bench/router_prior.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "router_prior.json"

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
t0 = time.perf_counter()
import gateway.state  # noqa: F401  the baseline: what a gateway imports anyway
t1 = time.perf_counter()
from router import LearnedRouter, feature_builder_for, load_current
from router.shipped import install_shipped_prior
root = Path(tempfile.mkdtemp()) / "router"
install_shipped_prior(root)
artifact = load_current(root)
router = LearnedRouter(artifact, feature_builder_for(artifact.features))
router.predict_quality("warm-up query", 1)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def per_request(runs: int) -> dict:
    import tempfile

    sys.path.insert(0, str(ROOT))
    import time

    from policies import load_catalog
    from router import LearnedRouter, feature_builder_for, load_current
    from router.rules import RouteRequest
    from router.shipped import install_shipped_prior

    root = Path(tempfile.mkdtemp()) / "router"
    install_shipped_prior(root)
    artifact = load_current(root)
    features = feature_builder_for(artifact.features)
    router = LearnedRouter(artifact, features)
    pool = tuple(load_catalog(None).workers)
    route_ms, embed_ms = [], []
    for i in range(runs):
        text = f"Query {i}: explain why the sum of two even numbers is even, and give three examples. " * 2
        started = time.perf_counter()
        features.transform([text], [1])
        embed_ms.append(1000 * (time.perf_counter() - started))
        text = text + " again"  # not cached
        started = time.perf_counter()
        router.route(RouteRequest(text=text, prompt_chars=len(text)), pool)
        route_ms.append(1000 * (time.perf_counter() - started))
    return {"route_p50_ms": float(np.median(route_ms)), "embed_p50_ms": float(np.median(embed_ms))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "passive"}
    loads = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, check=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(args.repeats)
    ]
    shipped = ROOT / "router" / "prior"
    card = json.loads((shipped / "card.json").read_text())
    load_s = float(np.median([r["load_s"] for r in loads]))
    import_s = float(np.median([r["import_s"] for r in loads]))
    result = {
        "version": card["version"],
        "size_bytes": sum(f.stat().st_size for f in shipped.iterdir()),
        "workers": len(card["workers"]),
        "rows": card["rows"],
        "load_s_p50": load_s,
        "gateway_import_s_p50": import_s,
        "load_over_import": load_s / import_s,
        **per_request(args.runs),
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count()},
    }
    result["route_over_embed"] = result["route_p50_ms"] / result["embed_p50_ms"]
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="The shipped router prior")
    for column in (
        "size",
        "public models",
        "questions",
        "in force after (p50)",
        "÷ gateway import",
        "route p50",
        "÷ embedding",
    ):
        table.add_column(column)
    table.add_row(
        f"{result['size_bytes'] / 1e6:.2f} MB",
        str(result["workers"]),
        f"{result['rows']:,}",
        f"{load_s:.2f} s",
        f"{result['load_over_import']:.2f}×",
        f"{result['route_p50_ms']:.2f} ms",
        f"{result['route_over_embed']:.2f}×",
    )
    Console().print(table)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
