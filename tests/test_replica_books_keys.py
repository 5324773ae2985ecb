"""A key revoked on one replica is not accepted by another once Redis goes down.

docs/replicas.md: a revocation reaches every replica within 1 s; while Redis is down "a key verified in
the last 5 min keeps its last known state (no revocation can be written meanwhile)". A revocation
written *before* the outage must then be part of that state. Replica B verified a key, the key was
revoked through replica A (or the CLI), B was not asked for that key again, and Redis went down: B
used to accept the revoked key for up to 5 minutes, because its cache still said "active".

Now every revocation bumps a counter that each replica reads along with the keys it looks up and its
readiness probe, and a cached check older than the last change cannot stand in for Redis. Keys
verified since keep working through the outage.

Two replicas (in-process gateways) on one real redis-server; no test bets on timing (the one wait
lets the 0.5 s key cache age past its TTL: a lower bound on the monotonic clock, not a race).
"""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from gateway.keys import RedisKeyStore
from policies import parse_catalog
from tests.conftest import Gateway, RedisServer, catalog_yaml_for, start_gateway

BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _chat(gw: Gateway, key: str) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=BODY, timeout=60)


def _key(gw: Gateway, tenant: str) -> tuple[str, str]:
    created = httpx.post(gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": tenant})
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


def _past_the_key_cache(gw: Gateway, verified_at: float) -> None:
    """Until `gw`'s key cache entries made before `verified_at` are stale (so it must ask Redis)."""
    cache_ttl_s = gw.state.auth.store.cache_ttl_s
    time.sleep(max(0.0, verified_at + cache_ttl_s + 0.1 - time.monotonic()))


@pytest.fixture
def replicas(upstream, tmp_path):
    server = RedisServer()  # its own: the test stops it
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    started = [start_gateway(catalog, tmp_path / name, redis_url=server.url) for name in ("a", "b")]
    yield server, started
    for gw in started:
        gw.server.stop()
    server.stop()


@pytest.mark.parametrize("revoked_through", ["admin API", "CLI"])
def test_a_key_revoked_before_an_outage_stays_revoked_during_it(replicas, upstream, revoked_through):
    server, (a, b) = replicas
    revoked_id, revoked = _key(a, "leaky")
    _, idle = _key(a, "idle")  # not revoked, verified by B before the revocation only
    assert _chat(b, revoked).status_code == 200 and _chat(b, idle).status_code == 200
    verified_at = time.monotonic()
    if revoked_through == "CLI":  # `polyroute keys revoke` with REDIS_URL: the same store, another process
        RedisKeyStore(server.url).revoke(revoked_id)
    else:
        answer = httpx.delete(a.url + f"/admin/keys/{revoked_id}", headers=a.auth(a.admin_key))
        assert answer.status_code == 200
    _, active = _key(a, "active")
    assert httpx.get(b.url + "/readyz").status_code == 200  # B's readiness probe: B is in touch with Redis
    assert _chat(b, active).status_code == 200  # verified by B after the revocation
    _past_the_key_cache(b, verified_at)

    server.stop()
    calls = len(upstream.requests)
    refused = _chat(b, revoked)
    assert refused.status_code == 503, refused.text  # before: 200, a revoked key served
    assert refused.json()["error"]["code"] == "key_store_unavailable"
    # a key checked before the revocation cannot be told apart from the revoked one: it fails closed too
    assert _chat(b, idle).status_code == 503
    assert len(upstream.requests) == calls
    # a key B verified since the revocation keeps its last known state through the outage, as documented
    assert _chat(b, active).status_code == 200


def test_keys_keep_working_through_an_outage_when_nothing_was_revoked(replicas):
    server, (a, b) = replicas
    _, key = _key(a, "steady")
    assert _chat(b, key).status_code == 200
    verified_at = time.monotonic()
    assert httpx.get(b.url + "/readyz").status_code == 200
    _past_the_key_cache(b, verified_at)
    server.stop()
    assert _chat(b, key).status_code == 200


def test_the_revocation_counter_is_bumped_with_the_revocation(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    store = RedisKeyStore(redis_server.url)
    record, _ = store.create("acme")
    assert client.get(RedisKeyStore.REVOCATIONS) is None  # creating a key revokes nothing
    store.revoke(record.id)
    store.revoke(record.id)  # already revoked: nothing changes
    assert client.get(RedisKeyStore.REVOCATIONS) == b"1"
