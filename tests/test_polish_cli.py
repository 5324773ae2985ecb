"""The CLI as a newcomer reads it: `polyroute workers` in an 80-column terminal, every command's
--help (summaries, option help, the environment variables an option falls back to), and the
commands that must see the catalog and router dir the gateway they serve sees."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from policies import load_catalog
from polyroute.cli import app
from tests.conftest import catalog_yaml_for

runner = CliRunner()
ROOT = typer.main.get_command(app)
# first sentences cut at one of these read as "Put a trained version in force, e.g."
ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "cf.")
# a clean environment for the catalog: no provider key set, no catalog file named
NO_KEYS = {
    name: None
    for name in (
        "POLYROUTE_WORKERS_FILE",
        "OPENAI_API_KEY",
        "ANTHROPIC_API_KEY",
        "DEEPSEEK_API_KEY",
        "TOGETHERAI_API_KEY",
        "MISTRAL_API_KEY",
    )
}


def _commands(command=ROOT, path: tuple[str, ...] = ()):
    """(path, command, parent) for every command and group under `polyroute`."""
    for name, sub in getattr(command, "commands", {}).items():
        yield path + (name,), sub, command
        yield from _commands(sub, path + (name,))


COMMANDS = {" ".join(path): (command, parent) for path, command, parent in _commands()}


def _long_catalog(tmp_path: Path, name: str) -> Path:
    """The test catalog with its first worker renamed to `name` (a long name, as an operator's may be)."""
    path = tmp_path / "workers.yaml"
    path.write_text(catalog_yaml_for("http://127.0.0.1:9").replace("name: cheap", f"name: {name}", 1))
    return path


# ---- polyroute workers ---------------------------------------------------------------------------
def _table_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("│")]


def test_workers_in_80_columns_shows_every_name_whole():
    result = runner.invoke(app, ["workers"], env={"COLUMNS": "80", **NO_KEYS})
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.output)
    for worker in load_catalog(None).workers:
        # whole in its own table cell: the name a user types to pin the worker
        assert any(re.match(rf"│ {re.escape(worker.name)} +│", row) for row in rows), (worker.name, rows)
    assert all(len(line) <= 80 for line in result.output.splitlines()), result.output
    # and why a worker is not available, unbroken: the env var to set
    assert "gpt-4.1: env var OPENAI_API_KEY is not set" in result.output
    assert "claude-sonnet-4: env var ANTHROPIC_API_KEY is not set" in result.output


def test_workers_keeps_a_long_name_whole_in_80_columns(tmp_path):
    name = "acme-eu-finetuned-llama-3.3-70b-instruct"
    result = runner.invoke(
        app, ["workers", "--workers-file", str(_long_catalog(tmp_path, name))], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    assert any(re.match(rf"│ {re.escape(name)} +│", row) for row in _table_rows(result.output)), result.output


def test_workers_reads_the_catalog_the_gateway_reads(tmp_path):
    """POLYROUTE_WORKERS_FILE, as `serve` and the other offline commands read it."""
    name = "from-the-environment"
    env = {"COLUMNS": "200", "POLYROUTE_WORKERS_FILE": str(_long_catalog(tmp_path, name))}
    result = runner.invoke(app, ["workers"], env=env)
    assert result.exit_code == 0, result.output
    assert name in result.output and "gemma-3-270m-local" not in result.output

    missing = runner.invoke(app, ["workers"], env={"POLYROUTE_WORKERS_FILE": str(tmp_path / "nope.yaml")})
    assert missing.exit_code == 2
    assert "POLYROUTE_WORKERS_FILE" in missing.output and "nope.yaml" in missing.output


def test_policies_explain_reads_the_catalog_the_gateway_reads(tmp_path):
    name = "from-the-environment"
    env = {"POLYROUTE_WORKERS_FILE": str(_long_catalog(tmp_path, name)), "POLYROUTE_POLICY_FILE": None}
    args = ["policies", "explain", "--text", "hello", "--json", "--assume-available"]
    result = runner.invoke(app, [*args, "--data-dir", str(tmp_path / "data")], env=env)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert name in body["pool"] and "gpt-4.1" not in body["pool"] + [e["worker"] for e in body["excluded"]]


# ---- every command's --help ----------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_help_summary_is_not_cut_at_an_abbreviation(path):
    command, parent = COMMANDS[path]
    result = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    for limit in (45, 80, 200):  # the summary the parent's --help lists, at any terminal width
        summary = command.get_short_help_str(limit)
        assert not summary.endswith(ABBREVIATIONS), (path, summary)
    listing = runner.invoke(app, [*path.split()[:-1], "--help"], env={"COLUMNS": "80"}).output
    line = next(line for line in listing.splitlines() if line.strip().startswith(path.split()[-1] + " "))
    assert not line.rstrip().endswith(ABBREVIATIONS), line


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_every_option_and_argument_has_help(path):
    command, _ = COMMANDS[path]
    bare = [
        "/".join(getattr(p, "opts", [p.name]))
        for p in command.params
        if not (getattr(p, "help", None) or "").strip()
    ]
    assert bare == [], f"{path}: no help for {bare}"
    shown = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "200"}).output
    for param in command.params:
        if param.param_type_name == "option":
            assert param.help in " ".join(shown.split()), (path, param.opts)


