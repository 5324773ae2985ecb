"""Exact-match response cache: opt-in, per tenant, with a TTL; never shared across tenants.

The key is a SHA-256 of the tenant, the policy version and the normalised request (JSON with
sorted keys, without the fields that do not change the answer: `stream`, `stream_options`,
`user`). The tenant is part of the hash *and* of the Redis key prefix, so no lookup can reach
another tenant's answers; the policy version is in the hash so a policy edit never serves an
answer from a worker the new policy would not admit.

The cache fails open: when the store is down a lookup is a miss and a write is skipped.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from typing import Protocol

import orjson

from gateway.store.health import Breaker, StoreReplyError, StoreUnavailable, guarded

IGNORED_FIELDS = frozenset({"stream", "stream_options", "user"})
MAX_ENTRY_BYTES = 1_000_000


def cache_key(tenant: str, policy_version: str, request: dict) -> str:
    normal = {k: v for k, v in request.items() if k not in IGNORED_FIELDS and v is not None}
    blob = orjson.dumps([tenant, policy_version, normal], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()


class ResponseCache(Protocol):
    async def get(self, tenant: str, key: str) -> bytes | None: ...
    async def put(self, tenant: str, key: str, value: bytes, ttl_s: int) -> None: ...
    def status(self) -> dict: ...


class MemoryCache:
    """Bounded LRU with per-entry expiry (one process)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    async def get(self, tenant: str, key: str) -> bytes | None:
        with self._lock:
            entry = self._entries.get((tenant, key))
            if entry is None:
                return None
            if entry[0] <= time.monotonic():
                del self._entries[(tenant, key)]
                return None
            self._entries.move_to_end((tenant, key))
            return entry[1]

    async def put(self, tenant: str, key: str, value: bytes, ttl_s: int) -> None:
        if len(value) > MAX_ENTRY_BYTES:
            return
        with self._lock:
            self._entries[(tenant, key)] = (time.monotonic() + ttl_s, value)
            self._entries.move_to_end((tenant, key))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def status(self) -> dict:
        return {"backend": "memory", "ok": True, "entries": len(self._entries)}


class RedisCache:
    PREFIX = "polyroute:cache:"

    def __init__(self, redis, breaker: Breaker) -> None:
        self._redis = redis
        self.breaker = breaker

    def _key(self, tenant: str, key: str) -> str:
        return f"{self.PREFIX}{{{tenant}}}:{key}"

    async def get(self, tenant: str, key: str) -> bytes | None:
        try:
            return await guarded(self.breaker, lambda: self._redis.get(self._key(tenant, key)), "cache.get")
        except (StoreUnavailable, StoreReplyError):
            return None  # fail open: a miss

    async def put(self, tenant: str, key: str, value: bytes, ttl_s: int) -> None:
        if len(value) > MAX_ENTRY_BYTES:
            return
        try:
            await guarded(
                self.breaker, lambda: self._redis.set(self._key(tenant, key), value, ex=ttl_s), "cache.put"
            )
        except (StoreUnavailable, StoreReplyError):
            return  # fail open: not cached

    def status(self) -> dict:
        return {"backend": "redis", **self.breaker.status()}
