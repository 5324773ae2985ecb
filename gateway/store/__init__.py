"""Shared state behind one interface, two backends: in-process (default) and Redis (replicas).

| feature     | in-process              | Redis                          | when Redis is down           |
|-------------|-------------------------|--------------------------------|------------------------------|
| keys        | keys.json (file)        | hashes, 0.5 s local cache      | recently verified keys work, others 503 |
| budgets     | dict + spend.json       | Lua reserve/settle/release     | fail closed (503) for tenants with a budget |
| rate limits | GCRA in a dict          | GCRA in one Lua script         | fail open (logged, counted)  |
| cache       | LRU with TTL            | SET EX under the tenant's prefix | fail open (miss)           |
| ledger      | ledger.jsonl            | stream, buffered writes        | buffered (bounded), spilled to disk at shutdown |

Budget settles and spend that could not be sent are kept too, and spilled to
`budget-unsent.jsonl` at shutdown (`RedisBudgets.spill`), like the ledger's records.

"Down" is decided by the breaker (gateway/store/health.py): connection failures and timeouts,
BREAKER_THRESHOLD in a row or one failed health probe, not one slow reply (REDIS_TIMEOUT_S is
generous for a loaded machine). A reply error (Redis answered that our script or data is wrong)
is not "down": it fails only the request that hit it (500 `store_error`) and is logged once per kind.

A request's ledger record may be written a moment after its answer (a stream's when it is settled,
a replica's when it next flushes to Redis); `find_request` lets the feedback endpoint wait for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from gateway.ledger import Ledger, RequestRecord
from gateway.store.budgets import (
    BudgetExceeded,
    Budgets,
    Limits,
    MemoryBudgets,
    RedisBudgets,
    Reservation,
    to_micros,
)
from gateway.store.cache import MemoryCache, RedisCache, ResponseCache, cache_key
from gateway.store.health import (
    BREAKER_COOLDOWN_S,
    BREAKER_THRESHOLD,
    REDIS_TIMEOUT_S,
    Breaker,
    StoreReplyError,
    StoreUnavailable,
    is_unavailable,
    sync_client,
)
from gateway.store.ledger_redis import Arrivals, RedisLedger
from gateway.store.ratelimit import Limit, Limiter, MemoryLimiter, RedisLimiter, Verdict

__all__ = [
    "BudgetExceeded",
    "Budgets",
    "Breaker",
    "Limit",
    "Limiter",
    "Limits",
    "Reservation",
    "ResponseCache",
    "StoreReplyError",
    "StoreUnavailable",
    "Stores",
    "Verdict",
    "cache_key",
    "find_request",
    "open_stores",
    "to_micros",
]


class LocalLedger(Ledger):
    """The file ledger of a single gateway, telling a feedback that waits for a request id when that
    request is recorded (`Arrivals`). Nothing else writes this ledger, so such a wait needs no polling."""

    shared = False

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.arrivals = Arrivals()

    def record_request(self, record: RequestRecord) -> None:
        super().record_request(record)
        self.arrivals.arrived(record.id)


# Polling the Redis index for a record another replica has not flushed yet: the first re-check soon
# (a record written here wakes the wait at once anyway), then doubling up to about two flush
# intervals, so a long wait costs a few Redis reads, not one per millisecond.
FIRST_POLL_S = 0.01
MAX_POLL_S = 0.4


async def find_request(
    ledger: LocalLedger | RedisLedger, request_id: str, tenant: str, wait_s: float
) -> tuple[str, str | None] | None:
    """(tenant, worker) of `tenant`'s request `request_id`, waiting up to `wait_s` seconds for its
    record; None if it is still unknown, or another tenant's, by then.

    The feedback a client sends right after its answer can come before the request's record: a
    stream's is written when its budget is settled, after the last chunk, and a replica keeps its
    records in memory until it next flushes them to Redis, where another replica finds them. A 404
    then would tell the client the request does not exist, and it would drop the feedback. So an id
    not found is looked for again — when it is recorded here (an event) and, with Redis, every so
    often in the index (exponential backoff) — until the deadline. Another tenant's id takes exactly
    the same path as an unknown one, wait included, so neither the answer nor its timing confirms it
    exists. Every wait is an asyncio wait: the event loop keeps serving meanwhile. Raises
    StoreUnavailable when Redis cannot be read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    poll = FIRST_POLL_S
    with ledger.arrivals.watch(request_id) as recorded:  # before the first look: no arrival missed
        while True:
            found = await asyncio.to_thread(ledger.lookup, request_id)
            if found is not None and found[0] == tenant:
                return found
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(recorded.wait(), min(poll, remaining) if ledger.shared else remaining)
            except TimeoutError:
                pass
            recorded.clear()  # a foreign id recorded meanwhile must not turn the wait into a busy loop
            poll = min(poll * 2, MAX_POLL_S)


