"""Noisy neighbour: does one tenant's heavy traffic hurt another tenant's small requests?

A real gateway process on a real redis-server (both started here) in front of the test upstream
(its own process). Tenant "light" has a daily budget, so each of its requests goes through Redis
(rate-limit check, usage read, reserve, settle); it sends small requests from a few concurrent
clients. Tenant "heavy" sends 2-4 MB number-heavy prompts from a few threads. Each round runs
the light tenant alone (the baseline) and then next to the heavy tenant, so both see the same
machine; the report is the light tenant's p50/p99 and error rate in each phase, the ratio to the
baseline, errors broken down by status, and /healthz latency (how long the event loop keeps
everyone waiting). Target: the light tenant's error rate is 0% next to the heavy one.

Bounded: each phase stops after --light-requests light requests or --max-seconds, whichever
comes first; the heavy tenant sends at most --heavy-max requests per phase.

    .venv/bin/python bench/noisy_neighbour.py [--rounds 2] [--light-requests 150]
    .venv/bin/python bench/noisy_neighbour.py --gateway-src /path/to/other/checkout  # A/B a version

Writes bench/results/noisy_neighbour.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import redis
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from bench.overhead import free_port, pct, wait_http  # noqa: E402

ADMIN_KEY = "pr-bench-admin"
LIGHT_BODY = {
    "model": "auto",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 5,
}


# ---- processes -------------------------------------------------------------------------------
def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def start_stack(workdir: Path, gateway_src: Path) -> tuple[list[subprocess.Popen], str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    redis_proc, redis_url = start_redis(workdir)
    up_port, gw_port = free_port(), free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.upstream", "--port", str(up_port), "--latency-ms", "20"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    catalog = workdir / "workers.yaml"
    catalog.write_text(
        f"""version: 1
workers:
  - name: bench-upstream
    model: openai/bench-model
    api_base: http://127.0.0.1:{up_port}/v1
    api_key_env: BENCH_UPSTREAM_KEY
    input_price_per_m: 0.10
    output_price_per_m: 0.20
    tier: open-moe
    license: Apache-2.0
    provider: fake
    jurisdiction: US
    context_window: 2000000
"""
    )
    policy = workdir / "policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": "noisy-neighbour",
                "tenants": {"light": {"budget": {"daily_usd": "1000"}}, "heavy": {}},
            }
        )
    )
    gateway = subprocess.Popen(
        [sys.executable, "-m", "polyroute.cli", "serve", "--port", str(gw_port)]
        + ["--workers-file", str(catalog), "--data-dir", str(workdir / "data")]
        + ["--no-local-workers", "--log-level", "warning"],
        cwd=gateway_src,  # `python -m` imports the gateway from here
        env={
            **env,
            "BENCH_UPSTREAM_KEY": "sk-bench",
            "REDIS_URL": redis_url,
            "POLYROUTE_ADMIN_KEY": ADMIN_KEY,
            "POLYROUTE_POLICY_FILE": str(policy),
        },
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "gateway.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    gw_url = f"http://127.0.0.1:{gw_port}"
    procs = [gateway, upstream, redis_proc]
    try:  # a loaded machine can take a minute to import everything
        wait_http(f"http://127.0.0.1:{up_port}/v1/models", timeout=180)
        wait_http(gw_url + "/healthz", timeout=180)
    except RuntimeError:
        stop(procs)
        raise RuntimeError(
            "the stack did not start:\n" + (workdir / "gateway.log").read_text()[-3000:]
        ) from None
    return procs, gw_url, redis_url


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def new_key(gw_url: str, tenant: str) -> str:
    created = httpx.post(
        gw_url + "/admin/keys",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        json={"tenant": tenant},
        timeout=30,
    )
    created.raise_for_status()
    return created.json()["key"]


# ---- load ------------------------------------------------------------------------------------
def heavy_bodies(count: int, seed: int = 12) -> list[bytes]:
    """Prompts of 2 to 4 MB made of numbers (amounts, ids, dates, long digit runs): the worst case
    for the data-class detectors, which look at every digit group."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        size = rng.randint(2_000_000, 3_900_000)  # under the 4 MiB body limit with the JSON around it
        parts: list[str] = []
        total = 0
        while total < size:
            kind = rng.random()
            if kind < 0.4:
                token = str(rng.randint(0, 10 ** rng.randint(1, 9)))
            elif kind < 0.6:
                token = f"{rng.randint(0, 99999)}.{rng.randint(0, 99):02d}"
            elif kind < 0.75:
                token = " ".join(str(rng.randint(1000, 9999)) for _ in range(4))
            elif kind < 0.9:
                token = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            else:
                token = "".join(rng.choice("0123456789") for _ in range(rng.randint(10, 20)))
            parts.append(token)
            total += len(token) + 1
        content = "Sum these numbers: " + " ".join(parts)
        bodies.append(
            orjson.dumps(
                {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 5}
            )
        )
    return bodies