# (command, option, the environment variable the option falls back to)
ENV_FALLBACKS = [
    ("serve", "--host", "POLYROUTE_HOST"),
    ("serve", "--port", "POLYROUTE_PORT"),
    ("serve", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("serve", "--local-workers", "POLYROUTE_LOCAL_WORKERS"),
    ("serve", "--data-dir", "POLYROUTE_DATA_DIR"),
    ("workers", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("policies validate", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("policies explain", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("policies explain", "--policy", "POLYROUTE_POLICY_FILE"),
    ("router train", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("router train", "--router-dir", "POLYROUTE_ROUTER_DIR"),
    ("router train", "--data", "POLYROUTE_ROUTELLM_DATA"),
    ("router train", "--from-ledger", "REDIS_URL"),
    ("router eval", "--workers-file", "POLYROUTE_WORKERS_FILE"),
    ("router eval", "--router-dir", "POLYROUTE_ROUTER_DIR"),
    ("router eval", "--data", "POLYROUTE_ROUTELLM_DATA"),
    ("router eval", "--ledger", "REDIS_URL"),
    ("router status", "--router-dir", "POLYROUTE_ROUTER_DIR"),
    ("router rollback", "--router-dir", "POLYROUTE_ROUTER_DIR"),
    ("router activate", "--router-dir", "POLYROUTE_ROUTER_DIR"),
    ("ingest", "--url", "POLYROUTE_BASE_URL"),
    ("ingest", "--api-key", "POLYROUTE_API_KEY"),
]


@pytest.mark.parametrize(("path", "option", "variable"), ENV_FALLBACKS)
def test_option_help_names_the_environment_variable_it_reads(path, option, variable):
    command, _ = COMMANDS[path]
    param = next(p for p in command.params if option in getattr(p, "opts", []))
    assert variable in param.help, (path, option, param.help)


def test_keys_help_says_keys_go_to_redis_when_redis_url_is_set():
    shown = " ".join(runner.invoke(app, ["keys", "--help"], env={"COLUMNS": "80"}).output.split())
    assert "REDIS_URL" in shown


# ---- router eval --save-acceptance: into the router dir the gateway reads ----------------------------
def _gsm8k(tmp_path: Path) -> Path:
    data = tmp_path / "routellm"
    (data / "gsm8k").mkdir(parents=True)
    fixture = Path(__file__).parent / "fixtures" / "gsm8k_small.csv"
    (data / "gsm8k" / "gsm8k_responses.csv").write_bytes(fixture.read_bytes())
    return data


@pytest.mark.parametrize("how", ["option", "environment"])
def test_save_acceptance_writes_into_the_router_dir(tmp_path, how):
    """The gateway's cascade reads <router dir>/acceptance.joblib; with --router-dir or
    POLYROUTE_ROUTER_DIR (the Helm chart's shared router store) the model went to <data dir>/router."""
    router_dir = tmp_path / "router-store"
    args = ["router", "eval", "--strategy", "cascade", "--save-acceptance"]
    args += ["--data", str(_gsm8k(tmp_path)), "--out", str(tmp_path / "cascade.json")]
    args += ["--data-dir", str(tmp_path / "data")]
    env = {"POLYROUTE_ROUTER_DIR": None}
    if how == "option":
        args += ["--router-dir", str(router_dir)]
    else:
        env["POLYROUTE_ROUTER_DIR"] = str(router_dir)
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert (router_dir / "acceptance.joblib").is_file()
    assert not (tmp_path / "data" / "router" / "acceptance.joblib").exists()
