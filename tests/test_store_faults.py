"""Store faults must stay as small as they are (issue 12, items 1 and 3).

- A zero-cost reservation (a budgeted tenant on a free worker) settles, releases and expires like
  any other, on both backends; before, Redis refused the "-0" the scripts sent and the tenant was
  locked out for good.
- A Redis *reply error* (our script or data is wrong) fails only the request that hit it; it never
  opens the breaker, so nobody else gets "store unavailable".
- A settle that fails leaves no done-marker, so a hold never outlives its settle.
- One slow reply is not an outage; the breaker opens on consecutive connection failures only.

Everything runs against a real redis-server (tests/conftest.py); the breaker state machine is
driven directly with the real exceptions the Redis client raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from decimal import Decimal

import httpx
import pytest
import redis
import redis.asyncio
import yaml

from gateway.store import Limits, StoreUnavailable, health, open_stores
from gateway.store.budgets import RedisBudgets, periods
from gateway.store.health import Breaker, guarded
from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

pytestmark = pytest.mark.anyio

REFUSED = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connection refused, a real outage


def _client(stores) -> redis.Redis:
    """A plain client on the same Redis as `stores`, to look at what the scripts left behind."""
    kwargs = stores.redis.connection_pool.connection_kwargs
    return redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))


def _holds_left(stores, tenant: str) -> list[bytes]:
    """Every hold still recorded for the tenant in Redis (zset members and r:<id> hash fields)."""
    client = _client(stores)
    hashes = [f"{RedisBudgets.PREFIX}{{{tenant}}}:{p}" for p in periods()]
    left = [m for h in hashes for m in client.zrange(h + ":holds", 0, -1)]
    left += [f for h in hashes for f in client.hkeys(h) if f.startswith(b"r:")]
    return sorted(left)


# ---- zero-cost reservations ------------------------------------------------------------------
async def test_a_zero_cost_hold_settles_and_releases(stores):
    limits = Limits(daily=1000, monthly=5000)
    for _ in range(3):  # served by a free worker, again and again
        hold = await stores.budgets.reserve("free", 0, limits)
        await stores.budgets.settle(hold, 0)
    failed = await stores.budgets.reserve("free", 0, limits)
    await stores.budgets.release(failed)
    paid = await stores.budgets.reserve("free", 300, limits)  # predicted a price, cost nothing
    await stores.budgets.settle(paid, 0)
    usage = await stores.budgets.usage("free")
    assert usage.daily_usd == 0 and usage.monthly_usd == 0
    if stores.backend == "redis":
        assert _holds_left(stores, "free") == []  # no hold outlived its settle
        assert stores.budgets.status()["pending_settles"] == 0  # and none is waiting for a retry
    assert stores.status()["ok"] is True


async def test_an_expired_zero_cost_hold_is_reaped(stores):
    stores.budgets.hold_s = 0.05  # a replica crashed between reserve and settle, twice
    limits = Limits(daily=1000)
    await stores.budgets.reserve("crash", 0, limits)
    await stores.budgets.reserve("crash", 600, limits)
    await asyncio.sleep(0.3)  # both holds have expired (any longer wait only makes that surer)
    stores.budgets.hold_s = 900
    hold = await stores.budgets.reserve("crash", 900, limits)  # reaps both, the zero one included
    assert hold.micros == 900
    if stores.backend == "redis":  # only the new hold is left, in both periods
        rid = hold.id.encode()
        assert _holds_left(stores, "crash") == sorted([rid, rid, b"r:" + rid, b"r:" + rid])
    await stores.budgets.settle(hold, 0)
    assert (await stores.budgets.usage("crash")).daily_usd == 0
    assert stores.status()["ok"] is True


async def test_the_poisoned_holds_an_older_version_left_are_reaped(redis_server, tmp_path):
    """What the "-0" bug left in Redis: a hold in the zset whose amount was already removed by a
    settle that then failed. It expires and must be dropped, not lock the tenant out."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stores = open_stores(tmp_path, redis_server.url)
    try:
        for period in periods():
            key = f"{RedisBudgets.PREFIX}{{locked}}:{period}"
            client.hset(key, mapping={"settled": 5, "reserved": 0})
            client.zadd(key + ":holds", {"rsv_poisoned": 1000})  # expired long ago
        hold = await stores.budgets.reserve("locked", 10, Limits(daily=1000, monthly=5000))
        await stores.budgets.settle(hold, 10)
        assert _holds_left(stores, "locked") == []
        assert (await stores.budgets.usage("locked")).daily_usd == Decimal("0.000015")
    finally:
        await stores.close()


