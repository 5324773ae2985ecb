"""The Redis ledger stream keeps about `ledger_stream_max` records (XADD MAXLEN ~, oldest first):
without a bound it grew with every request until Redis hit its memory cap (the chart's
`redis.maxmemory`, noeviction) and refused every write — budgets then fail closed. A real
redis-server; the gateway's setting reaches the ledger."""

from __future__ import annotations

import redis

from gateway import Settings
from gateway.state import build_state
from gateway.store.health import Breaker
from gateway.store.ledger_redis import STREAM, RedisLedger
from tests.conftest import RedisServer
from tests.test_store import _request


def _fill(server: RedisServer, stream_max: int | None, n: int) -> int:
    client = redis.Redis.from_url(server.url)
    client.delete(STREAM)
    ledger = RedisLedger(client, Breaker("Redis"), None, 10_000, stream_max)
    for i in range(n):
        ledger.record_request(_request(i))
    assert ledger.flush() == n
    return client.xlen(STREAM)


def test_the_stream_keeps_about_stream_max_records_and_the_newest(redis_server: RedisServer):
    kept = _fill(redis_server, 1000, 3000)
    # approximate trimming removes whole stream nodes (100 entries each by default): never fewer
    assert 1000 <= kept < 1200, kept
    client = redis.Redis.from_url(redis_server.url)
    (newest,) = client.xrevrange(STREAM, count=1)
    assert b'"req_2999"' in newest[1][b"r"]  # the oldest go, the newest stay


def test_without_a_bound_every_record_is_kept(redis_server: RedisServer):
    assert _fill(redis_server, None, 3000) == 3000


def test_the_setting_reaches_the_gateways_ledger(redis_server: RedisServer, tmp_path):
    settings = Settings(
        data_dir=tmp_path, redis_url=redis_server.url, local_workers=False, ledger_stream_max=5000
    )
    state = build_state(settings)
    assert state.stores.ledger.stream_max == 5000
    assert Settings.from_env({"POLYROUTE_LEDGER_STREAM_MAX": "250000"}).ledger_stream_max == 250_000
