"""Hot reload of the worker catalog (gateway/catalog_reload.py), through the HTTP API.

Each gateway reads a workers file of its own and checks it every 50 ms (the catalog file is looked
at on every check: CatalogFile.interval_s = 0). A test edits the file, then waits, with a generous
timeout, for what /admin/workers says: the new sha256 in force, or why the edit was refused.
"""

from __future__ import annotations

import logging
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import yaml

from policies.catalog import text_digest
from tests.conftest import catalog_yaml_for, start_gateway

TIMEOUT_S = 60.0
HELLO = [{"role": "user", "content": "hello there"}]
BASE_POLICY = {"version": "base", "tenants": {"acme": {}}}
# the test upstream's reported usage for every call: cheap costs 0.10 + 0.20 per 1M → 0.0003 USD
TOKENS = {"prompt_tokens": 1000, "completion_tokens": 1000}

LOCAL_WORKER = """
  - name: tiny-local
    model: tiny-local
    input_price_per_m: 0
    output_price_per_m: 0
    tier: local
    license: Apache-2.0
    provider: llama.cpp
    context_window: 2048
    local:
      gguf: /nonexistent/tiny.gguf
      n_ctx: 2048
"""

NEWBIE = """
  - name: newbie
    model: openai/newbie-model
    api_base: {url}/v1
    api_key_env: POLYROUTE_TEST_UPSTREAM_KEY
    context_window: 8192
    input_price_per_m: 3.00
    output_price_per_m: 4.00
    tier: specialist
    license: MIT
    provider: fake
    jurisdiction: FR
"""


def judge(worker: str) -> dict:
    """A tenant's judge: a policy name the catalog must have (policies/catalog_check.py)."""
    return {"worker": worker, "sample": 0.001, "daily_budget_usd": 1}