# ---- reply errors ----------------------------------------------------------------------------
def _corrupt_month(client: redis.Redis, tenant: str) -> None:
    """A data bug: the tenant's month hash holds a string (WRONGTYPE for every script touching it)."""
    client.set(f"{RedisBudgets.PREFIX}{{{tenant}}}:{periods()[1]}", "not a hash")


async def test_a_reply_error_fails_its_call_not_the_store(redis_server, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stores = open_stores(tmp_path, redis_server.url)
    try:
        _corrupt_month(client, "broken")
        limits = Limits(daily=1000, monthly=5000)
        for _ in range(6):  # twice the breaker's threshold
            with pytest.raises(health.StoreReplyError, match="budgets.reserve"):
                await stores.budgets.reserve("broken", 10, limits)
            with pytest.raises(health.StoreReplyError, match="budgets.usage"):
                await stores.budgets.usage("broken")
        assert stores.breaker.up and stores.status()["ok"] is True
        hold = await stores.budgets.reserve("fine", 10, limits)  # everyone else is served
        await stores.budgets.settle(hold, 10)
        assert (await stores.budgets.usage("fine")).daily_usd == Decimal("0.00001")
        assert stores.budgets.status()["reply_errors"] >= 12
    finally:
        await stores.close()


async def test_a_failed_settle_leaves_its_hold_for_the_retry(redis_server, tmp_path):
    """The done-marker is written last: a settle that fails half-way can be retried in full."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stores = open_stores(tmp_path, redis_server.url)
    try:
        limits = Limits(daily=1000, monthly=5000)
        hold = await stores.budgets.reserve("acme", 100, limits)
        day, month = (f"{RedisBudgets.PREFIX}{{acme}}:{p}" for p in periods())
        client.hset(day, "settled", "garbage")  # a data bug the settle trips over
        await stores.budgets.settle(hold, 40)  # fails (logged), the request it belongs to stands
        assert stores.breaker.up
        client.hset(day, "settled", "0")  # the data is repaired
        await stores.budgets.settle(hold, 40)  # the retry does the whole settle
        usage = await stores.budgets.usage("acme")
        assert usage.daily_usd == usage.monthly_usd == Decimal("0.00004")
        assert _holds_left(stores, "acme") == []
        await stores.budgets.settle(hold, 40)  # and it is still idempotent
        assert (await stores.budgets.usage("acme")).monthly_usd == Decimal("0.00004")
        assert client.hget(month, "reserved") == b"0"
    finally:
        await stores.close()


async def test_guarded_counts_outages_not_reply_errors(redis_server):
    client = redis.asyncio.Redis.from_url(redis_server.url)
    dead = redis.asyncio.Redis.from_url(REFUSED)
    breaker = Breaker("test", cooldown_s=60, threshold=2)
    try:
        await client.set("plain-string", "x")
        for _ in range(5):  # WRONGTYPE: Redis answered, our request was wrong
            with pytest.raises(health.StoreReplyError):
                await guarded(breaker, lambda: client.hincrby("plain-string", "f", 1), "test")
        assert breaker.up and breaker.failures == 0
        with pytest.raises(StoreUnavailable):
            await guarded(breaker, dead.ping, "test")
        assert breaker.up  # one connection failure is not an outage yet
        with pytest.raises(StoreUnavailable):
            await guarded(breaker, dead.ping, "test")
        assert not breaker.up  # two in a row are
        calls = []
        with pytest.raises(StoreUnavailable):  # open: fails at once, the call is not even made
            await guarded(breaker, lambda: calls.append(1) or client.ping(), "test")
        assert calls == []
    finally:
        await client.aclose()
        await dead.aclose()


# ---- the breaker's state machine ---------------------------------------------------------------
def test_breaker_opens_after_consecutive_failures_only():
    breaker = Breaker("test", cooldown_s=60, threshold=3)
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    slow = redis.TimeoutError("Timeout reading from socket")
    breaker.failure(slow)
    breaker.failure(refused)
    assert breaker.up and breaker.check() is False  # two failures: still closed, calls go through
    breaker.success()  # an answer resets the count
    breaker.failure(slow)
    breaker.failure(slow)
    assert breaker.up
    breaker.failure(refused)
    assert not breaker.up and breaker.state == "open" and breaker.opened == 1
    with pytest.raises(StoreUnavailable, match="Connection refused"):
        breaker.check()
    assert breaker.status() == {"ok": False, "error": f"ConnectionError: {refused}", "opened": 1}


def test_breaker_half_open_lets_one_probe_through():
    breaker = Breaker("test", cooldown_s=0, threshold=1, probe_timeout_s=60)
    breaker.failure(redis.ConnectionError("Connection refused"))
    assert breaker.state == "half-open"  # the cooldown (0 s) is over
    assert breaker.check() is True  # this caller probes
    with pytest.raises(StoreUnavailable):
        breaker.check()  # everyone else fails fast while the probe is out
    breaker.failure(redis.ConnectionError("Connection refused"))  # the probe failed: open again
    assert not breaker.up and breaker.check() is True  # (cooldown 0: the next caller probes)
    breaker.release_probe()  # that probe was cancelled before it learnt anything
    assert breaker.check() is True
    breaker.success()  # the probe got an answer: closed
    assert breaker.up and breaker.check() is False and breaker.status()["error"] is None


def test_a_failed_health_probe_opens_at_once():
    breaker = Breaker("test", cooldown_s=60, threshold=3)
    breaker.probe_failed(redis.ConnectionError("Connection refused"))
    assert not breaker.up
    with pytest.raises(StoreUnavailable):
        breaker.check()


def test_error_kinds():
    from redis import exceptions

    unavailable = [
        redis.ConnectionError("refused"),
        redis.TimeoutError("Timeout reading from socket"),
        exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("MASTERDOWN Link with MASTER is down"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError(),
    ]
    replies = [
        redis.ResponseError("value is not an integer or out of range script: 5248, on @user_script:1."),
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        redis.ResponseError("polyroute budget: bad settle amount -1"),
        redis.DataError("Invalid input of type: 'NoneType'"),
    ]
    assert [health.is_unavailable(e) for e in unavailable] == [True] * len(unavailable)
    assert [health.is_reply_error(e) for e in unavailable] == [False] * len(unavailable)
    assert [health.is_reply_error(e) for e in replies] == [True] * len(replies)
    assert [health.is_unavailable(e) for e in replies] == [False] * len(replies)


async def test_one_slow_reply_is_not_an_outage(redis_server, tmp_path):
    """A reply held back 1.5 s (CLIENT PAUSE: Redis itself is slow) is late, not missing."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stores = open_stores(tmp_path, redis_server.url)
    try:
        await stores.budgets.usage("acme")  # connected
        client.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # ends by itself after 1.5 s
        hold = await stores.budgets.reserve("acme", 10, Limits(daily=1000))
        assert hold.micros == 10 and stores.breaker.up and stores.breaker.failures == 0
    finally:
        await stores.close()


# ---- through the gateway ---------------------------------------------------------------------
FREE_WORKER = """
  - name: free
    model: openai/free-model
    api_base: {url}/v1
    api_key_env: POLYROUTE_TEST_UPSTREAM_KEY
    context_window: 8192
    input_price_per_m: 0
    output_price_per_m: 0
    tier: specialist
    license: Apache-2.0
    provider: fake
    jurisdiction: FR
    capabilities: [general]
"""


def _budget_gateway(upstream, tmp_path, redis_url: str | None) -> Gateway:
    """A gateway whose catalog has a free worker, and tenants with budgets."""
    policy_file = tmp_path / "policy.yaml"
    budget = {"budget": {"daily_usd": "1.00"}}
    policy_file.write_text(
        yaml.safe_dump({"version": "faults", "tenants": {"capped": budget, "broken": budget, "fine": budget}})
    )
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + FREE_WORKER.format(url=upstream.url))
    return start_gateway(catalog, tmp_path / "data", policy_file=policy_file, redis_url=redis_url)