class Outcomes:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.statuses: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[str] = collections.Counter()

    def add(self, status: str, seconds: float, code: str | None = None) -> None:
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(seconds)
        elif code:
            self.codes[f"{status} {code}"] += 1

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def errors(self) -> int:
        return self.total - self.statuses.get("200", 0)


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def light_phase(gw_url: str, key: str, concurrency: int, total: int, max_seconds: float):
    """The light tenant's small requests, plus a /healthz probe every 50 ms (event-loop lag)."""
    light, health = Outcomes(), Outcomes()
    remaining = [total]
    deadline = time.monotonic() + max_seconds
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            while remaining[0] > 0 and time.monotonic() < deadline:
                remaining[0] -= 1
                start = time.perf_counter()
                try:
                    response = await client.post(
                        gw_url + "/v1/chat/completions", json=LIGHT_BODY, headers=headers
                    )
                    light.add(str(response.status_code), time.perf_counter() - start, _code(response))
                except httpx.HTTPError as exc:
                    light.add(f"exc:{type(exc).__name__}", time.perf_counter() - start)

        async def prober(done: asyncio.Event) -> None:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    response = await client.get(gw_url + "/healthz")
                    health.add(str(response.status_code), time.perf_counter() - start)
                except httpx.HTTPError as exc:
                    health.add(f"exc:{type(exc).__name__}", time.perf_counter() - start)
                await asyncio.sleep(0.05)

        done = asyncio.Event()
        probe = asyncio.create_task(prober(done))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        done.set()
        await probe
    return light, health


def heavy_load(
    gw_url: str, key: str, bodies: list[bytes], threads: int, max_requests: int, stop: threading.Event
):
    """The heavy tenant: `threads` clients posting the big bodies until told to stop (or the cap)."""
    heavy = Outcomes()
    sent = [0]
    lock = threading.Lock()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}

    def client_loop(index: int) -> None:
        with httpx.Client(timeout=120) as client:
            n = index
            while not stop.is_set():
                with lock:
                    if sent[0] >= max_requests:
                        return
                    sent[0] += 1
                body = bodies[n % len(bodies)]
                n += threads
                start = time.perf_counter()
                try:
                    response = client.post(gw_url + "/v1/chat/completions", content=body, headers=headers)
                    status, code = str(response.status_code), _code(response)
                except httpx.HTTPError as exc:
                    status, code = f"exc:{type(exc).__name__}", None
                with lock:
                    heavy.add(status, time.perf_counter() - start, code)

    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="heavy")
    futures = [pool.submit(client_loop, i) for i in range(threads)]
    return heavy, pool, futures


def summary(outcomes: Outcomes) -> dict:
    lat = outcomes.latencies
    return {
        "requests": outcomes.total,
        "ok": len(lat),
        "errors": outcomes.errors,
        "error_rate": round(outcomes.errors / outcomes.total, 4) if outcomes.total else None,
        "p50_ms": round(pct(lat, 0.5), 1) if lat else None,
        "p99_ms": round(pct(lat, 0.99), 1) if lat else None,
        "max_ms": round(max(lat) * 1000, 1) if lat else None,
        "by_status": dict(sorted(outcomes.statuses.items())),
        "error_codes": dict(sorted(outcomes.codes.items())),
    }


def merge(parts: list[Outcomes]) -> Outcomes:
    out = Outcomes()
    for part in parts:
        out.latencies += part.latencies
        out.statuses.update(part.statuses)
        out.codes.update(part.codes)
    return out


