"""Stored Responses (POST /v1/responses with `store`, the default): in-process or Redis, per tenant, with a TTL.

A record is one response as the client saw it plus the conversation that led to it (the input items
of its whole `previous_response_id` chain, this request's included), so a follow-up needs one read,
not a walk up the chain, and deleting an earlier response does not break a later one.

| backend    | where                                        | expiry                        |
|------------|----------------------------------------------|-------------------------------|
| in-process | a dict, oldest evicted past 10,000 or 256 MB  | checked on read (`clock`)     |
| Redis      | `polyroute:responses:{<tenant>}:<id>` (JSON)  | `SET PX` (Redis expires it)   |

The tenant is part of the key, so no lookup reaches another tenant's responses: an id of another
tenant's is simply not found (404). Unlike the cache this store does not fail open: a conversation
continued without its context would be a wrong answer, so an unreachable Redis is a 503.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import orjson

from gateway.store.health import Breaker, guarded

MAX_ENTRIES = 10_000  # in-process: past either bound the oldest responses are evicted
MAX_BYTES = 256 * 1024 * 1024


class ResponseStore(Protocol):
    async def get(self, tenant: str, response_id: str) -> dict | None: ...
    async def put(self, tenant: str, response_id: str, record: dict, ttl_s: float) -> None: ...
    async def delete(self, tenant: str, response_id: str) -> bool: ...
    def status(self) -> dict: ...


class MemoryResponses:
    """One process's responses, each with its expiry on `clock` (time.monotonic; tests pass their own)."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    async def get(self, tenant: str, response_id: str) -> dict | None:
        with self._lock:
            entry = self._entries.get((tenant, response_id))
            if entry is None:
                return None
            if entry[0] <= self.clock():
                self._drop((tenant, response_id))
                return None
            raw = entry[1]
        return orjson.loads(raw)  # a copy: the caller may change it

    async def put(self, tenant: str, response_id: str, record: dict, ttl_s: float) -> None:
        raw = orjson.dumps(record)
        with self._lock:
            self._drop((tenant, response_id))
            self._entries[(tenant, response_id)] = (self.clock() + ttl_s, raw)
            self._bytes += len(raw)
            while len(self._entries) > self.max_entries or (
                self._bytes > self.max_bytes and len(self._entries) > 1
            ):
                self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[str, str]) -> tuple[float, bytes] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])
        return entry

    async def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entry = self._drop((tenant, response_id))
        return entry is not None and entry[0] > self.clock()

    def status(self) -> dict:
        return {"backend": "memory", "ok": True, "entries": len(self._entries), "bytes": self._bytes}


class RedisResponses:
    """Responses in Redis, shared by every replica. Raises StoreUnavailable / StoreReplyError."""

    PREFIX = "polyroute:responses:"

    def __init__(self, redis, breaker: Breaker) -> None:
        self._redis = redis
        self.breaker = breaker

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.PREFIX}{{{tenant}}}:{response_id}"

    async def get(self, tenant: str, response_id: str) -> dict | None:
        raw = await guarded(
            self.breaker, lambda: self._redis.get(self._key(tenant, response_id)), "responses.get"
        )
        return None if raw is None else orjson.loads(raw)

    async def put(self, tenant: str, response_id: str, record: dict, ttl_s: float) -> None:
        raw = orjson.dumps(record)
        px = max(1, round(ttl_s * 1000))
        await guarded(
            self.breaker, lambda: self._redis.set(self._key(tenant, response_id), raw, px=px), "responses.put"
        )

    async def delete(self, tenant: str, response_id: str) -> bool:
        removed = await guarded(
            self.breaker, lambda: self._redis.delete(self._key(tenant, response_id)), "responses.delete"
        )
        return bool(removed)

    def status(self) -> dict:
        return {"backend": "redis", **self.breaker.status()}


def responses_store(stores) -> ResponseStore:
    """The responses store beside `stores` (gateway.store.Stores, one per app): on the same Redis
    client and breaker when REDIS_URL is set, else an in-process one of this app's own. Opened on
    first use and kept on the Stores object."""
    store = getattr(stores, "_responses", None)
    if store is None:
        if stores.redis is not None:
            store = RedisResponses(stores.redis, stores.breaker)
        else:
            store = MemoryResponses()
        stores._responses = store
    return store
