"""Bad input to the offline router commands (`router eval`, `router train`, `router calibrate`): one clear
line and a non-zero exit, before any long work where the input allows it, and never a traceback.

Every input is a tiny file built here; every refusal comes before a model is fitted, so these are fast.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from gateway.ledger import FeedbackRecord, RequestRecord
from polyroute.cli import app

WORKERS = ("cheap", "mid", "big")
ROUTE = {
    "chosen": "cheap",
    "propensity": 1.0,
    "greedy": "cheap",
    "epsilon": 0.0,
    "explore": [],
    "pool": ["cheap", "mid"],
    "cost_weight": 0.0,
    "min_quality": None,
    "prompt_chars": 30,
    "max_output_tokens": None,
    "needs_tools": False,
}


def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})


def refused(result: Result, code: int, message: str) -> None:
    """Exit `code` with `message` (line wrapping ignored), and no traceback."""
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split()), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output


def routerbench(path: Path, first: int, count: int, blank: tuple[str, ...] = ()) -> Path:
    """A RouterBench CSV of `count` queries numbered from `first`; the `blank` workers' scores empty."""
    header = ["sample_id", "prompt", "eval_name", *WORKERS, *(f"{w}|total_cost" for w in WORKERS)]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for i in range(first, first + count):
            scores = ["" if w in blank else str(float((i + j) % 2)) for j, w in enumerate(WORKERS)]
            costs = [str(0.001 * (j + 1)) for j in range(len(WORKERS))]
            task = "arith" if i % 2 else "chat"
            writer.writerow([f"q{i}", f"Question number {i}: what is {i} plus {i}?", task, *scores, *costs])
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "train": routerbench(tmp_path / "train.csv", 0, 12),
        "test": routerbench(tmp_path / "test.csv", 100, 4),
    }


def eval_files(train: Path, test: Path, out: Path, *extra: object) -> Result:
    return invoke(
        "router", "eval", "--format", "routerbench", "--train", train, "--test", test, "--out", out, *extra
    )


# ---- 1: no training rows left -----------------------------------------------------------------------


def test_eval_without_training_rows_says_why(tmp_path, files):
    out = tmp_path / "r.json"
    header_only = routerbench(tmp_path / "header.csv", 0, 0)
    refused(eval_files(header_only, files["test"], out), 1, "the --train files hold no data rows")
    overlap = (
        "no training rows left: of the 4 rows of the --train files, 4 share a query with the --test files"
    )
    refused(eval_files(files["test"], files["test"], out), 1, overlap)
    onboard = eval_files(files["test"], files["test"], out, "--onboard", "big", "--probes", "5")
    refused(onboard, 1, overlap)  # the cause, not "big has only 0 labelled training queries"
    assert not out.exists()


def test_a_worker_without_training_scores_is_named(tmp_path, files):
    blank = routerbench(tmp_path / "blank.csv", 0, 12, blank=("mid",))
    refused(eval_files(blank, files["test"], tmp_path / "r.json"), 1, "no training scores for worker(s) mid")


# ---- 2 and 10: result paths checked before the run -------------------------------------------------


@pytest.mark.parametrize(
    ("out", "plot", "message"),
    [
        ("adir", None, "Invalid value for --out: {tmp}/adir is a directory"),
        ("afile/r.json", None, "Invalid value for --out: {tmp}/afile is a file"),
        ("r.json", "curves", "Invalid value for --plot: {tmp}/curves needs an image extension"),
        ("r.json", "curves.xyz", "Invalid value for --plot: {tmp}/curves.xyz needs an image extension"),
        ("r.json", "adir", "Invalid value for --plot: {tmp}/adir is a directory"),
    ],
)
def test_eval_checks_out_and_plot_before_running(tmp_path, files, out, plot, message):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    extra = () if plot is None else ("--plot", tmp_path / plot)
    refused(
        eval_files(files["train"], files["test"], tmp_path / out, *extra), 2, message.format(tmp=tmp_path)
    )
    assert not (tmp_path / "r.json").exists()


def test_ledger_eval_checks_out_and_refuses_plot(tmp_path):
    (tmp_path / "adir").mkdir()
    args = ("router", "eval", "--from-ledger", "--candidate", "v1", "--router-dir", tmp_path / "router")
    refused(invoke(*args, "--out", tmp_path / "adir"), 2, "is a directory")
    refused(
        invoke(*args, "--plot", tmp_path / "p.png"),
        2,
        "Invalid value for --plot: --from-ledger draws no curves",
    )


def test_routellm_eval_checks_its_default_plot_path(tmp_path):
    (tmp_path / "r.png").mkdir()  # the default plot beside --out r.json
    refused(
        invoke("router", "eval", "--data", tmp_path, "--out", tmp_path / "r.json"), 2, "r.png is a directory"
    )


# ---- 3: malformed ledger records -------------------------------------------------------------------


def request(rid: str, query: str, route: dict | None = None) -> dict:
    return asdict(RequestRecord(rid, "acme", "auto", "cheap", "fast", 200, query=query, route=route))


def feedback(rid: str, value: float) -> dict:
    return asdict(FeedbackRecord(rid, "acme", value, "cheap"))


def without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


def write_ledger(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({**feedback("r1", 0.5), "score": "abc"}, "feedback score 'abc' is not a number from 0 to 1"),
        ({**feedback("r1", 0.5), "score": None}, "feedback score None is not a number from 0 to 1"),
        (without(feedback("r1", 0.5), "request_id"), "feedback without a request_id"),
        (5, "not a ledger record"),
        (without(request("r2", "What is the capital of Peru?"), "id"), "request without an id"),
    ],
)
def test_train_from_ledger_names_a_malformed_record(tmp_path, bad, message):
    good = [request("r1", "What is the capital of France?"), feedback("r1", 1.0)]
    ledger = write_ledger(tmp_path / "ledger.jsonl", [*good, bad])
    result = invoke(
        "router", "train", "--from-ledger", "--data-dir", tmp_path, "--router-dir", tmp_path / "router"
    )
    refused(result, 1, f"{ledger}:3: {message}")
    assert not (tmp_path / "router").exists()


