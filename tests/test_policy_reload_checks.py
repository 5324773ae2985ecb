"""The policy's two doors (a file edit, PUT /admin/policies) and its start apply the same checks.

Each test was a defect found by an audit of policy reloads (its numbering in the section titles):
YAML that repeats a key was half-applied; the judge-in-catalog check ran on PUT only; a deleted policy
file went unnoticed and a restart then put the shipped default in force; PUT on a read-only policy
file was a 500; the judge read two policy versions for one grade; a refused PUT left no trace;
cross-reference errors were placed at `(top level)`; catalog edits on disk silently did nothing.
All real parts: a gateway on loopback in front of the test upstream (tests/fakes).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from policies import (
    CatalogError,
    PolicyError,
    PolicySource,
    catalog_problems,
    parse_catalog,
    parse_policy,
)
from policies.chat_template import ChatTemplateError, load_chat_template
from router.compose import WORKFLOWS
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, start_gateway

HELLO = [{"role": "user", "content": "hello there"}]
BASE = {"version": "base", "tenants": {"acme": {}}}
JUDGE_NOT_IN_CATALOG = {
    "version": "typo",
    "tenants": {"acme": {"judge": {"worker": "no-such-worker", "sample": 1, "daily_budget_usd": 1}}},
}


def write_policy_text(path: Path, text: str) -> None:
    """As an editor or a ConfigMap sync does: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def gw(upstream, tmp_path):
    policy_file = tmp_path / "policy.yaml"
    write_policy_text(policy_file, yaml.safe_dump(BASE))
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    g = start_gateway(catalog, tmp_path / "data", policy_file=policy_file, policy_reload_interval_s=0.05)
    g.policy_file = policy_file
    yield g
    g.server.stop()


def put(gw, text: str) -> httpx.Response:
    return httpx.put(
        gw.url + "/admin/policies",
        headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
        content=text,
        timeout=30,
    )


def status(gw) -> dict:
    return httpx.get(gw.url + "/admin/policies/status", headers=gw.auth(gw.admin_key), timeout=30).json()


def audit(gw) -> list[dict]:
    return httpx.get(gw.url + "/admin/policies/audit", headers=gw.auth(gw.admin_key), timeout=30).json()[
        "data"
    ]


def file_result(gw, text: str) -> tuple[bool, str | None]:
    """Write the file, wait until the watcher has looked at it; (accepted, last_error)."""
    before = gw.state.policy.engine.version
    write_policy_text(gw.policy_file, text)
    wait_for(lambda: gw.state.policy.engine.version != before or gw.state.policy.last_error is not None)
    return gw.state.policy.engine.version != before, gw.state.policy.last_error


def put_and_file_agree(gw, text: str, fragment: str) -> None:
    """The same text is refused by PUT (400) and by a file edit (last good kept), naming `fragment`."""
    in_force = gw.state.policy.engine.version
    via_put = put(gw, text)
    assert via_put.status_code == 400, via_put.text
    assert fragment in via_put.json()["error"]["message"]
    assert gw.state.policy.engine.version == in_force
    accepted, error = file_result(gw, text)
    assert not accepted, "the text PUT refuses was put in force from the file"
    assert error and fragment in error
    assert gw.state.policy.engine.version == in_force


# ---- 1. a repeated YAML key is refused, naming the key and its line ------------------------------
DUPLICATE_RULES = """\
version: dup
rules:
  - id: pii-eu-only
    when: {data_classes: [pii]}
    allow_jurisdictions: [EU]
tenants:
  acme: {}
rules:
  - id: cost-ceiling
    max_request_cost_usd: 1
"""


def test_a_repeated_top_level_key_is_refused_with_its_line():
    with pytest.raises(PolicyError) as info:
        parse_policy(DUPLICATE_RULES, "policy.yaml")
    assert "policy.yaml: line 8: duplicate key 'rules' (first at line 2)" in str(info.value)


def test_a_repeated_tenant_is_refused():
    text = "version: 1\ntenants:\n  acme: {budget: {daily_usd: 1}}\n  acme: {cache: {enabled: true}}\n"
    with pytest.raises(PolicyError, match=r"line 4: duplicate key 'acme' \(first at line 3\)"):
        parse_policy(text, "policy.yaml")


def test_a_repeated_key_inside_a_rule_is_refused_by_put_and_by_the_file(gw):
    text = """\
version: dup2
rules:
  - id: pii-eu-only
    when: {data_classes: [pii]}
    allow_jurisdictions: [EU]
    allow_jurisdictions: [US, CN]
"""
    put_and_file_agree(gw, text, "line 6: duplicate key 'allow_jurisdictions' (first at line 5)")


