"""Live changes while a multi-step workflow is in flight, as an operator makes them: the policy file
edited (hot reload) or a new router version put in force between two steps of a plan that started
before. A worker the new policy excludes is not called by a later step, nor by the fast mode that
answers when the plan produced nothing, and the answer, its headers and the ledger say what happened;
the plan keeps the router version it started with, and says which.

No timing bets: the test upstream holds the first step's call until the test has made its change,
and the test makes the change itself (the reload the watcher would make on its next tick)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.fakes.upstream import FakeUpstream
from tests.test_planner_gateway import (  # noqa: F401 (trained: a fixture)
    QUESTION,
    behave_all,
    pick,
    trained,
    with_planner,
)

DISAGREE = {"cheap": "A", "mid": "B", "pricey": "C"}  # the plan reads one answer and calls again


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def planned(held: FakeUpstream, tmp_path: Path, trained, policy: dict | None = None, **settings) -> Gateway:  # noqa: F811
    """A gateway whose router has the trained planner, on the held upstream (see `reloading`)."""
    from router import save_artifact

    planner, artifact = trained
    save_artifact(tmp_path / "data" / "router", with_planner(artifact, planner))
    return reloading(held, tmp_path, policy, **settings)


def reloading(held: FakeUpstream, tmp_path: Path, policy: dict | None = None, **settings) -> Gateway:
    """A gateway on the held upstream, without retries; its policy file (if given) is reloaded by
    the test, not by the watcher's tick."""
    if policy is not None:
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
        settings["policy_file"] = tmp_path / "policy.yaml"
    return start_gateway(
        parse_catalog(catalog_yaml_for(held.url)),
        tmp_path / "data",
        retries=0,
        policy_reload_interval_s=3600,
        **settings,
    )


def during_first_step(
    gw: Gateway, held: FakeUpstream, first: str, change: Callable[[], None], body: dict, headers: dict
) -> httpx.Response:
    """Send ``body``; once ``first``'s call has reached the upstream (and is held there) make
    ``change``, then let the call answer. Returns the response."""
    gate = held.hold(f"{first}-model")
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, gw.v1 + "/chat/completions", headers=headers, json=body, timeout=120)
        wait_for(lambda: held.requests_for(f"{first}-model") or sent.done(), f"{first}'s call")
        change()
        gate.set()
        return sent.result()


def edit_policy(gw: Gateway, policy: dict) -> Callable[[], None]:
    def change() -> None:
        Path(gw.state.policy.path).write_text(yaml.safe_dump(policy))
        assert gw.state.policy.reload("file"), gw.state.policy.last_error

    return change


def deny(gw: Gateway, *workers: str) -> dict:
    """A policy that excludes ``workers`` by their jurisdictions (the test catalog's differ)."""
    places = [gw.state.catalog.get(w).jurisdiction for w in workers]
    return {"version": "closed", "rules": [{"id": "deny-late", "deny_jurisdictions": places}]}


def ask_body(content: str = QUESTION, **extra) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 20, **extra}


def plan_headers(gw: Gateway, cost_weight: float) -> dict:
    return {**gw.auth(), "x-polyroute-trace": "1", "x-polyroute-cost-weight": str(cost_weight)}


# ---- the policy edited while a plan runs ------------------------------------------------------------
def test_a_worker_excluded_by_a_reload_mid_plan_is_not_called_by_a_later_step(held, trained, tmp_path):  # noqa: F811
    gw = planned(held, tmp_path, trained, policy={"version": "open"})
    try:
        cost_weight, rounds = pick(gw, DISAGREE, lambda r: len(r) >= 2)
        first, wanted = rounds[0][0], rounds[1][0]
        behave_all(held, DISAGREE)
        admitted = gw.state.policy.engine.version
        answer = during_first_step(
            gw, held, first, edit_policy(gw, deny(gw, wanted)), ask_body(), plan_headers(gw, cost_weight)
        )
        assert answer.status_code == 200, answer.text
        assert not held.requests_for(f"{wanted}-model")  # the plan wanted it next: never called
        closed = gw.state.policy.engine.version
        note = answer.headers["x-polyroute-compose"]
        assert note.endswith(f"left out by a policy reload during the workflow: {wanted}")
        trace = answer.json()["polyroute"]["trace"]
        why = trace["detail"]["excluded_by_policy"][wanted]
        assert closed in why and "deny-late" in why
        assert wanted not in answer.headers["x-polyroute-plan"]
        assert answer.headers["x-polyroute-worker"] != wanted
        # the request was admitted under the version it names; the ledger keeps the whole story
        assert answer.headers["x-polyroute-policy-version"] == admitted
        record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
        assert record["policy_version"] == admitted and record["status"] == 200
        assert record["trace"]["detail"]["excluded_by_policy"] == {wanted: why}
        assert wanted not in [s["worker"] for s in record["trace"]["steps"]]
    finally:
        gw.server.stop()


