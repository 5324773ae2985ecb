"""Gateway overhead: the test upstream called directly vs through polyroute, per client API.

Starts the test upstream and the gateway as separate processes on loopback, then drives each
with the same bounded load (1 and 32 concurrent clients, non-streaming and streaming) and
reports p50/p99 latency, the ratio, and the milliseconds the gateway adds. The gateway is driven
through each client API it serves: POST /v1/chat/completions, /v1/messages (Anthropic) and
/v1/responses (OpenAI Responses, stored as by default); the direct baseline is always the
upstream's chat completions, which is what the worker call is in every case.

In each round every target runs the scenario back to back, in an order rotated from round to
round, so all see the same machine noise. `vs chat` (issue 17's target: within 20%, i.e. <= 1.20)
is, per round, (endpoint p50 - direct p50) / (chat completions p50 - direct p50): the milliseconds
the gateway adds to a request of that API over those it adds to a chat completion, same
concurrency, same stream mode, same round; the median over the rounds is reported.
Writes bench/results/overhead.json.

    .venv/bin/python bench/overhead.py [--requests 400] [--rounds 5]
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
TARGET = 1.20  # issue 17: an endpoint's added ms within 20% of chat completions'
# The gateway's client APIs: the path and the request body (stream set per scenario).
APIS = {
    "chat": ("/v1/chat/completions", {"model": "auto", "messages": MESSAGES}),
    "messages": ("/v1/messages", {"model": "auto", "max_tokens": 256, "messages": MESSAGES}),
    "responses": ("/v1/responses", {"model": "auto", "input": MESSAGES[0]["content"]}),
}


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


async def one_call(client: httpx.AsyncClient, url: str, headers: dict, body: dict, stream: bool) -> float:
    body = {**body, "stream": stream}
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
    url: str, headers: dict, body: dict, concurrency: int, total: int, stream: bool, max_seconds: float
) -> list[float]:
    latencies: list[float] = []
    remaining = [total]
    deadline = time.monotonic() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            while remaining[0] > 0 and time.monotonic() < deadline:
                remaining[0] -= 1
                latencies.append(await one_call(client, url, headers, body, stream))

        for _ in range(min(concurrency, 4)):  # warm the connections and both servers
            await one_call(client, url, headers, body, stream)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000


def targets_for(up_url: str, gw_url: str, key: str) -> dict[str, tuple[str, dict, dict]]:
    """name -> (url, headers, body): the upstream directly, and the gateway through each API."""
    gateway_headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    targets = {
        "direct": (
            up_url + "/v1/chat/completions",
            {"authorization": "Bearer x"},
            {"model": "bench-model", "messages": MESSAGES},
        )
    }
    for api, (path, body) in APIS.items():
        targets[api] = (gw_url + path, gateway_headers, body)
    return targets


def measure(targets: dict, concurrency: int, stream: bool, args: argparse.Namespace) -> dict[str, list]:
    """Latencies per target and round: each round runs every target, in a rotated order."""
    names = list(targets)
    rounds: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            url, headers, body = targets[name]
            rounds[name].append(
                asyncio.run(drive(url, headers, body, concurrency, args.requests, stream, args.max_seconds))
            )
    return rounds


def row(api: str, concurrency: int, stream: bool, rounds: dict[str, list], elapsed: float) -> dict:
    """One table row: the API's latencies against the direct baseline (chat's row keeps the keys the
    file had before the other APIs were added), and for the others the ratio to chat's added ms."""
    direct = [x for r in rounds["direct"] for x in r]
    gateway = [x for r in rounds[api] for x in r]
    d50, d99 = pct(direct, 0.5), pct(direct, 0.99)
    g50, g99 = pct(gateway, 0.5), pct(gateway, 0.99)
    out = {
        "mode": "stream" if stream else "non-stream",
        "concurrency": concurrency,
        "requests_direct": len(direct),
        "requests_gateway": len(gateway),
        "direct_p50_ms": round(d50, 2),
        "direct_p99_ms": round(d99, 2),
        "gateway_p50_ms": round(g50, 2),
        "gateway_p99_ms": round(g99, 2),
        "ratio_p50": round(g50 / d50, 2),
        "ratio_p99": round(g99 / d99, 2),
        "added_p50_ms": round(g50 - d50, 2),
        "added_p99_ms": round(g99 - d99, 2),
        "gateway_mean_ms": round(statistics.fmean(gateway) * 1000, 2),
        "seconds": round(elapsed, 1),
        "endpoint": APIS[api][0],
    }
    if api != "chat":
        per_round = []
        for d, c, g in zip(rounds["direct"], rounds["chat"], rounds[api], strict=True):
            base = pct(d, 0.5)
            per_round.append((pct(g, 0.5) - base) / (pct(c, 0.5) - base))
        out["added_vs_chat_rounds"] = [round(x, 2) for x in per_round]
        out["added_vs_chat"] = round(statistics.median(per_round), 2)
        out["within_target"] = out["added_vs_chat"] <= TARGET
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="requests per target per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running every target")
    parser.add_argument("--max-seconds", type=float, default=60, help="cap per run")
    args = parser.parse_args()
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp:
        procs, up_url, gw_url, key = start_processes(Path(tmp))
        try:
            targets = targets_for(up_url, gw_url, key)
            rows = []
            for stream in (False, True):
                for concurrency in (1, 32):
                    started = time.perf_counter()
                    rounds = measure(targets, concurrency, stream, args)
                    elapsed = time.perf_counter() - started
                    rows += [row(api, concurrency, stream, rounds, elapsed) for api in APIS]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=15)

    table = Table(title="polyroute overhead vs direct upstream (loopback, ms)")
    columns = ["endpoint", "mode", "clients", "direct p50", "direct p99", "gateway p50", "gateway p99"]
    columns += ["ratio p50", "added p50", "added p99", "vs chat"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        vs_chat = (
            f"{r['added_vs_chat']:.2f}" + ("" if r["within_target"] else " !")
            if "added_vs_chat" in r
            else "-"
        )
        table.add_row(
            r["endpoint"].removeprefix("/v1/"),
            r["mode"],
            str(r["concurrency"]),
            f"{r['direct_p50_ms']:.2f}",
            f"{r['direct_p99_ms']:.2f}",
            f"{r['gateway_p50_ms']:.2f}",
            f"{r['gateway_p99_ms']:.2f}",
            f"{r['ratio_p50']:.2f}x",
            f"{r['added_p50_ms']:.2f}",
            f"{r['added_p99_ms']:.2f}",
            vs_chat,
        )
    console.print(table)
    console.print(
        f"vs chat: median over {args.rounds} rounds of (endpoint p50 - direct p50) / (chat p50 - direct p50),"
        f" same clients and mode; target <= {TARGET:.2f} ('!' marks a miss)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "overhead.json"
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "added_vs_chat": "per round: (endpoint p50 - direct p50) / (chat p50 - direct p50), same clients "
        "and mode; the median over rounds. Target <= 1.20 (issue 17).",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
