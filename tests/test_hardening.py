"""Resource bounds and edge cases of the request path (issue 12, items 5-7).

Real parts only: gateways on uvicorn, the loopback test upstream, clients that are httpx or raw
sockets (to hang up mid-body, trickle a body or send half a request line). No assertion depends on
how fast anything runs: a deadline is always far shorter than what would outlast it (a trickle of
minutes against a deadline of seconds), and waits for the books are generous polls.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal

import httpx
import orjson
import pytest
import yaml

from policies import parse_catalog
from retrieval import InvalidName, check_name
from tests.conftest import FAKE_KEY_ENV, Gateway, running_upstream, start_gateway
from tests.fakes.upstream import FakeUpstream

# The tight gateway's total per-request deadline: a loaded machine opens a stream well within it.
DEADLINE_S = 6.0
BODY_TIMEOUT_S = 1.0  # the tight gateway's body-read timeout
BUDGET = Decimal("1")
LONG_TEXT = " ".join(f"word{i}" for i in range(100))


@pytest.fixture(scope="module")
def slow_upstream() -> Iterator[FakeUpstream]:
    """Its own upstream: the slow answers here must not hold up the session's shared one."""
    with running_upstream() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _reset_slow(slow_upstream: FakeUpstream) -> None:
    slow_upstream.reset()


def _catalog(url: str):
    common = f"api_base: {url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192"
    worker = (
        "input_price_per_m: 1.00\n    output_price_per_m: 2.00\n    tier: specialist\n    license: MIT\n"
        "    provider: fake\n    jurisdiction: FR\n    capabilities: [general]"
    )
    return parse_catalog(
        f"""
version: 1
workers:
  - name: slow
    model: openai/slow-model
    {common}
    {worker}
    timeout_s: 600
  - name: flaky
    model: openai/flaky-model
    {common}
    {worker}
    timeout_s: 5
    retries: 0
  - name: sturdy
    model: openai/sturdy-model
    {common}
    {worker}
""",
        "hardening catalog",
    )


def _gateway(upstream: FakeUpstream, tmp_path_factory, name: str, **settings) -> Gateway:
    data_dir = tmp_path_factory.mktemp(name)
    policy_file = data_dir / "policy.yaml"
    tenants = {t: {"budget": {"daily_usd": str(BUDGET)}} for t in ("acme", "streamer", "cut")}
    policy_file.write_text(yaml.safe_dump({"version": "hardening", "tenants": tenants}))
    gw = start_gateway(
        _catalog(upstream.url), data_dir / "data", policy_file=policy_file, retry_backoff_s=0.01, **settings
    )
    return gw


@pytest.fixture(scope="module")
def hgw(slow_upstream, tmp_path_factory) -> Iterator[Gateway]:
    """Default bounds (a five-minute deadline): nothing here is cut by time."""
    gw = _gateway(slow_upstream, tmp_path_factory, "hgw")
    yield gw
    gw.server.stop()


@pytest.fixture(scope="module")
def tight(slow_upstream, tmp_path_factory) -> Iterator[Gateway]:
    gw = _gateway(
        slow_upstream,
        tmp_path_factory,
        "tight",
        request_timeout_s=DEADLINE_S,
        body_timeout_s=BODY_TIMEOUT_S,
    )
    yield gw
    gw.server.stop()


def _chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tell me a long story"}], **extra}


