"""Policies through the gateway over HTTP: headers, 403s, confinement of fallback, admin API, hot
reload (valid, invalid YAML, schema error, file removed), and no mixed versions during a reload."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway

HELLO = [{"role": "user", "content": "hello there"}]
PII = [{"role": "user", "content": "Please e-mail the summary to jane.doe@example.com"}]

BASE_POLICY = {
    "version": "base",
    "rules": [
        {"id": "pii-no-cn-no-us", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU"]},
        {"id": "no-mnpl", "when": {"tenants": ["acme"]}, "deny_licenses": ["MNPL-0.1"]},
    ],
    "aliases": {"batch": "bulk jobs"},
}


def write_policy(path: Path, policy: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(policy))
    tmp.replace(path)  # atomic, as an editor or a ConfigMap swap does


@pytest.fixture(scope="module")
def pgw(upstream, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("policy-gw")
    policy_file = data_dir / "policy.yaml"
    write_policy(policy_file, BASE_POLICY)
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    gw = start_gateway(catalog, data_dir, policy_file=policy_file, policy_reload_interval_s=0.05)
    gw.policy_file = policy_file
    yield gw
    gw.server.stop()


@pytest.fixture(autouse=True)
def _restore_policy(request):
    yield
    if "pgw" in request.fixturenames:
        gw = request.getfixturevalue("pgw")
        write_policy(gw.policy_file, BASE_POLICY)
        wait_for(
            lambda: gw.state.policy.engine.version.startswith("base+") and not gw.state.policy.last_error
        )


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def chat(gw, messages=HELLO, model="auto", key=None, **extra) -> httpx.Response:
    headers = gw.auth(key) | extra.pop("headers", {})
    return httpx.post(
        gw.v1 + "/chat/completions", headers=headers, json={"model": model, "messages": messages, **extra}
    )


def admin(gw, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(
        method, gw.url + path, headers=gw.auth(gw.admin_key) | kwargs.pop("headers", {}), **kwargs
    )


def test_every_response_carries_the_policy_version(pgw, upstream):
    version = pgw.state.policy.engine.version
    ok = chat(pgw)
    assert ok.status_code == 200 and ok.headers["x-polyroute-policy-version"] == version
    assert ok.headers["x-polyroute-data-class"] == "public"
    missing = chat(pgw, model="no-such-model")
    assert missing.status_code == 404 and missing.headers["x-polyroute-policy-version"] == version


def test_pii_goes_only_where_the_policy_allows(pgw, upstream):
    response = chat(pgw, messages=PII)
    assert response.status_code == 200
    assert response.headers["x-polyroute-data-class"] == "pii"
    assert response.headers["x-polyroute-worker"] == "cheap"  # FR; mid is CN, pricey is US


def test_policy_confines_fallback_to_the_pool(pgw, upstream):
    """The only admissible worker fails; a healthy inadmissible worker must never be called."""
    upstream.behave("cheap-model", status=500)
    response = chat(pgw, messages=PII)
    assert response.status_code == 502
    assert "cheap: 500" in response.json()["error"]["message"]
    assert len(upstream.requests_for("cheap-model")) == 1 + pgw.state.settings.retries
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")


def test_streaming_fallback_is_confined_too(pgw, upstream):
    upstream.behave("cheap-model", status=503)
    response = chat(pgw, messages=PII, stream=True)
    assert response.status_code == 502
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")


def test_tag_and_header_raise_the_data_class(pgw, upstream):
    tagged = chat(pgw, metadata={"data_class": "pii"})
    assert (
        tagged.headers["x-polyroute-data-class"] == "pii" and tagged.headers["x-polyroute-worker"] == "cheap"
    )
    by_header = chat(pgw, headers={"x-polyroute-data-class": "pii"})
    assert by_header.headers["x-polyroute-data-class"] == "pii"
    bad = chat(pgw, metadata={"data_class": "ultra"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_data_class"
    assert not upstream.requests_for("mid-model")


def test_pinned_inadmissible_worker_is_403_naming_the_rule(pgw, upstream):
    response = chat(pgw, messages=PII, model="mid")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "policy_denied" and error["type"] == "permission_error"
    assert "pii-no-cn-no-us" in error["message"] and "jurisdiction CN" in error["message"]
    assert not upstream.requests


def test_empty_pool_is_403_naming_the_rules(pgw, upstream):
    write_policy(
        pgw.policy_file,
        {**BASE_POLICY, "version": "strict", "rules": [{"id": "nothing-over-1b", "max_active_params_b": 1}]},
    )
    wait_for(lambda: pgw.state.policy.engine.version.startswith("strict+"))
    response = chat(pgw)
    assert response.status_code == 403
    error = response.json()["error"]
    assert "nothing-over-1b" in error["message"] and "data class public" in error["message"]
    assert response.headers["x-polyroute-policy-version"].startswith("strict+")
    assert not upstream.requests


def test_alias_scopes_rules(pgw, upstream):
    write_policy(
        pgw.policy_file,
        {
            **BASE_POLICY,
            "version": "alias",
            "rules": [{"id": "batch-eu", "when": {"models": ["batch"]}, "deny_providers": ["fake"]}],
        },
    )
    wait_for(lambda: pgw.state.policy.engine.version.startswith("alias+"))
    assert chat(pgw, model="batch").status_code == 403
    assert chat(pgw, model="auto").status_code == 200


def test_rules_scoped_to_a_workflow_apply_to_requests_for_it(pgw, upstream):
    """A rule scoped to `compose:ensemble` applies to compose:ensemble requests (it was accepted by
    validation and applied by explain, but a workflow request was decided as `auto`), beside the rules
    scoped to `auto`, which cover every workflow; it does not apply to other workflows or to auto."""
    write_policy(
        pgw.policy_file,
        {
            **BASE_POLICY,
            "version": "workflow",
            "rules": [
                {
                    "id": "ensembles-not-us",
                    "when": {"models": ["compose:ensemble"]},
                    "deny_jurisdictions": ["US"],
                },
                {"id": "auto-not-cn", "when": {"models": ["auto"]}, "deny_jurisdictions": ["CN"]},
            ],
        },
    )
    wait_for(lambda: pgw.state.policy.engine.version.startswith("workflow+"))
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, text="Paris is the capital of France.")
    explained = admin(
        pgw, "POST", "/admin/policies/explain", json={"model": "compose:ensemble", "text": "hi"}
    ).json()
    assert "pricey" not in explained["pool"] and "mid" not in explained["pool"]
    upstream.requests.clear()
    ensemble = chat(pgw, model="compose:ensemble", max_tokens=20)
    assert ensemble.status_code == 200, ensemble.text
    called = {r["model"] for r in upstream.requests}
    assert called and not called & {"pricey-model", "mid-model"}, called  # US by its rule, CN by auto's
    upstream.requests.clear()
    debate = chat(pgw, model="compose:debate", max_tokens=20, headers={"x-polyroute-trace": "1"})
    assert debate.status_code == 200, debate.text
    called = {r["model"] for r in upstream.requests}
    assert "pricey-model" in called and "mid-model" not in called, called  # auto's rule only
    upstream.requests.clear()


# ---- hot reload --------------------------------------------------------------------------------
def test_reload_valid_then_invalid_yaml_then_schema_error_then_removed(pgw):
    status = lambda: admin(pgw, "GET", "/admin/policies/status").json()  # noqa: E731
    write_policy(pgw.policy_file, {**BASE_POLICY, "version": "v2"})
    wait_for(lambda: status()["version"].startswith("v2+"))
    assert status()["last_error"] is None

    pgw.policy_file.write_text("version: 3\nrules: [")
    wait_for(lambda: status()["last_error"] is not None)
    assert "invalid YAML" in status()["last_error"] and status()["version"].startswith("v2+")
    assert chat(pgw).headers["x-polyroute-policy-version"].startswith("v2+")  # last good stays in force

    pgw.policy_file.write_text("version: 4\nrules: [{id: r, max_active_params_b: -1}]")
    wait_for(lambda: "greater than 0" in (status()["last_error"] or ""))
    assert status()["version"].startswith("v2+")

    pgw.policy_file.unlink()
    wait_for(lambda: "missing" in (status()["last_error"] or ""))
    assert status()["version"].startswith("v2+") and chat(pgw).status_code == 200

    write_policy(pgw.policy_file, {**BASE_POLICY, "version": "v5"})
    wait_for(lambda: status()["version"].startswith("v5+") and status()["last_error"] is None)
    assert httpx.get(pgw.url + "/readyz").json()["policy"]["in_force"] is True


def test_concurrent_requests_during_reload_never_mix_versions(pgw, upstream):
    """Version A admits only `cheap`, B only `pricey`; every answer must match its version header."""
    only = {"A": "cheap", "B": "pricey"}

    def policy(label: str) -> dict:
        return {
            "version": label,
            "rules": [
                {
                    "id": f"only-{only[label]}",
                    "allow_providers": ["fake"],
                    "deny_licenses": ["MIT", "proprietary" if label == "A" else "Apache-2.0"],
                }
            ],
        }

    stop = time.monotonic() + 3.0
    results: list[tuple[str, str]] = []

    def client_loop() -> None:
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < stop:
                r = client.post(
                    pgw.v1 + "/chat/completions",
                    headers=pgw.auth(),
                    json={"model": "auto", "messages": HELLO},
                )
                if r.status_code == 200:
                    results.append((r.headers["x-polyroute-policy-version"], r.headers["x-polyroute-worker"]))

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(client_loop) for _ in range(4)]
        flips = 0
        while time.monotonic() < stop:
            write_policy(pgw.policy_file, policy("AB"[flips % 2]))
            flips += 1
            time.sleep(0.1)
        for f in futures:
            f.result()
    seen_versions = {v.split("+")[0] for v, _ in results}
    assert seen_versions >= {"A", "B"}, "both versions served during the run"
    for version, worker in results:
        label = version.split("+")[0]
        if label in only:
            assert worker == only[label], f"{version} answered by {worker}"


# ---- admin API ---------------------------------------------------------------------------------
def test_admin_get_put_explain_and_audit(pgw, upstream):
    got = admin(pgw, "GET", "/admin/policies")
    assert got.status_code == 200 and "pii-no-cn-no-us" in got.text
    assert got.headers["x-polyroute-policy-version"] == pgw.state.policy.engine.version

    new_text = yaml.safe_dump({**BASE_POLICY, "version": "admin-1"})
    put = admin(pgw, "PUT", "/admin/policies", content=new_text, headers={"content-type": "application/yaml"})
    assert put.status_code == 200 and put.json()["version"].startswith("admin-1+")
    assert pgw.policy_file.read_text() == new_text  # written to the file, so it survives a restart
    assert chat(pgw).headers["x-polyroute-policy-version"].startswith("admin-1+")

    bad = admin(
        pgw,
        "PUT",
        "/admin/policies",
        content="version: 1\nrules: [{id: x}]",
        headers={"content-type": "application/yaml"},
    )
    assert bad.status_code == 400 and "sets no constraint" in bad.json()["error"]["message"]
    assert pgw.state.policy.engine.version.startswith("admin-1+")  # unchanged
    assert pgw.policy_file.read_text() == new_text

    wrong_type = admin(pgw, "PUT", "/admin/policies", json={"version": 1})
    assert wrong_type.status_code == 415

    explain = admin(
        pgw, "POST", "/admin/policies/explain", json={"tenant": "acme", "text": "ring me on +44 20 7183 8750"}
    )
    body = explain.json()
    assert explain.status_code == 200 and body["data_class"] == "pii"
    assert body["pool"] == ["cheap"]
    excluded = {e["worker"]: e for e in body["excluded"]}
    assert excluded["mid"]["rule"] == "pii-no-cn-no-us" and excluded["nokey"]["rule"] == "unavailable"
    assert "detected phone: pii" in body["data_class_reasons"]
    assumed = admin(
        pgw,
        "POST",
        "/admin/policies/explain",
        json={"tenant": "acme", "text": "hello", "assume_available": True},
    ).json()
    assert assumed["assume_available"] is True and "nokey" in assumed["pool"]
    assert all(e["rule"] != "unavailable" for e in assumed["excluded"])
    not_a_flag = admin(
        pgw, "POST", "/admin/policies/explain", json={"text": "hello", "assume_available": "maybe"}
    )
    assert not_a_flag.status_code == 400 and "assume_available" in not_a_flag.json()["error"]["message"]

    audit = admin(pgw, "GET", "/admin/policies/audit").json()["data"]
    put_entries = [e for e in audit if e["action"] == "put"]
    assert put_entries and "admin-env" in put_entries[-1]["who"]
    assert "+version: admin-1" in put_entries[-1]["diff"]
    assert put_entries[-1]["new_version"].startswith("admin-1+")


def test_file_edits_are_audited_too(pgw):
    write_policy(pgw.policy_file, {**BASE_POLICY, "version": "edited-on-disk"})
    wait_for(lambda: pgw.state.policy.engine.version.startswith("edited-on-disk+"))
    audit = admin(pgw, "GET", "/admin/policies/audit").json()["data"]
    assert audit[-1]["action"] == "reload" and audit[-1]["who"] == "file"
    assert audit[-1]["new_version"].startswith("edited-on-disk+")


def test_policy_admin_routes_need_the_admin_key(pgw):
    assert httpx.get(pgw.url + "/admin/policies", headers=pgw.auth()).status_code == 403
    assert httpx.put(pgw.url + "/admin/policies", content="x").status_code == 401


# ---- fail closed -------------------------------------------------------------------------------
def test_invalid_policy_at_start_refuses_every_request(upstream, tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("version: 1\nrules: [")
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "data",
        policy_file=policy_file,
        policy_reload_interval_s=0.05,
    )
    try:
        response = chat(gw)
        assert response.status_code == 503 and response.json()["error"]["code"] == "policy_unavailable"
        assert "invalid YAML" in response.json()["error"]["message"]
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["policy"]["in_force"] is False
        assert not upstream.requests
        write_policy(policy_file, BASE_POLICY)  # fixing the file brings the gateway back, no restart
        wait_for(lambda: chat(gw).status_code == 200)
    finally:
        gw.server.stop()


def test_budget_through_the_gateway(upstream, tmp_path):
    policy_file = tmp_path / "policy.yaml"
    write_policy(policy_file, {"version": "b", "tenants": {"acme": {"budget": {"daily_usd": "0.0000025"}}}})
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", policy_file=policy_file
    )
    try:
        upstream.behave("cheap-model", prompt_tokens=10, completion_tokens=5)  # $0.000002 at cheap's prices
        first = chat(gw, max_tokens=5)
        assert first.status_code == 200 and first.headers["x-polyroute-worker"] == "cheap"
        second = chat(gw, max_tokens=5)
        assert second.status_code == 403
        assert "budget:daily" in second.json()["error"]["message"]
    finally:
        gw.server.stop()
    saved = (tmp_path / "data" / "spend.json").read_text()
    assert "acme|" in saved  # spend survives a restart


def test_a_put_that_would_change_one_replica_only_is_refused(upstream, redis_server, tmp_path):
    """With Redis the gateway runs as one of several replicas; a policy file in its own data dir is read
    by no other replica, so a PUT through the Service would change one pod and say "in force". It is a
    409 naming the way out; a POLYROUTE_POLICY_FILE set explicitly (the chart's ConfigMap, or a file
    the operator chose) is written as asked."""
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    own = start_gateway(catalog, tmp_path / "own", redis_url=redis_server.url)
    chosen = tmp_path / "chosen" / "policy.yaml"
    chosen.parent.mkdir()
    write_policy(chosen, BASE_POLICY)
    explicit = start_gateway(catalog, tmp_path / "explicit", redis_url=redis_server.url, policy_file=chosen)
    edited = yaml.safe_dump({**BASE_POLICY, "version": "edited"})
    try:
        refused = admin(
            own, "PUT", "/admin/policies", content=edited, headers={"content-type": "application/yaml"}
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "policy_not_shared"
        assert "POLYROUTE_POLICY_FILE" in refused.json()["error"]["message"]
        assert not own.state.policy.engine.version.startswith("edited")
        done = admin(
            explicit, "PUT", "/admin/policies", content=edited, headers={"content-type": "application/yaml"}
        )
        assert done.status_code == 200, done.text
        assert explicit.state.policy.engine.version.startswith("edited")
    finally:
        own.server.stop()
        explicit.server.stop()
