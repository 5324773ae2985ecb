"""Gateway overhead: the test upstream called directly vs through polyroute.

Starts the test upstream and the gateway as separate processes on loopback, then drives each
with the same bounded load (1 and 32 concurrent clients, non-streaming and streaming) and
reports p50/p99 latency, the ratio, and the milliseconds the gateway adds. Direct and gateway
runs alternate in rounds so both see the same machine noise. Writes bench/results/overhead.json.

    .venv/bin/python bench/overhead.py [--requests 400] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

MESSAGES = [{"role": "user", "content": "Summarise the plot of Hamlet in one sentence, please."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def write_bench_catalog(path: Path, upstream_url: str, model: str = "bench-model") -> None:
    """One worker on the test upstream: what both overhead benchmarks put the gateway in front of."""
    path.write_text(
        f"""version: 1
workers:
  - name: bench-upstream
    model: openai/{model}
    api_base: {upstream_url}/v1
    api_key_env: BENCH_UPSTREAM_KEY
    input_price_per_m: 1.0
    output_price_per_m: 2.0
    tier: open-moe
    license: Apache-2.0
    provider: fake
    jurisdiction: US
    context_window: 8192
"""
    )


def start_processes(workdir: Path) -> tuple[list[subprocess.Popen], str, str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    up_port, gw_port = free_port(), free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.upstream", "--port", str(up_port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    catalog = workdir / "workers.yaml"
    write_bench_catalog(catalog, f"http://127.0.0.1:{up_port}")
    from gateway.keys import FileKeyStore

    _, key = FileKeyStore(workdir / "data" / "keys.json").create("bench")
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyroute.cli",
            "serve",
            "--port",
            str(gw_port),
            "--workers-file",
            str(catalog),
            "--data-dir",
            str(workdir / "data"),
            "--no-local-workers",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env={**env, "BENCH_UPSTREAM_KEY": "sk-bench"},
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "gateway.log", "wb"),
    )
    up_url, gw_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    wait_http(up_url + "/v1/models")
    wait_http(gw_url + "/healthz")
    return [upstream, gateway], up_url, gw_url, key


async def one_call(client: httpx.AsyncClient, url: str, headers: dict, model: str, stream: bool) -> float:
    body = {"model": model, "messages": MESSAGES, "stream": stream}
    start = time.perf_counter()
    if stream:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            response.raise_for_status()
            async for _ in response.aiter_bytes():
                pass
    else:
        response = await client.post(url, json=body, headers=headers)
        response.raise_for_status()
    return time.perf_counter() - start


async def drive(
    url: str, headers: dict, model: str, concurrency: int, total: int, stream: bool, max_seconds: float
) -> list[float]:
    latencies: list[float] = []
    remaining = [total]
    deadline = time.monotonic() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            while remaining[0] > 0 and time.monotonic() < deadline:
                remaining[0] -= 1
                latencies.append(await one_call(client, url, headers, model, stream))

        for _ in range(min(concurrency, 4)):  # warm the connections and both servers
            await one_call(client, url, headers, model, stream)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="requests per scenario per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds")
    parser.add_argument("--max-seconds", type=float, default=60, help="cap per run")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        procs, up_url, gw_url, key = start_processes(Path(tmp))
        try:
            targets = {
                "direct": (up_url + "/v1/chat/completions", {"authorization": "Bearer x"}, "bench-model"),
                "gateway": (gw_url + "/v1/chat/completions", {"authorization": f"Bearer {key}"}, "auto"),
            }
            rows = []
            scenarios = [(c, s) for s in (False, True) for c in (1, 32)]
            for concurrency, stream in scenarios:
                samples: dict[str, list[float]] = {"direct": [], "gateway": []}
                started = time.perf_counter()
                for _ in range(args.rounds):
                    for name, (url, headers, model) in targets.items():
                        samples[name] += asyncio.run(
                            drive(url, headers, model, concurrency, args.requests, stream, args.max_seconds)
                        )
                elapsed = time.perf_counter() - started
                d50, d99 = pct(samples["direct"], 0.5), pct(samples["direct"], 0.99)
                g50, g99 = pct(samples["gateway"], 0.5), pct(samples["gateway"], 0.99)
                rows.append(
                    {
                        "mode": "stream" if stream else "non-stream",
                        "concurrency": concurrency,
                        "requests_direct": len(samples["direct"]),
                        "requests_gateway": len(samples["gateway"]),
                        "direct_p50_ms": round(d50, 2),
                        "direct_p99_ms": round(d99, 2),
                        "gateway_p50_ms": round(g50, 2),
                        "gateway_p99_ms": round(g99, 2),
                        "ratio_p50": round(g50 / d50, 2),
                        "ratio_p99": round(g99 / d99, 2),
                        "added_p50_ms": round(g50 - d50, 2),
                        "added_p99_ms": round(g99 - d99, 2),
                        "gateway_mean_ms": round(statistics.fmean(samples["gateway"]) * 1000, 2),
                        "seconds": round(elapsed, 1),
                    }
                )
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=15)

    table = Table(title="polyroute overhead vs direct upstream (loopback, ms)")
    for column in (
        "mode",
        "clients",
        "direct p50",
        "direct p99",
        "gateway p50",
        "gateway p99",
        "ratio p50",
        "added p50",
        "added p99",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["mode"],
            str(r["concurrency"]),
            f"{r['direct_p50_ms']:.2f}",
            f"{r['direct_p99_ms']:.2f}",
            f"{r['gateway_p50_ms']:.2f}",
            f"{r['gateway_p99_ms']:.2f}",
            f"{r['ratio_p50']:.2f}x",
            f"{r['added_p50_ms']:.2f}",
            f"{r['added_p99_ms']:.2f}",
        )
    console.print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "overhead.json"
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
