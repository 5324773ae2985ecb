"""Every judge call the judge's budget was charged for is in the ledger, including a grade dropped
because judging was turned off while the judge was answering (docs/learning-from-traffic.md). A
real gateway, the test upstream as the judge; the grade runs in the background and is waited for by
polling its outcome metric, never by sleeping a fixed time."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import yaml

from tests.test_judge import judge_answering, make_gateway, policy, wait_for_outcomes  # noqa: F401

# The judge answers this long after it was called: far more than turning judging off takes, so the
# policy change lands while the judge is answering even on a loaded machine.
JUDGE_LATENCY_S = 5.0


def test_a_paid_grade_dropped_because_judging_was_turned_off_is_booked_as_unscored(
    make_gateway,  # noqa: F811 - the fixture imported from tests/test_judge.py
    upstream,
):
    gw = judge_answering(make_gateway, upstream, latency_s=JUDGE_LATENCY_S)
    off = httpx.put(
        gw.url + "/admin/policies",
        headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
        content=yaml.safe_dump({**policy(None), "version": "judging-off"}),
        timeout=30,
    )
    assert off.status_code == 200, off.text
    assert wait_for_outcomes(gw, 1) == {"disabled": 1}  # dropped, as documented
    spend = httpx.get(gw.url + "/admin/spend/judge:acme", headers=gw.auth(gw.admin_key), timeout=30).json()
    charged_micros = Decimal(spend["daily_usd"]) * 1_000_000
    assert charged_micros > 0  # the judge's budget paid for the call

    records = [json.loads(line) for line in (gw.data_dir / "ledger.jsonl").read_text().splitlines()]
    (graded,) = [r for r in records if r["type"] == "request"]
    judge_records = [
        r for r in records if r["type"] == "feedback" and r.get("source") in ("judge", "judge_unscored")
    ]
    assert len(judge_records) == 1, judge_records
    (booked,) = judge_records
    assert booked["source"] == "judge_unscored" and booked["score"] is None  # its cost, no label
    assert booked["request_id"] == graded["id"] and booked["tenant"] == "acme"
    assert booked["worker"] == "cheap" and booked["judge"] == "pricey"
    assert booked["cost_micros"] == charged_micros
