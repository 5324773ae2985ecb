"""Budget spend that a replica could not send to Redis survives that replica's restart.

docs/replicas.md: while Redis is down, budget settles that fail "are kept and retried", and the
ledger's unsent records are written to disk at shutdown and re-sent at the next start. A replica
stopped (a rolling deploy, a rescheduled pod) *while* Redis is down used to drop the kept settles and
the spend of tenants without a budget with its memory: the in-flight request's hold then stayed
reserved at its prediction until it expired, and its actual cost never reached the books.

Two replicas (in-process gateways) on one real redis-server with persistence, as deployed; Redis is
stopped and started again on the same port. No test waits on time: every wait is on a condition
with a generous deadline.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio
import yaml

from gateway.store import Limits, to_micros
from gateway.store.budgets import RedisBudgets, SpilledSettle, SpilledSpend, periods
from gateway.store.health import Breaker
from policies import parse_catalog
from tests.conftest import Gateway, RedisServer, catalog_yaml_for, start_gateway

DEADLINE_S = 60.0


def _gateway(upstream, tmp_path: Path, name: str, redis_url: str) -> Gateway:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        yaml.safe_dump({"version": "books", "tenants": {"capped": {"budget": {"daily_usd": "10"}}}})
    )
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    return start_gateway(catalog, tmp_path / name, policy_file=policy_file, redis_url=redis_url)


def _key(gw: Gateway, tenant: str) -> str:
    created = httpx.post(gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": tenant})
    assert created.status_code == 201, created.text
    return created.json()["key"]


def _chat(gw: Gateway, key: str, max_tokens: int = 5) -> httpx.Response:
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=60)


def _micros(answers: list[httpx.Response]) -> int:
    """What the budget counts for these answers: each settle rounds up to a whole micro-dollar."""
    return sum(to_micros(Decimal(a.headers["x-polyroute-cost-usd"])) for a in answers)


def _books(gw: Gateway, tenant: str) -> int | None:
    """The tenant's spend today as `gw` reads it from Redis, in micro-dollars (None: not readable now)."""
    answer = httpx.get(gw.url + f"/admin/spend/{tenant}", headers=gw.auth(gw.admin_key), timeout=30)
    if answer.status_code != 200:
        return None
    return to_micros(Decimal(answer.json()["daily_usd"]))


