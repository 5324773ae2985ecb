"""Policy evaluation time per request: 50 workers, 20 rules, a 2,000-token prompt.

Measures `PolicyEngine.evaluate` (classification + every rule against every worker + budgets)
with detection off, with detection on a clean prompt (every detector scans all of it: the worst
case), and with detection on a prompt that carries PII. Writes bench/results/policy.json.

    .venv/bin/python bench/policy.py [--iterations 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policies import PolicyEngine, PolicyRequest, Spend, parse_catalog, parse_policy  # noqa: E402

JURISDICTIONS = ["US", "FR", "DE", "CN", "GB", "local", "IE", "JP", None]
LICENSES = ["Apache-2.0", "MIT", "proprietary", "llama3", "gemma", "MNPL-0.1"]
TIERS = ["open-moe", "specialist", "frontier", "local"]


def make_catalog(n: int, rng: random.Random):
    workers = []
    for i in range(n):
        where = rng.choice(JURISDICTIONS)
        worker = {
            "name": f"w{i:02d}",
            "model": f"openai/w{i}",
            "api_base": "http://127.0.0.1:9/v1",
            "input_price_per_m": round(rng.uniform(0, 5), 2),
            "output_price_per_m": round(rng.uniform(0, 20), 2),
            "tier": rng.choice(TIERS),
            "license": rng.choice(LICENSES),
            "provider": f"p{i % 7}",
            "context_window": 32768,
            "active_params_b": rng.choice([1, 7, 13, 22, 37, 70]),
        }
        if where:
            worker["jurisdiction"] = where
        workers.append(worker)
    return parse_catalog(yaml.safe_dump({"version": 1, "workers": workers}))


def make_policy(n_rules: int, rng: random.Random) -> PolicyEngine:
    kinds = [
        lambda: {"allow_jurisdictions": rng.sample(["EU", "US", "local", "JP"], 2)},
        lambda: {"deny_jurisdictions": ["CN"]},
        lambda: {"deny_licenses": [rng.choice(LICENSES)]},
        lambda: {"allow_licenses": rng.sample(LICENSES, 4)},
        lambda: {"max_active_params_b": rng.choice([13, 40, 70])},
        lambda: {"max_request_cost_usd": "0.5"},
        lambda: {"max_output_price_per_m": {"frontier": 15, "open-moe": 5}},
        lambda: {"deny_providers": [f"p{rng.randrange(7)}"]},
    ]
    scopes = [{}, {"tenants": ["acme", "globex"]}, {"data_classes": ["pii"]}, {"models": ["auto", "batch"]}]
    rules = [
        {"id": f"r{i}", "when": scopes[i % len(scopes)], **kinds[i % len(kinds)]()} for i in range(n_rules)
    ]
    text = yaml.safe_dump(
        {
            "version": "bench",
            "rules": rules,
            "aliases": {"batch": "b"},
            "tenants": {"acme": {"budget": {"daily_usd": 100, "monthly_usd": 1000}}},
        }
    )
    return PolicyEngine(*parse_policy(text))


def prompt(tokens: int, pii: bool) -> str:
    """Ordinary prose with numbers, dates and prices: ~4 characters per token."""
    sentence = (
        "On 2024-11-15 the team shipped release 3.2.1 to 1,250 customers; revenue rose 4.5% to $1,299.99 "
        "per seat, order #123456789 closed at 14:30 and the Q3 report lists 42 open items. "
    )
    text = (sentence * (tokens * 4 // len(sentence) + 1))[: tokens * 4]
    return text + (" Contact jane.doe@example.com or +33 6 12 34 56 78." if pii else "")


def measure(engine, catalog, request, iterations: int) -> list[float]:
    for _ in range(200):
        engine.evaluate(request, catalog, env={})
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        engine.evaluate(request, catalog, env={})
        samples.append((time.perf_counter_ns() - start) / 1000)
    return sorted(samples)


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=3000)
    args = parser.parse_args()
    rng = random.Random(7)
    catalog = make_catalog(50, rng)
    engine = make_policy(20, rng)
    off = PolicyEngine(
        engine.policy.model_copy(
            update={"detection": engine.policy.detection.model_copy(update={"enabled": False})}
        ),
        engine.version,
    )
    clean, with_pii = prompt(2000, False), prompt(2000, True)
    spend = Spend()
    cases = [
        ("detection off", off, clean),
        ("detection on, clean prompt", engine, clean),
        ("detection on, PII in prompt", engine, with_pii),
    ]
    rows = []
    for label, eng, text in cases:
        request = PolicyRequest("acme", "auto", (text,), None, len(text), 512, spend)
        admission = eng.evaluate(request, catalog, env={})
        samples = measure(eng, catalog, request, args.iterations)
        rows.append(
            {
                "case": label,
                "p50_us": round(pct(samples, 0.5), 1),
                "p99_us": round(pct(samples, 0.99), 1),
                "data_class": admission.data_class,
                "pool": len(admission.pool),
                "rules_in_scope": len(admission.rules_applied),
            }
        )
    table = Table(
        title=f"policy evaluation, 50 workers × 20 rules, 2,000-token prompt ({args.iterations} runs)"
    )
    for column in ("case", "p50 µs", "p99 µs", "data class", "admitted", "rules in scope"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["case"],
            f"{r['p50_us']:.1f}",
            f"{r['p99_us']:.1f}",
            r["data_class"],
            str(r["pool"]),
            str(r["rules_in_scope"]),
        )
    Console().print(table)
    out = ROOT / "bench" / "results" / "policy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "workers": 50,
        "rules": 20,
        "prompt_tokens": 2000,
        "iterations": args.iterations,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
