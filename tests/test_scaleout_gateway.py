"""Budgets, rate limits and the response cache through the gateway, on both store backends,
and the gateway's behaviour while Redis is down and after it comes back."""

from __future__ import annotations

import concurrent.futures
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.store import to_micros
from policies import parse_catalog
from tests.conftest import Gateway, RedisServer, catalog_yaml_for, start_gateway


def write_policy(path: Path, tenants: dict) -> None:
    path.write_text(yaml.safe_dump({"version": "scale", "tenants": tenants}))


def chat(gw: Gateway, key: str | None = None, content: str = "hello there", **extra) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=30)


@pytest.fixture(params=["memory", "redis"])
def make_gateway(request, upstream, tmp_path):
    url = None
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        import redis

        redis.Redis.from_url(server.url).flushdb()
        url = server.url
    started: list[Gateway] = []

    def make(tenants: dict) -> Gateway:
        policy_file = tmp_path / "policy.yaml"
        write_policy(policy_file, tenants)
        gw = start_gateway(
            parse_catalog(catalog_yaml_for(upstream.url)),
            tmp_path / f"data{len(started)}",
            policy_file=policy_file,
            redis_url=url,
        )
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.server.stop()


def new_key(gw: Gateway, tenant: str, **limits) -> str:
    response = httpx.post(
        gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": tenant, **limits}
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


# ---- rate limits -----------------------------------------------------------------------------
def test_key_rpm_limit_answers_429_with_retry_after(make_gateway, upstream):
    gw = make_gateway({})
    key = new_key(gw, "acme", rpm=3)
    answers = [chat(gw, key) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    refused = answers[3]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 15 <= int(refused.headers["retry-after"]) <= 20  # one request per 20 s refills
    assert len(upstream.requests) == 3  # the refused request never reached a worker
    assert chat(gw).status_code == 200  # another key of the tenant is not limited by this one


def test_tenant_limits_from_the_policy_cover_all_its_keys(make_gateway):
    gw = make_gateway({"acme": {"rate_limit": {"rpm": 2, "tpm": 100_000}}})
    other_key = new_key(gw, "acme")
    assert chat(gw).status_code == 200
    assert chat(gw, other_key).status_code == 200
    third = chat(gw)
    assert third.status_code == 429 and "tenant" in third.json()["error"]["message"]
    assert int(third.headers["x-ratelimit-limit-tokens"]) == 100_000


def test_a_request_larger_than_the_token_limit_is_refused_for_good(make_gateway, upstream):
    gw = make_gateway({"acme": {"rate_limit": {"tpm": 500}}})
    refused = chat(gw, max_tokens=1000)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "request_too_large"
    assert "retry-after" not in refused.headers and not upstream.requests
    assert chat(gw, max_tokens=100).status_code == 200


# ---- cache -----------------------------------------------------------------------------------
def test_cache_is_opt_in_and_never_crosses_tenants(make_gateway, upstream):
    gw = make_gateway({"acme": {"cache": {"enabled": True, "ttl_s": 60}}})
    globex = new_key(gw, "globex")
    first = chat(gw, temperature=0)
    assert first.status_code == 200 and first.headers["x-polyroute-cache"] == "miss"
    second = chat(gw, temperature=0)
    assert second.headers["x-polyroute-cache"] == "hit" and second.json() == first.json()
    assert second.headers["x-polyroute-cost-usd"] == "0" and second.headers["x-polyroute-strategy"] == "cache"
    assert len(upstream.requests) == 1
    assert chat(gw, temperature=0.5).headers["x-polyroute-cache"] == "miss"  # another request
    # globex asks the very same question: its cache is off, and acme's answers are not its own
    assert "x-polyroute-cache" not in chat(gw, globex, temperature=0).headers
    opted_in = httpx.post(
        gw.v1 + "/chat/completions",
        headers={**gw.auth(globex), "x-polyroute-cache": "on"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0},
    )
    assert opted_in.headers["x-polyroute-cache"] == "miss"
    assert len(upstream.requests) == 4


def test_cache_skips_streams_personal_data_and_bad_headers(make_gateway, upstream):
    gw = make_gateway({"acme": {"cache": {"enabled": True}}})
    for _ in range(2):
        assert "x-polyroute-cache" not in chat(gw, content="mail me at jo@example.com").headers  # PII
        with httpx.stream(
            "POST",
            gw.v1 + "/chat/completions",
            headers=gw.auth(),
            json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        ) as streamed:
            assert "x-polyroute-cache" not in streamed.headers and b"[DONE]" in streamed.read()
    assert len(upstream.requests) == 4
    bad = httpx.post(
        gw.v1 + "/chat/completions",
        headers={**gw.auth(), "x-polyroute-cache": "maybe"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert bad.status_code == 400 and "x-polyroute-cache" in bad.json()["error"]["message"]


# ---- budgets ---------------------------------------------------------------------------------
def test_concurrent_requests_stay_within_the_budget(make_gateway, upstream):
    # cheap: $0.10/M in, $0.20/M out. Each request reports 10 + 5 tokens = $0.000002 and is
    # predicted at (prompt chars/4 + max_tokens 5) tokens: the reservation covers the actual cost.
    budget = Decimal("0.00002")  # ten requests' worth
    gw = make_gateway({"acme": {"budget": {"daily_usd": str(budget)}}})
    upstream.behave("cheap-model", prompt_tokens=1, completion_tokens=5, latency_s=0.05)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: chat(gw, max_tokens=5, content="hi"), range(40)))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    spent = sum(Decimal(a.headers["x-polyroute-cost-usd"]) for a in ok)
    assert spent <= budget and len(ok) >= 5
    assert all(a.status_code == 403 for a in refused) and refused
    assert {a.json()["error"]["code"] for a in refused} <= {"budget_exceeded", "policy_denied"}
    # every settle landed and no hold is left behind (the books count whole micro-dollars, rounded up)
    books = httpx.get(gw.url + "/admin/spend/acme", headers=gw.auth(gw.admin_key)).json()
    assert (
        Decimal(books["daily_usd"])
        == sum(Decimal(to_micros(Decimal(a.headers["x-polyroute-cost-usd"]))) for a in ok) / 1_000_000
    )
    assert Decimal(books["daily_usd"]) <= budget


# ---- Redis down ------------------------------------------------------------------------------
def test_redis_down_and_back_without_restart(upstream, tmp_path):
    server = RedisServer(persist_dir=tmp_path)  # Redis keeps its data across the outage, as deployed
    policy_file = tmp_path / "policy.yaml"
    write_policy(policy_file, {"capped": {"budget": {"daily_usd": "10"}}})
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "data",
        policy_file=policy_file,
        redis_url=server.url,
    )
    try:
        capped = new_key(gw, "capped")
        for key in (None, capped):  # both keys verified (and so remembered) while Redis is up
            answer = chat(gw, key)
            assert answer.status_code == 200, answer.text
        assert httpx.get(gw.url + "/readyz").json()["degraded"] is False  # the probe reached Redis
        server.stop()
        # acme has no budget: served (a key verified minutes ago keeps working, the ledger buffers)
        served = chat(gw)
        assert served.status_code == 200
        # capped has a budget: fail closed, no worker called
        calls = len(upstream.requests)
        down = chat(gw, capped)
        assert down.status_code == 503 and down.json()["error"]["code"] == "budget_store_unavailable"
        assert len(upstream.requests) == calls
        # ready but degraded: Redis is every replica's, so an unready answer would empty the Service
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200 and ready.json()["store"]["ok"] is False
        assert ready.json()["degraded"] is True
        assert gw.state.stores.ledger.buffered >= 1
        server.start()
        deadline = time.monotonic() + 10
        while httpx.get(gw.url + "/readyz").json()["degraded"]:
            assert time.monotonic() < deadline, "the gateway did not recover after Redis came back"
            time.sleep(0.1)
        assert chat(gw, capped).status_code == 200
        while gw.state.stores.ledger.buffered:
            assert time.monotonic() < deadline, "buffered ledger records were not sent"
            time.sleep(0.05)
        ids = {r.get("id") for r in gw.state.stores.ledger.records()}
        assert served.headers["x-polyroute-request-id"] in ids  # written while Redis was down, not lost
    finally:
        gw.server.stop()
        server.stop()


def test_the_strict_readiness_rule_is_kept_on_request(upstream, tmp_path):
    """Ready-but-degraded is for a replica that reached Redis (it verified keys, it has books to
    send); one started during the outage stays unready (test_redis_down_at_start_then_up), so a
    rollout waits. POLYROUTE_READY_REQUIRES_STORE=true keeps the old rule: unready while Redis is down."""
    server = RedisServer()
    strict = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "strict",
        redis_url=server.url,
        ready_requires_store=True,
    )
    try:
        assert httpx.get(strict.url + "/readyz").status_code == 200
        server.stop()
        ready = httpx.get(strict.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["degraded"] is True
    finally:
        strict.server.stop()


def test_redis_down_at_start_then_up(upstream, tmp_path):
    """The gateway starts without Redis (clear log, /readyz false) and recovers when it appears."""
    from gateway import Settings, create_app
    from tests.fakes.server import serve_in_thread

    server = RedisServer()
    server.stop()
    settings = Settings(data_dir=tmp_path, local_workers=False, redis_url=server.url, key_reload_interval_s=0)
    running = serve_in_thread(create_app(settings, parse_catalog(catalog_yaml_for(upstream.url))))
    try:
        assert httpx.get(running.url + "/healthz").status_code == 200
        ready = httpx.get(running.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["store"]["ok"] is False
        denied = httpx.post(
            running.url + "/v1/chat/completions", headers={"authorization": "Bearer pr-x"}, json={}
        )
        assert denied.status_code == 503 and denied.json()["error"]["code"] == "key_store_unavailable"
        server.start()
        deadline = time.monotonic() + 10
        while httpx.get(running.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "no recovery after Redis came up"
            time.sleep(0.1)
    finally:
        running.stop()
        server.stop()
