"""API keys: created once, stored only as SHA-256 hashes, mapped to a tenant.

The embedded default keeps them in one JSON file under the data dir, written atomically
(temp file + rename, under a lock file) so the CLI and a running gateway can share it: the
gateway re-reads the file when its mtime changes (checked at most once per reload interval),
so a key created or revoked by `polyroute keys ...` takes effect without a restart.
Keys are 256-bit random tokens, so a plain hash is the right storage (no password stretching).

The request path calls `verify_async`: an answer already in memory is returned at once, and
anything that needs I/O (re-reading the file, asking Redis) runs in a worker thread, so a slow
disk or a slow Redis never stops the event loop. `verify` is the same check, blocking, for the CLI.
"""

from __future__ import annotations

import asyncio
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
from typing import Protocol

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
    rpm: int | None = None  # this key's own limits, on top of its tenant's (policy YAML)
    tpm: int | None = None

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


class KeyStoreUnavailable(RuntimeError):
    """The shared key store cannot be reached: authentication fails closed (503), never open."""


class KeyStore(Protocol):
    """Hashed API keys; two backends: a file (one host) and Redis (replicas)."""

    def verify(self, plaintext: str) -> KeyRecord | None: ...
    async def verify_async(self, plaintext: str) -> KeyRecord | None: ...
    def list(self, include_revoked: bool = True) -> list[KeyRecord]: ...
    def create(
        self, tenant: str, name: str = "", admin: bool = False, rpm: int | None = None, tpm: int | None = None
    ) -> tuple[KeyRecord, str]: ...
    def revoke(self, key_id: str) -> KeyRecord: ...
    def has_admin(self) -> bool: ...
    def ping(self) -> bool: ...


