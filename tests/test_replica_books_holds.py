"""A reservation whose reply never reached the gateway does not block the tenant's budget.

A replica whose event loop is starved (both cores busy) can read Redis's reply to a reserve after
the client's timeout has fired, or the request can be cancelled (its deadline, a shutdown) once
Redis has already run the script. The gateway then refuses the request (503), yet the hold is in
Redis; before, it stayed there for `hold_s` (15 minutes), counted against the budget on every
replica. Now the reservation is released with the kept settles at the next flush.

Real redis-server. The stall is made deterministic, not timed: Redis holds the script back
(CLIENT PAUSE WRITE) until the test sees it queued, the test then blocks the event loop while
Redis runs it, and only lets the loop go on once the hold exists and the client's timeout is due.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio

from gateway.store import Limits, StoreUnavailable
from gateway.store.budgets import RedisBudgets, periods
from gateway.store.health import Breaker

pytestmark = pytest.mark.anyio

CLIENT_TIMEOUT_S = 0.5  # the product's is health.REDIS_TIMEOUT_S (5 s); the mechanism is the same
DEADLINE_S = 60.0


def _holds(admin: redis.Redis, tenant: str) -> list[bytes]:
    """Every hold of the tenant left in Redis (zset members and r:<id> hash fields)."""
    hashes = [f"{RedisBudgets.PREFIX}{{{tenant}}}:{p}" for p in periods()]
    left = [m for h in hashes for m in admin.zrange(h + ":holds", 0, -1)]
    return sorted(left + [f for h in hashes for f in admin.hkeys(h) if f.startswith(b"r:")])


def _script_queued(admin: redis.Redis) -> bool:
    """Redis has read the reserve script and holds it back (the pause): a blocked EVALSHA client."""
    clients = admin.execute_command("CLIENT", "LIST").decode().splitlines()
    return any("cmd=evalsha" in line and "flags=b" in line for line in clients)


def _stall_until_reserved(admin: redis.Redis, tenant: str) -> None:
    """Block the event loop (this is a synchronous call inside a coroutine) while Redis runs the
    held-back script, until its hold exists and the client's read timeout is past due."""
    admin.execute_command("CLIENT", "UNPAUSE")
    deadline = time.monotonic() + DEADLINE_S
    while not _holds(admin, tenant):
        assert time.monotonic() < deadline, "Redis never ran the reserve"
        time.sleep(0.01)
    time.sleep(2 * CLIENT_TIMEOUT_S)  # not a bet on scheduling: the timer is due once this has passed


@pytest.mark.parametrize("ending", ["timeout", "cancelled"])
async def test_a_reservation_lost_in_flight_is_released(redis_server, ending):
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushdb()
    client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=CLIENT_TIMEOUT_S)
    budgets = RedisBudgets(client, Breaker("Redis"))
    limits = Limits(daily=1000, monthly=1000)
    try:
        await budgets.release(await budgets.reserve("warm", 1, limits))  # the scripts are loaded
        admin.execute_command("CLIENT", "PAUSE", int(DEADLINE_S * 1000), "WRITE")
        try:
            pending = asyncio.create_task(budgets.reserve("capped", 400, limits))
            deadline = time.monotonic() + DEADLINE_S
            while not _script_queued(admin):
                assert time.monotonic() < deadline, "the reserve never reached Redis"
                await asyncio.sleep(0.01)
        finally:
            if ending == "cancelled":
                pending.cancel()  # the request's deadline passes while the loop is stalled
            _stall_until_reserved(admin, "capped")
        if ending == "timeout":
            with pytest.raises(StoreUnavailable, match="Timeout"):  # the request gets a 503
                await pending
        else:
            with pytest.raises(asyncio.CancelledError):
                await pending
        assert _holds(admin, "capped")  # Redis did reserve: this is the hold nobody will settle
        await budgets.flush()
        assert _holds(admin, "capped") == []
        usage = await budgets.usage("capped")
        assert usage.daily_usd == usage.monthly_usd == 0
        assert (await budgets.reserve("capped", 1000, limits)).micros == 1000  # the whole budget is there
        assert budgets.status()["pending_settles"] == 0
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()


async def test_a_refused_connection_queues_no_release():
    """Nothing was sent when Redis refuses the connection: an outage does not fill the retry buffer."""
    client = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0", socket_timeout=CLIENT_TIMEOUT_S)
    budgets = RedisBudgets(client, Breaker("Redis"))
    try:
        for _ in range(5):  # through the breaker's threshold: failures, then failing fast
            with pytest.raises(StoreUnavailable):
                await budgets.reserve("capped", 10, Limits(daily=1000))
        assert budgets.status()["pending_settles"] == 0
    finally:
        await client.aclose()
