"""`polyroute` as an operator runs it, in a real subprocess (tests/test_sdk_audit_*): a setting the
gateway refuses, given as an option or as a POLYROUTE_* variable, stops `serve` with one line naming
the value and where it came from, exit 2, not a pydantic traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_")},
        "POLYROUTE_DATA_DIR": str(tmp_path / "data"),
        "COLUMNS": "80",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", "serve", "--no-local-workers", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (
            ("--port", "70000"),
            {},
            "invalid port 70000 (from --port): Input should be less than or equal to 65535",
        ),
        (
            (),
            {"POLYROUTE_PORT": "abc"},
            "invalid port 'abc' (from POLYROUTE_PORT): Input should be a valid integer",
        ),
        (
            ("--port", "0"),
            {"POLYROUTE_REQUEST_TIMEOUT_S": "-1"},
            "invalid request_timeout_s '-1' (from POLYROUTE_REQUEST_TIMEOUT_S): Input should be greater than 0",
        ),
    ],
)
def test_serve_refuses_a_bad_setting_in_one_line(tmp_path: Path, args, env, words):
    done = serve(tmp_path, *args, **env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cannot start: {words}"), done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was written


def run(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator's script runs it: stdout and stderr are pipes (80 columns for rich)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_")}
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, "COLUMNS": "80"},
    )


@pytest.fixture
def long_data_dir(tmp_path: Path) -> Path:
    """A data dir whose path alone is wider than 80 columns, as deployments' paths often are."""
    path = tmp_path / "a-directory-name-as-long-as-operators-make-them" / "and-one-more-level-of-it"
    assert len(str(path)) > 80
    return path


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("router", "activate", "v999"), "no router model version 'v999' under {dir}/router"),
        (
            ("router", "train", "--from-ledger"),
            "no ledger at {dir}/ledger.jsonl (has this gateway served a request?)",
        ),
        (("router", "rollback"), "no previous router version to roll back to"),
    ],
)
def test_an_error_is_one_line_however_long_its_path(long_data_dir: Path, args, words):
    done = run(*args, data_dir=long_data_dir)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [words.format(dir=long_data_dir)]


def test_router_status_names_a_long_router_dir_on_one_line(long_data_dir: Path):
    done = run("router", "status", data_dir=long_data_dir)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first == f"router dir {long_data_dir}/router: in force none (rule-based router), previous -"


def test_policies_explain_names_a_long_policy_path_on_one_line(long_data_dir: Path):
    long_data_dir.mkdir(parents=True)
    policy = long_data_dir / "policy.yaml"
    policy.write_text("version: audit\n")
    done = run("policies", "explain", "--text", "hello", "--policy", str(policy), data_dir=long_data_dir)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("policy audit+") and first.endswith(f"({policy}) · tenant default · model auto")


def test_policies_explain_refuses_a_model_the_gateway_does_not_know(tmp_path: Path):
    done = run("policies", "explain", "--text", "hello", "--model", "gpt-5-turbo", data_dir=tmp_path)
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""  # no explanation of a request the gateway would refuse
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("unknown model 'gpt-5-turbo': the gateway answers it with 404 model_not_found")
    assert "auto, compose:cascade" in line and "batch" in line  # the names it takes, aliases included


@pytest.mark.parametrize("model", ["auto", "batch", "compose:cascade", "gemma-3-270m-local"])
def test_policies_explain_takes_every_model_the_gateway_takes(tmp_path: Path, model: str):
    done = run("policies", "explain", "--text", "hello", "--model", model, "--json", data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == model


def test_router_eval_names_an_unknown_format_as_given(tmp_path: Path):
    done = run("router", "eval", "--format", "xyz", data_dir=tmp_path)
    assert done.returncode == 2
    assert "'xyz' is not a format: use one of routerbench, llmrouter" in done.stderr
    assert "needs --format" not in done.stderr  # it was given, only not a known one


def test_serve_refuses_an_unknown_log_level_without_a_traceback(tmp_path: Path):
    done = serve(tmp_path, "--log-level", "loud")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "'loud': use one of debug, info, warning, error" in done.stderr
    assert not (tmp_path / "data").exists()