def check_tenant(tenant: str) -> None:
    """Refuse a tenant name a key must not carry, whoever creates the key (`POST /admin/keys` has a
    stricter pattern of its own; the CLI and the stores come here). A colon is reserved: the gateway
    keeps books under `<owner>:<tenant>` (the judge's budget is `judge:acme`, gateway/judge.py), so a
    key for tenant "judge:acme" spent from, and was reported with, acme's judge budget. Spaces and
    control characters are refused too: "acme " is a typo that no policy tenant matches, and a key
    whose tenant no policy names gets no budget and no tenant rate limit."""
    if not tenant or len(tenant) > 64:
        raise ValueError("tenant must be 1 to 64 characters")
    bad = next((c for c in tenant if c == ":" or c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(
            f"tenant {tenant!r} holds {bad!r}: a tenant name has no spaces, control characters or ':' "
            "(':' is reserved for the gateway's own books, e.g. the judge's 'judge:<tenant>')"
        )


def new_key(
    tenant: str, name: str, admin: bool, rpm: int | None = None, tpm: int | None = None
) -> tuple[KeyRecord, str]:
    """A fresh key and its record; the plaintext is returned once and never stored."""
    check_tenant(tenant)
    for label, value, unit in (("rpm", rpm, "requests"), ("tpm", tpm, "tokens")):
        if value is not None and value <= 0:
            raise ValueError(f"{label} must be a positive number of {unit} per minute")
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    record = KeyRecord(
        id="key_" + secrets.token_hex(6),
        tenant=ADMIN_TENANT if admin else tenant,
        name=name,
        key_hash=hash_key(plaintext),
        created_at=_now(),
        admin=admin,
        rpm=rpm,
        tpm=tpm,
    )
    return record, plaintext


class FileKeyStore:
    """Hashed keys in `<data_dir>/keys.json`; safe to share between processes on one host."""

    def __init__(self, path: Path, reload_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self._records: dict[str, KeyRecord] = {}  # key_hash -> record
        self._seen: tuple[int, ...] | None = None  # `_version` of the file as last read
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._load()

    # ---- reading -------------------------------------------------------------------------
    @staticmethod
    def _version(stat: os.stat_result) -> tuple[int, ...]:
        """What tells one write of the file from the next. Not the mtime alone: a filesystem's
        timestamps can be coarse (1 s on ext4 with small inodes and on some network mounts, a clock
        tick on kernels before 6.13), so a revocation written in the same tick as the creation
        this gateway had just read kept the old mtime and was never read: the revoked key went on
        working. Every write replaces the file (a new inode), so the inode tells them apart."""
        return (stat.st_mtime_ns, stat.st_ino, stat.st_size, stat.st_ctime_ns)

    def _load(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._records, self._seen = {}, None
            return
        if self._version(stat) == self._seen:
            return
        raw = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        records = [KeyRecord(**item) for item in raw.get("keys", [])]
        self._records = {r.key_hash: r for r in records}
        self._seen = self._version(stat)

    def _due(self) -> bool:
        return time.monotonic() - self._checked_at >= self.reload_interval_s

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.reload_interval_s:
            return
        with self._lock:
            self._checked_at = now
            self._load()

    def _lookup(self, plaintext: str) -> KeyRecord | None:
        record = self._records.get(hash_key(plaintext))
        return record if record is not None and record.active else None

    def verify(self, plaintext: str) -> KeyRecord | None:
        """The active record for this key, or None: one hash, one dict hit (and a stat now and then)."""
        self._refresh()
        return self._lookup(plaintext)

    async def verify_async(self, plaintext: str) -> KeyRecord | None:
        """The request path's check: the file is stat'ed (and re-read if it changed) in a thread."""
        if self._due():
            await asyncio.to_thread(self._refresh)
        return self._lookup(plaintext)

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
                    self._seen = None
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
            self._seen = None
            self._load()

    def create(
        self, tenant: str, name: str = "", admin: bool = False, rpm: int | None = None, tpm: int | None = None
    ) -> tuple[KeyRecord, str]:
        """Create a key; the plaintext is returned once and never stored."""
        record, plaintext = new_key(tenant, name, admin, rpm, tpm)
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

    def ping(self) -> bool:
        """A local file is always reachable; its errors surface on read and write."""
        return True


class RedisKeyStore:
    """Hashed keys in Redis, shared by every replica.

    A verified key is remembered locally for `cache_ttl_s` (0.5 s), so most requests never touch
    Redis while a revocation still reaches every replica within a second. When Redis cannot be
    reached, a key verified in the last `stale_grace_s` keeps its last known state (no revocation
    can be written while Redis is down either); any other key fails closed with
    KeyStoreUnavailable (503), never open. A breaker makes those failures immediate.

    "Last known state" must not outlive a revocation this replica could have known of: a key
    verified here before it was revoked elsewhere (another replica, the CLI), and not asked for
    here since, was still cached as active, and was accepted for up to `stale_grace_s` once Redis
    went down. So every revocation also bumps a counter (`REVOCATIONS`) that each replica reads with
    every key it looks up and with every readiness probe; when it changes, whatever was cached
    before is no longer good enough to stand in for Redis (those keys fail closed, 503, until they
    are verified again). What is left is a revocation written after this replica's last contact
    with Redis, i.e. within one readiness-probe period of the outage.
    """

    PREFIX = "polyroute:keys:"
    REVOCATIONS = PREFIX + "revocations"  # bumped by every revocation

    def __init__(
        self, url: str, cache_ttl_s: float = 0.5, stale_grace_s: float = 300.0, timeout_s: float | None = None
    ) -> None:
        from gateway.store.health import REDIS_TIMEOUT_S, Breaker, sync_client

        self._redis = sync_client(url, REDIS_TIMEOUT_S if timeout_s is None else timeout_s)
        self.cache_ttl_s = cache_ttl_s
        self.stale_grace_s = stale_grace_s
        self.breaker = Breaker("Redis (keys)")
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        self._lock = threading.Lock()
        self._revocations: bytes | None | object = _UNSEEN  # the counter as last read
        self._stale_floor = float("-inf")  # cache entries from then or before cannot stand in for Redis

    def _call(self, fn, *args):
        from gateway.store.health import StoreUnavailable, sync_guarded

        try:
            return sync_guarded(self.breaker, lambda: fn(*args), "keys")
        except StoreUnavailable as exc:
            raise KeyStoreUnavailable(f"key store {exc}") from exc

    def _load(self, raw: bytes | None) -> KeyRecord | None:
        return KeyRecord(**json.loads(raw)) if raw else None

    def _fresh(self, key_hash: str) -> tuple[bool, KeyRecord | None]:
        cached = self._cache.get(key_hash)
        if cached is not None and time.monotonic() - cached[0] < self.cache_ttl_s:
            return True, cached[1]
        return False, None

    def _saw_revocations(self, counter: bytes | None, read_at: float) -> None:
        """The revocation counter as read by a round trip that started at `read_at` (monotonic). A
        change means a key may have been revoked since anything in the cache was read: entries read
        at or before `read_at` may no longer stand in for Redis during an outage. (At or before: of
        two reads racing in threads, the one that reports a change may be the older one.)"""
        with self._lock:
            if self._revocations is _UNSEEN:
                self._revocations = counter
            elif counter != self._revocations:
                self._revocations = counter
                self._stale_floor = max(self._stale_floor, read_at)

    def _read(self, key_hash: str) -> tuple[bytes | None, bytes | None]:
        """The key's record and the revocation counter, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(self.PREFIX + "hash:" + key_hash)
        pipe.get(self.REVOCATIONS)
        raw, counter = pipe.execute()
        return raw, counter

    def verify(self, plaintext: str) -> KeyRecord | None:
        """Blocking (a Redis round trip on a cache miss): the CLI's check, and the thread's work below."""
        key_hash = hash_key(plaintext)
        hit, record = self._fresh(key_hash)
        if not hit:
            now = time.monotonic()
            cached = self._cache.get(key_hash)
            try:
                raw, counter = self._call(self._read, key_hash)
            except KeyStoreUnavailable:
                if cached is None or now - cached[0] > self.stale_grace_s or cached[0] <= self._stale_floor:
                    raise
                return cached[1] if cached[1] is not None and cached[1].active else None
            self._saw_revocations(counter, now)
            record = self._load(raw)
            with self._lock:
                if len(self._cache) > 100_000:
                    self._cache.clear()
                self._cache[key_hash] = (now, record)
        return record if record is not None and record.active else None

    async def verify_async(self, plaintext: str) -> KeyRecord | None:
        """The request path's check: a key verified in the last `cache_ttl_s` is answered at once;
        otherwise the Redis round trip runs in a worker thread, never on the event loop."""
        hit, record = self._fresh(hash_key(plaintext))
        if hit:
            return record if record is not None and record.active else None
        return await asyncio.to_thread(self.verify, plaintext)

    def _put(self, record: KeyRecord, revoked: bool = False) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.PREFIX + "hash:" + record.key_hash, json.dumps(asdict(record)))
        pipe.set(self.PREFIX + "id:" + record.id, record.key_hash)
        pipe.sadd(self.PREFIX + "all", record.key_hash)
        if revoked:  # in the same transaction: no replica can read the revocation without the bump
            pipe.incr(self.REVOCATIONS)
        self._call(pipe.execute)

    def create(
        self, tenant: str, name: str = "", admin: bool = False, rpm: int | None = None, tpm: int | None = None
    ) -> tuple[KeyRecord, str]:
        record, plaintext = new_key(tenant, name, admin, rpm, tpm)
        self._put(record)
        return record, plaintext

    def revoke(self, key_id: str) -> KeyRecord:
        key_hash = self._call(self._redis.get, self.PREFIX + "id:" + key_id)
        record = (
            self._load(self._call(self._redis.get, self.PREFIX + "hash:" + key_hash.decode()))
            if key_hash
            else None
        )
        if record is None:
            raise KeyNotFound(key_id)
        if record.active:
            record = replace(record, revoked_at=_now())
            self._put(record, revoked=True)
        with self._lock:
            self._cache.pop(record.key_hash, None)
        return record

    def list(self, include_revoked: bool = True) -> list[KeyRecord]:
        hashes = sorted(h.decode() for h in self._call(self._redis.smembers, self.PREFIX + "all"))
        raws = self._call(self._redis.mget, [self.PREFIX + "hash:" + h for h in hashes]) if hashes else []
        records = sorted((r for r in map(self._load, raws) if r is not None), key=lambda r: r.created_at)
        return [r for r in records if include_revoked or r.active]

    def has_admin(self) -> bool:
        return any(r.admin and r.active for r in self.list())

    def ping(self) -> bool:
        """Readiness; it also reads the revocation counter, so a replica that serves no request
        still learns of revocations (within one readiness-probe period) before an outage."""
        from gateway.store.health import is_unavailable

        read_at = time.monotonic()
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.ping()
            pipe.get(self.REVOCATIONS)
            pong, counter = pipe.execute()
        except Exception as exc:  # not ready, whatever it is; only an outage opens the breaker
            if is_unavailable(exc):
                self.breaker.probe_failed(exc)
            return False
        self.breaker.success()
        self._saw_revocations(counter, read_at)
        return bool(pong)


_UNSEEN = object()  # the revocation counter has not been read yet


def open_key_store(data_dir: Path, redis_url: str | None, reload_interval_s: float = 1.0) -> KeyStore:
    """Redis when a URL is given (replicas share keys), else the file under the data dir."""
    if redis_url:
        return RedisKeyStore(redis_url)
    return FileKeyStore(Path(data_dir) / "keys.json", reload_interval_s)
