"""Given-up worker calls are on the books: every call of a worker that was retried or fallen back
from carries what became of it (gateway/upstream.py `Attempt`): a timeout after the request was
sent may be billed by the provider, a refusal (an error status) is not, a call that never left is not.

Before, only `polyroute_worker_attempts_total{outcome="error"}` counted them: a worker that timed
out twice and then answered left no trace of the two calls its provider may bill, on either path.

Real parts only: WorkerClient in-process, and a gateway on uvicorn, against the loopback test upstream
(tests/fakes/upstream.py), on both ways a worker is reached (the OpenAI-wire fast path and
`litellm.acompletion`). A timeout is the upstream answering long after the worker's timeout (30 s
against 0.5 s): no assertion bets on a clock.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from gateway.metrics import Metrics
from gateway.upstream import WorkerClient, WorkerError
from policies import Worker, parse_catalog
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, ledger_record, start_gateway
from tests.test_worker_faults_paths import MESSAGES, chat, make_worker

STALL_S = 30.0  # the upstream's answer comes this late: far past TIMEOUT_S however loaded the machine
TIMEOUT_S = 0.5
ATTEMPTS_HEADER = "x-polyroute-attempts"
PATHS = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")


def attempts(carrier) -> list[tuple[str, str, int, bool]]:
    """The given-up calls a WorkerError, a Completion or an OpenStream carries, as tuples."""
    return [(a.worker, a.outcome, a.status, a.may_be_billed) for a in carrier.attempts]


async def call(client: WorkerClient, worker: Worker, stream: bool):
    """One call as the gateway makes it: a plain completion, or a stream read to its end."""
    if not stream:
        return await client.complete(worker, worker.api_base, chat())
    opened = await client.open_stream(worker, worker.api_base, chat(stream=True))
    async for _ in opened:
        pass
    return opened


# ---- WorkerClient: the attempts travel on WorkerError, Completion and OpenStream ---------------------
@PATHS
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.anyio
async def test_timed_out_attempts_are_on_the_final_error_as_may_be_billed(upstream, fast_path, stream):
    upstream.behave("cheap-model", latency_s=STALL_S)
    worker = make_worker(upstream.url + "/v1", timeout_s=TIMEOUT_S)
    client = WorkerClient(Metrics(), retries=1, backoff_s=0.01, fast_path=fast_path)
    with pytest.raises(WorkerError) as info:
        await call(client, worker, stream)
    assert info.value.status == 504
    assert len(upstream.requests_for("cheap-model")) == 2  # both calls reached the provider
    assert attempts(info.value) == [("w", "timeout", 504, True)] * 2


@PATHS
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.anyio
async def test_a_retried_refusal_is_on_the_answer_and_not_billed(upstream, fast_path, stream):
    upstream.behave("cheap-model", status=503, fail_times=1)
    worker = make_worker(upstream.url + "/v1")
    client = WorkerClient(Metrics(), retries=2, backoff_s=0.01, fast_path=fast_path)
    answered = await call(client, worker, stream)
    assert len(upstream.requests_for("cheap-model")) == 2
    assert attempts(answered) == [("w", "http_503", 503, False)]


@PATHS
@pytest.mark.anyio
async def test_a_call_that_never_left_is_not_billed(fast_path):
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = make_worker(f"http://127.0.0.1:{port}/v1", timeout_s=10)
    client = WorkerClient(Metrics(), retries=0, fast_path=fast_path)
    with pytest.raises(WorkerError) as info:
        await call(client, worker, stream=False)
    assert attempts(info.value) == [("w", "not_sent", 500, False)]


@pytest.mark.anyio
async def test_an_answer_with_nothing_to_give_up_carries_no_attempts(upstream):
    worker = make_worker(upstream.url + "/v1")
    answered = await call(WorkerClient(Metrics(), retries=2), worker, stream=False)
    assert attempts(answered) == []


# ---- a workflow's steps: the trace and the header of a composed request (gateway/compose.py) ---------
def _catalog_with_slow_cheap(url: str):
    catalog = parse_catalog(catalog_yaml_for(url), "accounting attempts")
    workers = tuple(
        w.model_copy(update={"timeout_s": TIMEOUT_S}) if w.name == "cheap" else w for w in catalog.workers
    )
    return catalog.model_copy(update={"workers": workers})


def ask_cascade(gw) -> httpx.Response:
    """A compose:cascade request of MESSAGES, answered (200)."""
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "compose:cascade", "messages": MESSAGES},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response


@PATHS
def test_a_cascade_step_that_timed_out_is_in_the_ledger_trace_and_the_header(upstream, tmp_path, fast_path):
    """cheap (the cascade's first step) times out twice, the step fails and pricey answers: the two
    calls cheap's provider may bill are in the ledger's trace and in x-polyroute-attempts."""
    gw = start_gateway(
        _catalog_with_slow_cheap(upstream.url),
        tmp_path / "gw",
        retries=1,
        fast_path=fast_path,
        compose_verifier="judge",
    )
    try:
        upstream.behave("cheap-model", latency_s=STALL_S)
        upstream.behave("pricey-model", text="Hello there, how are you?")
        response = ask_cascade(gw)
        assert response.headers["x-polyroute-worker"] == "pricey"
        assert len(upstream.requests_for("cheap-model")) == 2
        timed_out = {"worker": "cheap", "outcome": "timeout", "status": 504, "may_be_billed": True}
        record = ledger_record(gw, response.headers["x-polyroute-request-id"])
        assert record["trace"]["attempts"] == [timed_out, timed_out]
        assert response.headers[ATTEMPTS_HEADER] == "cheap:timeout:may-be-billed,cheap:timeout:may-be-billed"
    finally:
        gw.server.stop()


@PATHS
def test_a_cascade_step_retried_then_answered_keeps_its_refusal_in_the_trace(upstream, tmp_path, fast_path):
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / "gw",
        retries=2,
        fast_path=fast_path,
        compose_verifier="judge",
    )
    try:
        upstream.behave("cheap-model", status=503, fail_times=1, text="Hello there, how are you?")
        upstream.behave("pricey-model", text="9", replies={"How likely is the proposed answer": "9"})
        response = ask_cascade(gw)
        assert response.headers["x-polyroute-worker"] == "cheap"  # the judge accepted cheap's answer
        record = ledger_record(gw, response.headers["x-polyroute-request-id"])
        refused = {"worker": "cheap", "outcome": "http_503", "status": 503, "may_be_billed": False}
        assert record["trace"]["attempts"] == [refused]
        assert response.headers[ATTEMPTS_HEADER] == "cheap:http_503"
    finally:
        gw.server.stop()


def test_a_workflow_without_given_up_calls_has_no_attempts(upstream, tmp_path):
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "gw", compose_verifier="judge"
    )
    try:
        upstream.behave("cheap-model", text="Hello there, how are you?")
        upstream.behave("pricey-model", text="9", replies={"How likely is the proposed answer": "9"})
        response = ask_cascade(gw)
        assert ATTEMPTS_HEADER not in response.headers
        assert "attempts" not in ledger_record(gw, response.headers["x-polyroute-request-id"])["trace"]
    finally:
        gw.server.stop()
