"""The four workflows against real providers, when their keys are set.

Starts the gateway on loopback with the embedded catalog (local workers off), sends a few
questions through `compose:cascade`, `compose:ensemble`, `compose:builder` and `compose:debate`
next to fast mode, and prints per workflow: answers, steps, workers, cost and latency. Writes
bench/results/compose_live.json. Without any provider key (OPENAI_API_KEY, ANTHROPIC_API_KEY,
DEEPSEEK_API_KEY, TOGETHERAI_API_KEY, MISTRAL_API_KEY) it says so and exits 0: nothing to measure.

    .venv/bin/python bench/compose_live.py [--max-cost-usd 0.05]
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

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import free_port, wait_http  # noqa: E402

KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "DEEPSEEK_API_KEY", "TOGETHERAI_API_KEY", "MISTRAL_API_KEY")
QUESTIONS = [
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey in minutes?",
    "Write a Python function is_palindrome(s) that ignores case and non-letters.",
    "Is 391 a prime number? Answer yes or no, then explain briefly.",
]
TESTS = "assert is_palindrome('A man, a plan, a canal: Panama')\nassert not is_palindrome('polyroute')"
MODELS = ("auto", "compose:cascade", "compose:ensemble", "compose:builder", "compose:debate")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-cost-usd", type=float, default=0.05, help="each workflow's ceiling")
    args = parser.parse_args()
    console = Console()
    present = [k for k in KEYS if os.environ.get(k)]
    if not present:
        console.print("no provider key is set (" + ", ".join(KEYS) + "): nothing to run against; exiting 0")
        return 0
    admin, port = "pr-bench-admin", free_port()
    with tempfile.TemporaryDirectory() as data:
        env = {
            **os.environ,
            "POLYROUTE_ADMIN_KEY": admin,
            "HF_HUB_OFFLINE": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polyroute.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                data,
                "--no-local-workers",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/healthz")
            key = httpx.post(
                url + "/admin/keys", headers={"authorization": f"Bearer {admin}"}, json={"tenant": "bench"}
            ).json()["key"]
            rows = run(url, key, args.max_cost_usd)
        finally:
            server.terminate()
            server.wait(timeout=30)
    table = Table("question", "model", "status", "final worker", "steps", "cost USD", "latency s", "note")
    for r in rows:
        table.add_row(
            str(r["question"]),
            r["model"],
            str(r["status"]),
            r.get("worker") or "-",
            str(r.get("steps", "-")),
            r.get("cost_usd") or "-",
            f"{r['latency_s']:.1f}",
            (r.get("note") or "")[:40],
        )
    console.print(table)
    out = ROOT / "bench" / "results" / "compose_live.json"
    out.write_text(
        json.dumps({"keys_present": present, "max_cost_usd": args.max_cost_usd, "runs": rows}, indent=1)
    )
    console.print(f"wrote {out}")
    return 0


def run(url: str, key: str, ceiling: float) -> list[dict]:
    headers = {"authorization": f"Bearer {key}", "x-polyroute-trace": "1"}
    rows = []
    for q, question in enumerate(QUESTIONS):
        for model in MODELS:
            metadata = {"max_cost_usd": ceiling}
            if model == "compose:builder" and "is_palindrome" in question:
                metadata["tests"] = TESTS
            body = {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 400,
                "metadata": metadata,
            }
            started = time.perf_counter()
            response = httpx.post(url + "/v1/chat/completions", headers=headers, json=body, timeout=300)
            row = {
                "question": q,
                "model": model,
                "status": response.status_code,
                "latency_s": time.perf_counter() - started,
                "worker": response.headers.get("x-polyroute-worker"),
                "cost_usd": response.headers.get("x-polyroute-cost-usd"),
                "note": response.headers.get("x-polyroute-compose"),
            }
            if response.status_code == 200:
                payload = response.json()
                row["answer"] = payload["choices"][0]["message"]["content"]
                trace = (payload.get("polyroute") or {}).get("trace")
                row["steps"] = len(trace["steps"]) if trace else 1
                row["trace"] = trace
            else:
                row["error"] = response.text[:500]
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