@pytest.mark.parametrize("field", ["propensity", "prompt_chars"])
def test_eval_from_ledger_names_a_malformed_route(tmp_path, field):
    routed = request("r1", "What is the capital of France?", without(ROUTE, field))
    ledger = write_ledger(tmp_path / "export.jsonl", [routed, feedback("r1", 1.0)])
    (tmp_path / "router" / "v1").mkdir(parents=True)
    args = ("--from-ledger", "--candidate", "v1", "--ledger", ledger, "--router-dir", tmp_path / "router")
    refused(invoke("router", "eval", *args), 1, f"{ledger}:1: route lacks {field}")


def test_a_torn_ledger_line_is_skipped_with_one_warning(tmp_path, caplog):
    write_ledger(tmp_path / "ledger.jsonl", ['{"type": "req'])
    with caplog.at_level(logging.WARNING, logger="polyroute.ledger"):
        result = invoke("router", "train", "--from-ledger", "--data-dir", tmp_path)
    refused(result, 1, "the ledger holds no request with both a stored query and a counted score")
    assert [r.getMessage() for r in caplog.records].count(
        f"ledger {tmp_path / 'ledger.jsonl'} line 1 is not JSON; skipped"
    ) == 1


# ---- 4: the candidate is a version name ------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "code", "message"),
    [
        ("nosuchversion", 1, "no router version 'nosuchversion' in {root} (see `polyroute router status`)"),
        ("", 2, "Invalid value for --candidate: '' is not a router version name"),
        ("../router", 2, "Invalid value for --candidate: '../router' is not a router version name"),
    ],
)
def test_eval_candidate_must_be_a_version_on_disk(tmp_path, candidate, code, message):
    root = tmp_path / "router"
    root.mkdir()
    ledger = write_ledger(tmp_path / "export.jsonl", [request("r1", "q"), feedback("r1", 1.0)])
    args = ("--from-ledger", "--candidate", candidate, "--ledger", ledger, "--router-dir", root)
    refused(invoke("router", "eval", *args), code, message.format(root=root))


# ---- 5 and 6: what `router train` cannot train from ------------------------------------------------


def test_train_cascade_from_the_ledger_is_refused(tmp_path):
    result = invoke("router", "train", "--from-ledger", "--strategy", "cascade", "--data-dir", tmp_path)
    refused(result, 2, "--strategy cascade needs the workers' recorded answers")
    assert "unknown dataset" not in result.output


@pytest.mark.parametrize("strategy", ["fast", "cascade"])
def test_train_refuses_llmrouter_files_up_front(tmp_path, strategy):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps([{"question": "q", "scores": {"a": 1.0}}]))
    args = ("router", "train", "--format", "llmrouter", "--train", scores, "--strategy", strategy)
    result = invoke(*args, "--router-dir", tmp_path / "router")
    refused(result, 2, "--format llmrouter cannot train a router")
    assert "--prices" not in result.output  # train has no such option


# ---- 7 and 8: --onboard's options ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--onboard", "big", "--plot", "p.png"), "Invalid value for --plot: --onboard draws no curves"),
        (
            ("--onboard", "big", "--strategy", "cascade"),
            "Invalid value for --strategy: --onboard evaluates the fast",
        ),
        (("--probes", "10"), "Invalid value for --probes: applies only with --onboard WORKER"),
        (
            ("--onboard-repeats", "2"),
            "Invalid value for --onboard-repeats: applies only with --onboard WORKER",
        ),
    ],
)
def test_eval_refuses_options_onboarding_would_ignore(tmp_path, files, extra, message):
    refused(eval_files(files["train"], files["test"], tmp_path / "r.json", *extra), 2, message)


def test_onboard_probes_are_bounded_by_the_training_queries(tmp_path, files):
    out = tmp_path / "r.json"
    every = eval_files(files["train"], files["test"], out, "--onboard", "big", "--probes", "12")
    refused(every, 1, "--probes 12: must be below 12, the number of training queries")
    more = eval_files(files["train"], files["test"], out, "--onboard", "big", "--probes", "13")
    refused(more, 1, "--probes 13: big has only 12 labelled training queries")
    overlapping = routerbench(tmp_path / "overlap.csv", 8, 4)  # 4 of the 12 training queries
    fewer = eval_files(files["train"], overlapping, out, "--onboard", "big", "--probes", "9")
    refused(fewer, 1, "big has only 8 labelled training queries (4 training rows were dropped as queries of")
    assert not out.exists()


# ---- 9: an empty RouteLLM folder -------------------------------------------------------------------


def test_an_empty_routellm_folder_is_one_line(tmp_path):
    empty = tmp_path / "routellm"
    empty.mkdir()
    message = f"no mmlu_<subject>.csv files in {empty}/mmlu/responses"
    refused(invoke("router", "eval", "--data", empty, "--out", tmp_path / "r.json"), 1, message)
    refused(
        invoke("router", "train", "--dataset", "routellm", "--data", empty, "--router-dir", tmp_path),
        1,
        message,
    )


# ---- cosmetic: --max-cost-usd ----------------------------------------------------------------------


def test_calibrate_says_the_cost_cap_must_be_finite(tmp_path):
    result = invoke("router", "calibrate", "--max-cost-usd", "inf", "--data-dir", tmp_path)
    refused(result, 2, "--max-cost-usd must be a finite number of dollars, got inf")
