"""Training from the ledger with per-source weights: users' feedback, the judge and calibration probes,
joined to their requests and averaged per (query, worker) by weight; old ledgers still read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest

from gateway.ledger import FeedbackRecord, RequestRecord, training_rows
from router import read_pointer
from router.offline.ledger import ledger_dataset


def request(rid: str, query: str, worker: str = "cheap") -> dict:
    return asdict(RequestRecord(rid, "acme", "auto", worker, "fast", 200, query=query, data_class="public"))


def score(rid: str, value: float, source: str = "user", worker: str = "cheap") -> dict:
    return asdict(FeedbackRecord(rid, "acme", value, worker, source=source))


def test_sources_are_weighed_per_request():
    records = [
        request("r1", "what is GCRA?"),
        score("r1", 0.0, "user"),
        score("r1", 1.0, "user"),  # the user changed their mind: the latest of a source counts
        score("r1", 0.0, "judge"),
        score("r1", 0.5, "calibration"),
    ]
    weights = {"user": 1.0, "judge": 0.5, "calibration": 0.5}
    [row] = training_rows(iter(records), weights)
    assert row["score"] == pytest.approx((1.0 * 1.0 + 0.5 * 0.0 + 0.5 * 0.5) / 2.0)
    assert row["weight"] == pytest.approx(2.0) and row["sources"] == {
        "user": 1.0,
        "judge": 0.0,
        "calibration": 0.5,
    }
    [unweighted] = training_rows(iter(records))  # no weights: every source once
    assert unweighted["score"] == pytest.approx(0.5) and unweighted["weight"] == 3
    [no_judge] = training_rows(iter(records), {**weights, "judge": 0.0})
    assert no_judge["sources"] == {"user": 1.0, "calibration": 0.5}
    assert training_rows(iter(records), {"user": 0.0, "judge": 0.0, "calibration": 0.0}) == []


def test_old_ledgers_without_a_source_are_user_feedback_and_unknown_sources_are_left_out():
    old = {
        "request_id": "r1",
        "tenant": "acme",
        "score": 0.25,
        "worker": "cheap",
        "at": 1.0,
        "type": "feedback",
    }
    records = [request("r1", "q1"), old, request("r2", "q2"), score("r2", 1.0, "crowd")]
    rows = training_rows(iter(records), {"user": 1.0, "judge": 0.5, "calibration": 1.0})
    assert [(r["id"], r["score"], r["sources"]) for r in rows] == [("r1", 0.25, {"user": 0.25})]


def test_bad_weights_are_refused():
    for weights in ({"user": -1.0}, {"judge": float("nan")}, {"judge": float("inf")}):
        with pytest.raises(ValueError, match="finite and >= 0"):
            training_rows(iter([]), weights)


def test_a_cell_is_the_weighted_mean_of_its_rows():
    rows = [
        {"query": "q", "worker": "cheap", "score": 1.0, "weight": 1.0},
        {"query": "q", "worker": "cheap", "score": 0.0, "weight": 0.5},  # the same question, asked again
        {"query": "q", "worker": "mid", "score": 0.2},  # rows without a weight count once
        {"query": "other", "worker": "mid", "score": 0.6, "weight": 2.0},
    ]
    ds = ledger_dataset(rows)
    assert ds.workers == ["cheap", "mid"] and ds.texts == ["q", "other"]
    assert ds.labels[0, 0] == pytest.approx(1.0 / 1.5) and ds.labels[0, 1] == pytest.approx(0.2)
    assert np.isnan(ds.labels[1, 0]) and ds.labels[1, 1] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="no request with both a stored query and a counted score"):
        ledger_dataset([])


def train(data_dir, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", "router", "train", "--from-ledger", "--model", "logreg"]
        + ["--data-dir", str(data_dir), "--no-activate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_router_train_from_ledger_weighs_the_sources(tmp_path):
    """cheap is scored by users, mid only by the judge: weighting the judge 0 trains without mid."""
    records = []
    for i in range(40):
        records += [
            request(f"u{i}", f"Summarise meeting note {i} in one line."),
            score(f"u{i}", float(i % 2)),
        ]
        records += [
            request(f"j{i}", f"Translate phrase {i} to German.", "mid"),
            score(f"j{i}", float(i % 3 == 0), "judge", "mid"),
        ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    both = train(tmp_path)
    assert both.returncode == 0, both.stderr
    # every fitting stage shows a bar with its fits counted (issue 15: long jobs say how far they are)
    assert "scoring logreg out of fold" in both.stdout and "fitting logreg on all rows" in both.stdout
    assert "2/2 fits" in both.stdout
    root = tmp_path / "router"
    assert read_pointer(root) == {}  # --no-activate: a candidate, not in force
    [first] = [json.loads(p.read_text()) for p in root.glob("*/card.json")]
    assert first["observed"] == {"cheap": 40, "mid": 40}
    assert first["data"]["weights"] == {"calibration": 1.0, "judge": 0.5, "user": 1.0}
    assert first["data"]["scored_requests_by_source"] == {"user": 40, "judge": 40}

    users_only = train(tmp_path, "--weight-judge", "0")
    assert users_only.returncode == 0, users_only.stderr
    cards = [json.loads(p.read_text()) for p in root.glob("*/card.json")]
    [second] = [c for c in cards if c["version"] != first["version"]]
    assert second["observed"] == {"cheap": 40} and second["data"]["scored_requests_by_source"] == {"user": 40}

    nothing = train(tmp_path, "--weight-judge", "0", "--weight-feedback", "0", "--weight-calibration", "0")
    assert nothing.returncode == 2 and "not all 0" in nothing.stderr
    negative = train(tmp_path, "--weight-judge", "-1")
    assert negative.returncode == 2 and "--weight-judge" in negative.stderr