def test_a_repeated_key_in_the_worker_catalog_is_refused():
    text = """\
version: 1
workers:
  - name: w
    model: openai/x
    input_price_per_m: 1
    output_price_per_m: 1
    tier: frontier
    license: proprietary
    provider: p
    jurisdiction: DE
    context_window: 1000
    jurisdiction: US
"""
    with pytest.raises(
        CatalogError, match=r"workers.yaml: line 12: duplicate key 'jurisdiction' \(first at line 10\)"
    ):
        parse_catalog(text, "workers.yaml")


def test_a_repeated_key_in_a_chat_template_file_is_refused(tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("chat_template: '{{ messages }}'\nstop: ['a']\nstop: ['b']\n")
    with pytest.raises(ChatTemplateError, match=r"line 3: duplicate key 'stop' \(first at line 2\)"):
        load_chat_template(str(template))


def test_yaml_merge_keys_may_still_be_overridden():
    """`<<: *base` then a key of its own is how YAML overrides a merged value: not a repetition."""
    text = """\
version: 1
tenants:
  acme: &base {budget: {daily_usd: 1}, cache: {enabled: true}}
  beta:
    <<: *base
    budget: {daily_usd: 2}
"""
    policy, _ = parse_policy(text, "policy.yaml")
    assert str(policy.tenants["beta"].budget.daily_usd) == "2" and policy.tenants["beta"].cache.enabled


# ---- 2. the policy must fit the worker catalog: at start, on reload, on PUT, in the CLI ------------
def test_a_judge_outside_the_catalog_is_refused_by_put_and_by_the_file(gw):
    put_and_file_agree(
        gw,
        yaml.safe_dump(JUDGE_NOT_IN_CATALOG),
        "tenants.acme.judge.worker: 'no-such-worker' is not in the catalog",
    )
    rejected = [e for e in audit(gw) if e["action"] == "rejected"]
    assert {e["who"] == "file" for e in rejected} == {True, False}  # the PUT's and the file's


def test_a_policy_that_does_not_fit_the_catalog_is_refused_at_start(upstream, tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(JUDGE_NOT_IN_CATALOG))
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", policy_file=policy_file
    )
    try:
        s = gw.state.policy.status()
        assert not s["in_force"]  # as a schema-invalid file at start: nothing in force, fail closed
        assert "tenants.acme.judge.worker: 'no-such-worker' is not in the catalog" in s["last_error"]
        chat = httpx.post(
            gw.v1 + "/chat/completions", headers=gw.auth(), json={"model": "cheap", "messages": HELLO}
        )
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "policy_unavailable"
        assert httpx.get(gw.url + "/readyz").status_code == 503
    finally:
        gw.server.stop()


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("no-such-embedder", "'no-such-embedder' is not in the catalog"),
        ("cheap", "'cheap' is a chat worker, not an embedding worker"),
    ],
)
def test_an_embeddings_alias_must_name_an_embedding_worker(gw, target, why):
    text = yaml.safe_dump({"version": "emb", "aliases": {"embed": {"worker": target}}})
    put_and_file_agree(gw, text, f"embedding_aliases.embed.worker: {why}")


def test_a_rule_scoped_to_a_model_no_request_can_name_is_refused_with_its_place(gw):
    text = yaml.safe_dump(
        {
            "version": "typo-model",
            "rules": [
                {"id": "ok", "when": {"models": ["auto"]}, "max_active_params_b": 10},
                {"id": "gpt-small", "when": {"models": ["cheap", "gpt-4-1"]}, "max_active_params_b": 10},
            ],
        }
    )
    put_and_file_agree(gw, text, "rules.1.when.models.1: 'gpt-4-1' is not a model a request can name")


