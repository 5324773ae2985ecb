"""A key that cannot be checked during a Redis outage: 503, and the body says what happened.

docs/replicas.md: while Redis is down, a key verified in the last 5 min keeps its last known state
unless a key was revoked since; any other key fails closed (503). The refusal is right (a key checked
before a revocation cannot be told apart from the revoked one), but its body read "cannot verify API
keys right now: key store Redis (keys) unreachable: …", which says neither that this key was refused
unchecked nor why a key that worked a minute ago is refused now.

One gateway on a real redis-server that the test stops; no mock.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.keys import RedisKeyStore
from policies import parse_catalog
from tests.conftest import Gateway, RedisServer, catalog_yaml_for, start_gateway

BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _chat(gw: Gateway, key: str) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=BODY, timeout=60)


def _key(gw: Gateway, tenant: str) -> tuple[str, str]:
    created = httpx.post(
        gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": tenant}, timeout=60
    )
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


@pytest.fixture
def gateway_on_redis(upstream, tmp_path):
    server = RedisServer()  # its own: the test stops it
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", redis_url=server.url)
    yield server, gw
    gw.server.stop()
    server.stop()


def test_a_key_checked_before_a_revocation_is_refused_with_a_clear_503_while_redis_is_down(
    gateway_on_redis, upstream
):
    server, gw = gateway_on_redis
    _, key = _key(gw, "steady")
    assert _chat(gw, key).status_code == 200  # verified (and remembered) while Redis is up
    verified_at = time.monotonic()
    revoked_id, _ = _key(gw, "leaving")
    RedisKeyStore(server.url).revoke(revoked_id)  # `polyroute keys revoke`: another key, elsewhere
    assert httpx.get(gw.url + "/readyz", timeout=60).status_code == 200  # the gateway reads the counter
    # a lower bound on the clock, not a race: the 0.5 s key cache must have aged, so Redis is asked
    time.sleep(max(0.0, verified_at + gw.state.auth.store.cache_ttl_s + 0.1 - time.monotonic()))

    server.stop()
    calls = len(upstream.requests)
    refused = _chat(gw, key)
    assert refused.status_code == 503, refused.text  # fails closed: not weakened
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("key_store_unavailable", "server_error")
    message = error["message"]
    assert message.startswith("The API key could not be checked: the key store (Redis) cannot be reached"), (
        message
    )
    assert "Redis (keys) unreachable: ConnectionError" in message  # what the gateway saw
    assert "no key is let through unchecked" in message
    assert "in the last 5 minutes, with no key revoked since" in message  # why a key that worked fails now
    assert "Retry once Redis is back" in message
    # a token this gateway never saw gets the very same body: the 503 says nothing about the key itself
    unknown = _chat(gw, "sk-polyroute-never-issued")
    assert unknown.status_code == 503 and unknown.json()["error"] == error
    assert len(upstream.requests) == calls  # no worker called