@dataclass
class Stores:
    budgets: Budgets
    limiter: Limiter
    cache: ResponseCache
    ledger: LocalLedger | RedisLedger
    breaker: Breaker | None = None  # the Redis breaker, None in-process
    redis: object | None = None  # the asyncio client (closed at shutdown)

    @property
    def backend(self) -> str:
        return "memory" if self.breaker is None else "redis"

    async def ping(self) -> bool:
        """Readiness: can the shared store be reached right now (always true in-process)."""
        if self.redis is None:
            return True
        try:
            ok = bool(await self.redis.ping())
        except Exception as exc:
            if is_unavailable(exc):
                self.breaker.probe_failed(exc)  # a failed health probe: Redis is down, fail fast now
            return False
        self.breaker.success()
        return ok

    def status(self) -> dict:
        return {
            "backend": self.backend,
            **(self.breaker.status() if self.breaker else {"ok": True, "error": None}),
            "budgets": self.budgets.status(),
            "rate_limits": self.limiter.status(),
            "cache": self.cache.status(),
            "ledger": self.ledger.status() if hasattr(self.ledger, "status") else {"backend": "file"},
        }

    async def close(self) -> None:
        """At shutdown, after the last flush: budget settles and spend still unsent (Redis down) are
        kept on disk for the next start, as the ledger's records are; then the client closes."""
        if isinstance(self.budgets, RedisBudgets):
            await asyncio.to_thread(self.budgets.spill)
        if self.redis is not None:
            await self.redis.aclose()


def open_stores(
    data_dir: Path,
    redis_url: str | None,
    ledger_buffer_max: int = 50_000,
    ledger_stream_max: int | None = None,
) -> Stores:
    data_dir = Path(data_dir)
    if not redis_url:
        return Stores(
            budgets=MemoryBudgets(data_dir / "spend.json"),
            limiter=MemoryLimiter(),
            cache=MemoryCache(),
            ledger=LocalLedger(data_dir / "ledger.jsonl"),
        )
    import redis.asyncio

    breaker = Breaker("Redis", cooldown_s=BREAKER_COOLDOWN_S, threshold=BREAKER_THRESHOLD)
    timeouts = {"socket_timeout": REDIS_TIMEOUT_S, "socket_connect_timeout": REDIS_TIMEOUT_S}
    # A blocking pool: a burst of requests waits for a free connection instead of failing.
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=64, timeout=REDIS_TIMEOUT_S, **timeouts
    )
    client = redis.asyncio.Redis(connection_pool=pool)
    blocking = sync_client(redis_url)
    return Stores(
        budgets=RedisBudgets(client, breaker, spill_path=data_dir / "budget-unsent.jsonl"),
        limiter=RedisLimiter(client, breaker),
        cache=RedisCache(client, breaker),
        ledger=RedisLedger(
            blocking, breaker, data_dir / "ledger-unsent.jsonl", ledger_buffer_max, ledger_stream_max
        ),
        breaker=breaker,
        redis=client,
    )
