r"""Policy evaluation time per request, and data-class detection's quality and speed.

1. `PolicyEngine.evaluate` (classification + every rule against every worker + budgets), 50 workers,
   20 rules, a 2,000-token prompt: with detection off, on a clean prompt (every detector scans all of
   it: the worst case), and on a prompt that carries PII.
2. Detection recall per kind on the labelled corpus of obfuscated PII and secrets
   (bench/data/pii_corpus.jsonl, made by bench/pii_corpus.py), and the false-positive rate on
   ordinary technical text: the corpus's generated negatives, SciFact abstracts and the LLMRouter
   queries from /work/shared/data (read there, not copied; texts holding contact details, i.e.
   "@", "+<digit>", "tel", "fax", "phone", "e-mail" or "contact", are left out: real abstracts
   carry their authors' addresses and phone numbers, which are personal data, not negatives).
3. Detection time per MB on 4 MB texts (number-heavy, prose, code-like), next to a plain `re`
   baseline run in the same process on the same text: one pass of r"\d{13,19}", the naive card pattern.

Writes bench/results/policy.json.

    .venv/bin/python bench/policy.py [--iterations 3000] [--speed-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pii_corpus import CORPUS, load  # noqa: E402
from policies import PolicyEngine, PolicyRequest, Spend, parse_catalog, parse_policy  # noqa: E402
from policies.detect import BUILTIN_KINDS, builtin_detectors, scan  # noqa: E402

SHARED = Path("/work/shared/data")
CONTACT = re.compile(r"@|\+\d|\btel\b|\bfax\b|phone|e-?mail|\bcontact", re.IGNORECASE)

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


def shared_negatives() -> dict[str, list[str]]:
    """Real prose from the shared data sets, when present: SciFact abstracts, LLMRouter queries."""
    sources: dict[str, list[str]] = {}
    scifact = SHARED / "beir" / "scifact" / "corpus.jsonl"
    if scifact.exists():
        rows = [json.loads(line) for line in scifact.read_text(encoding="utf-8").split("\n") if line]
        sources["SciFact abstracts"] = [f"{r['title']}. {r['text']}" for r in rows]
    queries = SHARED / "llmrouter" / "default_query_train.jsonl"
    if queries.exists():
        rows = [json.loads(line) for line in queries.read_text(encoding="utf-8").split("\n") if line]
        sources["LLMRouter queries"] = [r["query"] for r in rows]
    return sources


def detection_quality() -> dict:
    detectors = builtin_detectors()
    rows = load(CORPUS)
    per_kind: dict[str, list[int]] = {k: [0, 0] for k in BUILTIN_KINDS}
    missed: dict[str, list[str]] = {}
    for row in rows:
        if row["kind"] is None:
            continue
        found = {f.kind for f in scan([row["text"]], detectors, first_only=False)}
        per_kind[row["kind"]][1] += 1
        if row["kind"] in found:
            per_kind[row["kind"]][0] += 1
        else:
            missed.setdefault(f"{row['kind']}/{row['variant']}", []).append(row["text"])
    negatives = {"corpus technical text": [r["text"] for r in rows if r["kind"] is None]}
    excluded: dict[str, int] = {}
    for name, texts in shared_negatives().items():
        negatives[name] = [t for t in texts if not CONTACT.search(t)]
        excluded[name] = len(texts) - len(negatives[name])
    fpr = []
    for name, texts in negatives.items():
        flagged = []
        for text in texts:
            found = scan([text], detectors, first_only=False)
            if found:
                flagged.append(
                    {
                        "kinds": sorted({f.kind for f in found}),
                        "spans": [text[f.start : f.end] for f in found][:3],
                    }
                )
        fpr.append(
            {
                "source": name,
                "texts": len(texts),
                "excluded_contact_details": excluded.get(name, 0),
                "flagged": len(flagged),
                "fpr": round(len(flagged) / max(1, len(texts)), 5),
                "examples": flagged[:5],
            }
        )
    positives = sum(t for _, t in per_kind.values())
    found_total = sum(h for h, _ in per_kind.values())
    all_negatives = sum(r["texts"] for r in fpr)
    all_flagged = sum(r["flagged"] for r in fpr)
    return {
        "recall": {
            k: {"found": h, "total": t, "recall": round(h / t, 4) if t else None}
            for k, (h, t) in per_kind.items()
        },
        "recall_overall": round(found_total / positives, 4),
        "positives": positives,
        "variants": len({(r["kind"], r["variant"]) for r in rows if r["kind"]}),
        "missed_examples": {k: v[:2] for k, v in missed.items()},
        "false_positives": fpr,
        "fpr_overall": round(all_flagged / max(1, all_negatives), 5),
        "negatives": all_negatives,
    }


def speed_texts(megabytes: float, rng: random.Random) -> dict[str, str]:
    """Number-heavy (tables, decimals, ids, dates, IPs), prose (SciFact, or the prompt generator),
    and code-like text, each cut to the same size."""
    size = int(megabytes * 1_000_000)
    parts: list[str] = []
    length = 0
    while length < size:
        k = rng.random()
        if k < 0.3:
            piece = str(rng.randrange(10 ** rng.randint(1, 12)))
        elif k < 0.45:
            piece = f"{rng.random() * 1000:.3f}"
        elif k < 0.55:
            piece = ".".join(str(rng.randrange(256)) for _ in range(4))
        elif k < 0.65:
            piece = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif k < 0.8:
            piece = " ".join(str(rng.randrange(100)) for _ in range(8))
        else:
            piece = rng.choice(["the", "value", "of", "row", "and", "total", "ms", "|", ","])
        parts.append(piece)
        length += len(piece) + 1
    texts = {"number-heavy": " ".join(parts)[:size]}
    prose = shared_negatives().get("SciFact abstracts")
    texts["prose"] = (" ".join(prose) if prose else prompt(size // 4 + 1, False))[:size]
    code = (
        'def handler(event, ctx):\n    rows = db.query("SELECT id, name FROM users WHERE id = %s", [event["id"]])\n'
        "    return {'status': 200, 'count': len(rows), 'version': '3.2.1', 'ts': 1700000000123}\n"
    )
    texts["code"] = (code * (size // len(code) + 1))[:size]
    return texts


def detection_speed(megabytes: float, rng: random.Random) -> list[dict]:
    detectors = builtin_detectors()
    baseline = re.compile(r"\d{13,19}")
    rows = []
    for name, text in speed_texts(megabytes, rng).items():
        mb = len(text.encode("utf-8")) / 1e6
        timings = []
        for i in range(3):
            fresh = text + " " * (i + 1)  # a new object each time: detectors cache per text object
            start = time.perf_counter()
            scan([fresh], detectors)
            timings.append(time.perf_counter() - start)
        base_timings = []
        for _ in range(3):
            start = time.perf_counter()
            sum(1 for _ in baseline.finditer(text))
            base_timings.append(time.perf_counter() - start)
        detect_s, base_s = min(timings), min(base_timings)
        rows.append(
            {
                "text": name,
                "mb": round(mb, 2),
                "detection_s": round(detect_s, 3),
                "detection_ms_per_mb": round(detect_s * 1000 / mb, 1),
                "baseline_ms_per_mb": round(base_s * 1000 / mb, 1),
                "ratio_to_baseline": round(detect_s / base_s, 2),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--speed-mb", type=float, default=4.0, help="size of each detection-speed text")
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
    console = Console()
    console.print(table)

    quality = detection_quality()
    recall_table = Table(
        title=f"detection recall, {quality['positives']} obfuscated positives ({quality['variants']} variants)"
    )
    for column in ("kind", "found", "total", "recall"):
        recall_table.add_column(column, justify="right")
    for kind, r in quality["recall"].items():
        recall_table.add_row(kind, str(r["found"]), str(r["total"]), f"{r['recall']:.4f}")
    recall_table.add_row("all", "", str(quality["positives"]), f"{quality['recall_overall']:.4f}")
    console.print(recall_table)
    fpr_table = Table(title="false positives on ordinary text (a text with any finding)")
    for column in ("source", "texts", "left out (contact details)", "flagged", "FPR"):
        fpr_table.add_column(column, justify="right")
    for r in quality["false_positives"]:
        fpr_table.add_row(
            r["source"],
            str(r["texts"]),
            str(r["excluded_contact_details"]),
            str(r["flagged"]),
            f"{r['fpr']:.4%}",
        )
    fpr_table.add_row("all", str(quality["negatives"]), "", "", f"{quality['fpr_overall']:.4%}")
    console.print(fpr_table)

    speed = detection_speed(args.speed_mb, random.Random(11))
    speed_table = Table(
        title=f"detection speed, all built-in detectors, {args.speed_mb:g} MB texts (best of 3)"
    )
    for column in ("text", "MB", "detection s", "ms / MB", "baseline ms / MB", "× baseline"):
        speed_table.add_column(column, justify="right")
    for r in speed:
        speed_table.add_row(
            r["text"],
            f"{r['mb']:.2f}",
            f"{r['detection_s']:.3f}",
            f"{r['detection_ms_per_mb']:.1f}",
            f"{r['baseline_ms_per_mb']:.1f}",
            f"{r['ratio_to_baseline']:.2f}",
        )
    console.print(speed_table)

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
    meta["detection_speed_mb"] = args.speed_mb
    meta["speed_baseline"] = "one re pass of \\d{13,19} over the same text"
    out.write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "detection_quality": quality, "detection_speed": speed},
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
