"""Two real gateway processes (`polyroute serve`) over one redis-server behave as one gateway.

Concurrent requests at both replicas: their combined spend stays within the tenant's budget,
one key's rate limit holds across both, and a key revoked through one is refused by the other
within a second. Bounded: 40 + 30 requests, each with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import time
from decimal import Decimal

import httpx
import pytest
import yaml

from tests.conftest import catalog_yaml_for

ADMIN_KEY = "pr-replica-admin"
BUDGET = Decimal("0.00002")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def replicas(upstream, redis_server, tmp_path):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    catalog_file = tmp_path / "workers.yaml"
    catalog_file.write_text(catalog_yaml_for(upstream.url))
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        yaml.safe_dump({"version": "replicas", "tenants": {"capped": {"budget": {"daily_usd": str(BUDGET)}}}})
    )
    procs, urls = [], []
    for name in ("a", "b"):
        port = _free_port()
        env = {
            **os.environ,
            "REDIS_URL": redis_server.url,
            "POLYROUTE_ADMIN_KEY": ADMIN_KEY,
            "POLYROUTE_TEST_UPSTREAM_KEY": "sk-test",
            "POLYROUTE_POLICY_FILE": str(policy_file),
        }
        command = [sys.executable, "-m", "polyroute.cli", "serve", "--port", str(port)]
        command += ["--workers-file", str(catalog_file), "--data-dir", str(tmp_path / name)]
        command += ["--no-local-workers", "--log-level", "warning"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{url} did not become ready"
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _key(url: str, tenant: str, **limits) -> tuple[str, str]:
    created = httpx.post(url + "/admin/keys", headers=ADMIN, json={"tenant": tenant, **limits}, timeout=10)
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


def _chat(url: str, key: str) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    return httpx.post(
        url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body, timeout=30
    )


def _fire(urls: list[str], key: str, count: int) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda i: _chat(urls[i % 2], key), range(count)))


def test_two_replicas_behave_as_one_gateway(replicas, upstream):
    a, b = replicas
    upstream.behave("cheap-model", prompt_tokens=1, completion_tokens=5, latency_s=0.02)

    # one budget, two replicas: reservations in Redis keep the combined spend within it
    _, capped = _key(a, "capped")
    answers = _fire(replicas, capped, 40)
    served = [r for r in answers if r.status_code == 200]
    spent = sum(Decimal(r.headers["x-polyroute-cost-usd"]) for r in served)
    assert spent <= BUDGET and served and {r.headers["x-polyroute-worker"] for r in served} == {"cheap"}
    assert {r.status_code for r in answers} == {200, 403}
    books = [
        Decimal(httpx.get(u + "/admin/spend/capped", headers=ADMIN).json()["daily_usd"]) for u in replicas
    ]
    assert books[0] == books[1] <= BUDGET  # both replicas see the same books

    # one key limited to 10 requests a minute, used through both replicas at once
    _, limited = _key(b, "free", rpm=10)
    answers = _fire(replicas, limited, 30)
    codes = [r.status_code for r in answers]
    assert codes.count(200) in (10, 11)  # 10 at once, +1 if the run spans the 6 s refill
    assert set(codes) == {200, 429}
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-limit-requests"] == "10"

    # a key revoked through one replica is refused by the other within a second
    key_id, key = _key(a, "free")
    assert _chat(b, key).status_code == 200
    assert httpx.delete(a + f"/admin/keys/{key_id}", headers=ADMIN).status_code == 200
    revoked_at = time.monotonic()
    while _chat(b, key).status_code != 401:
        assert time.monotonic() - revoked_at < 1.0, "revocation did not reach the other replica in 1 s"
        time.sleep(0.02)
