"""`polyroute router`, `policies explain`, `router calibrate` and `ledger export` as an operator runs
them, in a real subprocess: a bad argument or a state the command cannot work from exits 2 (or 1)
with one clear line, no traceback, and nothing written; stderr holds no stray line.

Inputs are tiny files built here or the small fixtures under tests/fixtures/multi; every refusal
comes before a model is fitted, except where a test says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "multi"
ROUTERBENCH = FIXTURES / "routerbench_tiny.csv"


def polyroute(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_") and "REDIS_URL" not in k},
        "HF_HUB_OFFLINE": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=cwd,
    )


def refused(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    """Exit ``code``; the error is one line holding every word; no traceback."""
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "Error" not in done.stdout, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    error = [line for line in lines if all(word in line for word in words)]
    assert error, done.stderr
    if code == 2 and lines[0].startswith("Usage:"):  # typer's usage error: Usage, Try, Error
        assert len(lines) == 3 and lines[2].startswith("Error: "), done.stderr
    else:
        assert len(lines) == 1, done.stderr


# ---- policies explain: what the gateway refuses is refused here too


@pytest.mark.parametrize(
    ("option", "value", "word"),
    [
        ("--max-tokens", "-5", "--max-tokens"),
        ("--max-tokens", "0", "--max-tokens"),
        ("--tenant", "", "a request always has a tenant"),
        ("--tenant", "  ", "a request always has a tenant"),
    ],
)
def test_policies_explain_refuses_a_request_the_gateway_cannot_receive(tmp_path: Path, option, value, word):
    done = polyroute("policies", "explain", "--text", "hello", option, value, "--json", cwd=tmp_path)
    refused(done, 2, word)
    assert done.stdout == ""  # no explanation of a request that cannot exist


def test_policies_explain_still_takes_a_good_request(tmp_path: Path):
    done = polyroute(
        "policies",
        "explain",
        "--text",
        "hello",
        "--tenant",
        "acme",
        "--max-tokens",
        "1",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tenant"] == "acme"


def test_calibrate_refuses_a_tenant_no_key_can_carry(tmp_path: Path):
    done = polyroute(
        "router", "calibrate", "--dry-run", "--data-dir", tmp_path / "d", "--tenant", "", cwd=tmp_path
    )
    refused(done, 2, "--tenant", "tenant must be 1 to 64 characters")
    assert not (tmp_path / "d" / "ledger.jsonl").exists()


# ---- ledger export: stderr holds its messages and nothing else


def test_ledger_export_leaves_no_blank_line_before_its_error(tmp_path: Path):
    done = polyroute("ledger", "export", "--data-dir", tmp_path / "none", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    missing = tmp_path / "none" / "ledger.jsonl"
    assert done.stderr == f"no ledger at {missing} (has this gateway served a request?)\n", repr(done.stderr)


def test_ledger_export_leaves_no_blank_line_after_its_export(tmp_path: Path):
    data = tmp_path / "d"
    data.mkdir()
    record = {"type": "feedback", "request_id": "r1", "score": 1, "ts": "2026-11-01T00:00:00+00:00"}
    (data / "ledger.jsonl").write_text(json.dumps(record) + "\n")
    done = polyroute("ledger", "export", "--data-dir", data, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [record]
    assert done.stderr == f"exported 1 records from {data / 'ledger.jsonl'} as jsonl\n", repr(done.stderr)


# ---- router split


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--format", "nope"), ("--format", "'nope' is not a format: use one of routerbench, llmrouter")),
        (("--format", "routerbench", "--test-fraction", "1.5"), ("--test-fraction", "not between 0 and 1")),
        (("--format", "routerbench", "--test-fraction", "nan"), ("--test-fraction", "not between 0 and 1")),
    ],
)
def test_split_refuses_a_bad_argument_with_exit_2(tmp_path: Path, args, words):
    done = polyroute(
        "router", "split", "--input", ROUTERBENCH, "--out-dir", tmp_path / "out", *args, cwd=tmp_path
    )
    refused(done, 2, *words)
    assert not (tmp_path / "out").exists()


def test_split_refuses_an_out_dir_that_is_a_file(tmp_path: Path):
    (tmp_path / "taken").write_text("mine\n")
    done = polyroute(
        "router", "split", "--format", "routerbench", "--input", ROUTERBENCH, "--out-dir", tmp_path / "taken",
        cwd=tmp_path,
    )  # fmt: skip
    refused(done, 2, "--out-dir", "is a file")
    assert (tmp_path / "taken").read_text() == "mine\n"


def test_split_refuses_two_inputs_of_one_name(tmp_path: Path):
    """Both would be written as OUT/train/<name>: the second replaced the first, and its rows were lost."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "data.csv").write_text(ROUTERBENCH.read_text())
    done = polyroute(
        "router", "split", "--format", "routerbench", "--input", tmp_path / "a" / "data.csv",
        "--input", tmp_path / "b" / "data.csv", "--out-dir", tmp_path / "out", cwd=tmp_path,
    )  # fmt: skip
    refused(done, 2, "--input", "would both be written as data.csv")
    assert not (tmp_path / "out").exists()