def test_fast_mode_after_a_plan_without_an_answer_calls_no_worker_a_reload_excluded(held, trained, tmp_path):  # noqa: F811
    """The plan's first worker fails, and meanwhile the policy excludes every other worker: the plan
    has no answer, and fast mode, which answers when a plan `auto` chose produced none, may not fall
    back to them either: nobody else is called, the answer is a 502 saying why."""
    gw = planned(held, tmp_path, trained, policy={"version": "open"})
    try:
        cost_weight, rounds = pick(gw, DISAGREE, lambda r: len(r) >= 2)
        first = rounds[0][0]
        others = [w for w in DISAGREE if w != first]
        behave_all(held, DISAGREE)
        held.behave(f"{first}-model", status=500)
        answer = during_first_step(
            gw, held, first, edit_policy(gw, deny(gw, *others)), ask_body(), plan_headers(gw, cost_weight)
        )
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "workflow_failed"
        assert (
            "left out by a policy reload during the workflow: " + ", ".join(sorted(others))
            in (answer.json()["error"]["message"])
        )
        assert {b["model"] for b in held.requests} == {f"{first}-model"}
    finally:
        gw.server.stop()


def test_a_reload_that_excludes_nobody_changes_nothing_in_the_plan(held, trained, tmp_path):  # noqa: F811
    """The same rules under a new label: the request is evaluated again under it, and the plan goes
    on as planned (a re-evaluation must not exclude a worker the request was admitted to)."""
    policy = {"version": "v1", "tenants": {"acme": {"budget": {"daily_usd": 5}}}}
    gw = planned(held, tmp_path, trained, policy=policy)
    try:
        cost_weight, rounds = pick(gw, DISAGREE, lambda r: len(r) >= 2)
        behave_all(held, DISAGREE)
        answer = during_first_step(
            gw,
            held,
            rounds[0][0],
            edit_policy(gw, {**policy, "version": "v2"}),
            ask_body(),
            plan_headers(gw, cost_weight),
        )
        assert answer.status_code == 200, answer.text
        assert [
            r.split("+") for r in answer.headers["x-polyroute-plan"].split("steps=")[1].split(",")
        ] == rounds
        assert "left out" not in answer.headers["x-polyroute-compose"]
        assert "excluded_by_policy" not in answer.json()["polyroute"]["trace"].get("detail", {})
    finally:
        gw.server.stop()


def test_a_cascade_neither_judges_with_nor_escalates_to_a_worker_a_reload_excluded(held, tmp_path):
    """compose:cascade under the rule-based router: cheap answers, pricey (the strongest) judges it
    and is the escalation. Excluded while cheap answers, pricey is called for neither: the judge's
    verdict is missing (escalate), the escalation is excluded, and cheap's answer is kept."""
    gw = reloading(held, tmp_path, {"version": "open"})
    try:
        behave_all(held, {"cheap": "4", "mid": "4", "pricey": "9"})
        body = {**ask_body(model="compose:cascade"), "metadata": {"verifier": "judge"}}
        answer = during_first_step(
            gw,
            held,
            "cheap",
            edit_policy(gw, deny(gw, "pricey")),
            body,
            {**gw.auth(), "x-polyroute-trace": "1"},
        )
        assert answer.status_code == 200, answer.text
        assert not held.requests_for("pricey-model")
        assert answer.headers["x-polyroute-worker"] == "cheap"
        trace = answer.json()["polyroute"]["trace"]
        assert "pricey" in trace["detail"]["excluded_by_policy"]
        skipped = [s for s in trace["steps"] if s["worker"] == "pricey"]
        assert skipped and all(s["verdict"].startswith("skipped: excluded by policy closed") for s in skipped)
    finally:
        gw.server.stop()