def test_every_model_a_request_can_name_may_scope_a_rule():
    """What the engine matches `when.models` against: auto, compose:<workflow>, chat and embeddings
    aliases, chat and embedding workers. None of these is refused; an unknown workflow is."""
    catalog = parse_catalog(
        catalog_yaml_for("http://127.0.0.1:9")
        + f"""
  - name: embed-remote
    kind: embedding
    model: openai/embed-model
    api_base: http://127.0.0.1:9/v1
    api_key_env: {FAKE_KEY_ENV}
    dimensions: 8
    input_price_per_m: 1.00
    tier: specialist
    license: proprietary
    provider: fake
    context_window: 512
"""
    )
    models = ["auto", "compose:cascade", "batch", "vectors", "cheap", "embed-remote"]
    policy, _ = parse_policy(
        yaml.safe_dump(
            {
                "version": 1,
                "aliases": {"batch": "bulk", "vectors": {"worker": "embed-remote"}},
                "tenants": {"acme": {"judge": {"worker": "pricey", "daily_budget_usd": 1}}},
                "rules": [{"id": "r", "when": {"models": models}, "max_active_params_b": 10}],
            }
        )
    )
    assert catalog_problems(policy, catalog, WORKFLOWS) == []
    judged_by_embedder, _ = parse_policy(
        yaml.safe_dump(
            {
                "version": 1,
                "tenants": {"acme": {"judge": {"worker": "embed-remote", "daily_budget_usd": 1}}},
                "rules": [{"id": "r", "when": {"models": ["compose:nope"]}, "max_active_params_b": 10}],
            }
        )
    )
    assert catalog_problems(judged_by_embedder, catalog, WORKFLOWS) == [
        "tenants.acme.judge.worker: 'embed-remote' is an embedding worker, not a chat worker "
        "(a judge is a chat worker)",
        "rules.0.when.models.0: 'compose:nope' is not a model a request can name "
        "(auto, compose:<workflow>, an alias of this policy, or a worker of the catalog)",
    ]


@pytest.mark.parametrize("alias", ["auto", "compose:cascade"])
def test_an_alias_cannot_take_a_reserved_model_name(alias):
    with pytest.raises(PolicyError, match=f"aliases.{alias}: alias name '{alias}' is reserved"):
        parse_policy(f"version: 1\naliases: {{'{alias}': x}}\n", "policy.yaml")
    with pytest.raises(PolicyError, match=f"embedding_aliases.{alias}: alias name '{alias}' is reserved"):
        parse_policy(f"version: 1\naliases: {{'{alias}': {{worker: w}}}}\n", "policy.yaml")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, wide enough that no message is wrapped; `env` is added."""
    base = {k: v for k, v in os.environ.items() if k != "POLYROUTE_WORKERS_FILE"}
    env = {**base, "COLUMNS": "1000", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_validate_checks_the_policy_against_the_catalog(tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(JUDGE_NOT_IN_CATALOG))
    refused = run_cli("policies", "validate", str(policy_file))  # the embedded catalog
    assert refused.returncode == 2, refused.stderr
    assert "tenants.acme.judge.worker: 'no-such-worker' is not in the catalog" in refused.stderr

    workers = tmp_path / "workers.yaml"
    workers.write_text(catalog_yaml_for("http://127.0.0.1:9").replace("name: pricey", "name: no-such-worker"))
    ok = run_cli("policies", "validate", str(policy_file), "--workers-file", str(workers))
    assert ok.returncode == 0, ok.stderr
    assert f"fits {workers}" in ok.stderr
    from_env = run_cli("policies", "validate", str(policy_file), env={"POLYROUTE_WORKERS_FILE": str(workers)})
    assert from_env.returncode == 0, from_env.stderr  # as `serve` resolves the catalog
    missing = run_cli("policies", "validate", str(policy_file), "--workers-file", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read catalog" in missing.stderr


# ---- 3. the policy file deleted, moved back, and a restart without it ------------------------------
def test_a_file_removed_after_a_clean_load_is_reported(gw):
    gw.policy_file.unlink()
    wait_for(lambda: gw.state.policy.last_error is not None)
    s = status(gw)
    assert "file is missing; keeping the last good policy" in s["last_error"] and s["in_force"]
    ready = httpx.get(gw.url + "/readyz").json()["policy"]
    assert "missing" in ready["last_error"]


def test_a_file_moved_away_and_back_clears_the_error(gw):
    aside = gw.policy_file.with_name("policy.yaml.aside")
    gw.policy_file.rename(aside)
    wait_for(lambda: gw.state.policy.last_error is not None)
    assert "missing" in status(gw)["last_error"]
    aside.rename(gw.policy_file)  # same inode, same mtime and size as the version in force
    wait_for(lambda: gw.state.policy.last_error is None)
    assert status(gw)["version"].startswith("base+")


def test_an_invalid_edit_undone_by_restoring_the_file_clears_the_error(gw):
    os.link(gw.policy_file, gw.policy_file.with_name("policy.yaml.orig"))  # keep the inode
    accepted, error = file_result(gw, "version: bad\nrules: [{id: x}]\n")
    assert not accepted and "sets no constraint" in error
    os.replace(gw.policy_file.with_name("policy.yaml.orig"), gw.policy_file)  # back as loaded
    wait_for(lambda: gw.state.policy.last_error is None)


def test_a_restart_without_the_policy_file_refuses_to_start(upstream, tmp_path):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    data_dir = tmp_path / "data"
    gw = start_gateway(catalog, data_dir)  # first start: <data dir>/policy.yaml, seeded from the default
    try:
        assert gw.state.policy.engine.version.startswith("1+")
        [seeded] = audit(gw)
        assert seeded["action"] == "seeded" and seeded["new_version"] == gw.state.policy.engine.version
        strict = {"version": "strict", "rules": [{"id": "eu-only", "allow_jurisdictions": ["EU"]}]}
        assert put(gw, yaml.safe_dump(strict)).status_code == 200
    finally:
        gw.server.stop()
    (data_dir / "policy.yaml").unlink()
    with pytest.raises(PolicyError) as info:
        start_gateway(catalog, data_dir)
    message = str(info.value)
    assert f"the policy file {data_dir / 'policy.yaml'} is missing" in message
    assert "refusing to start rather than put the shipped default policy in force" in message
    assert not (data_dir / "policy.yaml").exists()


def test_a_data_dir_with_a_ledger_but_no_audit_log_has_served_before(upstream, tmp_path):
    """A data dir seeded before the audit log recorded seeding: its ledger says it served."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "ledger.jsonl").write_text("")
    with pytest.raises(PolicyError, match="it holds ledger.jsonl"):
        start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), data_dir)


