"""`polyroute router calibrate` killed outright (SIGKILL) while a paid call is in flight: the call is not
lost to the books.

Ctrl-C and SIGTERM record each call in flight as stopped (status 499); SIGKILL gives the process no
chance to. A provider may still bill such a call, and a rerun did not know of it, so its cap could be
passed. Now the run writes an intent record (type "intent") for each paid call before sending it,
closed by the call's outcome record; a rerun books an open one as stopped (499) at its hold, counts
it against its cap, and says so in one line.

Real processes and real signals against the test upstream (which holds the call in flight), the
ledger read back from disk; waits are on conditions with generous deadlines, never on a clock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import pytest

from polyroute.calibrate import graded_pairs
from tests.conftest import backend_redis_url, catalog_yaml_for
from tests.test_calibrate import PROBES, RIGHT, ROOT, calibrate_command
from tests.test_calibrate import calibrate as run_calibrate

DEADLINE_S = 120.0  # for what a loaded 2-core machine does in a few seconds
INTENT, IN_FLIGHT = "intent", 102  # polyroute.calibrate's, spelt out: the record format is the contract


def lost_calls(records: list[dict]):
    from polyroute.calibrate import lost_calls

    return lost_calls(records)


@pytest.fixture(params=["file", "redis"])
def setup(request: pytest.FixtureRequest, tmp_path: Path, upstream) -> dict:
    """A data dir and the test upstream's catalog, one choice probe ([p1]); the ledger in the data
    dir's file, or in a real redis-server (REDIS_URL, as a scaled-out gateway's)."""
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(catalog_yaml_for(upstream.url))
    probe_file = tmp_path / "probes.jsonl"
    probe_file.write_text("".join(json.dumps(p) + "\n" for p in PROBES[:1]))
    url = backend_redis_url(request)
    env = {"REDIS_URL": url} if url else {}
    return {"data_dir": tmp_path / "data", "workers_file": workers_file, "probe_file": probe_file, "env": env}


def ledger(setup: dict) -> list[dict]:
    """The ledger the runs wrote, as a gateway with their settings reads it (file or Redis)."""
    from gateway.ledger_export import ledger_records

    try:
        return list(ledger_records(setup["data_dir"], setup["env"].get("REDIS_URL")))
    except FileNotFoundError:
        return []


def calibrate(setup: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return run_calibrate(setup, *args, env=setup["env"])


def said(done: subprocess.CompletedProcess[str]) -> str:
    return " ".join(done.stderr.split())


def signal_while_in_flight(setup: dict, upstream, signum: signal.Signals) -> int:
    """Start a run of one probe on cheap, whose upstream holds the call; send the run `signum` once
    the call is in flight, and return its exit code once it has ended."""
    upstream.behave("cheap-model", replies=RIGHT, text="?", latency_s=600)
    command, environment = calibrate_command(setup, "--workers", "cheap", "--probes", "1", env=setup["env"])
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not upstream.requests_for("cheap-model"):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run sent no call"
            time.sleep(0.05)
        proc.send_signal(signum)
        proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode


def kill_while_in_flight(setup: dict, upstream) -> dict:
    """SIGKILL a run once its call is in flight (no handler runs, nothing more is written). Returns
    the intent the run left."""
    assert signal_while_in_flight(setup, upstream, signal.SIGKILL) == -9
    records = ledger(setup)
    assert [r["type"] for r in records] == [INTENT]  # written before the call was sent; nothing after
    (intent,) = records
    assert intent["status"] == IN_FLIGHT and intent["model"] == "cheap" and intent["worker"] is None
    assert intent["trace"]["calibration"]["probe"] == PROBES[0]["id"]
    assert intent["trace"]["calibration"]["in_flight"]["hold_micros"] > 0
    return intent


def test_a_rerun_books_a_call_a_killed_run_left_in_flight_and_counts_it_against_its_cap(setup, upstream):
    intent = kill_while_in_flight(setup, upstream)
    hold_micros = intent["trace"]["calibration"]["in_flight"]["hold_micros"]
    upstream.requests.clear()
    upstream.behave("cheap-model", replies=RIGHT, text="?")

    # the cap is the lost call's hold: booked and counted, it leaves no room for the probe's call,
    # which alone would fit (it is held at the same prediction). A rerun that did not count the lost
    # call sent it, and with the lost one the two could pass the cap.
    cap = str(Decimal(hold_micros) / 1_000_000)
    done = calibrate(setup, "--workers", "cheap", "--probes", "1", "--max-cost-usd", cap)
    assert done.returncode == 0, done.stderr
    assert (
        "1 call to cheap was in flight when an earlier run was killed (no outcome in the ledger; the "
        "provider may bill it): booked as stopped (status 499) at its hold" in said(done)
    )
    assert "stopped at the cost cap" in said(done)
    assert not upstream.requests_for("cheap-model")  # nothing sent: the cap counted the lost call
    records = ledger(setup)
    booked = [r for r in records if r["type"] == "request" and r["id"] == intent["id"]]
    assert len(booked) == 1
    (stopped,) = booked
    assert stopped["status"] == 499 and stopped["worker"] is None and stopped["model"] == "cheap"
    assert stopped["cost_micros"] == hold_micros  # at its hold, the most it may cost
    assert stopped["fallbacks"] == ["cheap"] and stopped["strategy"] == "calibration"
    assert stopped["trace"]["calibration"]["probe"] == PROBES[0]["id"]
    assert "lost in flight" in stopped["trace"]["calibration"]["error"]
    assert "in_flight" not in stopped["trace"]["calibration"]
    assert lost_calls(records) == []  # closed: no later run books it again

    # a rerun with room: the probe is asked again and graded; the lost call is not booked twice
    again = calibrate(setup, "--workers", "cheap", "--probes", "1", "--max-cost-usd", "1")
    assert again.returncode == 0, again.stderr
    assert "earlier run was killed" not in said(again)
    records = ledger(setup)
    assert [r["status"] for r in records if r["type"] == "request" and r["id"] == intent["id"]] == [499]
    assert {pair: g.score for pair, g in graded_pairs(records).items()} == {("cheap", PROBES[0]["id"]): 1.0}
    # every paid call of the reruns has its intent, each closed by its outcome
    intents = [r for r in records if r["type"] == INTENT]
    closed = {r["id"] for r in records if r["type"] == "request"}
    assert len(intents) == 2 and all(r["id"] in closed for r in intents)


def test_the_dry_run_says_so_and_books_nothing(setup, upstream):
    intent = kill_while_in_flight(setup, upstream)
    done = calibrate(setup, "--workers", "cheap", "--probes", "1", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "was in flight when an earlier run was killed" in said(done)
    assert "a real run books them" in said(done)
    assert ledger(setup) == [intent]  # a dry run writes nothing


def test_ctrl_c_closes_the_intent_of_the_call_it_records_as_stopped(setup, upstream):
    """Ctrl-C (and SIGTERM) record the call in flight as stopped themselves: its intent is closed by
    that record, and a rerun books nothing more."""
    assert signal_while_in_flight(setup, upstream, signal.SIGINT) == 130
    records = ledger(setup)
    assert [(r["type"], r["status"]) for r in records] == [(INTENT, IN_FLIGHT), ("request", 499)]
    assert records[0]["id"] == records[1]["id"] and lost_calls(records) == []


def test_an_intent_of_a_run_still_going_is_not_lost():
    """Two runs on one ledger: the other run's open intent is in flight, not lost, while its process
    runs on this host; once it has ended, or when it ran on another host (which cannot be asked), the
    intent counts as lost."""
    import os
    import socket

    def intent(pid: int, host: str) -> dict:
        return {
            "type": INTENT,
            "id": f"cal_{pid}_{host}",
            "tenant": "calibration",
            "strategy": "calibration",
            "model": "cheap",
            "status": IN_FLIGHT,
            "trace": {"calibration": {"in_flight": {"hold_micros": 7, "pid": pid, "host": host}}},
        }

    here = socket.gethostname()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        running = intent(sleeper.pid, here)
        assert lost_calls([running]) == []
        elsewhere = intent(sleeper.pid, here + "-elsewhere")
        assert [c.record["id"] for c in lost_calls([elsewhere])] == [elsewhere["id"]]
    finally:
        sleeper.kill()
        sleeper.wait()
    (lost,) = lost_calls([running])
    assert lost.hold == Decimal("0.000007") and lost.worker == "cheap"
    assert os.getpid() != sleeper.pid


def test_the_ledgers_readers_skip_intent_records():
    """The readers calibration and training share skip an intent: it is no grade, no training row,
    and an intent closed by its outcome is no lost call."""
    from gateway.ledger import training_rows

    intent = {
        "type": INTENT,
        "id": "cal_1",
        "tenant": "calibration",
        "model": "cheap",
        "worker": None,
        "strategy": "calibration",
        "status": IN_FLIGHT,
        "query": "Which planet is the largest?",
        "trace": {"calibration": {"probe": "p1", "in_flight": {"hold_micros": 9, "pid": -1, "host": "-"}}},
    }
    answered = {
        **intent,
        "type": "request",
        "worker": "cheap",
        "status": 200,
        "trace": {"calibration": {"probe": "p1"}},
    }
    scored = {
        "type": "feedback",
        "request_id": "cal_1",
        "tenant": "calibration",
        "score": 1.0,
        "worker": "cheap",
        "source": "calibration",
    }
    records = [intent, answered, scored]
    assert {pair: g.score for pair, g in graded_pairs(records).items()} == {("cheap", "p1"): 1.0}
    assert [row["worker"] for row in training_rows(iter(records), {"calibration": 1.0})] == ["cheap"]
    assert lost_calls(records) == [] and [c.hold for c in lost_calls([intent])] == [Decimal("0.000009")]


def test_router_training_from_the_ledger_accepts_a_ledger_with_intent_records(tmp_path):
    from gateway.ledger import record_problem
    from gateway.ledger_export import located_file_records

    path = tmp_path / "ledger.jsonl"
    intent = {"type": INTENT, "id": "cal_1", "tenant": "calibration", "model": "cheap", "status": IN_FLIGHT}
    path.write_text(json.dumps(intent) + "\n")
    assert record_problem(intent) is None
    assert [record for _, record in located_file_records(path)] == [intent]
