"""The `polyroute` command, run as a real subprocess (as a user would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gateway.keys import FileKeyStore


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it; `env` replaces the environment (to control which keys are set)."""
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def polyroute(*args: str, data_dir) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--data-dir", str(data_dir))


def test_keys_create_list_revoke(tmp_path):
    created = polyroute("keys", "create", "--tenant", "acme", "--name", "laptop", "-q", data_dir=tmp_path)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("pr-") and len(key) > 40
    store = FileKeyStore(tmp_path / "keys.json")
    record = store.verify(key)
    assert record is not None and record.tenant == "acme" and record.name == "laptop"

    listed = polyroute("keys", "list", "--json", data_dir=tmp_path)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["id"] for r in rows] == [record.id] and rows[0]["revoked_at"] is None
    assert key not in listed.stdout and record.key_hash not in listed.stdout

    revoked = polyroute("keys", "revoke", record.id, data_dir=tmp_path)
    assert revoked.returncode == 0 and "revoked" in revoked.stderr
    assert FileKeyStore(tmp_path / "keys.json").verify(key) is None


def test_revoking_an_unknown_key_fails_clearly(tmp_path):
    result = polyroute("keys", "revoke", "key_missing", data_dir=tmp_path)
    assert result.returncode == 1 and "no key with id key_missing" in result.stderr


def test_workers_command_shows_availability(tmp_path):
    result = run_cli("workers", env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "gemma-3-270m-local" in result.stdout and "OPENAI_API_KEY" in result.stdout


def test_serve_refuses_an_invalid_catalog(tmp_path):
    bad = tmp_path / "workers.yaml"
    bad.write_text("workers: [")
    result = run_cli("serve", "--workers-file", str(bad), "--data-dir", str(tmp_path))
    assert result.returncode == 2 and "invalid YAML" in result.stderr


def test_policies_validate(tmp_path):
    good = tmp_path / "policy.yaml"
    good.write_text("version: 9\nrules: [{id: small, max_active_params_b: 13}]\n")
    ok = run_cli("policies", "validate", str(good))
    assert ok.returncode == 0 and "valid" in ok.stderr and "1 rules" in ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 9\nrules: [{id: small}]\n")
    refused = run_cli("policies", "validate", str(bad))
    assert refused.returncode == 2 and "sets no constraint" in refused.stderr


def test_policies_explain_defaults_to_the_default_tenant(tmp_path):
    def explain(*extra: str, env: dict[str, str]):
        args = ("policies", "explain", "--text", "mail bob@example.com", "--data-dir", str(tmp_path))
        return run_cli(*args, "--json", *extra, env=env)

    result = explain(env={"PATH": "/usr/bin:/bin", "DEEPSEEK_API_KEY": "x", "MISTRAL_API_KEY": "y"})
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["tenant"] == "default" and body["data_class"] == "pii"
    excluded = {e["worker"]: e for e in body["excluded"]}
    assert excluded["deepseek-chat"]["rule"] == "pii-eu-or-local"
    assert "mixtral-8x22b" in body["pool"] and "gemma-3-270m-local" in body["pool"]
    assert excluded["gpt-4.1"]["rule"] == "unavailable"
    assumed = explain("--assume-available", env={"PATH": "/usr/bin:/bin"})
    assert assumed.returncode == 0, assumed.stderr
    assumed_body = json.loads(assumed.stdout)
    assert assumed_body["assume_available"] is True
    assert all(e["rule"] != "unavailable" for e in assumed_body["excluded"])
    # without keys, the rules alone decide: gpt-4.1 (US) is out for pii by the rule, not for its key
    assert {e["worker"]: e["rule"] for e in assumed_body["excluded"]}["gpt-4.1"] == "pii-eu-or-local"
    table = run_cli(
        "policies",
        "explain",
        "--text",
        "hi",
        "--tenant",
        "acme",
        "--data-dir",
        str(tmp_path),
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )
    assert table.returncode == 0 and "tenant acme" in table.stdout and "data class public" in table.stdout


def test_help_keeps_the_env_and_default_hints():
    """Rich used to read "[env POLYROUTE_PORT, default 8400]" as markup and drop it (issue 15)."""
    import os

    env = {**os.environ, "COLUMNS": "200"}
    serve = run_cli("serve", "--help", env=env)
    assert serve.returncode == 0 and "[env POLYROUTE_PORT, default 8400]" in serve.stdout
    train = run_cli("router", "train", "--help", env=env)
    assert "[default: <data dir>/router]" in train.stdout


def test_the_cli_makes_litellm_use_its_bundled_price_map(tmp_path):
    """Run outside make, importing litellm must not reach out for the remote price map (issue 15, item 8).

    Every outbound HTTP(S) request is sent to a loopback proxy that counts connections: the bare
    import does connect (so the check can fail), the import after the CLI's module does not.
    """
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    connections = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            connections.append(conn)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    proxy = f"http://127.0.0.1:{server.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k not in ("LITELLM_LOCAL_MODEL_COST_MAP", "HF_HUB_OFFLINE")}
    env.update({"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy})
    env.pop("NO_PROXY", None), env.pop("no_proxy", None)

    def imports(code: str) -> int:
        before = len(connections)
        subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, cwd=tmp_path)
        return len(connections) - before

    try:
        assert imports("import litellm") > 0
        assert imports("import polyroute.cli, litellm") == 0
    finally:
        server.close()


def test_the_sdk_and_ingest_find_the_gateway_on_polyroute_port(monkeypatch):
    """`POLYROUTE_PORT=9000 make serve` and then the SDK or `polyroute ingest` with no URL: same gateway."""
    from polyroute import Client
    from polyroute.client import default_base_url

    monkeypatch.delenv("POLYROUTE_BASE_URL", raising=False)
    monkeypatch.delenv("POLYROUTE_PORT", raising=False)
    assert default_base_url() == "http://127.0.0.1:8400"
    monkeypatch.setenv("POLYROUTE_PORT", "9000")
    assert Client(api_key="k").base_url == "http://127.0.0.1:9000"
    monkeypatch.setenv("POLYROUTE_BASE_URL", "http://gateway.internal:80/")
    assert Client(api_key="k").base_url == "http://gateway.internal:80"  # an explicit URL wins