def write_text(path: Path, text: str) -> None:
    """As an editor or a ConfigMap sync does: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for(condition, what: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        time.sleep(0.02)
    return result


def catalog_file(gw) -> dict:
    return httpx.get(gw.url + "/admin/workers", headers=gw.auth(gw.admin_key), timeout=30).json()[
        "catalog_file"
    ]


def wait_applied(gw, text: str) -> None:
    digest = text_digest(text)
    wait_for(lambda: catalog_file(gw)["sha256"] == digest, f"catalog {digest} in force")


def wait_refused(gw, text: str) -> dict:
    digest = text_digest(text)

    def refused():
        status = catalog_file(gw)
        return status if status["on_disk_sha256"] == digest and status["refused"] else None

    return wait_for(refused, f"catalog {digest} refused")


def chat(gw, model: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": model, "messages": HELLO},
        timeout=timeout,
    )


def cost(response: httpx.Response) -> Decimal:
    assert response.status_code == 200, response.text
    return Decimal(response.headers["x-polyroute-cost-usd"])


def start(upstream, tmp_path: Path, text: str, policy: dict | None = None):
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(text)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy or BASE_POLICY))
    gw = start_gateway(
        None,
        tmp_path / "data",
        workers_file=workers_file,
        policy_file=policy_file,
        policy_reload_interval_s=0.05,
    )
    gw.state.catalog_file.interval_s = 0  # every check looks at the file (the default: every few seconds)
    upstream.behave("cheap-model", **TOKENS)
    upstream.behave("newbie-model", **TOKENS)
    return gw, workers_file


@pytest.fixture
def gateway(upstream, tmp_path):
    text = catalog_yaml_for(upstream.url)
    gw, workers_file = start(upstream, tmp_path, text)
    gw.text, gw.workers_file = text, workers_file
    yield gw
    gw.server.stop()


def test_a_price_change_applies_to_the_next_request(gateway, caplog):
    caplog.set_level(logging.INFO, logger="polyroute.gateway")
    assert cost(chat(gateway, "cheap")) == Decimal("0.0003")
    edited = gateway.text.replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
    write_text(gateway.workers_file, edited)
    wait_applied(gateway, edited)
    assert cost(chat(gateway, "cheap")) == Decimal("0.0013")  # 1.10 + 0.20 per 1M, 1000 tokens each
    ready = httpx.get(gateway.url + "/readyz", timeout=30).json()["catalog"]
    assert (
        ready["sha256"] == text_digest(edited)
        and ready["on_disk"] == "unchanged"
        and ready["warning"] is None
    )
    applied = [r.getMessage() for r in caplog.records if "in force, replacing" in r.getMessage()]
    assert len(applied) == 1 and text_digest(edited) in applied[0] and "changed ['cheap']" in applied[0]


def test_an_added_worker_can_be_pinned_and_a_removed_one_is_unknown(gateway, upstream):
    assert chat(gateway, "newbie").status_code == 404
    assert chat(gateway, "mid").status_code == 200
    assert 'polyroute_worker_up{worker="pricey"} 1.0' in httpx.get(gateway.url + "/metrics", timeout=30).text
    pricey = gateway.text.index("  - name: pricey")
    nokey = gateway.text.index("  - name: nokey")
    edited = gateway.text[:pricey] + gateway.text[nokey:] + NEWBIE.format(url=upstream.url)
    edited = edited.replace("  - name: mid\n", "  - name: mid2\n")  # mid is removed, mid2 added
    write_text(gateway.workers_file, edited)
    wait_applied(gateway, edited)

    added = chat(gateway, "newbie")
    assert added.headers["x-polyroute-worker"] == "newbie" and cost(added) == Decimal("0.007")
    removed = chat(gateway, "mid")
    assert removed.status_code == 404 and removed.json()["error"]["code"] == "model_not_found"
    assert "mid2" in removed.json()["error"]["message"]
    workers = httpx.get(
        gateway.url + "/admin/workers", headers=gateway.auth(gateway.admin_key), timeout=30
    ).json()
    assert {w["name"] for w in workers["catalog"]} == {"cheap", "mid2", "nokey", "newbie"}
    metrics = httpx.get(gateway.url + "/metrics", timeout=30).text
    assert 'polyroute_worker_up{worker="newbie"} 1.0' in metrics and 'worker="pricey"' not in metrics
    # a policy version from now on is checked against the catalog in force: pricey is gone
    refused = httpx.put(
        gateway.url + "/admin/policies",
        headers={**gateway.auth(gateway.admin_key), "content-type": "application/yaml"},
        content=yaml.safe_dump({"version": "v2", "tenants": {"acme": {"judge": judge("pricey")}}}),
        timeout=30,
    )
    assert refused.status_code == 400 and "judge.worker: 'pricey' is not in the catalog" in refused.text


def test_an_invalid_file_keeps_the_catalog_in_force_and_says_why(gateway):
    edited = gateway.text.replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
    write_text(gateway.workers_file, edited)
    wait_applied(gateway, edited)
    write_text(gateway.workers_file, edited.replace("input_price_per_m: 1.10", "input_price_per_m: -1"))

    def invalid():
        ready = httpx.get(gateway.url + "/readyz", timeout=30).json()["catalog"]
        return ready if ready["on_disk_error"] else None

    ready = wait_for(invalid, "/readyz says the file is invalid")
    assert ready["sha256"] == text_digest(edited) and "input_price_per_m" in ready["on_disk_error"]
    assert "not applied" in ready["warning"]
    assert cost(chat(gateway, "cheap")) == Decimal("0.0013")  # the last good catalog serves


def test_a_catalog_that_drops_a_worker_the_policy_names_is_refused(upstream, tmp_path):
    text = catalog_yaml_for(upstream.url)
    gw, workers_file = start(
        upstream, tmp_path, text, {"version": "j", "tenants": {"acme": {"judge": judge("mid")}}}
    )
    try:
        mid = text.index("  - name: mid")
        pricey = text.index("  - name: pricey")
        edited = (text[:mid] + text[pricey:]).replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
        write_text(workers_file, edited)
        refused = wait_refused(gw, edited)
        assert refused["sha256"] == text_digest(text)  # the catalog in force is the old one
        assert "policy in force does not fit" in refused["refused"] and "'mid'" in refused["refused"]
        ready = httpx.get(gw.url + "/readyz", timeout=30).json()["catalog"]
        assert ready["refused"] == refused["refused"] and refused["refused"] in ready["warning"]
        assert chat(gw, "mid").headers["x-polyroute-worker"] == "mid"
        assert cost(chat(gw, "cheap")) == Decimal("0.0003")  # nothing of the edit applied
        # the policy changed first (no judge on mid): the same file is tried again, and fits
        put = httpx.put(
            gw.url + "/admin/policies",
            headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
            content=yaml.safe_dump(BASE_POLICY),
            timeout=30,
        )
        assert put.status_code == 200, put.text
        wait_applied(gw, edited)
        assert chat(gw, "mid").status_code == 404 and cost(chat(gw, "cheap")) == Decimal("0.0013")
    finally:
        gw.server.stop()


def test_a_changed_local_worker_keeps_the_catalog_and_says_restart(upstream, tmp_path):
    text = catalog_yaml_for(upstream.url) + LOCAL_WORKER
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        edited = text.replace("n_ctx: 2048", "n_ctx: 4096").replace(
            "input_price_per_m: 0.10", "input_price_per_m: 1.10"
        )
        write_text(workers_file, edited)
        refused = wait_refused(gw, edited)
        assert refused["refused"] == "restart to apply: local worker tiny-local changed"
        assert refused["sha256"] == text_digest(text)
        assert cost(chat(gw, "cheap")) == Decimal("0.0003")  # the price edit beside it is not applied either
        # the file back as it was in force: nothing to say any more
        write_text(workers_file, text)
        wait_for(lambda: catalog_file(gw)["warning"] is None, "the warning cleared")
    finally:
        gw.server.stop()


def test_a_request_in_flight_is_billed_at_the_catalog_it_started_with(held, tmp_path):
    text = catalog_yaml_for(held.url)
    gw, workers_file = start(held, tmp_path, text)
    try:
        gate = held.hold("cheap-model")
        answer: dict[str, httpx.Response] = {}
        caller = threading.Thread(target=lambda: answer.update(first=chat(gw, "cheap", timeout=120)))
        caller.start()
        wait_for(lambda: held.requests_for("cheap-model"), "the call held at the upstream")
        edited = text.replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
        write_text(workers_file, edited)
        wait_applied(gw, edited)
        gate.set()
        caller.join(timeout=120)
        assert cost(answer["first"]) == Decimal("0.0003")  # the price it was admitted and routed at
        assert cost(chat(gw, "cheap")) == Decimal("0.0013")  # the next one: the new price
    finally:
        held.release_all()  # a failed assertion above leaves no call held while the gateway stops
        gw.server.stop()


def test_a_cached_answer_is_not_served_after_a_catalog_edit(gateway, upstream):
    """The response cache keeps an answer for the policy and the catalog it was made under: after a
    price edit the same request asks the worker again, and is billed at the new price."""
    asked = {"x-polyroute-cache": "on"}

    def cached_chat() -> httpx.Response:
        body = {"model": "cheap", "messages": HELLO}
        return httpx.post(
            gateway.v1 + "/chat/completions", headers={**gateway.auth(), **asked}, json=body, timeout=30
        )

    first, again = cached_chat(), cached_chat()
    assert cost(first) == Decimal("0.0003")
    assert again.headers["x-polyroute-strategy"] == "cache" and cost(again) == Decimal("0")
    edited = gateway.text.replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
    write_text(gateway.workers_file, edited)
    wait_applied(gateway, edited)
    after = cached_chat()
    assert after.headers["x-polyroute-strategy"] != "cache"
    assert cost(after) == Decimal("0.0013")
    assert len(upstream.requests_for("cheap-model")) == 2
