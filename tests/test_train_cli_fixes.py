"""`router train` / `router status` / `router eval --from-ledger`: options that must not be silently
ignored, catalogs that must be the gateway's, a router dir checked before the fit, and readable
progress and errors.

Real files and the real CLI (typer's runner, a subprocess where the environment matters); tiny inputs,
so every training here takes a few seconds.
"""

from __future__ import annotations

import csv
import json
import shutil
import socket
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from gateway.ledger import FeedbackRecord, RequestRecord
from polyroute.cli import app
from router import list_versions, load_current, read_pointer, save_artifact, train_artifact
from tests.conftest import catalog_yaml_for
from tests.test_ips import logged_ledger
from tests.test_router_learned import synthetic

FIXTURES = Path(__file__).parent / "fixtures"
ROUTELLM = FIXTURES / "routellm"  # MMLU + GSM8K labels, for the fast path
ROUTELLM_WORKERS = "mixtral-8x7b, gpt-4-1106-preview"


def invoke(*args: object, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400", **(env or {})})


def train_cascade(*args: object) -> Result:
    """`polyroute router train --strategy cascade ARGS...`"""
    return invoke("router", "train", "--strategy", "cascade", *args)


def eval_candidate(
    root: Path, version: str, ledger: Path, *args: object, env: dict[str, str] | None = None
) -> Result:
    """`polyroute router eval --from-ledger --candidate VERSION --router-dir ROOT --ledger FILE ARGS...`"""
    return invoke(
        "router",
        "eval",
        "--from-ledger",
        "--candidate",
        version,
        "--router-dir",
        root,
        "--ledger",
        ledger,
        *args,
        env=env,
    )


def refused(result: Result, code: int, message: str) -> None:
    """Exit `code` with `message` (line wrapping ignored), and no traceback."""
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split()), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def no_versions(root: Path) -> bool:
    return not list(root.glob("*/card.json"))


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    """cheap (specialist), mid (open-moe), pricey (frontier), nokey (frontier)."""
    path = tmp_path / "workers.yaml"
    path.write_text(catalog_yaml_for("http://127.0.0.1:9"))
    return path


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    """A data dir whose ledger scores cheap (right half the time) and pricey (always right)."""
    records = []
    for i in range(40):
        for worker in ("cheap", "pricey"):
            rid = f"r{i}-{worker}"
            query = f"Compute {i} * 7 + {i} and explain step {i}."
            records.append(
                asdict(
                    RequestRecord(rid, "acme", "auto", worker, "fast", 200, completion_tokens=50, query=query)
                )
            )
            score = float(i % 2) if worker == "cheap" else 1.0
            records.append(asdict(FeedbackRecord(rid, "acme", score, worker)))
    data = tmp_path / "data"
    data.mkdir()
    (data / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


@pytest.fixture
def gsm8k(tmp_path: Path) -> Path:
    """A RouteLLM folder with 60 GSM8K rows and both models' answers: enough for the cascade."""
    root = tmp_path / "routellm"
    (root / "gsm8k").mkdir(parents=True)
    shutil.copy(FIXTURES / "gsm8k_small.csv", root / "gsm8k" / "gsm8k_responses.csv")
    return root


def train_ledger(
    ledger_dir: Path, root: Path, *extra: object, model: str = "logreg", env: dict[str, str] | None = None
) -> Result:
    return invoke(
        "router",
        "train",
        "--from-ledger",
        "--data-dir",
        ledger_dir,
        "--model",
        model,
        "--router-dir",
        root,
        *extra,
        env=env,
    )


# ---- 1 and 2: --map ----------------------------------------------------------------------------------


def test_cascade_routellm_takes_the_documented_map_and_the_catalog_tiers(tmp_path, gsm8k, catalog):
    """The cascade path named Mixtral `mistralai/Mixtral-8x7B-Instruct-v0.1`, so docs/router.md's
    `--map mixtral-8x7b=...` did nothing; and it never read the catalog, so it had no tier priors."""
    result = train_cascade(
        "--dataset",
        "routellm",
        "--data",
        gsm8k,
        "--model",
        "knn",
        "--map",
        "mixtral-8x7b=cheap",
        "--map",
        "gpt-4-1106-preview=pricey",
        "--workers-file",
        catalog,
        "--router-dir",
        tmp_path / "r",
    )
    assert result.exit_code == 0, result.output
    artifact = load_current(tmp_path / "r")
    assert artifact.workers == ["cheap", "pricey"]
    assert set(artifact.tier_prior) == {"specialist", "frontier"}
    assert artifact.cascade is not None


@pytest.mark.parametrize(
    ("strategy", "source"),
    [("fast", "mixtral-8x7bb"), ("cascade", "mistralai/Mixtral-8x7B-Instruct-v0.1")],
)
def test_a_map_of_a_worker_the_data_lacks_is_refused(tmp_path, gsm8k, strategy, source):
    data = ROUTELLM if strategy == "fast" else gsm8k
    result = invoke(
        "router",
        "train",
        "--strategy",
        strategy,
        "--dataset",
        "routellm",
        "--data",
        data,
        "--model",
        "knn",
        "--map",
        f"{source}=mixtral-8x22b",
        "--router-dir",
        tmp_path / "r",
    )
    refused(result, 2, f"--map: the data has no worker '{source}' (its workers: {ROUTELLM_WORKERS})")
    assert no_versions(tmp_path / "r")


def test_two_workers_mapped_to_one_name_are_refused(tmp_path):
    result = invoke(
        "router",
        "train",
        "--dataset",
        "routellm",
        "--data",
        ROUTELLM,
        "--model",
        "logreg",
        "--map",
        "mixtral-8x7b=gpt-4.1",
        "--map",
        "gpt-4-1106-preview=gpt-4.1",
        "--router-dir",
        tmp_path / "r",
    )
    refused(result, 2, "--map gives mixtral-8x7b and gpt-4-1106-preview the one name 'gpt-4.1'")
    assert no_versions(tmp_path / "r")


# ---- 11: options the chosen source would ignore ----------------------------------------------------


@pytest.mark.parametrize(
    ("source", "extra", "message"),
    [
        (
            ("--dataset", "routellm", "--data", ROUTELLM),
            ("--train", FIXTURES / "gsm8k_small.csv"),
            "Invalid value for --train: applies only with --format FORMAT",
        ),
        (
            ("--dataset", "routellm", "--data", ROUTELLM),
            ("--weight-judge", "0"),
            "Invalid value for --weight-judge: applies only with --from-ledger",
        ),
        (
            ("--from-ledger",),
            ("--map", "cheap=deepseek-chat"),
            "Invalid value for --map: renames a dataset's workers; the ledger records the gateway's catalog names",
        ),
        (
            ("--from-ledger",),
            ("--data", ROUTELLM),
            "Invalid value for --data: applies only with --dataset routellm",
        ),
    ],
)
def test_an_option_the_source_would_ignore_is_refused(tmp_path, ledger_dir, source, extra, message):
    result = invoke(
        "router", "train", *source, *extra, "--data-dir", ledger_dir, "--router-dir", tmp_path / "r"
    )
    refused(result, 2, message)
    assert not (tmp_path / "r").exists()


# ---- 3 and 4: the catalog is the gateway's ---------------------------------------------------------


def test_a_missing_workers_file_is_refused_before_training(tmp_path, ledger_dir):
    result = train_ledger(ledger_dir, tmp_path / "r", "--workers-file", tmp_path / "no-such.yaml")
    refused(result, 2, f"{tmp_path / 'no-such.yaml'}: cannot read catalog")
    assert "training on" not in result.output
    assert not (tmp_path / "r").exists()


def test_train_reads_POLYROUTE_WORKERS_FILE(tmp_path, ledger_dir, catalog):
    """The chart's retrain CronJob names the operator's catalog only in POLYROUTE_WORKERS_FILE."""
    result = train_ledger(ledger_dir, tmp_path / "r", env={"POLYROUTE_WORKERS_FILE": str(catalog)})
    assert result.exit_code == 0, result.output
    assert set(load_current(tmp_path / "r").tier_prior) == {"specialist", "frontier"}


def test_a_broken_POLYROUTE_WORKERS_FILE_is_an_error(tmp_path, ledger_dir):
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nworkers: [{name: x}]\n")
    result = train_ledger(ledger_dir, tmp_path / "r", env={"POLYROUTE_WORKERS_FILE": str(broken)})
    refused(result, 2, "(from POLYROUTE_WORKERS_FILE)")
    assert str(broken) in result.output


@pytest.fixture
def candidate(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "router"
    trained = train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)
    return root, save_artifact(root, trained, activate=False).name


def test_eval_from_ledger_reads_POLYROUTE_WORKERS_FILE(tmp_path, candidate, catalog):
    """In a gateway pod (NOTES.txt's command) the catalog is only in the environment: the embedded one
    knows none of the logged workers, so every request was skipped."""
    root, version = candidate
    records, _ = logged_ledger(60, seed=5)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = eval_candidate(root, version, ledger, env={"POLYROUTE_WORKERS_FILE": str(catalog)})
    assert result.exit_code == 0, result.output
    assert "60 logged requests" in " ".join(result.output.split())


# ---- IPS (a): the --out report is strict JSON ------------------------------------------------------


def test_eval_out_is_strict_json_when_no_logged_choice_is_the_candidates(tmp_path, candidate, catalog):
    root, version = candidate
    records, _ = logged_ledger(60, seed=7)
    lines = []
    for r in records:  # every choice `mid`, no exploration: the candidate (cheap/pricey) never agrees
        if r["type"] == "request":
            route = dict(r["route"], chosen="mid", greedy="mid", propensity=1.0, epsilon=0.0, explore=[])
            r = dict(r, worker="mid", route=route)
        lines.append(json.dumps(r) + "\n")
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(lines))
    out = tmp_path / "report.json"
    result = eval_candidate(root, version, ledger, "--workers-file", catalog, "--out", out)
    assert result.exit_code == 0, result.output

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON (RFC 8259)")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["quality"]["snips"]["value"] is None