def test_serve_says_why_it_cannot_start_without_a_traceback(tmp_path):
    """`polyroute serve` on a data dir that has served and lost its policy file: one line and exit 2,
    as for a bad catalog, not a traceback ending in the reason."""
    (tmp_path / "ledger.jsonl").write_text("")
    result = run_cli("serve", "--data-dir", str(tmp_path), "--no-local-workers", "--port", "1")
    assert result.returncode == 2, result.stderr
    out = result.stdout + result.stderr
    assert "cannot start:" in out and "refusing to start" in out and "Traceback" not in out


# ---- 5. PUT on a read-only policy file (the Helm chart's ConfigMap mount) --------------------------
def read_only_dir(src: Path, dst: Path):
    """`dst`: `src` made read-only for real — a read-only bind mount (as kubelet mounts a ConfigMap),
    else the immutable attribute (root may not create files there either), else (not root) mode 0555.
    Returns an undo function, or None when this machine offers none of them."""
    dst.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(dst)], capture_output=True)
    if mounted.returncode == 0:
        return lambda: subprocess.run(["umount", str(dst)], check=True)
    dst.rmdir()
    if os.geteuid() != 0:
        src.chmod(0o555)
        return lambda: src.chmod(0o755)
    if (
        shutil.which("chattr")
        and subprocess.run(["chattr", "+i", str(src)], capture_output=True).returncode == 0
    ):
        return lambda: subprocess.run(["chattr", "-i", str(src)], check=True)
    return None


def test_put_on_a_read_only_policy_file_is_a_clear_409(upstream, tmp_path):
    src, mounted = tmp_path / "configmap", tmp_path / "mounted"
    src.mkdir()
    (src / "policy.yaml").write_text(yaml.safe_dump(BASE))
    undo = read_only_dir(src, mounted)
    if undo is None:
        pytest.skip("no read-only condition here: no bind mount, no chattr, and running as root")
    policy_dir = mounted if mounted.exists() else src
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "data",
        policy_file=policy_dir / "policy.yaml",
    )
    try:
        before = gw.state.policy.engine.version
        r = put(
            gw, yaml.safe_dump({"version": "via-put", "rules": [{"id": "eu", "allow_jurisdictions": ["EU"]}]})
        )
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "policy_file_read_only"
        assert f"the policy file {policy_dir / 'policy.yaml'} is read-only here" in error["message"]
        assert "nothing was changed" in error["message"]
        assert "helm upgrade --reuse-values --set-file policy=" in error["message"]
        assert gw.state.policy.engine.version == before and status(gw)["last_error"] is None
        [rejected] = [e for e in audit(gw) if e["action"] == "rejected"]
        assert "is read-only here" in rejected["error"] and "via-put" in rejected["diff"]
        assert sorted(p.name for p in policy_dir.iterdir()) == ["policy.yaml"]  # no temporary file left
    finally:
        gw.server.stop()
        undo()


