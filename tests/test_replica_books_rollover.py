"""Budgets at the UTC day and month boundaries, without waiting for midnight.

The books count a reservation, a settle and a spend record in the UTC day and month of the budget's
clock (`clock`, gateway/store/budgets.py), which the test moves from 23:59:59 to past midnight:

- the daily budget starts afresh at midnight while the monthly one goes on, and both start afresh
  on the first of the month;
- a hold taken before midnight and settled after it stays in the day (and month) it was taken in:
  it was checked against that day's budget, and it never counts against the new day's;
- two replicas on one Redis agree, and a refusal is a 403 in OpenAI's error JSON naming the budget.

Hold expiry is not on this clock (Redis's TIME decides it), so nothing here waits on time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

import httpx
import pytest
import redis
import yaml

from gateway.store import BudgetExceeded, Limits, to_micros
from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, start_gateway


@dataclass
class Clock:
    """The books' time, moved by the test."""

    at: datetime

    def __call__(self) -> datetime:
        return self.at


BEFORE_MIDNIGHT = datetime(2026, 11, 15, 23, 59, 59, 999_000, tzinfo=UTC)
NEXT_DAY = datetime(2026, 11, 16, 0, 0, 0, tzinfo=UTC)
LAST_SECOND_OF_MONTH = datetime(2026, 11, 30, 23, 59, 59, 999_000, tzinfo=UTC)
NEXT_MONTH = datetime(2026, 12, 1, 0, 0, 0, tzinfo=UTC)


def _micros(spend) -> tuple[int, int]:
    return to_micros(spend.daily_usd), to_micros(spend.monthly_usd)


@pytest.mark.anyio
async def test_the_day_starts_afresh_at_midnight_and_the_month_goes_on(stores):
    clock = Clock(BEFORE_MIDNIGHT)
    stores.budgets.clock = clock
    limits = Limits(daily=100, monthly=150)
    late = await stores.budgets.reserve("acme", 60, limits)  # still running at midnight
    await stores.budgets.settle(await stores.budgets.reserve("acme", 40, limits), 40)
    with pytest.raises(BudgetExceeded) as refused:
        await stores.budgets.reserve("acme", 1, limits)
    assert refused.value.period == "daily"

    clock.at = NEXT_DAY
    assert _micros(await stores.budgets.usage("acme")) == (0, 100)  # a new day, the same month
    with pytest.raises(BudgetExceeded) as refused:
        await stores.budgets.reserve("acme", 60, limits)
    assert (refused.value.period, refused.value.left_micros) == ("monthly", 50)
    await stores.budgets.reserve("acme", 50, limits)
    await stores.budgets.settle(late, 30)  # after midnight: it stays in the day it was taken in
    assert _micros(await stores.budgets.usage("acme")) == (50, 40 + 30 + 50)
    clock.at = BEFORE_MIDNIGHT
    assert _micros(await stores.budgets.usage("acme")) == (40 + 30, 40 + 30 + 50)


@pytest.mark.anyio
async def test_the_month_starts_afresh_on_the_first(stores):
    clock = Clock(LAST_SECOND_OF_MONTH)
    stores.budgets.clock = clock
    limits = Limits(daily=100, monthly=100)
    late = await stores.budgets.reserve("acme", 100, limits)
    with pytest.raises(BudgetExceeded):
        await stores.budgets.reserve("acme", 1, limits)
    stores.budgets.record("globex", 7)  # a tenant without a budget: counted in the day it was spent
    clock.at = NEXT_MONTH
    assert _micros(await stores.budgets.usage("acme")) == (0, 0)
    await stores.budgets.settle(late, 80)
    first = await stores.budgets.reserve("acme", 100, limits)  # the whole of the new month's budget
    assert first.periods == ("d:2026-12-01", "m:2026-12")
    clock.at = LAST_SECOND_OF_MONTH
    assert _micros(await stores.budgets.usage("acme")) == (80, 80)  # the late settle, in its own month
    clock.at = NEXT_MONTH
    stores.budgets.record("globex", 5)
    await stores.budgets.flush()  # (in-process, saving keeps only the current day and month)
    assert _micros(await stores.budgets.usage("globex")) == (5, 5)
    assert _micros(await stores.budgets.usage("acme")) == (100, 100)  # the new month's hold


# ---- two replicas ------------------------------------------------------------------------------
# cheap: $0.10/M in, $0.20/M out. A request ("hi", max_tokens 5) is predicted at, and costs, 1 + 5
# tokens = $0.0000011: 2 micro-dollars on the books. Three a day, five a month.
DAILY_USD, MONTHLY_USD, PER_REQUEST = "0.000006", "0.00001", 2


def _chat(gw: Gateway, key: str) -> httpx.Response:
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=60)


def _refused_for(answer: httpx.Response, period: str) -> None:
    """A 403 in OpenAI's error JSON that names the budget that refused."""
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] in ("budget_exceeded", "policy_denied") and f"budget:{period}" in error["message"]


@pytest.fixture
def replicas(upstream, redis_server, tmp_path):
    redis.Redis.from_url(redis_server.url).flushdb()
    policy_file = tmp_path / "policy.yaml"
    budget = {"daily_usd": DAILY_USD, "monthly_usd": MONTHLY_USD}
    policy_file.write_text(yaml.safe_dump({"version": "rollover", "tenants": {"capped": {"budget": budget}}}))
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    started = [
        start_gateway(catalog, tmp_path / name, policy_file=policy_file, redis_url=redis_server.url)
        for name in ("a", "b")
    ]
    yield started
    for gw in started:
        gw.server.stop()


def test_two_replicas_roll_over_together(replicas, upstream):
    a, b = replicas
    clock = Clock(LAST_SECOND_OF_MONTH.replace(day=29))
    for gw in replicas:
        gw.state.stores.budgets.clock = clock  # one clock for both: replicas' clocks agree (NTP)
    upstream.behave("cheap-model", prompt_tokens=1, completion_tokens=5)
    created = httpx.post(a.url + "/admin/keys", headers=a.auth(a.admin_key), json={"tenant": "capped"})
    key = created.json()["key"]

    def books(gw: Gateway) -> tuple[int, int]:
        spend = httpx.get(gw.url + "/admin/spend/capped", headers=gw.auth(gw.admin_key)).json()
        return to_micros(Decimal(spend["daily_usd"])), to_micros(Decimal(spend["monthly_usd"]))

    served = [_chat(gw, key) for gw in (a, b, a)]
    assert [s.status_code for s in served] == [200] * 3, served[-1].text
    assert {to_micros(Decimal(s.headers["x-polyroute-cost-usd"])) for s in served} == {PER_REQUEST}
    _refused_for(_chat(b, key), "daily")
    assert books(a) == books(b) == (6, 6)

    clock.at = LAST_SECOND_OF_MONTH  # the next day: the day starts afresh, the month goes on
    assert books(a) == books(b) == (0, 6)
    served = [_chat(gw, key) for gw in (b, a)]
    assert [s.status_code for s in served] == [200] * 2, served[-1].text
    _refused_for(_chat(b, key), "monthly")
    assert books(a) == books(b) == (4, 10)

    clock.at = NEXT_MONTH  # the first of the month: both start afresh
    assert books(a) == books(b) == (0, 0)
    assert _chat(a, key).status_code == 200
    assert books(b) == (2, 2)
