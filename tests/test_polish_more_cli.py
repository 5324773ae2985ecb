"""The CLI prints what users, files and workers say as text, not as rich markup, and its help names
every environment variable an option falls back to.

rich reads "[...]" in what it prints as markup: "[draft]" in a path, "[test]" in a key's label or the
"[a-zA-Z0-9]" of a pattern in an error vanished, and "[/x]" raised rich.errors.MarkupError, a
traceback instead of the message (after `keys create` had stored the key it then never showed).
Every command runs for real here (typer's CliRunner; `ingest` against a gateway on loopback).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from gateway import Settings
from policies import parse_catalog
from polyroute.cli import app
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, start_gateway

runner = CliRunner()
ROOT = typer.main.get_command(app)
# nothing from the machine's environment: no Redis, no data dir, catalog or router dir named
CLEAN = {
    name: None
    for name in (
        "REDIS_URL",
        "POLYROUTE_REDIS_URL",
        "POLYROUTE_DATA_DIR",
        "POLYROUTE_WORKERS_FILE",
        "POLYROUTE_ROUTER_DIR",
        "POLYROUTE_POLICY_FILE",
    )
}
WIDE = {**CLEAN, "COLUMNS": "250"}
HOSTILE = "[/x] [bold]y[/bold] [draft]"  # a closing tag rich cannot match, a style, a word in brackets


def said(result) -> str:
    """The command's output (stdout and stderr) on one line, however rich wrapped it."""
    return " ".join(result.output.split())


def _option(path: str, option: str):
    command = ROOT
    for name in path.split():
        command = command.commands[name]
    return next(p for p in command.params if option in getattr(p, "opts", []))


# ---- help: the environment variables an option falls back to ---------------------------------------
@pytest.mark.parametrize(
    ("option", "same_as"),
    [
        ("--workers-file", "workers"),  # cli.py's WorkersFile: POLYROUTE_WORKERS_FILE, as serve reads it
        ("--router-dir", "router status"),  # cli.py's RouterDir: POLYROUTE_ROUTER_DIR
        ("--data-dir", "keys list"),  # cli.py's DataDir: POLYROUTE_DATA_DIR
    ],
)
def test_calibrate_options_say_what_the_other_commands_say(option, same_as):
    """`router calibrate` reads these through gateway Settings.from_env, as `serve` does: its help
    is the other commands' help word for word (it said only "worker catalog YAML" and "model store
    [default: <data dir>/router]")."""
    assert _option("router calibrate", option).help == _option(same_as, option).help


def test_calibrate_help_names_its_environment_variables():
    shown = said(runner.invoke(app, ["router", "calibrate", "--help"], env={"COLUMNS": "100"}))
    for variable in ("POLYROUTE_WORKERS_FILE", "POLYROUTE_ROUTER_DIR", "POLYROUTE_DATA_DIR", "REDIS_URL"):
        assert variable in shown, variable


def test_the_help_is_what_calibrate_reads(tmp_path):
    """The settings calibrate builds take both variables when the options are not given."""
    env = {"POLYROUTE_WORKERS_FILE": "/etc/w.yaml", "POLYROUTE_ROUTER_DIR": "/srv/router"}
    settings = Settings.from_env(env, data_dir=tmp_path, workers_file=None, router_dir=None)
    assert (settings.workers_file, settings.router_dir) == (Path("/etc/w.yaml"), Path("/srv/router"))
    missing = tmp_path / "from-env.yaml"
    result = runner.invoke(
        app,
        ["router", "calibrate", "--dry-run", "--data-dir", str(tmp_path / "data")],
        env={**WIDE, "POLYROUTE_WORKERS_FILE": str(missing)},
    )
    assert result.exit_code == 2 and str(missing) in said(result), result.output


def test_other_options_name_their_fallbacks_too():
    out = _option("retrieval eval", "--out").help  # no --data-dir there: the data dir is the env's
    assert "POLYROUTE_DATA_DIR" in out and "<data dir>/results" in out
    api_key = _option("ingest", "--api-key").help
    assert "POLYROUTE_API_KEY" in api_key and not api_key.startswith("[")  # says what it is, too


# ---- calibrate: messages quote paths, option values and errors --------------------------------------
def test_calibrate_quotes_a_bad_option_value_whole(tmp_path):
    args = ["router", "calibrate", "--dry-run", "--data-dir", str(tmp_path), "--max-cost-usd", HOSTILE]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.exception  # was: MarkupError, a traceback and exit 1
    assert f"got {HOSTILE!r}" in said(result)