# ---- main ------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="baseline + mixed phases, alternating")
    parser.add_argument("--light-requests", type=int, default=150, help="light requests per phase")
    parser.add_argument("--light-concurrency", type=int, default=4)
    parser.add_argument("--heavy-threads", type=int, default=3, help="concurrent heavy clients")
    parser.add_argument(
        "--heavy-max",
        type=int,
        default=200,
        help="heavy requests per mixed phase at most (it also ends with it)",
    )
    parser.add_argument("--max-seconds", type=float, default=60, help="cap per phase")
    parser.add_argument("--gateway-src", type=Path, default=ROOT, help="checkout whose gateway is run")
    parser.add_argument("--out", type=Path, default=RESULTS / "noisy_neighbour.json")
    args = parser.parse_args()
    console = Console(width=150)
    started = time.perf_counter()
    bodies = heavy_bodies(4)
    console.print(f"heavy bodies: {', '.join(f'{len(b) / 1e6:.1f} MB' for b in bodies)}")
    phases: dict[str, dict[str, list[Outcomes]]] = {
        "baseline": {"light": [], "health": [], "heavy": []},
        "with heavy": {"light": [], "health": [], "heavy": []},
    }
    with tempfile.TemporaryDirectory() as tmp:
        procs, gw_url, redis_url = start_stack(Path(tmp), args.gateway_src.resolve())
        try:
            light_key, heavy_key = new_key(gw_url, "light"), new_key(gw_url, "heavy")
            asyncio.run(light_phase(gw_url, light_key, 2, 10, 30))  # warm up connections and caches
            for round_no in range(args.rounds):
                for phase in phases:
                    stop_heavy = threading.Event()
                    pool = None
                    if phase == "with heavy":
                        heavy, pool, futures = heavy_load(
                            gw_url, heavy_key, bodies, args.heavy_threads, args.heavy_max, stop_heavy
                        )
                        time.sleep(1.0)  # the heavy requests are in the gateway before the light start
                    light, health = asyncio.run(
                        light_phase(
                            gw_url, light_key, args.light_concurrency, args.light_requests, args.max_seconds
                        )
                    )
                    if pool is not None:
                        stop_heavy.set()
                        concurrent.futures.wait(futures, timeout=180)
                        pool.shutdown(wait=False, cancel_futures=True)
                        phases[phase]["heavy"].append(heavy)
                    phases[phase]["light"].append(light)
                    phases[phase]["health"].append(health)
                    console.print(
                        f"round {round_no + 1} {phase}: light {light.total} requests, {light.errors} errors"
                    )
            ready = httpx.get(gw_url + "/readyz", timeout=30).json()
        finally:
            stop(procs)
        log_tail = (Path(tmp) / "gateway.log").read_text(errors="replace")[-4000:]

    rows = {}
    for phase, parts in phases.items():
        rows[phase] = {
            "light": summary(merge(parts["light"])),
            "healthz": summary(merge(parts["health"])),
            "heavy": summary(merge(parts["heavy"])) if parts["heavy"] else None,
        }
    base, mixed = rows["baseline"]["light"], rows["with heavy"]["light"]
    ratios = {
        "light_p50": round(mixed["p50_ms"] / base["p50_ms"], 2)
        if base["p50_ms"] and mixed["p50_ms"]
        else None,
        "light_p99": round(mixed["p99_ms"] / base["p99_ms"], 2)
        if base["p99_ms"] and mixed["p99_ms"]
        else None,
    }

    table = Table(title="noisy neighbour: the light tenant's requests, alone and next to 2-4 MB prompts")
    for column in (
        "phase",
        "light reqs",
        "errors",
        "error rate",
        "p50 ms",
        "p99 ms",
        "max ms",
        "healthz p99 ms",
        "heavy reqs (ok)",
        "heavy p50 ms",
    ):
        table.add_column(column, justify="right")
    for phase, row in rows.items():
        light, health, heavy = row["light"], row["healthz"], row["heavy"]
        table.add_row(
            phase,
            str(light["requests"]),
            str(light["errors"]),
            f"{100 * (light['error_rate'] or 0):.1f}%",
            f"{light['p50_ms']}",
            f"{light['p99_ms']}",
            f"{light['max_ms']}",
            f"{health['p99_ms']}",
            f"{heavy['requests']} ({heavy['ok']})" if heavy else "-",
            f"{heavy['p50_ms']}" if heavy else "-",
        )
    console.print(table)
    console.print(f"light p50 ×{ratios['light_p50']}, p99 ×{ratios['light_p99']} vs the baseline")
    for phase, row in rows.items():
        if row["light"]["errors"]:
            console.print(
                f"{phase}: light errors by status {row['light']['by_status']} {row['light']['error_codes']}"
            )
        if row["heavy"]:
            console.print(
                f"{phase}: heavy by status {row['heavy']['by_status']} {row['heavy']['error_codes']}"
            )
    store = ready.get("store", {})
    console.print(
        f"store after the run: ok={store.get('ok')} breaker opened {store.get('opened', '?')} times"
    )

    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "gateway_src": str(args.gateway_src.resolve()),
        "rounds": args.rounds,
        "light_requests_per_phase": args.light_requests,
        "light_concurrency": args.light_concurrency,
        "heavy_threads": args.heavy_threads,
        "heavy_max_per_phase": args.heavy_max,
        "heavy_body_mb": [round(len(b) / 1e6, 2) for b in bodies],
        "seconds": round(time.perf_counter() - started, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"meta": meta, "phases": rows, "ratios": ratios, "store_after": store}, indent=2) + "\n"
    )
    console.print(f"wrote {args.out}")
    if any(row["light"]["errors"] for row in rows.values()):
        console.print("[yellow]gateway log tail:[/]\n" + log_tail)


if __name__ == "__main__":
    main()