# ---- 6. one grade, one policy version --------------------------------------------------------------
class ReloadOnJudgeRead(PolicySource):
    """The real PolicySource, with a hook for the race under test: the first time Judge.grade reads
    `engine`, the file's next version is written and really reloaded right after the read — what the
    watcher's reload thread can do at any moment. Nothing is stood in for: only the timing is forced."""

    next_text: str | None = None

    @property
    def engine(self):
        engine = PolicySource.engine.fget(self)
        if self.next_text is not None and sys._getframe(1).f_code.co_name == "grade":
            text, self.next_text = self.next_text, None
            write_policy_text(self.path, text)
            self.reload("file")
        return engine


def test_a_grade_takes_its_judge_and_its_rules_from_one_policy_version(upstream, tmp_path):
    old = {
        "version": "old",
        "tenants": {"acme": {"judge": {"worker": "pricey", "sample": 1, "daily_budget_usd": 10}}},
    }
    new = {
        "version": "new",
        "tenants": {"acme": {"judge": {"worker": "mid", "sample": 1, "daily_budget_usd": 10}}},
        "rules": [{"id": "acme-not-cn", "when": {"tenants": ["acme"]}, "deny_jurisdictions": ["CN"]}],
    }
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(old))
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "data",
        policy_file=policy_file,
        policy_reload_interval_s=3600,
    )
    try:
        gw.state.policy.__class__ = ReloadOnJudgeRead
        gw.state.policy.next_text = yaml.safe_dump(new)
        upstream.behave("mid-model", text="8")
        upstream.behave("pricey-model", text="8")
        r = httpx.post(
            gw.v1 + "/chat/completions", headers=gw.auth(), json={"model": "cheap", "messages": HELLO}
        )
        assert r.status_code == 200
        wait_for(lambda: gw.state.policy.engine.version.startswith("new+") and gw.state.judge.in_flight == 0)
        # the old version's judge (pricey) graded under the old version's rules; the new version's
        # judge (mid, CN) — which that version's own rule excludes for acme — was never called
        assert not upstream.requests_for("mid-model")
        assert len(upstream.requests_for("pricey-model")) == 1
    finally:
        gw.server.stop()


# ---- 7. a refused PUT is logged and audited like a refused file edit --------------------------------
def test_a_refused_put_is_logged_and_audited_like_a_refused_file_edit(gw, caplog):
    caplog.set_level(logging.ERROR, logger="polyroute.policies")
    accepted, error = file_result(gw, "version: bad\nrules: [{id: x}]\n")
    assert not accepted and "sets no constraint" in error
    write_policy_text(gw.policy_file, yaml.safe_dump({**BASE, "version": "good-again"}))
    wait_for(lambda: gw.state.policy.engine.version.startswith("good-again+"))
    via_put = put(gw, "version: bad-put\nrules: [{id: y}]\n")
    assert via_put.status_code == 400
    rejected = [e for e in audit(gw) if e["action"] == "rejected"]
    assert [e["who"] == "file" for e in rejected] == [True, False]
    by_put = rejected[1]  # who: the admin key that sent it
    assert "rule 'y' sets no constraint" in by_put["error"] and "bad-put" in by_put["diff"]
    assert by_put["old_version"].startswith("good-again+") and by_put["new_version"] is None
    refusals = [r.getMessage() for r in caplog.records if "policy refused" in r.getMessage()]
    assert len(refusals) == 2 and "(put by " in refusals[1] and "rule 'y' sets no constraint" in refusals[1]
    assert gw.state.policy.last_error is None  # the file did not change: its status stays clean


# ---- 8. cross-reference errors are placed -----------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "version: 1\nrules:\n  - {id: a, max_active_params_b: 10}\n  - {id: a, max_active_params_b: 20}\n",
            "rules.1.id: duplicate rule id 'a' (first at rules.0)",
        ),
        (
            "version: 1\nrules: [{id: r, when: {data_classes: [pi]}, max_active_params_b: 1}]\n",
            "rules.0.when.data_classes: unknown data class 'pi'",
        ),
        (
            "version: 1\nrules: [{id: r, allow_jurisdictions: [EU, Mars]}]\n",
            "rules.0.allow_jurisdictions: unknown jurisdiction 'Mars'",
        ),
        ("version: 1\ndefault_data_class: publik\n", "default_data_class: 'publik' is not in data_classes"),
        (
            "version: 1\naliases: {both: x}\nembedding_aliases: {both: {worker: w}}\n",
            "aliases.both: is both a chat alias and an embedding alias",
        ),
    ],
)
def test_a_cross_reference_error_names_its_place(text, expected):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "policy.yaml")
    assert expected in str(info.value) and "(top level)" not in str(info.value)


