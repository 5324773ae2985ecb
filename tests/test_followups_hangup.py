"""A client that hangs up before the first byte of a plain (non-streamed) answer: the ledger said 200
for an answer nobody received (a stream the client leaves already says 499), and fast mode went on
falling back for nobody. Now the call in flight finishes (its cost is known and billed, as a
workflow's step in flight is), no attempt starts after the hang-up, and the ledger says 499.

No timing bets: the test upstream holds the worker's call until the client has hung up and the
gateway has logged that it noticed, then lets it answer (or fail)."""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, start_gateway
from tests.fakes.upstream import FakeUpstream


@pytest.fixture
def gw(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    gateway = start_gateway(parse_catalog(catalog_yaml_for(held.url)), tmp_path / "data", retries=0)
    try:
        yield gateway
    finally:
        gateway.server.stop()


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def send_and_hang_up(gw: Gateway, held: FakeUpstream, question: str, caplog) -> None:
    """POST a plain chat request over a raw connection; once cheap's call is held at the upstream,
    close the connection, wait for the gateway to notice (its log line), then release the call."""
    body = json.dumps(
        {"model": "auto", "messages": [{"role": "user", "content": question}], "max_tokens": 10}
    ).encode()
    url = urlsplit(gw.url)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\n"
        f"authorization: Bearer {gw.api_key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    gate = held.hold("cheap-model")
    with socket.create_connection((url.hostname, url.port), timeout=60) as conn:
        conn.sendall(head + body)
        assert wait_for(lambda: held.requests_for("cheap-model"), "cheap's call")
    # the gateway notices the hang-up while the call is held (the old code never did: it then
    # recorded the answer as a 200; the bound only lets that old behaviour show as a failure)
    wait_for(lambda: "the client hung up before its answer" in caplog.text, "the hang-up noticed", 30)
    gate.set()


def ledger_record_of(gw: Gateway, question: str) -> dict:
    """The one ledger record of the request that asked ``question`` (the client never got its id)."""
    path = Path(gw.data_dir) / "ledger.jsonl"
    found: list[dict] = []

    def written() -> bool:
        if path.exists():
            found[:] = [
                r
                for r in map(json.loads, path.read_text().splitlines())
                if r.get("type", "request") == "request" and r.get("query") == question
            ]
        return bool(found)

    assert wait_for(written, "the ledger record"), f"no ledger record for {question!r}"
    (record,) = found
    return record


def question() -> str:
    return f"What is 2 + 2? ({uuid.uuid4().hex})"


def test_a_plain_answer_the_client_hung_up_on_is_499_and_billed(gw, held, caplog):
    caplog.set_level(logging.INFO, logger="polyroute.gateway")
    held.behave("cheap-model", prompt_tokens=100, completion_tokens=5)
    asked = question()
    send_and_hang_up(gw, held, asked, caplog)
    record = ledger_record_of(gw, asked)
    assert record["status"] == 499, record
    assert record["worker"] == "cheap" and record["trace"]["ended"] == "client_disconnected"
    # the call finished: what it cost is billed exactly, not guessed
    assert record["prompt_tokens"] == 100 and record["completion_tokens"] == 5
    assert record["cost_micros"] > 0
    assert len(held.requests) == 1


def test_no_fallback_starts_after_the_client_hung_up(gw, held, caplog):
    """cheap fails after the hang-up: mid (next in the ranking) is not called for nobody."""
    caplog.set_level(logging.INFO, logger="polyroute.gateway")
    held.behave("cheap-model", status=500)
    asked = question()
    send_and_hang_up(gw, held, asked, caplog)
    record = ledger_record_of(gw, asked)
    assert record["status"] == 499, record
    assert record["fallbacks"] == ["cheap"] and record["trace"]["ended"] == "client_disconnected"
    assert not held.requests_for("mid-model") and not held.requests_for("pricey-model")