def _record(gw: Gateway, request_id: str, timeout_s: float = 30.0) -> dict:
    """The ledger record of one request, once written (a stream's is written after it ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for record in gw.state.ledger.records():
            if record.get("type") == "request" and record.get("id") == request_id:
                return record
        assert time.monotonic() < deadline, f"no ledger record for {request_id}"
        time.sleep(0.05)


def _spend(gw: Gateway, tenant: str) -> Decimal:
    books = httpx.get(f"{gw.url}/admin/spend/{tenant}", headers=gw.auth(gw.admin_key), timeout=30).json()
    return Decimal(books["daily_usd"])


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- item 5: a client that hangs up mid-stream pays for what was streamed ---------------------------
def test_client_that_hangs_up_mid_stream_pays_for_what_was_streamed(hgw, slow_upstream):
    slow_upstream.behave("slow-model", text=LONG_TEXT, chunk_delay_s=0.05)
    _, key = hgw.state.auth.store.create("streamer", "hangs up")
    before = _spend(hgw, "streamer")
    assert before == 0
    received = 0
    with _logs("polyroute", "uvicorn.error", "uvicorn") as captured, httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", hgw.v1 + "/chat/completions", headers=hgw.auth(key), json=_chat_body("slow", stream=True)
        ) as response:
            assert response.status_code == 200
            request_id = response.headers["x-polyroute-request-id"]
            for line in response.iter_lines():
                if line.startswith("data:") and '"content":"word' in line:
                    received += 1
                    if received == 10:
                        break  # hang up: leaving the block closes the connection mid-stream
        record = _record(hgw, request_id)
    assert not [
        r.getMessage() for r in captured.records if r.exc_info or "Exception in ASGI" in r.getMessage()
    ]
    assert record["status"] == 499
    assert record["trace"]["stream"] == "client_disconnected"
    assert record["trace"]["usage"] == "estimated"  # the provider's usage never arrived
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] >= received
    assert record["completion_tokens"] < 100  # what was streamed, not the whole answer
    assert record["cost_micros"] > 0
    # the hold was settled with that amount: the books show exactly it, no hold left behind
    _wait_for(lambda: _spend(hgw, "streamer") == Decimal(record["cost_micros"]) / 1_000_000, what="settle")


# ---- item 6: small things ----------------------------------------------------------------------------
def test_collection_name_with_a_trailing_newline_is_refused(hgw, slow_upstream):
    with pytest.raises(InvalidName):
        check_name("handbook\n")
    with pytest.raises(InvalidName):
        check_name("_s-abc\n", internal=True)
    assert check_name("handbook") == "handbook"
    read = httpx.get(hgw.url + "/v1/collections/handbook%0A", headers=hgw.auth(), timeout=30)
    assert read.status_code == 400 and read.json()["error"]["code"] == "invalid_collection_name"
    asked = httpx.post(
        hgw.v1 + "/chat/completions",
        headers=hgw.auth(),
        json=_chat_body("sturdy", metadata={"collections": ["handbook\n"]}),
        timeout=30,
    )
    assert asked.status_code == 400 and asked.json()["error"]["code"] == "invalid_collection_name"
    assert not slow_upstream.requests


@pytest.mark.parametrize(
    "how, value",
    [
        ("metadata", "inf"),
        ("metadata", "Infinity"),
        ("metadata", "nan"),
        ("metadata", True),
        ("metadata", 1e6),
        ("metadata", -1),
        ("header", "inf"),
        ("header", "1e999"),
        ("header", "NaN"),
        ("header", "1e6"),
    ],
)
def test_cost_weight_must_be_a_finite_bounded_number(hgw, slow_upstream, how, value):
    """(A bare JSON 1e999 in the body is refused by the JSON parser already: 400 invalid_json.)"""
    headers = hgw.auth()
    if how == "header":
        response = httpx.post(
            hgw.v1 + "/chat/completions",
            headers={**headers, "x-polyroute-cost-weight": value},
            json=_chat_body("auto"),
            timeout=30,
        )
    else:
        response = httpx.post(
            hgw.v1 + "/chat/completions",
            headers=headers,
            json=_chat_body("auto", metadata={"cost_weight": value}),
            timeout=30,
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "metadata.cost_weight" and error["code"] == "invalid_value"
    assert not slow_upstream.requests


def test_a_sane_cost_weight_is_still_accepted(hgw):
    for value in (0, 0.5, "2", 100):
        response = httpx.post(
            hgw.v1 + "/chat/completions",
            headers=hgw.auth(),
            json=_chat_body("auto", metadata={"cost_weight": value}),
            timeout=30,
        )
        assert response.status_code == 200, response.text


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _logs(*names: str) -> Iterator[_Capture]:
    """Records of the named loggers (uvicorn's do not propagate to the root, so caplog misses them)."""
    capture = _Capture()
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(capture)
        logger.setLevel(logging.INFO)
    try:
        yield capture
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(capture)
            logger.setLevel(level)


def _head(gw: Gateway, length: int, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {gw.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_client_that_hangs_up_while_sending_its_body_is_one_log_line(hgw, slow_upstream):
    with _logs("polyroute", "uvicorn.error", "uvicorn") as captured:
        with socket.create_connection(("127.0.0.1", hgw.server.port), timeout=30) as sock:
            sock.sendall(_head(hgw, 1000) + b'{"model": "auto", "messages": [')
        # the gateway notices when it reads on; wait for whatever it logs about it
        _wait_for(
            lambda: any(
                "disconnect" in r.getMessage() or r.exc_info or "Exception in ASGI" in r.getMessage()
                for r in captured.records
            ),
            what="the gateway to notice the hang-up",
        )
        time.sleep(0.2)  # a second record (a traceback after a first line) would land now
    tracebacks = [r for r in captured.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    lines = [r for r in captured.records if "disconnect" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno <= logging.INFO
    assert not slow_upstream.requests


# ---- item 7: resource bounds ---------------------------------------------------------------------------
def test_worker_retries_and_timeout_are_per_worker_and_visible(hgw, slow_upstream):
    slow_upstream.behave("flaky-model", status=503)
    slow_upstream.behave("sturdy-model", status=503)
    flaky = httpx.post(hgw.v1 + "/chat/completions", headers=hgw.auth(), json=_chat_body("flaky"), timeout=60)
    sturdy = httpx.post(
        hgw.v1 + "/chat/completions", headers=hgw.auth(), json=_chat_body("sturdy"), timeout=60
    )
    assert flaky.status_code == sturdy.status_code == 502
    assert len(slow_upstream.requests_for("flaky-model")) == 1  # retries: 0 in the catalog
    assert len(slow_upstream.requests_for("sturdy-model")) == 3  # the default: POLYROUTE_RETRIES=2
    workers = httpx.get(hgw.url + "/admin/workers", headers=hgw.auth(hgw.admin_key), timeout=30).json()
    cards = {w["name"]: w for w in workers["catalog"]}
    assert cards["flaky"]["retries"] == 0 and cards["flaky"]["timeout_s"] == 5
    assert cards["sturdy"]["retries"] is None and cards["sturdy"]["timeout_s"] == 60  # None: the default
    models = httpx.get(hgw.v1 + "/models", headers=hgw.auth(), timeout=30).json()["data"]
    public = {m["id"]: m["polyroute"] for m in models if m["id"] in ("flaky", "sturdy")}
    assert (public["flaky"]["timeout_s"], public["flaky"]["retries"]) == (5, 0)
    assert (public["sturdy"]["timeout_s"], public["sturdy"]["retries"]) == (60, 2)  # the effective default


def test_deadline_cuts_a_worker_that_never_answers(tight, slow_upstream):
    """The worker's own timeout is ten minutes; the request's deadline (6 s) bounds it, retries included."""
    slow_upstream.behave("slow-model", latency_s=60)
    for stream in (False, True):
        response = httpx.post(
            tight.v1 + "/chat/completions",
            headers=tight.auth(),
            json=_chat_body("slow", stream=stream),
            timeout=40,  # before the deadline existed this waited the worker's full minute
        )
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "request_timeout"
        record = _record(tight, response.headers["x-polyroute-request-id"])
        assert record["status"] == 504 and record["cost_micros"] == 0
    _wait_for(lambda: _spend(tight, "acme") == 0, what="the holds to be released")


def test_deadline_bounds_a_composed_workflow(tight, slow_upstream):
    """Each step of a workflow waits for its worker at most until the request's deadline."""
    for model in ("slow-model", "flaky-model", "sturdy-model"):
        slow_upstream.behave(model, latency_s=60)
    response = httpx.post(
        tight.v1 + "/chat/completions",
        headers=tight.auth(),
        json=_chat_body("compose:cascade"),
        timeout=40,  # before, the first step alone waited its minute (POLYROUTE_COMPOSE_STEP_TIMEOUT_S)
    )
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "workflow_failed"
    assert _record(tight, response.headers["x-polyroute-request-id"])["status"] == 502


def test_deadline_ends_a_trickling_stream_with_an_error_event_and_bills_it(tight, slow_upstream):
    slow_upstream.behave("slow-model", text=LONG_TEXT, chunk_delay_s=1.0)  # 100 s in all, against 6 s
    _, key = tight.state.auth.store.create("cut", "trickled")
    events: list[dict] = []
    with httpx.stream(
        "POST",
        tight.v1 + "/chat/completions",
        headers=tight.auth(key),
        json=_chat_body("slow", stream=True),
        timeout=60,
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-polyroute-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                break
            events.append(orjson.loads(line[5:]))
            assert len(events) < 30, "the stream was not cut by the deadline"  # ~6 come before it
    assert events[-1] == {"done": True}
    error = events[-2]["error"]
    assert error["code"] == "request_timeout" and error["type"] == "server_error"
    record = _record(tight, request_id)
    assert record["status"] == 504 and record["trace"]["stream"] == "deadline"
    assert record["prompt_tokens"] > 0 and record["cost_micros"] > 0
    _wait_for(lambda: _spend(tight, "cut") == Decimal(record["cost_micros"]) / 1_000_000, what="settle")


def _trickle(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.wait(0.3):
        try:
            sock.sendall(b" ")
        except OSError:
            return


def _response_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


def _head_while_trickling(port: int, start: bytes) -> bytes:
    """Send `start` (headers and the beginning of a body), then trickle the rest of the body, and
    return the response head: only the server's body timeout ends the wait."""
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(start)
        trickler = threading.Thread(target=_trickle, args=(sock, stop), daemon=True)
        trickler.start()
        try:
            return _response_head(sock)
        finally:
            stop.set()
            trickler.join(timeout=10)


def test_a_body_that_trickles_is_cut_with_408(tight, slow_upstream):
    # 100,000 bytes at 3 a second: only the timeout ends this
    head = _head_while_trickling(tight.server.port, _head(tight, 100_000) + b'{"model": "auto", ')
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"body_timeout" in head or b"connection: close" in head.lower()
    assert not slow_upstream.requests


def test_body_timeout_applies_to_every_route(tight):
    head = _head_while_trickling(
        tight.server.port, _head(tight, 100_000, "/v1/collections/notes/search") + b'{"query": '
    )
    assert head.startswith(b"HTTP/1.1 408"), head[:200]


# ---- `polyroute serve`: uvicorn's limits, and a header timeout uvicorn lacks --------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(slow_upstream, tmp_path_factory) -> Iterator[str]:
    """A real `polyroute serve` process with short connection timeouts."""
    tmp = tmp_path_factory.mktemp("served")
    catalog_file = tmp / "workers.yaml"
    catalog_file.write_text(
        f"version: 1\nworkers:\n  - name: sturdy\n    model: openai/sturdy-model\n"
        f"    api_base: {slow_upstream.url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192\n"
        "    input_price_per_m: 1\n    output_price_per_m: 2\n    tier: specialist\n    license: MIT\n"
        "    provider: fake\n"
    )
    port = _free_port()
    env = {
        **os.environ,
        "POLYROUTE_ADMIN_KEY": "pr-served-admin",
        FAKE_KEY_ENV: "sk-test",
        "POLYROUTE_HEADER_TIMEOUT_S": "1",
        "POLYROUTE_BODY_TIMEOUT_S": "1",
        "POLYROUTE_KEEP_ALIVE_TIMEOUT_S": "1",
    }
    command = [sys.executable, "-m", "polyroute.cli", "serve", "--port", str(port)]
    command += ["--workers-file", str(catalog_file), "--data-dir", str(tmp / "data")]
    command += ["--no-local-workers", "--log-level", "warning"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "polyroute serve exited"
            try:
                if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "polyroute serve did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _closed_by_server(sock: socket.socket) -> bytes:
    """Read until the server closes the connection (30 s at most: then the test fails)."""
    data = b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            return data
        data += piece


def test_serve_closes_a_connection_whose_headers_never_finish(served):
    port = int(served.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and nothing more
        data = _closed_by_server(sock)
    assert data == b"" or data.startswith(b"HTTP/1.1 408")


def test_serve_refuses_oversized_headers(served):
    port = int(served.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        big = b"X-Big: " + b"a" * 40_000 + b"\r\n"  # over POLYROUTE_MAX_HEADER_BYTES (16 KiB)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + big + b"\r\n")
        data = _closed_by_server(sock)
    assert data.startswith(b"HTTP/1.1 431"), data[:200]
    ok = httpx.get(served + "/healthz", headers={"x-fine": "a" * 8000}, timeout=30)
    assert ok.status_code == 200  # headers within the cap pass


def test_serve_cuts_a_trickling_body(served):
    port = int(served.rsplit(":", 1)[1])
    head = _head_while_trickling(
        port,
        b"POST /admin/keys HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer pr-served-admin\r\n"
        b"Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n{",
    )
    assert head.startswith(b"HTTP/1.1 408"), head[:200]


def test_serve_uvicorn_settings_come_from_the_gateway_settings():
    from gateway import Settings
    from gateway.serving import uvicorn_options

    options = uvicorn_options(
        Settings(
            keep_alive_timeout_s=3,
            max_header_bytes=8192,
            limit_concurrency=500,
            graceful_shutdown_s=20,
        )
    )
    assert options["timeout_keep_alive"] == 3
    assert options["h11_max_incomplete_event_size"] == 8192
    assert options["limit_concurrency"] == 500
    assert options["timeout_graceful_shutdown"] == 20
    defaults = uvicorn_options(Settings())
    assert defaults["timeout_graceful_shutdown"] is not None  # uvicorn's default waits forever
