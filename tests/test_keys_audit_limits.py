"""A rate limit whose rate changes while its state exists (a policy edit, a reload): what was used is
kept in units, on both backends and through the admin API.

The state of a limit is a GCRA arrival time, i.e. time owed. Read at a new rate without restating it,
3 requests used under "3 a minute" became the whole minute of "1000 a minute" (a raised limit left
a handful of requests, not 997), and 500 tokens used under "1000 a minute" became 50 of "100 a
minute" (a lowered limit let the tenant go on as if it had barely started).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.store import Limit
from policies import parse_catalog
from tests.conftest import backend_redis_url, catalog_yaml_for, running_upstream, start_gateway

pytestmark = pytest.mark.anyio


async def test_a_raised_limit_leaves_at_once_what_was_not_used(stores):
    small = Limit("tenant:acme|rpm", "requests", 3, 1)
    for _ in range(3):
        (verdict,) = await stores.limiter.check("acme", [small])
        assert verdict.allowed
    (refused,) = await stores.limiter.check("acme", [small])
    assert not refused.allowed  # the minute's 3 are used
    raised = Limit("tenant:acme|rpm", "requests", 1000, 1)
    (verdict,) = await stores.limiter.check("acme", [raised])
    # 3 used before, this one now: 996 of 1000 left (the old rate refills 1 per 20 s, so the few
    # seconds this test takes give nothing back)
    assert verdict.allowed and verdict.remaining == 996


async def test_a_lowered_limit_counts_what_was_used_but_for_a_minute_at_most(stores):
    tokens = Limit("tenant:acme|tpm", "tokens", 1000, 500)
    (verdict,) = await stores.limiter.check("acme", [tokens])
    assert verdict.allowed and verdict.remaining == 500
    lowered = Limit("tenant:acme|tpm", "tokens", 100, 10)
    (verdict,) = await stores.limiter.check("acme", [lowered])
    # 500 tokens used are five minutes of "100 a minute": held to one minute owed, so 10 more tokens
    # wait for their 6 s (one token per 600 ms), not five minutes and not nothing
    assert not verdict.allowed and verdict.remaining == 0 and verdict.retry_after_ms == 6000


async def test_a_lowered_limits_retry_after_holds(stores):
    """The restated state is kept even when the request is refused: restated afresh at every check,
    the one-minute hold started over at each retry, so the 600 ms retry-after was not true until the
    old state had drained below the new minute (24 s here). Waiting what it says is enough (time
    passing only helps: the assertion holds however loaded the machine)."""
    assert (await stores.limiter.check("acme", [Limit("tenant:acme|tpm", "tokens", 1000, 500)]))[0].allowed
    one_token = Limit("tenant:acme|tpm", "tokens", 100, 1)
    (refused,) = await stores.limiter.check("acme", [one_token])
    assert not refused.allowed and 0 < refused.retry_after_ms <= 600
    await asyncio.sleep(refused.retry_after_ms / 1000 + 0.05)  # the client doing what retry-after says
    (again,) = await stores.limiter.check("acme", [one_token])
    assert again.allowed, again


async def test_a_correction_after_a_rate_change_is_in_the_new_rate(stores):
    """A request charged 500 tokens under 1000 a minute used 100 (the correction, `adjust`); then
    the limit is lowered to 100 a minute. The 100 used are the whole new minute: the next token
    waits up to 600 ms (its share of the refill), where the old arithmetic read the 6 s owed under
    1000 a minute as 10 tokens of the new limit and let 90 more through at once."""
    charged = Limit("tenant:acme|tpm", "tokens", 1000, 500)
    assert (await stores.limiter.check("acme", [charged]))[0].allowed
    await stores.limiter.adjust("acme", Limit("tenant:acme|tpm", "tokens", 100, 500), -400)
    (verdict,) = await stores.limiter.check("acme", [Limit("tenant:acme|tpm", "tokens", 100, 1)])
    assert not verdict.allowed and 0 < verdict.retry_after_ms <= 600


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str | None:
    return backend_redis_url(request)


def test_raising_a_tenants_rpm_through_the_admin_api_takes_effect_at_once(backend, tmp_path: Path):
    """The operator's view: a tenant hit its rpm, the operator raises it with PUT /admin/policies,
    and the tenant's next answer says what is left of the new limit."""
    policy_file = tmp_path / "policy.yaml"

    def policy(version: str, rpm: int) -> str:
        return yaml.safe_dump({"version": version, "tenants": {"acme": {"rate_limit": {"rpm": rpm}}}})

    policy_file.write_text(policy("small", 2))
    settings = {"policy_file": policy_file, **({"redis_url": backend} if backend else {})}
    body = {"model": "cheap", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with running_upstream() as fake:
        gw = start_gateway(parse_catalog(catalog_yaml_for(fake.url)), tmp_path / "data", **settings)
        try:
            with httpx.Client(timeout=60) as http:
                chat = gw.v1 + "/chat/completions"
                assert [http.post(chat, headers=gw.auth(), json=body).status_code for _ in range(3)] == [
                    200,
                    200,
                    429,
                ]
                put = http.put(
                    gw.url + "/admin/policies",
                    headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
                    content=policy("raised", 100),
                )
                assert put.status_code == 200, put.text
                answer = http.post(chat, headers=gw.auth(), json=body)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-ratelimit-limit-requests"] == "100"
            assert answer.headers["x-ratelimit-remaining-requests"] == "97"  # 2 used, then this one
        finally:
            gw.server.stop()
