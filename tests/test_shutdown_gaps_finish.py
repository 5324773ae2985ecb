"""A request's books written while the shutdown cancels it (gateway/completions.py `Exchange.finish`).

Fast mode writes a request's ledger record in `finish`, after it settles the budget hold (a Lua
script on Redis, for replicas). The shutdown (uvicorn, after its graceful timeout) cancels the
requests still running; one whose answer had come in and whose settle was on its way to Redis lost
its record and its settle with it: the cancellation ended `finish` at the settle's await, and the
books of fast mode were no longer pending (`_calls` had marked them done), so the lifespan closed the
ledger without it. Now `finish` writes the books in a task of their own, pending in the gateway's
background work (AppState.pending_books), which the shutdown awaits before it closes the ledger.

Real parts: a gateway on the session's redis-server with a budgeted tenant, run by uvicorn and stopped
as a deploy stops it. No timing bets: the answer is held at the test upstream while Redis pauses its
writes (`CLIENT PAUSE … WRITE`: the settle waits there, as on a slow or failing-over Redis) and the
shutdown starts; the answer is let go only once uvicorn waits for the request (its graceful timeout,
GRACE_S, is armed), so the settle is sent after that timer started, and its own socket timeout
(REDIS_TIMEOUT_S, longer) ends after it: the cancellation falls on the settle. Then Redis resumes (the
record reaches the shared ledger, the hold is settled), or stays paused through the whole shutdown:
the settle, still pending when the lifespan starts (for REDIS_TIMEOUT_S - GRACE_S at least), gives up
at its socket timeout and keeps the settle for the next start, and the lifespan waits for it, the
books pending (within its 5 s grace, since the settle was sent before the cancellation), before it
writes what Redis could not take to disk. Without that wait the lifespan closed the ledger first, and
the record came too late for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
import uvicorn
import yaml

from gateway import Settings, create_app
from gateway.store.budgets import RedisBudgets, SpilledSettle, periods
from gateway.store.health import REDIS_TIMEOUT_S
from gateway.store.ledger_redis import STREAM
from policies import parse_catalog
from tests.conftest import ADMIN_KEY, FAKE_KEY_ENV, Gateway, RedisServer, catalog_yaml_for
from tests.fakes.server import RunningServer
from tests.fakes.upstream import FakeUpstream

WAIT_S = 60.0
PAUSE_MS = 120_000  # longer than the test can take: Redis resumes when the test says so
# uvicorn's graceful timeout: shorter than a Redis call's socket timeout, so a settle sent after it was
# armed is still waiting when the request is cancelled, and for REDIS_TIMEOUT_S - GRACE_S after
GRACE_S = 3.0
assert REDIS_TIMEOUT_S - GRACE_S >= 2

pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


class ShutdownSteps(logging.Handler):
    """uvicorn's shutdown, as it logs it: waiting for the requests (the graceful timeout is armed),
    then cancelling those still running once it has passed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.waiting = threading.Event()
        self.cancelled = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Waiting for connections to close"):
            self.waiting.set()
        elif message.startswith("Cancel ") and "timeout graceful shutdown exceeded" in message:
            self.cancelled.set()


@contextmanager
def watching_shutdown() -> Iterator[ShutdownSteps]:
    logger = logging.getLogger("uvicorn.error")  # the test servers log warnings only: INFO for the steps
    steps, level = ShutdownSteps(), logger.level
    logger.addHandler(steps)
    logger.setLevel(logging.INFO)
    try:
        yield steps
    finally:
        logger.removeHandler(steps)
        logger.setLevel(level)


def serve_with_grace(app) -> RunningServer:
    """uvicorn serving `app` in a thread on a loopback port, as tests/fakes/server.py does, with a
    graceful timeout of GRACE_S."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=GRACE_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", port, server, thread)


def budgeted_gateway(fake: FakeUpstream, tmp_path: Path, redis_url: str) -> Gateway:
    """The test catalog on Redis; tenant acme (the test key's) has a daily budget, so every attempt
    holds its predicted cost and `finish` settles it on Redis."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        yaml.safe_dump({"version": "shutdown", "tenants": {"acme": {"budget": {"daily_usd": "10"}}}})
    )
    os.environ[FAKE_KEY_ENV] = "sk-test-upstream"
    settings = Settings(
        data_dir=tmp_path / "data",
        admin_key=ADMIN_KEY,
        local_workers=False,
        router_prior=False,
        policy_file=policy_file,
        redis_url=redis_url,
    )
    app = create_app(settings, parse_catalog(catalog_yaml_for(fake.url)))
    state = app.state.polyroute
    _, key = state.auth.store.create("acme", "test key")
    running = serve_with_grace(app)
    return Gateway(running.url, key, ADMIN_KEY, state, running, settings.data_dir)


