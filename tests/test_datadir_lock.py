"""One gateway per data dir (gateway/datadir_lock.py): a second one is refused at start, naming the
holder; a stopped gateway lets go, and one killed with SIGKILL leaves no stale lock."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from gateway import Settings, create_app
from gateway.datadir_lock import LOCK_FILE, DataDirLock, DataDirLocked
from policies import PolicyError, parse_catalog
from tests.conftest import ADMIN_KEY, FAKE_KEY_ENV, catalog_yaml_for, start_gateway

START_TIMEOUT_S = 240  # a `polyroute serve` that imports everything on a loaded 2-core machine
ADVICE = "stop that gateway, or give this one another data dir (POLYROUTE_DATA_DIR or --data-dir)"


def settings_for(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, admin_key=ADMIN_KEY, local_workers=False, router_prior=False)


def lock_record(data_dir: Path) -> dict:
    return json.loads((data_dir / LOCK_FILE).read_text())


def in_use_by(data_dir: Path, pid: int) -> str:
    return (
        f"the data dir {data_dir.resolve()} is in use by another polyroute gateway "
        f"(pid {pid} on host {socket.gethostname()}, configured address "
    )


def test_a_second_gateway_on_the_same_dir_is_refused_until_the_first_stops(upstream, tmp_path):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    data_dir = tmp_path / "data"
    first = start_gateway(catalog, data_dir)
    try:
        with pytest.raises(DataDirLocked) as refused:
            start_gateway(catalog, data_dir)
        message = str(refused.value)
        assert message.startswith(in_use_by(data_dir, os.getpid()) + "127.0.0.1:8400, started "), message
        assert message.endswith(ADVICE), message
        # the refused one took nothing over: the first still serves and is the one the file names
        assert httpx.get(first.url + "/healthz", timeout=30).status_code == 200
        assert lock_record(data_dir)["pid"] == os.getpid()
    finally:
        first.server.stop()
    assert (data_dir / LOCK_FILE).read_text() == ""  # a stopped gateway is named by nobody
    second = start_gateway(catalog, data_dir)
    try:
        body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(second.v1 + "/chat/completions", headers=second.auth(), json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        second.server.stop()


@pytest.mark.anyio
async def test_an_app_lets_go_at_shutdown_and_takes_the_dir_again_when_it_starts(upstream, tmp_path):
    """The lifespan (what uvicorn, TestClient and LifespanManager run): shutdown releases the lock, and
    the same app started again takes it back, or is refused at startup while another app holds it."""
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    settings = settings_for(tmp_path / "data")
    first = create_app(settings, catalog)
    async with first.router.lifespan_context(first):
        with pytest.raises(DataDirLocked):
            create_app(settings, catalog)
    second = create_app(settings, catalog)  # the first has shut down
    with pytest.raises(DataDirLocked, match="is in use by another polyroute gateway"):
        async with first.router.lifespan_context(first):
            pytest.fail("the first app started on a data dir the second holds")
    async with second.router.lifespan_context(second):
        pass
    async with first.router.lifespan_context(first):  # a restart of the same app in this process
        with pytest.raises(DataDirLocked):
            create_app(settings, catalog)


def test_a_start_refused_for_its_policy_leaves_the_dir_free(upstream, tmp_path):
    """create_app releases the lock when it fails after taking it: a corrected start in the same
    process is not refused as a second gateway."""
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "ledger.jsonl").write_text("")  # has served, and its policy file is gone
    with pytest.raises(PolicyError, match="refusing to start") as refused:
        create_app(settings_for(data_dir), catalog)
    (data_dir / "policy.yaml").write_text(yaml.safe_dump({"version": "restored"}))
    # `refused` keeps the failed call's frame alive: the lock is let go by create_app, not the collector
    gw = start_gateway(catalog, data_dir)
    try:
        assert gw.state.policy.engine.version.startswith("restored")
    finally:
        gw.server.stop()
    assert refused.traceback  # still referenced up to here


def test_a_holder_whose_record_cannot_be_read_is_still_refused_and_the_message_says_so(tmp_path):
    holder = DataDirLock(tmp_path, "127.0.0.1", 8400)
    holder.acquire()
    try:
        (tmp_path / LOCK_FILE).write_text("not json")  # the record is informational only
        with pytest.raises(DataDirLocked) as refused:
            DataDirLock(tmp_path, "127.0.0.1", 8401).acquire()
        assert f"(its pid is not recorded in {tmp_path.resolve() / LOCK_FILE})" in str(refused.value)
    finally:
        holder.release()
    DataDirLock(tmp_path, "127.0.0.1", 8401).acquire()


# ---- a gateway in another process: `polyroute serve` -------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_")}
    return {**base, FAKE_KEY_ENV: "sk-test", "POLYROUTE_ADMIN_KEY": ADMIN_KEY, **extra}


@contextmanager
def served_by_subprocess(
    data_dir: Path, catalog_file: Path, port: int | None = None, **env: str
) -> Iterator[tuple[subprocess.Popen, int]]:
    """`polyroute serve` on data_dir, yielded once it has printed its "polyroute on http://…" line
    (printed after create_app, so the data dir is locked by then), with the port that line names
    (`port`: the one asked for, a free one by default, 0 for any; `env`: settings beside cli_env's);
    killed on exit."""
    port = free_port() if port is None else port
    command = [sys.executable, "-m", "polyroute.cli", "serve", "--port", str(port), "--no-local-workers"]
    command += ["--data-dir", str(data_dir), "--workers-file", str(catalog_file), "--log-level", "warning"]
    proc = subprocess.Popen(
        command,
        env=cli_env(COLUMNS="1000", **env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:  # drains the pipe for the process's whole life, so it never blocks on it
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"polyroute serve printed nothing for {START_TIMEOUT_S} s: {''.join(seen)}")
            if line is None:
                pytest.fail(f"polyroute serve exited ({proc.wait()}): {''.join(seen)}")
            seen.append(line)
            if "polyroute on http://" in line:
                port = int(line.split("polyroute on http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                break
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


@pytest.fixture
def catalog_file(upstream, tmp_path) -> Path:
    path = tmp_path / "workers.yaml"
    path.write_text(catalog_yaml_for(upstream.url))
    return path


def test_serve_on_a_held_dir_exits_non_zero_with_one_line(catalog_file, tmp_path):
    data_dir = tmp_path / "data"
    with served_by_subprocess(data_dir, catalog_file) as (holder, port), socket.socket() as taken:
        # a port in use: if the second serve were let through, it would fail to bind, not serve on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        command = [sys.executable, "-m", "polyroute.cli", "serve", "--no-local-workers"]
        command += ["--port", str(taken.getsockname()[1]), "--data-dir", str(data_dir)]
        command += ["--workers-file", str(catalog_file)]
        result = subprocess.run(
            command, env=cli_env(COLUMNS="80"), capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
        assert holder.poll() is None, "the first gateway should still run"
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    [line] = out.strip().splitlines()  # one line, even in an 80-column terminal
    assert line.startswith("cannot start: " + in_use_by(data_dir, holder.pid) + f"127.0.0.1:{port}, "), line
    assert line.endswith(ADVICE), line


def test_a_gateway_killed_with_sigkill_leaves_no_stale_lock(upstream, catalog_file, tmp_path):
    data_dir = tmp_path / "data"
    with served_by_subprocess(data_dir, catalog_file) as (holder, port):
        assert lock_record(data_dir)["pid"] == holder.pid
        with pytest.raises(DataDirLocked) as refused:  # held by a live process: refused in this one
            create_app(settings_for(data_dir), parse_catalog(catalog_yaml_for(upstream.url)))
        assert str(refused.value).startswith(in_use_by(data_dir, holder.pid) + f"127.0.0.1:{port}, ")
        holder.kill()  # SIGKILL: no shutdown runs, the lock file stays behind naming the dead process
        assert holder.wait(timeout=60) == -9
    assert lock_record(data_dir)["pid"] == holder.pid
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), data_dir)
    try:
        assert httpx.get(gw.url + "/healthz", timeout=30).status_code == 200
        assert lock_record(data_dir)["pid"] == os.getpid()
    finally:
        gw.server.stop()


def test_serve_on_a_port_in_use_exits_with_one_line_and_leaves_the_data_dir_free(catalog_file, tmp_path):
    """The port is bound before anything starts: a port in use was found by uvicorn only after the
    app had started (a local worker too), and said in uvicorn's words."""
    data_dir = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "polyroute.cli", "serve", "--no-local-workers", "--port", str(port)]
        command += ["--data-dir", str(data_dir), "--workers-file", str(catalog_file)]
        result = subprocess.run(
            command, env=cli_env(COLUMNS="80"), capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    [line] = out.strip().splitlines()
    assert line.startswith(f"cannot start: cannot listen on 127.0.0.1:{port} ("), line
    assert line.endswith("give this gateway another port (POLYROUTE_PORT or --port)"), line
    lock = DataDirLock(data_dir, "127.0.0.1", 1)  # the refused start holds nothing
    lock.acquire()
    lock.release()


def test_serve_on_port_0_names_the_port_it_listens_on(catalog_file, tmp_path):
    """The banner and the data-dir lock name the port bound, not the 0 asked for."""
    data_dir = tmp_path / "data"
    with served_by_subprocess(data_dir, catalog_file, port=0) as (holder, port):
        assert port != 0
        assert lock_record(data_dir)["address"] == f"127.0.0.1:{port}"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
