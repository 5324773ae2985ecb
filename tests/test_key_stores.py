"""The key store on both backends (file, Redis), and keys shared by two gateways over one Redis.

Redis is a real redis-server on a random loopback port, started by the tests.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.keys import FileKeyStore, KeyNotFound, KeyStoreUnavailable, RedisKeyStore
from policies import parse_catalog
from tests.conftest import RedisServer, catalog_yaml_for, start_gateway


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        return FileKeyStore(tmp_path / "keys.json", reload_interval_s=0)
    server: RedisServer = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(server.url).flushdb()
    return RedisKeyStore(server.url, cache_ttl_s=0)


def test_create_verify_list_revoke(store):
    record, key = store.create("acme", "laptop")
    assert key.startswith("pr-") and record.tenant == "acme" and record.name == "laptop"
    assert store.verify(key) == record
    assert store.verify(key + "x") is None
    assert [r.id for r in store.list()] == [record.id]
    revoked = store.revoke(record.id)
    assert revoked.revoked_at is not None and store.verify(key) is None
    assert store.revoke(record.id).revoked_at == revoked.revoked_at  # idempotent
    assert store.list(include_revoked=False) == []
    with pytest.raises(KeyNotFound):
        store.revoke("key_unknown")


def test_admin_keys_and_tenant_validation(store):
    assert not store.has_admin()
    record, key = store.create("ignored", admin=True)
    assert record.admin and record.tenant == "__admin__" and store.has_admin()
    with pytest.raises(ValueError, match="tenant"):
        store.create("")


def test_redis_store_keeps_only_hashes(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    _, key = RedisKeyStore(redis_server.url).create("acme")
    dump = b"".join(client.get(k) or b"" for k in client.keys("polyroute:keys:hash:*"))
    assert key.encode() not in dump and b"key_hash" in dump


def test_unreachable_redis_fails_closed():
    store = RedisKeyStore("redis://127.0.0.1:1/0")  # nothing listens on port 1
    with pytest.raises(KeyStoreUnavailable):
        store.verify("pr-anything")
    assert store.ping() is False


def test_two_gateways_share_keys_and_revocation(upstream, redis_server, tmp_path):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    a = start_gateway(catalog, tmp_path / "a", redis_url=redis_server.url)
    b = start_gateway(catalog, tmp_path / "b", redis_url=redis_server.url)
    try:
        created = httpx.post(
            a.url + "/admin/keys", headers=a.auth(a.admin_key), json={"tenant": "shared"}
        ).json()
        headers = {"authorization": f"Bearer {created['key']}"}
        body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(b.v1 + "/chat/completions", headers=headers, json=body).status_code == 200
        assert (
            httpx.delete(a.url + f"/admin/keys/{created['id']}", headers=a.auth(a.admin_key)).status_code
            == 200
        )
        revoked_at = time.monotonic()
        while httpx.post(b.v1 + "/chat/completions", headers=headers, json=body).status_code != 401:
            assert time.monotonic() - revoked_at < 1.0, "revocation did not reach the other replica in 1 s"
            time.sleep(0.02)
        ready = httpx.get(b.url + "/readyz").json()
        assert ready["keys"] == {"backend": "RedisKeyStore", "ok": True}
    finally:
        a.server.stop()
        b.server.stop()


def test_gateway_answers_503_when_redis_is_down(upstream, tmp_path):
    server = RedisServer()
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", redis_url=server.url)
    try:
        server.stop()
        response = httpx.post(
            gw.v1 + "/chat/completions",
            headers=gw.auth(),
            json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 503 and response.json()["error"]["code"] == "key_store_unavailable"
        assert not upstream.requests  # fail closed: nothing called with an unverified key
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["keys"]["ok"] is False
    finally:
        gw.server.stop()


def test_verifying_a_key_does_not_block_the_event_loop(upstream, tmp_path):
    """A key this replica has not seen is checked in Redis off the event loop: while Redis is hung
    (SIGSTOP: it accepts the request and does not answer), the gateway keeps serving, and the check
    completes when Redis answers (SIGCONT)."""
    import concurrent.futures
    import os
    import signal

    server = RedisServer()
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", redis_url=server.url)
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        _, key = gw.state.auth.store.create("fresh")  # never verified by this gateway yet
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            pending = pool.submit(
                httpx.post, gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=60
            )
            time.sleep(0.3)  # lets the request reach its key check (the test holds either way)
            assert httpx.get(gw.url + "/healthz", timeout=30).status_code == 200  # the loop is free
            assert not pending.done()  # while the key check still waits for Redis
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        answer = pending.result(timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        pool.shutdown()
        gw.server.stop()
        server.stop()