def ledger_requests(client: redis.Redis, data_dir: Path) -> list[dict]:
    """Every request record the gateway wrote: sent to Redis, or kept on disk for the next start."""
    records = [json.loads(fields[b"r"]) for _, fields in client.xrange(STREAM)]
    spill = data_dir / "ledger-unsent.jsonl"
    if spill.exists():
        records += [json.loads(line) for line in spill.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") == "request"]


def acme_books(client: redis.Redis) -> tuple[int, int]:
    """acme's settled and still-reserved micro-dollars today, as every replica reads them."""
    day, _ = periods()
    settled, reserved = client.hmget(f"{RedisBudgets.PREFIX}{{acme}}:{day}", "settled", "reserved")
    return int(settled or 0), int(reserved or 0)


def kept_settles(data_dir: Path) -> list[SpilledSettle]:
    """The budget settles a gateway could not send to Redis, kept on disk for its next start."""
    spill = data_dir / "budget-unsent.jsonl"
    lines = spill.read_text().splitlines() if spill.exists() else []
    return [SpilledSettle.model_validate_json(line) for line in lines if '"settle"' in line]


@pytest.mark.parametrize("redis_back", [True, False], ids=["redis-resumes", "redis-paused-throughout"])
def test_an_answer_whose_books_the_shutdown_cancels_is_still_on_the_ledger_and_settled(
    fake: FakeUpstream, redis_server: RedisServer, tmp_path: Path, redis_back: bool
):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    gw = budgeted_gateway(fake, tmp_path, redis_server.url)
    body = {"model": "cheap", "messages": [{"role": "user", "content": "Say hello"}]}
    outcome: dict = {}

    def request() -> None:
        try:
            outcome["response"] = httpx.post(
                gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=WAIT_S
            )
        except httpx.HTTPError as exc:  # the connection goes with the server
            outcome["error"] = exc

    thread = threading.Thread(target=request)
    gate = fake.hold("cheap-model")
    paused = False
    with watching_shutdown() as shutdown:
        try:
            thread.start()
            deadline = time.monotonic() + WAIT_S
            while not fake.requests_for("cheap-model"):  # the call is in flight, its answer held
                assert time.monotonic() < deadline, "cheap's call never reached the upstream"
                time.sleep(0.05)
            client.client_pause(PAUSE_MS, all=False)  # writes wait (the settle's script), reads do not
            paused = True
            gw.server.server.should_exit = True  # a deploy stops the gateway
            assert shutdown.waiting.wait(WAIT_S), "uvicorn never waited for the request in flight"
            gate.set()  # the answer comes in: `finish` settles the hold, and waits on Redis
            assert shutdown.cancelled.wait(WAIT_S), "uvicorn never cancelled the request"
            if redis_back:
                client.client_unpause()
                paused = False
            gw.server.thread.join(WAIT_S)  # the lifespan's shutdown: Redis still paused, or not
        finally:
            gate.set()
            if paused:
                client.client_unpause()
            gw.server.thread.join(WAIT_S)
            thread.join(WAIT_S)
    assert not gw.server.thread.is_alive()
    if "response" in outcome:  # cancelled before its answer was sent: uvicorn's own 500, not the answer
        assert outcome["response"].status_code == 500, outcome["response"].text
    [call] = fake.requests_for("cheap-model")  # answered once, and nothing after the cancellation
    [record] = ledger_requests(client, gw.data_dir)
    assert record["status"] == 200 and record["worker"] == "cheap", record
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0, record
    assert record["cost_micros"] > 0, record
    if redis_back:  # the hold was settled with what the answer cost, not left reserved until it expires
        assert acme_books(client) == (record["cost_micros"], 0)
        assert not kept_settles(gw.data_dir)
    else:  # the settle is kept for the next start, with what the answer cost
        [settle] = kept_settles(gw.data_dir)
        assert (settle.tenant, settle.micros) == ("acme", record["cost_micros"]), settle
