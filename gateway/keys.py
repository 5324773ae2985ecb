"""API keys: created once, stored only as SHA-256 hashes, mapped to a tenant.

The embedded default keeps them in one JSON file under the data dir, written atomically
(temp file + rename, under a lock file) so the CLI and a running gateway can share it: the
gateway re-reads the file when its mtime changes (checked at most once per reload interval),
so a key created or revoked by `polyroute keys ...` takes effect without a restart.
Keys are 256-bit random tokens, so a plain hash is the right storage (no password stretching).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

KEY_PREFIX = "pr-"
ADMIN_TENANT = "__admin__"


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    tenant: str
    name: str
    key_hash: str
    created_at: str
    revoked_at: str | None = None
    admin: bool = False

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def public(self) -> dict:
        """What may be shown (never the hash)."""
        data = asdict(self)
        data.pop("key_hash")
        return data


class KeyNotFound(KeyError):
    pass


class FileKeyStore:
    """Hashed keys in `<data_dir>/keys.json`; safe to share between processes on one host."""

    def __init__(self, path: Path, reload_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self._records: dict[str, KeyRecord] = {}  # key_hash -> record
        self._mtime_ns: int | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._load()

    # ---- reading -------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._records, self._mtime_ns = {}, None
            return
        if stat.st_mtime_ns == self._mtime_ns:
            return
        raw = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        records = [KeyRecord(**item) for item in raw.get("keys", [])]
        self._records = {r.key_hash: r for r in records}
        self._mtime_ns = stat.st_mtime_ns

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.reload_interval_s:
            return
        with self._lock:
            self._checked_at = now
            self._load()

    def verify(self, plaintext: str) -> KeyRecord | None:
        """The active record for this key, or None. Called on every request: one hash, one dict hit."""
        self._refresh()
        record = self._records.get(hash_key(plaintext))
        return record if record is not None and record.active else None

    def list(self, include_revoked: bool = True) -> list[KeyRecord]:
        self._refresh()
        records = sorted(self._records.values(), key=lambda r: r.created_at)
        return [r for r in records if include_revoked or r.active]

    # ---- writing -------------------------------------------------------------------------
    @contextmanager
    def _locked_for_write(self) -> Iterator[dict[str, KeyRecord]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_suffix(".lock")
        with open(lock_path, "a+") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                with self._lock:
                    self._mtime_ns = None
                    self._load()
                    records = dict(self._records)
                yield records
                self._write(records)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _write(self, records: dict[str, KeyRecord]) -> None:
        payload = {"version": 1, "keys": [asdict(r) for r in records.values()]}
        tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        with self._lock:
            self._mtime_ns = None
            self._load()

    def create(self, tenant: str, name: str = "", admin: bool = False) -> tuple[KeyRecord, str]:
        """Create a key; the plaintext is returned once and never stored."""
        if not tenant or len(tenant) > 64:
            raise ValueError("tenant must be 1 to 64 characters")
        plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(
            id="key_" + secrets.token_hex(6),
            tenant=ADMIN_TENANT if admin else tenant,
            name=name,
            key_hash=hash_key(plaintext),
            created_at=_now(),
            admin=admin,
        )
        with self._locked_for_write() as records:
            records[record.key_hash] = record
        return record, plaintext

    def revoke(self, key_id: str) -> KeyRecord:
        with self._locked_for_write() as records:
            match = next((r for r in records.values() if r.id == key_id), None)
            if match is None:
                raise KeyNotFound(key_id)
            if match.active:
                match = replace(match, revoked_at=_now())
                records[match.key_hash] = match
        return match

    def has_admin(self) -> bool:
        return any(r.admin and r.active for r in self.list())
