"""One gateway per data dir: an exclusive OS lock on `<data dir>/gateway.lock`, held while it serves.

A data dir holds one gateway's in-process books (`spend.json`, the ledger, the spills) and its
embedded Qdrant shards; a second gateway on the same dir would overwrite the first one's spend and
find every collection locked. So `create_app` takes this lock before it reads or writes the data
dir, and a second gateway is refused at start with a message naming the holder.

The lock is `flock(LOCK_EX | LOCK_NB)` on an open file description: the kernel drops it when the
holder's last descriptor closes, so a gateway killed with SIGKILL leaves no stale lock, and a lock
file left behind by a dead process blocks nobody. Two opens in one process conflict as two
processes do (a second app built in the same process is refused too). The pid, host, address and start
time written into the file are for the refusal message only; nothing decides on them. The address is
the one `polyroute serve` bound (it binds before it locks, so `--port 0` is named as the port it
became: `listening`). Under `uvicorn … --factory` (or any ASGI server) the app cannot know it at
start: it is built, and its lifespan started, before uvicorn binds, and uvicorn's own --host/--port
never reach it. So that lock records the settings' host:port marked as only `configured`, and the
refusal says the gateway may listen elsewhere rather than name an address it may not be on; the
gateway's first request tells it where it listens (the ASGI scope's `server`: the local address of
the connection, so for a wildcard bind the interface that request came in on), and the record is
rewritten with it (`listening_on`, from gateway/app.py).

The CLI commands that work beside a running gateway (`keys`, `router train|activate|rollback|
calibrate`, `ledger export`) do not take this lock: their writes are made to be concurrent with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

LOCK_FILE = "gateway.lock"
MAX_RECORD_BYTES = 4096


class DataDirLocked(RuntimeError):
    """Another live gateway (in this process or another) holds the data dir."""


class DataDirLock:
    """The gateway's lock on its data dir. `acquire` is a no-op while held; `release` keeps the file
    (unlinking a lock file lets a third process lock a new inode while the second holds the old)."""

    def __init__(self, data_dir: Path | str, host: str, port: int, listening: bool = True) -> None:
        """`host`:`port`: where the gateway listens (`listening`, as `polyroute serve` knows it, having
        bound it first), or only its configured address (not `listening`: an ASGI server binds its own)."""
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE
        self.host = host
        self.port = port
        self.listening = listening
        self._configured = (host, port, listening)  # what a start after a release records again
        self._started_at = ""
        self._file: Any = None  # the open lock file while held; closing it releases the flock

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock, or raise DataDirLocked saying who holds it and what to do."""
        if self._file is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        # a file object, not a bare fd: an app dropped without ever being shut down still lets go
        # of the lock when it is collected
        lock_file = os.fdopen(fd, "r+b", buffering=0)
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(lock_file.fileno())
            lock_file.close()
            raise DataDirLocked(refusal(self.data_dir, holder)) from None
        except BaseException:
            lock_file.close()
            raise
        self._file = lock_file
        self._started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._write_record()

    def listening_on(self, host: str, port: int) -> None:
        """The gateway was found listening on `host`:`port` (its first request's local address): the
        record names it in place of the configured address. A no-op once the address is known."""
        if self.listening or self._file is None:
            return
        self.host, self.port, self.listening = host, port, True
        with contextlib.suppress(OSError):  # the record informs a refusal; serving does not depend on it
            self._write_record()

    def _write_record(self) -> None:
        record = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "address": f"{self.host}:{self.port}",
                "address_is": "listening" if self.listening else "configured",
                "started_at": self._started_at,
            }
        ).encode()
        # written over the old record, then cut to length: a reader never finds the file empty
        os.pwrite(self._file.fileno(), record, 0)
        os.ftruncate(self._file.fileno(), len(record))

    def release(self) -> None:
        """Let go (idempotent). The record is cleared first: a stopped gateway is named by nobody."""
        lock_file, self._file = self._file, None
        if lock_file is None:
            return
        # a start after this one (the same app, started again) is served where its server binds then
        self.host, self.port, self.listening = self._configured
        with contextlib.suppress(OSError):
            os.ftruncate(lock_file.fileno(), 0)
        lock_file.close()

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def read_holder(fd: int) -> dict[str, Any] | None:
    """The holder's record from the lock file, or None when it is missing or unreadable."""
    try:
        record = json.loads(os.pread(fd, MAX_RECORD_BYTES, 0))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def refusal(data_dir: Path, holder: dict[str, Any] | None) -> str:
    """The refusal: which data dir, who holds it (when recorded), and the two ways out."""
    if holder is None:
        who = f"its pid is not recorded in {data_dir.resolve() / LOCK_FILE}"
    else:
        who = (
            f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, configured address "
            f"{holder.get('address', '?')}, started {holder.get('started_at', '?')}{_elsewhere(holder)}"
        )
    return (
        f"the data dir {data_dir.resolve()} is in use by another polyroute gateway ({who}); one "
        "gateway per data dir: stop that gateway, or give this one another data dir "
        "(POLYROUTE_DATA_DIR or --data-dir)"
    )


def _elsewhere(holder: dict[str, Any]) -> str:
    """For a holder that recorded only its configured address: where it listens is not known."""
    if holder.get("address_is") != "configured":
        return ""
    return (
        "; started outside `polyroute serve` (e.g. by uvicorn --factory, which binds after the app "
        "is built), it may listen on another address"
    )
