"""Reading the ledger for `router train/eval --from-ledger`, and what `router eval` reports from it.

- the ledger is streamed and only what training and the replay read is kept (a ledger can be far
  larger than memory), every record still checked, naming its line, before any work;
- a gateway's ledger.jsonl after a crash (a torn line mid-file) is read with `--ledger FILE` as the
  data dir's reader reads it, while a file that is no ledger is still refused;
- a log that says nothing about the candidate gives "no estimate", not IPS's certain-looking 0 ± 0;
- a Parquet `ledger export` is a ledger too;
- the Helm guide covers the router store and the retrain CronJob of values.yaml.

Real files and the real CLI throughout; the ledgers come from tests/test_ips.py's logged_ledger.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from statistics import median

import pytest
import yaml
from typer.testing import CliRunner, Result

from gateway.ledger import FeedbackRecord, Ledger, training_rows
from gateway.ledger_export import located_file_records, located_ledger_records
from polyroute.cli import _ledger_rows, app
from router import save_artifact, train_artifact
from tests.conftest import catalog_yaml_for
from tests.test_ips import logged_ledger
from tests.test_router_learned import synthetic

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = {"calibration": 1.0, "judge": 0.5, "user": 1.0}


def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})


def write(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


@pytest.fixture(scope="module")
def candidate(tmp_path_factory) -> tuple[Path, str, Path]:
    """(router dir, a version in it not in force, a catalog file)."""
    tmp = tmp_path_factory.mktemp("candidate")
    trained = train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)
    version = save_artifact(tmp / "router", trained, activate=False).name
    catalog = tmp / "workers.yaml"
    catalog.write_text(catalog_yaml_for("http://127.0.0.1:9"))
    return tmp / "router", version, catalog


def evaluate(candidate, *args: object) -> Result:
    root, version, catalog = candidate
    common = ("--router-dir", root, "--workers-file", catalog)
    return invoke("router", "eval", "--from-ledger", "--candidate", version, *common, *args)


def unscored(n: int, route: dict) -> list[dict]:
    """Routed requests nobody scored: they make no row, only `router train`'s output-token medians."""
    return [
        {
            "type": "request",
            "id": f"req_u{i}",
            "tenant": "acme",
            "model": "auto",
            "worker": "cheap" if i % 3 else "mid",
            "strategy": "fast",
            "status": 200,
            "completion_tokens": 10 + i % 7,
            "cost_micros": 5,
            "data_class": "public",
            "query": f"Say hello to my friend number {i} in a warm and friendly tone.",
            "turns": 1,
            "route": route,
            "at": 1.0,
        }
        for i in range(n)
    ]


# ---- A: streamed, and only what is used is kept ----------------------------------------------------


def test_a_ledger_file_is_read_line_by_line_not_whole(tmp_path):
    """Both readers yield a record before reading the file to its end: a line appended after the first
    record was handed out is still read (a reader that read the whole file first would miss it)."""
    records, _ = logged_ledger(2, seed=1)
    data = tmp_path / "data"
    data.mkdir()
    for path, reader in (
        (tmp_path / "export.jsonl", lambda p: located_file_records(p)),
        (data / "ledger.jsonl", lambda p: located_ledger_records(p.parent, None)),
    ):
        write(path, records[:2])
        located = reader(path)
        first = next(located)
        assert first == (f"{path}:1", records[0])
        with open(path, "a") as fh:
            fh.write(json.dumps(records[2]) + "\n")
        assert [where for where, _ in located] == [f"{path}:2", f"{path}:3"]


def test_ledger_rows_keep_only_what_training_and_the_replay_read(tmp_path):
    """The rows are those of the whole ledger and the output-token medians `router train` takes are the
    same, but no unscored request's query or route record is held."""
    scored, _ = logged_ledger(30, seed=2)
    extra = unscored(500, scored[0]["route"])
    everything = [*scored[:20], *extra, *scored[20:]]
    ledger = write(tmp_path / "ledger.jsonl", everything)

    records, rows, source = _ledger_rows(ledger, None, WEIGHTS, replay=True)

    assert source == str(ledger)
    assert rows == training_rows(iter(everything), WEIGHTS)
    held = {r.get("query") for r in records if r["type"] == "request"}
    assert not held & {r["query"] for r in extra}
    assert sum(1 for r in records if r.get("route")) == 30  # the scored requests' only

    def medians(records: list[dict]) -> dict[str, float]:
        tokens: dict[str, list] = {}
        for r in records:
            if r["type"] == "request" and r.get("status") == 200 and r.get("completion_tokens") is not None:
                tokens.setdefault(r["worker"], []).append(r["completion_tokens"])
        return {worker: median(values) for worker, values in tokens.items()}

    assert medians(records) == medians(everything)
    token_only = [r for r in records if r["type"] == "request" and r.get("query") is None]
    assert len(token_only) == 500 and len({id(r) for r in token_only}) == 2 * 7  # one per (worker, tokens)


def test_a_bad_record_at_the_end_of_a_long_ledger_stops_before_the_replay(tmp_path, candidate):
    scored, _ = logged_ledger(20, seed=3)
    bad = {**scored[1], "score": "high"}
    ledger = write(tmp_path / "ledger.jsonl", [*scored, *unscored(300, scored[0]["route"]), bad])
    result = evaluate(candidate, "--ledger", ledger)
    assert result.exit_code == 1, result.output
    assert f"{ledger}:{len(scored) + 301}: feedback score 'high'" in " ".join(result.output.split())


# ---- B: a gateway's ledger after a crash, with --ledger FILE ---------------------------------------


