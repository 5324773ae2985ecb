"""The data-dir lock of a gateway started by uvicorn itself (`uvicorn gateway.app:create_app --factory`)
does not name an address it may not listen on (gateway/datadir_lock.py).

The app is built, and its lifespan started, before uvicorn binds; uvicorn's own --host/--port never
reach it. The lock recorded the settings' address as the gateway's, and a second gateway's refusal
named it: with `--port 0` (or any --port but POLYROUTE_PORT) an address nothing listens on. Now,
until the gateway knows better, the record says that address is only the configured one and the
refusal says the gateway may listen elsewhere; its first request tells it where it listens (the
connection's local address), and from then on the record and the refusal name that address.
`polyroute serve`, which binds before it locks, names the port it bound from the start
(tests/test_datadir_lock.py).

uvicorn runs for real in a subprocess on --port 0; the test reads the port it bound from its own log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gateway.datadir_lock import LOCK_FILE, DataDirLock, DataDirLocked

START_TIMEOUT_S = 180  # imports everything on a loaded 2-core machine
CONFIGURED = "127.0.0.1:8471"  # POLYROUTE_HOST:POLYROUTE_PORT, where this gateway does not listen
RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def uvicorn_on_port_0(data_dir: Path) -> tuple[subprocess.Popen, int]:
    """uvicorn serving the gateway on a port it chooses; returns it and that port, once it serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_")}
    host, port = CONFIGURED.split(":")
    env |= {
        "POLYROUTE_DATA_DIR": str(data_dir),
        "POLYROUTE_LOCAL_WORKERS": "0",
        "POLYROUTE_ROUTER_PRIOR": "0",
        "POLYROUTE_HOST": host,
        "POLYROUTE_PORT": port,
    }
    command = [sys.executable, "-m", "uvicorn", "gateway.app:create_app", "--factory"]
    command += ["--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    bound: list[int] = []
    lines: list[str] = []

    def read_log() -> None:  # until uvicorn says where it listens; the rest of the log is drained
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if not bound and (match := RUNNING.search(line)):
                bound.append(int(match.group(1)))
                started.set()
        started.set()  # it exited

    started = threading.Event()
    threading.Thread(target=read_log, daemon=True).start()
    if not started.wait(START_TIMEOUT_S) or not bound:
        proc.kill()
        pytest.fail("uvicorn did not start:\n" + "".join(lines))
    return proc, bound[0]


def lock_record(data_dir: Path) -> dict:
    return json.loads((data_dir / LOCK_FILE).read_text())


def refusal_of_a_second_gateway(data_dir: Path) -> str:
    with pytest.raises(DataDirLocked) as refused:
        DataDirLock(data_dir, "127.0.0.1", 8472).acquire()
    return str(refused.value)


ELSEWHERE = (
    "; started outside `polyroute serve` (e.g. by uvicorn --factory, which binds after the app is "
    "built), it may listen on another address); one gateway per data dir"
)


def test_a_gateway_started_by_uvicorn_on_port_0_is_named_where_it_listens_once_it_knows(tmp_path):
    data_dir = tmp_path / "data"
    proc, port = uvicorn_on_port_0(data_dir)
    holder = f"(pid {proc.pid} on host {socket.gethostname()}, configured address "
    try:
        assert f"127.0.0.1:{port}" != CONFIGURED
        # before any request: the settings' address, said to be only that
        record = lock_record(data_dir)
        assert record["pid"] == proc.pid
        assert (record["address"], record["address_is"]) == (CONFIGURED, "configured"), record
        message = refusal_of_a_second_gateway(data_dir)
        assert f"{holder}{CONFIGURED}, started {record['started_at']}{ELSEWHERE}" in message, message
        # its first request tells it where it listens
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        learned = lock_record(data_dir)
        assert learned == {**record, "address": f"127.0.0.1:{port}", "address_is": "listening"}
        message = refusal_of_a_second_gateway(data_dir)
        assert f"{holder}127.0.0.1:{port}, started {record['started_at']}); one gateway" in message, message
    finally:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the lifespan's shutdown releases the lock
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert (data_dir / LOCK_FILE).read_text() == ""  # a stopped gateway is named by nobody


def test_a_lock_taken_where_the_gateway_listens_is_named_as_such(tmp_path):
    """`polyroute serve` binds first and gives create_app a lock on the port it bound: no caveat."""
    with DataDirLock(tmp_path, "127.0.0.1", 8473):
        assert lock_record(tmp_path)["address_is"] == "listening"
        message = refusal_of_a_second_gateway(tmp_path)
    assert ", configured address 127.0.0.1:8473, started " in message
    assert "may listen on another address" not in message


def test_a_learned_address_is_forgotten_when_the_lock_is_let_go(tmp_path):
    """The same app started again (in this process) may be served elsewhere: its next start records
    the configured address again, until a request says where it listens then."""
    lock = DataDirLock(tmp_path, "127.0.0.1", 8475, listening=False)
    with lock:
        lock.listening_on("127.0.0.1", 40123)
        assert (lock_record(tmp_path)["address"], lock_record(tmp_path)["address_is"]) == (
            "127.0.0.1:40123",
            "listening",
        )
    with lock:
        record = lock_record(tmp_path)
        assert (record["address"], record["address_is"]) == ("127.0.0.1:8475", "configured")