def test_places_are_the_files_own_after_broken_entries_are_set_aside():
    """A broken rule is set aside to find the cross-reference problems; the places they name are
    still counted in the file's terms, not in the list left after the drop."""
    text = """\
version: 1
rules:
  - {id: x}
  - {id: a, max_active_params_b: 10}
  - {id: a, max_active_params_b: 20}
  - {id: d, when: {data_classes: [secrett]}, max_active_params_b: 1}
"""
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "policy.yaml")
    message = str(info.value)
    assert "rules.0: Value error, rule 'x' sets no constraint" in message
    assert "rules.2.id: duplicate rule id 'a' (first at rules.1)" in message
    assert "rules.3.when.data_classes: unknown data class 'secrett'" in message


# ---- 4. a catalog edit on disk: reported, applied on restart ----------------------------------------
def test_a_catalog_file_that_cannot_be_applied_is_reported_while_the_catalog_in_force_serves(
    upstream, tmp_path, caplog
):
    """A valid edit is hot-reloaded (tests/test_catalog_reload.py); an invalid or missing file is
    reported on /readyz (once in the log per version) while the catalog in force keeps serving."""
    caplog.set_level(logging.INFO, logger="polyroute.policies")
    workers_file = tmp_path / "workers.yaml"
    text = catalog_yaml_for(upstream.url)
    workers_file.write_text(text)
    gw = start_gateway(None, tmp_path / "data", workers_file=workers_file)
    try:
        watched = gw.state.catalog_file
        watched.interval_s = 0  # every probe looks (the default: at most every few seconds)
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200 and ready.json()["catalog"]["on_disk"] == "unchanged"
        assert ready.json()["catalog"]["warning"] is None

        write_policy_text(workers_file, "workers: [")
        for _ in range(3):
            ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200  # a warning: the catalog in force still serves
        catalog = ready.json()["catalog"]
        assert catalog["on_disk"] == "changed" and "invalid YAML" in catalog["on_disk_error"]
        assert catalog["on_disk_sha256"] != catalog["sha256"]
        assert "is not applied" in catalog["warning"] and "a restart would fail" in catalog["warning"]
        workers = httpx.get(gw.url + "/admin/workers", headers=gw.auth(gw.admin_key)).json()
        assert workers["catalog_file"]["on_disk"] == "changed"
        assert next(w for w in workers["catalog"] if w["name"] == "cheap")["jurisdiction"] == "FR"  # in force
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "changed on disk" in r.getMessage()
        ]
        assert len(warnings) == 1  # once per version of the file, not per probe

        workers_file.unlink()
        assert httpx.get(gw.url + "/readyz").json()["catalog"]["on_disk"] == "missing"

        workers_file.write_text(text)  # as it was: nothing to say any more
        catalog = httpx.get(gw.url + "/readyz").json()["catalog"]
        assert catalog["on_disk"] == "unchanged" and catalog["warning"] is None
    finally:
        gw.server.stop()


def test_the_catalog_file_is_looked_at_no_more_than_every_interval(upstream, tmp_path):
    workers_file = tmp_path / "workers.yaml"
    text = catalog_yaml_for(upstream.url)
    workers_file.write_text(text)
    gw = start_gateway(None, tmp_path / "data", workers_file=workers_file)
    try:
        watched = gw.state.catalog_file
        assert watched.interval_s >= 1
        httpx.get(gw.url + "/readyz")
        # an invalid edit: the hot reload never applies it, so "changed" stays to be seen
        write_policy_text(workers_file, "workers: [")
        assert httpx.get(gw.url + "/readyz").json()["catalog"]["on_disk"] == "unchanged"  # not yet looked
        watched.interval_s = 0
        assert httpx.get(gw.url + "/readyz").json()["catalog"]["on_disk"] == "changed"
    finally:
        gw.server.stop()


def test_a_catalog_built_in_code_is_not_watched(gw):
    assert httpx.get(gw.url + "/readyz").json()["catalog"]["on_disk"] == "not_watched"
    assert json.dumps(gw.state.catalog_file.status())  # serialisable as /readyz sends it