# ---- a new router version put in force while a plan runs ----------------------------------------
def test_a_plan_keeps_the_router_version_it_started_with_and_says_which(held, trained, tmp_path):  # noqa: F811
    """`router activate` lands between the plan's rounds: the plan goes on with its own version's
    planner and priors (the new version has no planner at all), its headers and ledger record name
    that version, and a request sent meanwhile is served by the new one and says so."""
    from router import activate_version, save_artifact

    gw = planned(held, tmp_path, trained, router_reload_interval_s=0.05)
    try:
        root = gw.state.router.root
        started = gw.state.router.current.version
        _, artifact = trained
        plain = with_planner(artifact, None)
        plain.card = {**plain.card, "note": "a version without a planner"}
        newer = save_artifact(root, plain, activate=False).name
        cost_weight, rounds = pick(gw, DISAGREE, lambda r: len(r) >= 2)
        first = f"{rounds[0][0]}-model"
        behave_all(held, DISAGREE)
        sender = ThreadPoolExecutor(1)
        during = []

        def activate() -> None:
            activate_version(root, newer)
            wait_for(lambda: gw.state.router.current.version == newer, "the hot swap")
            body = ask_body(content="What is 2 + 2?")
            during.append(
                sender.submit(
                    httpx.post, gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=120
                )
            )
            # it is under way: answered, or routed to the held worker too (its router already chosen)
            wait_for(lambda: during[0].done() or len(held.requests_for(first)) > 1, "the second request")

        try:
            answer = during_first_step(
                gw, held, rounds[0][0], activate, ask_body(), plan_headers(gw, cost_weight)
            )
            meanwhile = during[0].result()
        finally:
            sender.shutdown()
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-strategy"] == "compose:plan"
        assert [
            r.split("+") for r in answer.headers["x-polyroute-plan"].split("steps=")[1].split(",")
        ] == rounds
        assert answer.headers["x-polyroute-router-version"] == started
        assert ledger_record(gw, answer.headers["x-polyroute-request-id"])["router_version"] == started
        assert meanwhile.status_code == 200, meanwhile.text
        assert meanwhile.headers["x-polyroute-router-version"] == newer
        assert meanwhile.headers["x-polyroute-strategy"] != "compose:plan"  # no planner in the new one
        assert ledger_record(gw, meanwhile.headers["x-polyroute-request-id"])["router_version"] == newer
    finally:
        gw.server.stop()


# ---- a catalog worker the model does not know, and one that cannot be called -----------------------
def with_newbie(url: str) -> str:
    """The test catalog plus `newbie`, a callable frontier worker the router's model has no column for
    (no vector: never trained on, never calibrated). `nokey` is known to nobody either, and its key
    env var is unset: unavailable."""
    return (
        catalog_yaml_for(url)
        + f"""  - name: newbie
    model: openai/newbie-model
    api_base: {url}/v1
    api_key_env: POLYROUTE_TEST_UPSTREAM_KEY
    context_window: 8192
    input_price_per_m: 0.05
    output_price_per_m: 0.05
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
"""
    )


@pytest.mark.parametrize("workflow", ["plan", "cascade"])
def test_a_workflow_auto_runs_over_a_worker_without_data_says_its_prior_is_used(
    held,
    trained,  # noqa: F811
    tmp_path,
    workflow,
):
    """Fast mode's reason says "prior used" when it picks a worker the model has no data for; the
    plan (over every admissible worker) and the predicted cascade (over its two levels) rest on that
    prior as much, and their reasons said nothing of it. The unavailable worker is in no pool."""
    from router import save_artifact

    planner, artifact = trained
    save_artifact(
        tmp_path / "data" / "router", with_planner(artifact, planner if workflow == "plan" else None)
    )
    gw = start_gateway(parse_catalog(with_newbie(held.url)), tmp_path / "data", retries=0)
    try:
        behave_all(held, {**dict.fromkeys(DISAGREE, "A"), "newbie": "A"})
        answer = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=ask_body(), timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-strategy"] == f"compose:{workflow}"
        reason = answer.headers["x-polyroute-route-reason"]
        assert reason.endswith("; no data for newbie yet, prior used"), reason
        assert "nokey" not in reason and not held.requests_for("nokey-model")
        basis = httpx.get(gw.url + "/admin/router", headers=gw.auth(gw.admin_key)).json()["workers"]
        assert basis["newbie"]["basis"] == "prior" and basis["cheap"]["basis"] == "calibrated"
    finally:
        gw.server.stop()
