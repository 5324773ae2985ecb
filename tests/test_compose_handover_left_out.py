"""A workflow `auto` chose hands over to fast mode (it produced no answer): the workers a policy
reload left out during the workflow are named by fast mode's answer too.

Before, the workflow kept them in its own `Run.excluded` only: fast mode's answer had no
`x-polyroute-left-out` header and its ledger trace no `excluded_by_policy`, so a client (and the
books) saw a cascade that skipped its escalation for no stated reason.
"""

from __future__ import annotations

import yaml

from tests.test_compose_accounting import ESTIMATES, gateway_with, record_of, save_cascading_router
from tests.test_router_live_change_plan import deny, during_first_step, edit_policy


def test_fast_mode_after_a_workflow_names_the_workers_a_reload_left_out(held, tmp_path):
    """cheap -> pricey: while cheap's call is held, a reload excludes pricey; cheap fails, so the
    cascade has no answer, and fast mode answers from mid, saying pricey was left out and why."""
    save_cascading_router(tmp_path / "data")
    gw = gateway_with(held, tmp_path, {}, retries=0, policy_reload_interval_s=3600)
    try:
        held.behave("cheap-model", status=500)
        held.behave("mid-model", text="about 40000")
        body = {"model": "auto", "messages": [{"role": "user", "content": ESTIMATES[0]}], "max_tokens": 50}
        headers = {**gw.auth(), "x-polyroute-cost-weight": "0.3"}
        answer = during_first_step(gw, held, "cheap", edit_policy(gw, deny(gw, "pricey")), body, headers)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-worker"] == "mid"
        assert answer.headers["x-polyroute-compose"].startswith("degraded: the cascade workflow")
        assert answer.headers["x-polyroute-left-out"] == "pricey"
        assert {b["model"] for b in held.requests} == {"cheap-model", "mid-model"}
        record = record_of(gw, answer.headers["x-polyroute-request-id"])
        assert record["worker"] == "mid"
        assert set(record["trace"]["excluded_by_policy"]) == {"pricey"}
        assert yaml.safe_load((tmp_path / "policy.yaml").read_text())["version"] == "closed"
    finally:
        gw.server.stop()