# ---- IPS (b): an unreachable Redis -----------------------------------------------------------------


def test_an_unreachable_redis_is_one_line_not_a_traceback(tmp_path, candidate, catalog):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    env = {"REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    root, version = candidate
    for args in (
        ("eval", "--from-ledger", "--candidate", version, "--router-dir", root, "--workers-file", catalog),
        ("train", "--from-ledger", "--router-dir", tmp_path / "r", "--no-activate"),
    ):
        result = invoke("router", *args, env=env)
        refused(result, 1, f"127.0.0.1:{port}")
        assert no_versions(tmp_path / "r")


# ---- 7: the router dir, checked before the fit -----------------------------------------------------


def test_a_router_dir_that_is_a_file_is_refused_before_training(tmp_path, ledger_dir):
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = train_ledger(ledger_dir, afile)
    refused(result, 1, f"router dir {afile} is unusable: {afile} is a file")
    assert "training on" not in result.output
    below = train_ledger(ledger_dir, afile / "router")
    refused(below, 1, f"{afile} is a file, so {afile / 'router'} cannot be created")


def test_a_damaged_current_json_is_said_before_training_and_replaced(tmp_path, ledger_dir):
    """It was a traceback after the fit (the new version on disk, not in force). Now it is said before
    the fit, and the new version in force replaces it, as `router activate` repairs it."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "current.json").write_text('{"version": "2026')  # torn
    result = train_ledger(ledger_dir, root)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    warned = text.index(f"{root / 'current.json'}: unreadable")
    assert "the new version replaces it" in text and warned < text.index("training on")
    [card] = list_versions(root)
    assert read_pointer(root) == {"version": card["version"], "previous": None}


def test_status_reports_a_damaged_current_json_after_the_versions(tmp_path, ledger_dir):
    root = tmp_path / "r"
    assert train_ledger(ledger_dir, root).exit_code == 0
    [card] = list_versions(root)
    (root / "current.json").write_text("not json")
    result = invoke("router", "status", "--router-dir", root)
    refused(result, 1, f"{root / 'current.json'}: unreadable")
    assert card["version"] in result.output  # what the operator needs to repair it


# ---- 12: progress and errors that name the worker --------------------------------------------------


@pytest.mark.parametrize(
    ("model", "stage"), [("ensemble", "fitting the ensemble"), ("mf", "fitting mf on all rows")]
)
def test_every_model_shows_its_fits(tmp_path, ledger_dir, model, stage):
    result = train_ledger(ledger_dir, tmp_path / "r", model=model)
    assert result.exit_code == 0, result.output
    assert stage in result.output and "fits" in result.output, result.output


def test_cascade_training_shows_its_fits_and_prior_folds(tmp_path, gsm8k):
    result = train_cascade(
        "--dataset",
        "routellm",
        "--data",
        gsm8k,
        "--router-dir",
        tmp_path / "r",
    )
    assert result.exit_code == 0, result.output
    # (the embedding bar shows only for texts not yet embedded in this process: not asserted here)
    for shown in ("fitting the ensemble (logreg, mf, knn) on all rows", "3/3 fits", "prior, fold 5/5"):
        assert shown in result.output, result.output


def test_a_worker_without_scores_is_named(tmp_path):
    workers = ("cheap", "mid", "big")
    path = tmp_path / "bench.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "sample_id",
                "prompt",
                "eval_name",
                *workers,
                *(f"{w}|total_cost" for w in workers),
                *(f"{w}|model_response" for w in workers),
            ]
        )
        for i in range(30):
            scores = ["" if w == "mid" else str(float((i + j) % 2)) for j, w in enumerate(workers)]
            writer.writerow(
                [
                    f"q{i}",
                    f"Question {i}: what is {i} plus {i}?",
                    "arith",
                    *scores,
                    "0.001",
                    "0.002",
                    "0.003",
                    *(str(2 * i) for _ in workers),
                ]
            )
    result = train_cascade(
        "--format",
        "routerbench",
        "--train",
        path,
        "--model",
        "knn",
        "--router-dir",
        tmp_path / "r",
    )
    refused(result, 1, "no labels for worker(s) ['mid']")