def _wait_for_books(gw: Gateway, tenant: str, expected: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (seen := _books(gw, tenant)) != expected:
        assert time.monotonic() < deadline, f"{tenant}'s books say {seen} micros, the answers cost {expected}"
        time.sleep(0.1)


def _wait_until_redis_answers(gw: Gateway) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while httpx.get(gw.url + "/readyz", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the replica did not see Redis come back"
        time.sleep(0.1)


@pytest.fixture
def persistent_redis(tmp_path):
    (tmp_path / "redis").mkdir()
    server = RedisServer(persist_dir=tmp_path / "redis")  # append-only file: data kept across restarts
    yield server
    server.stop()


def test_a_settle_kept_while_redis_is_down_survives_the_replicas_restart(
    upstream, tmp_path, persistent_redis
):
    """A request in flight on replica A when Redis goes down is answered; its settle cannot be sent;
    A is then stopped before Redis is back. Once Redis and A are back, both replicas' books hold
    the request's actual cost, not the prediction its hold reserved."""
    server = persistent_redis
    a = _gateway(upstream, tmp_path, "a", server.url)
    b = _gateway(upstream, tmp_path, "b", server.url)
    restarted: Gateway | None = None
    try:
        capped = _key(a, "capped")
        warm = [_chat(gw, capped) for gw in (a, b)]
        assert [w.status_code for w in warm] == [200, 200], warm[-1].text
        # max_tokens 1000: the hold reserves ~100x what the answer (1 + 5 tokens) costs
        upstream.behave("cheap-model", prompt_tokens=1, completion_tokens=5, latency_s=5)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_chat, a, capped, 1000)
            deadline = time.monotonic() + DEADLINE_S
            while not upstream.requests_for("cheap-model")[len(warm) :]:  # reserved, now at the worker
                assert time.monotonic() < deadline, "the request never reached the worker"
                time.sleep(0.02)
            server.stop()
            in_flight = pending.result(timeout=DEADLINE_S)
        assert in_flight.status_code == 200, in_flight.text
        a.server.stop()  # graceful: its last flush cannot reach Redis either
        assert not a.server.thread.is_alive()
        server.start()
        restarted = _gateway(upstream, tmp_path, "a", server.url)  # the same data dir
        expected = _micros([*warm, in_flight])
        for gw in (restarted, b):
            _wait_for_books(gw, "capped", expected)
        assert restarted.state.stores.budgets.status()["pending_settles"] == 0
        ids = {r.get("id") for r in restarted.state.stores.ledger.records()}
        assert in_flight.headers["x-polyroute-request-id"] in ids  # the ledger kept its record too
    finally:
        for gw in (restarted, b):
            if gw is not None:
                gw.server.stop()


def test_spend_recorded_while_redis_is_down_survives_the_replicas_restart(
    upstream, tmp_path, persistent_redis
):
    """A tenant without a budget is served while Redis is down (its key was verified just before);
    its spend is added to the books in batches, so it is still in replica A's memory when A stops.
    After the restart the books count it."""
    server = persistent_redis
    a = _gateway(upstream, tmp_path, "a", server.url)
    b = _gateway(upstream, tmp_path, "b", server.url)
    restarted: Gateway | None = None
    try:
        free = _key(a, "free")
        upstream.behave("cheap-model", prompt_tokens=1, completion_tokens=5)
        warm = [_chat(gw, free) for gw in (a, b)]
        assert [w.status_code for w in warm] == [200, 200], warm[-1].text
        _wait_for_books(b, "free", _micros(warm))
        server.stop()
        while_down = [_chat(a, free) for _ in range(3)]  # a key verified minutes ago keeps working
        assert [w.status_code for w in while_down] == [200] * 3, while_down[-1].text
        a.server.stop()
        assert not a.server.thread.is_alive()
        spilled = tmp_path / "a" / "budget-unsent.jsonl"
        assert spilled.exists() and all(json.loads(line) for line in spilled.read_text().splitlines())
        server.start()
        _wait_until_redis_answers(b)
        restarted = _gateway(upstream, tmp_path, "a", server.url)
        for gw in (restarted, b):
            _wait_for_books(gw, "free", _micros(warm + while_down))
        assert not spilled.exists()  # read back at the start, and sent
    finally:
        for gw in (restarted, b):
            if gw is not None:
                gw.server.stop()


@pytest.mark.anyio
async def test_a_torn_spill_line_is_skipped_and_the_rest_is_sent(redis_server, tmp_path):
    """A spill cut short (killed at the end of the grace period, a full disk) keeps its whole lines."""
    redis.Redis.from_url(redis_server.url).flushdb()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        first = RedisBudgets(client, Breaker("Redis"))
        hold = await first.reserve("capped", 300, Limits(daily=1000))  # the hold a stopped replica left
        day, _ = periods()
        spill = tmp_path / "budget-unsent.jsonl"
        spill.write_text(
            SpilledSettle(
                id=hold.id, tenant="capped", periods=hold.periods, held=300, micros=42
            ).model_dump_json()
            + "\n"
            + SpilledSpend(tenant="free", period=day, micros=7).model_dump_json()
            + '\n{"kind": "settle", "id": "rsv_torn'  # the last write, cut short
        )
        restarted = RedisBudgets(client, Breaker("Redis"), spill_path=spill)
        assert not spill.exists() and restarted.status()["pending_settles"] == 1
        await restarted.flush()
        assert to_micros((await restarted.usage("capped")).daily_usd) == 42  # settled, hold gone
        assert to_micros((await restarted.usage("free")).daily_usd) == 7
        await restarted.flush()  # sent once: nothing is counted twice
        assert to_micros((await restarted.usage("capped")).daily_usd) == 42
    finally:
        await client.aclose()