def test_a_gateway_ledger_after_a_crash_is_read_with_the_ledger_option(tmp_path, candidate, caplog):
    """The gateway ends a torn last line before appending (Ledger._append), so after a crash and a
    restart the torn line sits mid-file. It is skipped with one warning naming its line."""
    records, _ = logged_ledger(60, seed=4)
    path = write(tmp_path / "ledger.jsonl", records, tail='{"type":"request","id":"req_torn","ten')
    ledger = Ledger(path)  # the gateway restarting after the crash
    ledger.record_feedback(FeedbackRecord("req_1", "acme", 1.0, "cheap", source="user"))
    ledger.close()
    torn = len(records) + 1
    caplog.clear()  # the restart's own warning
    with caplog.at_level(logging.WARNING, logger="polyroute.ledger"):
        result = evaluate(candidate, "--ledger", path)
    assert result.exit_code == 0, result.output
    assert "60 logged requests" in " ".join(result.output.split())
    warned = [r.getMessage() for r in caplog.records]
    assert warned.count(f"ledger {path} line {torn} is not JSON; skipped") == 1, warned


def test_a_torn_first_line_is_skipped_but_a_file_that_is_no_ledger_is_refused(tmp_path, candidate):
    records, _ = logged_ledger(10, seed=5)
    torn_first = tmp_path / "torn-first.jsonl"
    torn_first.write_text(
        '{"type":"request","id":"req_x","te\n' + "".join(json.dumps(r) + "\n" for r in records)
    )
    assert len(list(located_file_records(torn_first))) == len(records)

    csv = tmp_path / "ledger.csv"
    csv.write_text("type,id,query\n" + "".join(json.dumps(r) + "\n" for r in records))
    result = evaluate(candidate, "--ledger", csv)
    assert result.exit_code == 1 and f"{csv}:1: not a JSON ledger record" in result.output, result.output
    binary = tmp_path / "ledger.bin"
    binary.write_bytes(b"\x89\xff\x00garbage\n" + json.dumps(records[0]).encode() + b"\n")
    result = evaluate(candidate, "--ledger", binary)
    assert result.exit_code == 1 and f"{binary}:1: not a JSON ledger record" in result.output, result.output


# ---- C: no overlap, no estimate --------------------------------------------------------------------


def test_a_log_without_the_candidate_s_choices_gives_no_estimate(tmp_path, candidate):
    """Every logged choice is `mid` with probability 1 (no exploration); the candidate picks cheap or
    pricey: IPS must not claim 0 ± 0, and the JSON report must stay JSON (no bare NaN)."""
    records, _ = logged_ledger(60, seed=7)
    pinned = [
        dict(
            r,
            worker="mid",
            route=dict(r["route"], chosen="mid", greedy="mid", propensity=1.0, epsilon=0.0, explore=[]),
        )
        if r["type"] == "request"
        else r
        for r in records
    ]
    out = tmp_path / "report.json"
    result = evaluate(candidate, "--ledger", write(tmp_path / "ledger.jsonl", pinned), "--out", out)
    assert result.exit_code == 0, result.output

    def strict(token: str):
        raise ValueError(f"{token} is not JSON")

    report = json.loads(out.read_text(), parse_constant=strict)
    assert report["agreement"] == 0.0
    for measure in ("quality", "cost_usd"):
        for estimator in ("ips", "snips"):
            estimate = report[measure][estimator]
            assert estimate["value"] is None and estimate["low"] is None and estimate["high"] is None
            assert estimate["n"] == 60
        assert report[measure]["logging_policy"]["value"] is not None
    ips_line = next(line for line in result.output.splitlines() if "candidate (IPS)" in line)
    assert ips_line.count("no estimate") == 2, result.output


# ---- D: a Parquet export -----------------------------------------------------------------------------


def test_a_parquet_export_is_read_like_the_ledger_it_came_from(tmp_path, candidate):
    records, _ = logged_ledger(80, seed=8)
    data = tmp_path / "data"
    data.mkdir()
    jsonl = write(data / "ledger.jsonl", records)
    parquet = tmp_path / "export.parquet"
    exported = invoke("ledger", "export", "--format", "parquet", "--out", parquet, "--data-dir", data)
    assert exported.exit_code == 0, exported.output

    read = list(located_file_records(parquet))
    assert [where for where, _ in read][:2] == [f"{parquet} row 1", f"{parquet} row 2"]
    for (_, back), original in zip(read, records, strict=True):
        assert back.pop("at") == pytest.approx(original["at"], abs=1e-3)  # Parquet keeps milliseconds
        assert back == {k: v for k, v in original.items() if v is not None and k != "at"}

    reports = []
    for ledger in (jsonl, parquet):
        out = tmp_path / f"{ledger.name}.json"
        result = evaluate(candidate, "--ledger", ledger, "--out", out)
        assert result.exit_code == 0, result.output
        reports.append({k: v for k, v in json.loads(out.read_text()).items() if k != "ledger"})
    assert reports[0] == reports[1]


# ---- E: the Helm guide -------------------------------------------------------------------------------


def test_the_helm_guide_covers_the_router_store_and_the_retrain_cronjob():
    guide = (ROOT / "docs" / "helm.md").read_text()
    values = yaml.safe_load((ROOT / "helm" / "polyroute" / "values.yaml").read_text())
    for key in ("existingClaim", "mountPath"):
        assert f"routerStore.{key}" in guide
    assert values["routerStore"]["mountPath"] in guide
    for key in ("enabled", "schedule", "activate", "weights", "extraArgs"):
        assert f"retrain.{key}" in guide
    assert f'"{values["retrain"]["schedule"]}"' in guide
    assert "router train --from-ledger" in guide and "router activate" in guide