def test_calibrate_keeps_the_brackets_of_a_catalog_error(tmp_path):
    """A catalog in a folder named "[draft]" with an invalid worker name: the error names the path
    and the pattern whole (both lost their brackets)."""
    workers_file = tmp_path / "[draft]" / "workers.yaml"
    workers_file.parent.mkdir()
    workers_file.write_text(catalog_yaml_for("http://127.0.0.1:9").replace("name: cheap", "name: 'bad name'"))
    args = ["router", "calibrate", "--dry-run", "--data-dir", str(tmp_path / "data")]
    result = runner.invoke(app, [*args, "--workers-file", str(workers_file)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert str(workers_file) in said(result)
    assert "[a-zA-Z0-9][a-zA-Z0-9._:-]" in said(result)


def test_calibrate_plan_names_a_bracketed_probe_file_whole(tmp_path):
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(catalog_yaml_for("http://127.0.0.1:9"))
    probes = tmp_path / "x[" / "y]" / "probes.jsonl"  # its path holds "[/y]": a closing tag to rich
    probes.parent.mkdir(parents=True)
    probes.write_text(
        '{"id": "p1", "task": "t", "type": "choice", "source": "test", "gold": "B", "max_tokens": 8, '
        '"prompt": "Which gas do plants take in?\\nA) oxygen\\nB) carbon dioxide"}\n'
    )
    args = ["router", "calibrate", "--dry-run", "--workers", "cheap", "--probes", "1"]
    args += [
        "--data-dir",
        str(tmp_path / "data"),
        "--workers-file",
        str(workers_file),
        "--probe-file",
        str(probes),
    ]
    result = runner.invoke(app, args, env={**WIDE, FAKE_KEY_ENV: "sk-test"})
    assert result.exit_code == 0, result.exception
    assert f"1 probes from {probes}" in said(result) and "dry run: nothing was sent" in said(result)


# ---- keys -------------------------------------------------------------------------------------------
def test_a_key_for_a_bracketed_tenant_is_shown_and_listed(tmp_path):
    data = ["--data-dir", str(tmp_path)]
    created = runner.invoke(
        app, ["keys", "create", "--tenant", "[/x]", "--name", "[test] CI", *data], env=WIDE
    )
    assert created.exit_code == 0, created.exception  # the key was stored, then MarkupError hid it
    key = created.output.strip().splitlines()[-1]
    assert key.startswith("pr-") and "for tenant [/x]" in said(created)
    listed = runner.invoke(app, ["keys", "list", *data], env=WIDE)
    assert listed.exit_code == 0, listed.exception  # one such key broke the listing of all keys
    assert "[/x]" in listed.output and "[test] CI" in listed.output
    unknown = runner.invoke(app, ["keys", "revoke", "key_[/nope]", *data], env=WIDE)
    assert unknown.exit_code == 1 and "no key with id key_[/nope]" in said(unknown)


# ---- policies explain and router status -------------------------------------------------------------
def test_policies_explain_names_a_bracketed_tenant(tmp_path):
    args = ["policies", "explain", "--text", "hello", "--tenant", HOSTILE, "--data-dir", str(tmp_path)]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.exception
    assert f"tenant {HOSTILE}" in said(result)


def test_router_status_names_a_bracketed_router_dir(tmp_path):
    root = tmp_path / "[draft]" / "router"
    result = runner.invoke(app, ["router", "status", "--router-dir", str(root)], env=WIDE)
    assert result.exit_code == 0, result.exception
    assert f"router dir {root}:" in said(result)


# ---- ingest: file names and the gateway's messages --------------------------------------------------
@pytest.fixture
def ingest_gateway(upstream, tmp_path_factory):
    catalog = parse_catalog(catalog_yaml_for(upstream.url), "test catalog")
    gw = start_gateway(catalog, tmp_path_factory.mktemp("gw"), retrieval_embedder="minilm-static")
    yield gw
    gw.server.stop()


def test_ingest_names_a_bracketed_file_it_could_not_read(ingest_gateway, tmp_path):
    (tmp_path / "good.txt").write_text("Alpha centauri is the nearest star system.")
    (tmp_path / "notes [draft].pdf").write_bytes(b"%PDF-1.4 not a pdf")
    args = ["ingest", str(tmp_path), "--collection", "notes", "--url", ingest_gateway.url]
    result = runner.invoke(app, [*args, "--api-key", ingest_gateway.api_key], env=WIDE)
    assert result.exit_code == 1, result.exception  # one file failed, the other is in
    assert "✗ notes [draft].pdf:" in said(result) and "1 created" in said(result)


def test_ingest_reports_a_collection_name_the_gateway_refuses(ingest_gateway, tmp_path):
    (tmp_path / "good.txt").write_text("Alpha centauri is the nearest star system.")
    args = ["ingest", str(tmp_path), "--collection", "[/x]", "--url", ingest_gateway.url]
    result = runner.invoke(app, [*args, "--api-key", ingest_gateway.api_key], env=WIDE)
    # refused before anything is sent (the gateway's own name rule), said as text, not a traceback
    assert result.exit_code == 2, result.exception
    assert "[/x]" in said(result) and "Nothing was read or sent" in said(result)