def test_split_still_splits(tmp_path: Path):
    done = polyroute(
        "router", "split", "--format", "routerbench", "--input", ROUTERBENCH, "--out-dir", tmp_path / "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sides = {
        side: (tmp_path / "out" / side / ROUTERBENCH.name).read_text().splitlines()
        for side in ("train", "test")
    }
    rows = ROUTERBENCH.read_text().splitlines()
    assert sides["train"][0] == sides["test"][0] == rows[0]
    assert sorted(sides["train"][1:] + sides["test"][1:]) == sorted(rows[1:])


# ---- a current.json that is JSON but not an object


@pytest.fixture
def listed_pointer(tmp_path: Path) -> Path:
    root = tmp_path / "models"  # not "router": the cwd comes first on `python -m`'s path
    root.mkdir()
    (root / "current.json").write_text("[1]\n")
    return root


def test_rollback_says_the_pointer_is_no_object(tmp_path: Path, listed_pointer: Path):
    done = polyroute("router", "rollback", "--router-dir", listed_pointer, cwd=tmp_path)
    refused(done, 1, "current.json: not a JSON object")
    assert (listed_pointer / "current.json").read_text() == "[1]\n"


def test_activate_repairs_a_pointer_that_is_no_object(tmp_path: Path):
    """A real version on disk (trained here, not put in force), then a pointer that is a JSON list:
    on the old code activate crashed with an AttributeError traceback; read_pointer now refuses a
    non-object as damaged, which activating replaces (docs/router.md)."""
    root = tmp_path / "models"
    trained = polyroute(
        "router", "train", "--strategy", "cascade", "--format", "routerbench", "--train", ROUTERBENCH,
        "--no-activate", "--router-dir", root, cwd=tmp_path,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    (version,) = [p.name for p in root.iterdir() if p.is_dir()]
    (root / "current.json").write_text("[1]\n")
    status = polyroute("router", "status", "--router-dir", root, cwd=tmp_path)
    refused(status, 1, "current.json: not a JSON object")
    done = polyroute("router", "activate", version, "--router-dir", root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((root / "current.json").read_text())["version"] == version


def test_train_with_a_pointer_that_is_no_object_says_so_and_replaces_it(tmp_path: Path, listed_pointer: Path):
    """On the old code the fit ran, then saving failed with an AttributeError traceback: the work lost."""
    done = polyroute(
        "router", "train", "--strategy", "cascade", "--format", "routerbench", "--train", ROUTERBENCH,
        "--router-dir", listed_pointer, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "current.json: not a JSON object (the new version replaces it" in " ".join(done.stderr.split())
    (version,) = [p.name for p in listed_pointer.iterdir() if p.is_dir()]
    assert json.loads((listed_pointer / "current.json").read_text())["version"] == version


# ---- --model and --backend: refused before the data is read


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--model", "bogus", ("--model", "'bogus': use one of auto, logreg, lightgbm, mf, knn, ensemble")),
        ("--backend", "bogus", ("--backend", "'bogus': use transformer or static")),
    ],
)
def test_train_refuses_an_unknown_model_or_backend_before_loading(tmp_path: Path, option, value, words):
    done = polyroute(
        "router", "train", "--strategy", "cascade", "--format", "routerbench", "--train", ROUTERBENCH,
        option, value, "--router-dir", tmp_path / "models", cwd=tmp_path,
    )  # fmt: skip
    refused(done, 2, *words)
    assert "training" not in done.stderr and not (tmp_path / "models").exists()


@pytest.mark.parametrize(("option", "value"), [("--model", "bogus"), ("--backend", "bogus")])
def test_eval_refuses_an_unknown_model_or_backend_before_loading(tmp_path: Path, option, value):
    train, test = halves(tmp_path)
    done = polyroute(
        "router", "eval", "--format", "routerbench", "--train", train, "--test", test,
        option, value, "--out", tmp_path / "r.json", cwd=tmp_path,
    )  # fmt: skip
    refused(done, 2, option, f"'{value}': use")
    assert "embedding" not in done.stderr and not (tmp_path / "r.json").exists()


def test_model_help_names_every_model_the_commands_take(tmp_path: Path):
    """docs/benchmarks.md runs `--model ensemble`: --help listed every other choice but that one."""
    for command in ("train", "eval"):
        done = polyroute("router", command, "--help", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "auto, ensemble, logreg, lightgbm, mf or knn" in " ".join(done.stdout.split()), done.stdout


def halves(tmp_path: Path) -> tuple[Path, Path]:
    """ROUTERBENCH's rows cut in two files that share no query: a train and a test file."""
    header, *rows = ROUTERBENCH.read_text().splitlines()
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    train.write_text("\n".join([header, *rows[:24]]) + "\n")
    test.write_text("\n".join([header, *rows[24:]]) + "\n")
    return train, test


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_seed_numpy_refuses_is_refused_before_loading(tmp_path: Path, command):
    """`--seed -1` failed after the queries were embedded, with numpy's "Seed must be between 0 and
    2**32 - 1", which does not say which option."""
    train, test = halves(tmp_path)
    if command == "train":
        args = ("--train", train, "--strategy", "cascade", "--router-dir", tmp_path / "models")
    else:
        args = ("--train", train, "--test", test, "--out", tmp_path / "r.json")
    done = polyroute("router", command, "--format", "routerbench", *args, "--seed", "-1", cwd=tmp_path)
    refused(done, 2, "--seed")
    assert "embedding" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.csv", "train.csv"]