@pytest.fixture(params=["memory", "redis"])
def budget_gateway(request, upstream, tmp_path):
    url = None
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        redis.Redis.from_url(url).flushdb()
    gw = _budget_gateway(upstream, tmp_path, url)
    yield gw
    gw.server.stop()


@pytest.fixture
def redis_gateway(upstream, tmp_path, redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    gw = _budget_gateway(upstream, tmp_path, redis_server.url)
    yield gw
    gw.server.stop()


def _key(gw: Gateway, tenant: str, **limits) -> str:
    created = httpx.post(
        gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": tenant, **limits}
    )
    assert created.status_code == 201, created.text
    return created.json()["key"]


def _chat(gw: Gateway, key: str, model: str = "auto") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=30)


def test_a_budgeted_tenant_on_a_free_worker_is_served_again_and_again(budget_gateway, upstream):
    gw = budget_gateway
    key = _key(gw, "capped")
    answers = [_chat(gw, key, model="free") for _ in range(6)]
    answers += [_chat(gw, key) for _ in range(2)]  # auto picks the free worker too: the cheapest
    assert [a.status_code for a in answers] == [200] * 8, answers[-1].text
    assert {a.headers["x-polyroute-worker"] for a in answers} == {"free"}
    assert {Decimal(a.headers["x-polyroute-cost-usd"]) for a in answers} == {Decimal(0)}
    # rate limits are still counted: 3 a minute (one more every 20 s), the 4th is refused
    limited = _key(gw, "capped", rpm=3)
    answers = [_chat(gw, limited, model="free") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    stores = gw.state.stores
    assert stores.status()["ok"] is True and (stores.breaker is None or stores.breaker.opened == 0)
    if stores.backend == "redis":
        assert stores.budgets.status()["pending_settles"] == 0
        assert _holds_left(stores, "capped") == []
    assert httpx.get(gw.url + "/readyz").status_code == 200
    books = httpx.get(gw.url + "/admin/spend/capped", headers=gw.auth(gw.admin_key)).json()
    assert Decimal(books["daily_usd"]) == 0


def test_a_reply_error_fails_one_tenant_and_nobody_else(redis_gateway, upstream):
    gw = redis_gateway
    broken, fine = _key(gw, "broken"), _key(gw, "fine")
    _corrupt_month(_client(gw.state.stores), "broken")
    calls = len(upstream.requests)
    refused = [_chat(gw, broken) for _ in range(6)]  # twice the breaker's threshold
    assert {r.status_code for r in refused} == {500}
    assert {r.json()["error"]["code"] for r in refused} == {"store_error"}
    assert len(upstream.requests) == calls  # no worker was called for the broken tenant
    assert gw.state.stores.breaker.up and gw.state.stores.breaker.opened == 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        served = list(pool.map(lambda _: _chat(gw, fine), range(8)))
    assert [r.status_code for r in served] == [200] * 8
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["store"]["ok"] is True


def test_a_slow_redis_reply_is_not_a_503(redis_gateway):
    """Redis answers 1.5 s late (CLIENT PAUSE): the budgeted request waits, it is not refused."""
    gw = redis_gateway
    key = _key(gw, "capped")
    assert _chat(gw, key).status_code == 200
    admin = _client(gw.state.stores)
    admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # ends by itself after 1.5 s
    late = _chat(gw, key)
    assert late.status_code == 200, late.text
    assert gw.state.stores.breaker.up and gw.state.stores.breaker.opened == 0
