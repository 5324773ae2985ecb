"""`polyroute ledger export`: JSONL and Parquet, from the file ledger and from Redis."""

from __future__ import annotations

import json
import os
import time

import pyarrow.parquet as pq

from gateway.ledger import FeedbackRecord, Ledger, RequestRecord
from gateway.ledger_export import located_file_records
from gateway.store.health import Breaker
from gateway.store.ledger_redis import RedisLedger
from tests.test_cli import polyroute, run_cli


def _records() -> list:
    old = time.time() - 10 * 86400
    return [
        RequestRecord(
            id="req_old", tenant="acme", model="auto", worker="cheap", strategy="cheapest", status=200, at=old
        ),
        RequestRecord(
            id="req_1",
            tenant="acme",
            model="auto",
            worker="mid",
            strategy="learned",
            status=200,
            prompt_tokens=12,
            completion_tokens=30,
            cost_micros=77,
            latency_ms=12.5,
            policy_version="v3",
            router_version="r7",
            data_class="internal",
            fallbacks=("cheap",),
            query="what is GCRA?",
        ),
        FeedbackRecord("req_1", "acme", 0.75, "mid"),
    ]


def test_file_ledger_to_jsonl_and_parquet(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for record in _records():
        (ledger.record_feedback if isinstance(record, FeedbackRecord) else ledger.record_request)(record)
    ledger.close()

    jsonl = polyroute("ledger", "export", "--type", "request", data_dir=tmp_path)
    assert jsonl.returncode == 0, jsonl.stderr
    rows = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert [r["id"] for r in rows] == ["req_old", "req_1"] and "exported 2 records" in jsonl.stderr

    out = tmp_path / "ledger.parquet"
    parquet = polyroute(
        "ledger", "export", "--out", str(out), "--since", time.strftime("%Y-%m-%d"), data_dir=tmp_path
    )
    assert parquet.returncode == 0, parquet.stderr
    table = pq.read_table(out).to_pylist()
    assert [r["type"] for r in table] == ["request", "feedback"]  # the old request is before --since
    request, feedback = table
    assert (
        request["fallbacks"] == ["cheap"]
        and request["cost_micros"] == 77
        and request["query"] == "what is GCRA?"
    )
    assert request["score"] is None and feedback["score"] == 0.75 and feedback["request_id"] == "req_1"
    assert not list(tmp_path.glob("*.partial"))


def test_export_errors_are_clear(tmp_path):
    missing = polyroute("ledger", "export", data_dir=tmp_path)
    assert missing.returncode == 1 and "no ledger at" in missing.stderr
    bad = polyroute("ledger", "export", "--format", "csv", data_dir=tmp_path)
    assert bad.returncode == 2 and "jsonl or parquet" in bad.stderr
    no_file = polyroute("ledger", "export", "--format", "parquet", data_dir=tmp_path)
    assert no_file.returncode == 2 and "--out" in no_file.stderr


def test_redis_ledger_export(redis_server, tmp_path):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    ledger = RedisLedger(client, Breaker("Redis"), tmp_path / "unsent.jsonl")
    for record in _records():
        (ledger.record_feedback if isinstance(record, FeedbackRecord) else ledger.record_request)(record)
    assert ledger.flush() == 3
    env = {**os.environ, "REDIS_URL": redis_server.url}
    exported = run_cli("ledger", "export", "--type", "feedback", "--data-dir", str(tmp_path), env=env)
    assert exported.returncode == 0, exported.stderr
    assert [json.loads(line)["request_id"] for line in exported.stdout.splitlines()] == ["req_1"]
    down = run_cli(
        "ledger",
        "export",
        "--data-dir",
        str(tmp_path),
        env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert down.returncode == 1 and "cannot read the ledger from Redis" in down.stderr


def test_keys_create_with_limits(tmp_path):
    created = polyroute(
        "keys", "create", "--tenant", "acme", "--rpm", "60", "--tpm", "1000", "-q", data_dir=tmp_path
    )
    assert created.returncode == 0, created.stderr
    rows = [
        json.loads(line)
        for line in polyroute("keys", "list", "--json", data_dir=tmp_path).stdout.splitlines()
    ]
    assert rows[0]["rpm"] == 60 and rows[0]["tpm"] == 1000
    refused = polyroute("keys", "create", "--rpm", "0", data_dir=tmp_path)
    assert refused.returncode == 2


def test_the_gateway_opens_a_ledger_whose_old_lines_it_cannot_index(tmp_path, caplog):
    """A hand-edited ledger (a bare number, a request without an id, another tool's record) must not
    stop the gateway from starting: those lines are skipped with a warning, the good ones indexed."""
    import logging

    path = tmp_path / "ledger.jsonl"
    good = {"type": "request", "id": "req_ok", "tenant": "acme", "worker": "cheap"}
    lines = [
        "5",
        json.dumps({"type": "request", "tenant": "acme"}),
        json.dumps({"type": "note"}),
        json.dumps(good),
    ]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="polyroute.ledger"):
        ledger = Ledger(path)
    try:
        assert ledger.lookup("req_ok") == ("acme", "cheap")
        assert ledger.lookup("req_missing") is None
    finally:
        ledger.close()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "line 1 is not a request or feedback record" in warned
    assert "line 2: a request without an id or tenant" in warned
    assert "line 3 is not a request or feedback record" in warned


def test_a_record_written_after_a_torn_line_is_kept(tmp_path):
    """A crash (or a full disk) left the last line half written: the next record starts on a line of
    its own instead of being glued to it, where both were skipped as not JSON."""
    path = tmp_path / "ledger.jsonl"
    whole = json.dumps({"type": "request", "id": "req_old", "tenant": "acme", "worker": "cheap"})
    path.write_text(whole + "\n" + whole[:40])
    ledger = Ledger(path)
    ledger.record_request(RequestRecord("req_new", "acme", "auto", "cheap", "fast", 200, query="hi"))
    ledger.record_feedback(FeedbackRecord("req_new", "acme", 1.0, "cheap", source="calibration"))
    ledger.close()
    reopened = Ledger(path)
    try:
        kept = [(r["type"], r.get("id") or r.get("request_id")) for r in reopened.records()]
        assert kept == [("request", "req_old"), ("request", "req_new"), ("feedback", "req_new")]
        assert reopened.lookup("req_new") == ("acme", "cheap")
    finally:
        reopened.close()


def test_a_write_cut_inside_a_character_does_not_keep_the_gateway_from_starting(tmp_path):
    """The gateway writes non-ASCII queries as UTF-8; a crash or a full disk can cut a write inside a
    character. The next start reads the ledger again: the torn line is skipped as any other, where the
    text reader raised UnicodeDecodeError from the constructor and no gateway could start on the file.
    `router train --ledger` reads the same lines by the same reader."""
    path = tmp_path / "ledger.jsonl"
    record = {"type": "request", "id": "req_old", "tenant": "acme", "worker": "cheap", "query": "数学の問題"}
    whole = json.dumps(record, ensure_ascii=False).encode()
    cut = whole.index("問".encode()) + 1  # one byte of a three-byte character
    path.write_bytes(whole + b"\n" + whole[:cut])
    ledger = Ledger(path)
    ledger.record_request(RequestRecord("req_new", "acme", "auto", "cheap", "fast", 200, query="数学"))
    ledger.close()
    reopened = Ledger(path)
    try:
        assert [r["id"] for r in reopened.records()] == ["req_old", "req_new"]
        assert reopened.lookup("req_old") == ("acme", "cheap")
    finally:
        reopened.close()
    assert [where.rsplit(":", 1)[1] for where, _ in located_file_records(path)] == ["1", "3"]
