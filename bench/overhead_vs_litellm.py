"""polyroute vs LiteLLM's own proxy, in front of the same upstream, with the same load.

Starts the test upstream (`python -m tests.fakes.upstream`), polyroute (uvicorn on
`gateway.app:create_app`, with an API key, the default policy, routing of model "auto" over a
catalog whose worker is that upstream, and the ledger on) and the LiteLLM proxy
(`litellm[proxy]==1.106.2` from its own venv, configured as its production page recommends:
config.yaml model_list with an openai-compatible api_base, a master_key, `set_verbose: False`,
`json_logs: true`, LITELLM_LOG=ERROR; no database) as separate processes on loopback. Then, for
1/16/64 concurrent clients, non-streaming and streaming, it drives the upstream directly, polyroute
and LiteLLM in alternating rounds for a fixed time each, and records latency, requests/s and the
CPU seconds each server's process tree used (so requests per CPU-second compares cost per core).
Both servers run one worker process (`--workers` 1: a gateway owns its data dir, so polyroute
scales by replicas rather than by processes on one dir).

    .venv/bin/python bench/overhead_vs_litellm.py [--seconds 6] [--rounds 2] [--workers 1]
        [--litellm-python PATH]    # default: .venv-litellm-proxy/bin/python, created if missing

Writes bench/results/overhead_vs_litellm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROXY_VENV = ROOT / ".venv-litellm-proxy"
LITELLM_SPEC = "litellm[proxy]==1.106.2"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import free_port, wait_http, write_bench_catalog  # noqa: E402

MESSAGES = [{"role": "user", "content": "Summarise the plot of Hamlet in one sentence, please."}]
MASTER_KEY = "sk-bench-litellm-master"
UPSTREAM_MODEL = "bench-model"
console = Console(width=150)


# ---- processes --------------------------------------------------------------------------------
def ensure_litellm_python(path: str | None) -> Path:
    if path:
        python = Path(path)
        if not python.exists():
            sys.exit(f"--litellm-python {python} does not exist")
        return python
    python = PROXY_VENV / "bin" / "python"
    if not python.exists():
        console.print(
            f"[yellow]LiteLLM proxy venv missing:[/] creating {PROXY_VENV.relative_to(ROOT)} and installing "
            f"{LITELLM_SPEC} (a separate venv, so its dependencies do not touch .venv; ~1-2 minutes)"
        )
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(PROXY_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", LITELLM_SPEC], check=True)
    return python


def litellm_config(path: Path, upstream_url: str) -> None:
    # JSON is valid YAML; the proxy reads it with its YAML loader.
    config = {
        "model_list": [
            {
                "model_name": UPSTREAM_MODEL,
                "litellm_params": {
                    "model": f"openai/{UPSTREAM_MODEL}",
                    "api_base": f"{upstream_url}/v1",
                    "api_key": "sk-bench",
                },
            }
        ],
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"request_timeout": 600, "set_verbose": False, "json_logs": True},
    }
    path.write_text(json.dumps(config, indent=2))


@dataclass
class Servers:
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def start(workdir: Path, litellm_python: Path, workers: int) -> Servers:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    servers = Servers()
    up_port, pr_port, ll_port = free_port(), free_port(), free_port()
    up_url = f"http://127.0.0.1:{up_port}"
    servers.procs["direct"] = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.upstream", "--port", str(up_port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    write_bench_catalog(workdir / "workers.yaml", up_url, UPSTREAM_MODEL)
    from gateway.keys import FileKeyStore

    _, key = FileKeyStore(workdir / "data" / "keys.json").create("bench")
    servers.procs["polyroute"] = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "gateway.app:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(pr_port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        cwd=ROOT,
        env={
            **env,
            "BENCH_UPSTREAM_KEY": "sk-bench",
            "POLYROUTE_WORKERS_FILE": str(workdir / "workers.yaml"),
            "POLYROUTE_DATA_DIR": str(workdir / "data"),
            "POLYROUTE_LOCAL_WORKERS": "false",
        },
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "polyroute.log", "wb"),
    )
    litellm_config(workdir / "litellm.yaml", up_url)
    litellm_bin = litellm_python.parent / "litellm"
    servers.procs["litellm"] = subprocess.Popen(
        [
            str(litellm_bin),
            "--config",
            str(workdir / "litellm.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(ll_port),
            "--num_workers",
            str(workers),
        ],
        cwd=workdir,
        env={
            **env,
            "LITELLM_LOG": "ERROR",
            "JSON_LOGS": "True",
            "DISABLE_SCHEMA_UPDATE": "True",
            "LITELLM_TELEMETRY": "False",
        },
        stdout=open(workdir / "litellm.out.log", "wb"),
        stderr=open(workdir / "litellm.log", "wb"),
    )
    servers.urls = {
        "direct": up_url + "/v1/chat/completions",
        "polyroute": f"http://127.0.0.1:{pr_port}/v1/chat/completions",
        "litellm": f"http://127.0.0.1:{ll_port}/v1/chat/completions",
    }
    servers.headers = {
        "direct": {"authorization": "Bearer x"},
        "polyroute": {"authorization": f"Bearer {key}"},
        "litellm": {"authorization": f"Bearer {MASTER_KEY}"},
    }
    servers.models = {"direct": UPSTREAM_MODEL, "polyroute": "auto", "litellm": UPSTREAM_MODEL}
    try:
        wait_http(up_url + "/v1/models")
        wait_http(f"http://127.0.0.1:{pr_port}/healthz")
        wait_http(f"http://127.0.0.1:{ll_port}/health/liveliness", timeout=180)
    except RuntimeError:
        servers.stop()
        for log in ("polyroute.log", "litellm.log"):
            console.print(f"--- {log}\n" + (workdir / log).read_text(errors="replace")[-3000:])
        raise
    return servers


# ---- CPU accounting ---------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return pids


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process and its live descendants (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            total = 0.0
            for proc in [root, *root.children(recursive=True)]:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.Error:
                    pass
            return total
        except psutil.Error:
            return 0.0
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


# ---- load -------------------------------------------------------------------------------------
async def one_call(
    session: aiohttp.ClientSession, url: str, headers: dict, body: bytes
) -> tuple[float, bool]:
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as response:
        payload = await response.read()
        ok = response.status == 200 and b"error" not in payload[-400:]
    return time.perf_counter() - start, ok


async def drive(url: str, headers: dict, model: str, concurrency: int, stream: bool, seconds: float):
    body = json.dumps({"model": model, "messages": MESSAGES, "stream": stream}).encode()
    headers = {**headers, "content-type": "application/json"}
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(min(concurrency, 4)):  # warm connections and the server
            await one_call(session, url, headers, body)
        deadline = time.monotonic() + seconds

        async def client() -> None:
            nonlocal errors
            while time.monotonic() < deadline:
                try:
                    latency, ok = await one_call(session, url, headers, body)
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1
                    continue
                if ok:
                    latencies.append(latency)
                else:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return latencies, errors, elapsed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000


def sanity_check(servers: Servers) -> None:
    for name in ("polyroute", "litellm"):
        response = httpx.post(
            servers.urls[name],
            headers=servers.headers[name],
            json={"model": servers.models[name], "messages": MESSAGES},
            timeout=30,
        )
        response.raise_for_status()
        text = response.json()["choices"][0]["message"]["content"]
        assert text, f"{name} returned no text"
        bad = httpx.post(
            servers.urls[name], headers={"authorization": "Bearer sk-wrong"}, json={}, timeout=30
        )
        assert bad.status_code in (400, 401, 403), f"{name} accepted a wrong key ({bad.status_code})"


def machine_info() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cpu": model,
        "os": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="duration of one run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per load level")
    parser.add_argument("--workers", type=int, default=1, help="worker processes for each server (1 only)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    parser.add_argument("--litellm-python", default=None, help="python of a venv with litellm[proxy]")
    args = parser.parse_args()
    if args.workers != 1:
        # uvicorn --workers N would start N gateways on one data dir, and the second is refused
        # (gateway/datadir_lock.py); polyroute scales out by replicas, each with its own data dir
        parser.error("--workers must be 1: a polyroute gateway owns its data dir (docs/replicas.md)")
    levels = [int(c) for c in args.concurrency.split(",")]
    litellm_python = ensure_litellm_python(args.litellm_python)
    litellm_version = subprocess.run(
        [str(litellm_python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()

    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        servers = start(Path(tmp), litellm_python, args.workers)
        try:
            sanity_check(servers)
            for stream in (False, True):
                for concurrency in levels:
                    samples = {name: [] for name in servers.urls}
                    errors = dict.fromkeys(servers.urls, 0)
                    seconds = dict.fromkeys(servers.urls, 0.0)
                    cpu = dict.fromkeys(servers.urls, 0.0)
                    for _ in range(args.rounds):
                        for name in servers.urls:
                            pid = servers.procs[name].pid
                            before = cpu_seconds(pid)
                            lat, err, elapsed = asyncio.run(
                                drive(
                                    servers.urls[name],
                                    servers.headers[name],
                                    servers.models[name],
                                    concurrency,
                                    stream,
                                    args.seconds,
                                )
                            )
                            cpu[name] += cpu_seconds(pid) - before
                            samples[name] += lat
                            errors[name] += err
                            seconds[name] += elapsed
                    row: dict = {"mode": "stream" if stream else "non-stream", "concurrency": concurrency}
                    d50, d99 = pct(samples["direct"], 0.5), pct(samples["direct"], 0.99)
                    for name in servers.urls:
                        n = len(samples[name])
                        p50, p99 = pct(samples[name], 0.5), pct(samples[name], 0.99)
                        row[name] = {
                            "requests": n,
                            "errors": errors[name],
                            "p50_ms": round(p50, 2),
                            "p99_ms": round(p99, 2),
                            "rps": round(n / seconds[name], 1),
                            "cpu_s": round(cpu[name], 2),
                            "req_per_cpu_s": round(n / cpu[name], 1) if cpu[name] else None,
                        }
                        if name != "direct":
                            row[name]["added_p50_ms"] = round(p50 - d50, 2)
                            row[name]["added_p99_ms"] = round(p99 - d99, 2)
                    ours, theirs = row["polyroute"], row["litellm"]
                    row["throughput_ratio"] = {
                        "rps": round(ours["rps"] / theirs["rps"], 2) if theirs["rps"] else None,
                        "per_cpu": round(ours["req_per_cpu_s"] / theirs["req_per_cpu_s"], 2)
                        if ours["req_per_cpu_s"] and theirs["req_per_cpu_s"]
                        else None,
                    }
                    rows.append(row)
                    console.print(
                        f"{row['mode']:>10} c={concurrency:<3} polyroute {ours['rps']:7.1f} req/s "
                        f"{ours['req_per_cpu_s']} req/cpu-s | litellm {theirs['rps']:7.1f} req/s "
                        f"{theirs['req_per_cpu_s']} req/cpu-s"
                    )
        finally:
            servers.stop()

    table = Table(
        title=f"polyroute vs LiteLLM proxy {litellm_version} (loopback, {args.workers} worker each)"
    )
    for column in (
        "mode",
        "clients",
        "direct p50/p99",
        "polyroute p50/p99",
        "litellm p50/p99",
        "added p99 pr/ll",
        "req/s pr/ll",
        "req/cpu-s pr/ll",
        "ratio req/s",
        "ratio per-cpu",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        d, p, ll = r["direct"], r["polyroute"], r["litellm"]
        table.add_row(
            r["mode"],
            str(r["concurrency"]),
            f"{d['p50_ms']:.1f}/{d['p99_ms']:.1f}",
            f"{p['p50_ms']:.1f}/{p['p99_ms']:.1f}",
            f"{ll['p50_ms']:.1f}/{ll['p99_ms']:.1f}",
            f"{p['added_p99_ms']:.1f}/{ll['added_p99_ms']:.1f}",
            f"{p['rps']:.0f}/{ll['rps']:.0f}",
            f"{p['req_per_cpu_s'] or 0:.0f}/{ll['req_per_cpu_s'] or 0:.0f}",
            f"{r['throughput_ratio']['rps']}x",
            f"{r['throughput_ratio']['per_cpu']}x",
        )
    console.print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "overhead_vs_litellm.json"
    meta = {
        **machine_info(),
        "litellm_proxy": f"litellm[proxy]=={litellm_version}, --num_workers {args.workers}, master_key auth, "
        "set_verbose False, json_logs, LITELLM_LOG=ERROR, no database",
        "polyroute": f"uvicorn gateway.app:create_app --workers {args.workers}; API key auth, default policy, "
        "model auto routed over a 1-worker catalog, ledger on",
        "load": f"aiohttp clients, {args.seconds}s per run, {args.rounds} alternating rounds "
        "(direct, polyroute, litellm) per level",
        "cpu_accounting": "user+system seconds of each server's process tree during its runs",
        "load_generator_shares_cores": True,
        "seconds_per_run": args.seconds,
        "rounds": args.rounds,
        "workers": args.workers,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpu_source": "psutil" if _has_psutil() else "/proc",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out.relative_to(ROOT)}")


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
