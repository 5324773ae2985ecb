"""`polyroute keys create` refuses a tenant name the gateway cannot keep apart from its own books, on
the file store and on Redis, with one line and nothing written.

`POST /admin/keys` always refused such names (its own pattern); the CLI took them: a key for tenant
"judge:acme" spent from, and was reported with, acme's judge budget (gateway/judge.py keeps it under
`judge:<tenant>` because "tenant names cannot hold a colon"), and "acme " (a stray space) made a key
that no policy tenant matches, so no budget and no tenant rate limit held it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import backend_redis_url
from tests.test_cli import run_cli


@pytest.fixture(params=["file", "redis"])
def cli_env(request: pytest.FixtureRequest) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "POLYROUTE_REDIS_URL")}
    url = backend_redis_url(request)
    return {**env, "REDIS_URL": url} if url else env


@pytest.mark.parametrize("tenant", ["judge:acme", "acme "])
def test_keys_create_refuses_a_tenant_name_the_books_cannot_keep_apart(cli_env, tmp_path: Path, tenant):
    data = ["--data-dir", str(tmp_path)]
    done = run_cli("keys", "create", "--tenant", tenant, "-q", *data, env=cli_env)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert not done.stdout  # no key printed
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"tenant {tenant!r} holds" in lines[0]
    listed = run_cli("keys", "list", "--json", *data, env=cli_env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == ""  # nothing half-written: no key at all
    fine = run_cli("keys", "create", "--tenant", "acme", "-q", *data, env=cli_env)
    assert fine.returncode == 0 and fine.stdout.startswith("pr-"), fine.stderr


def test_keys_list_shows_each_keys_own_limits(tmp_path: Path):
    """A key made with --rpm/--tpm is told apart in `keys list` (it was shown only with --json)."""
    data = ["--data-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "POLYROUTE_REDIS_URL")}
    env["COLUMNS"] = "250"  # one row per key, whatever the terminal
    limited = run_cli("keys", "create", "--tenant", "acme", "--rpm", "60", "--tpm", "100000", *data, env=env)
    plain = run_cli("keys", "create", "--tenant", "acme", "--name", "plain", *data, env=env)
    assert limited.returncode == 0 and plain.returncode == 0, (limited.stderr, plain.stderr)
    listed = run_cli("keys", "list", *data, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "key_" in line]
    assert len(rows) == 2, listed.stdout
    assert any("60 rpm, 100000 tpm" in row for row in rows), listed.stdout
    assert any("plain" in row and "rpm" not in row for row in rows), listed.stdout


def test_keys_create_notes_a_tenant_the_policy_does_not_name(tmp_path: Path):
    """A key for a tenant the policy does not name is no budget's and no tenant limit's: the key is
    made (a policy may name the tenant later), and the command says so on stderr (stdout stays the key)."""
    (tmp_path / "policy.yaml").write_text(
        yaml.safe_dump({"version": 1, "tenants": {"acme": {"budget": {"daily_usd": "5"}}}})
    )
    data = ["--data-dir", str(tmp_path)]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "POLYROUTE_REDIS_URL", "POLYROUTE_POLICY_FILE")
    }
    typo = run_cli("keys", "create", "--tenant", "acem", "-q", *data, env=env)
    assert typo.returncode == 0 and typo.stdout.startswith("pr-") and len(typo.stdout.split()) == 1
    said = " ".join(typo.stderr.split())
    assert "tenant 'acem' is not in the policy" in said and "it names acme" in said, said
    named = run_cli("keys", "create", "--tenant", "acme", "-q", *data, env=env)
    assert named.returncode == 0 and named.stdout.startswith("pr-")
    assert "not in the policy" not in named.stderr
