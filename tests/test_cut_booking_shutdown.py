"""Fast mode's worker call cut at shutdown is booked (gateway/completions.py `_calls`).

The gateway's shutdown cancels the requests still in flight after its graceful timeout. A workflow's
step call cut so is booked: the request's ledger record (503, `trace.ended: "cancelled"`) lists it
in `trace.attempts` as `cancelled`, after that worker's calls retried before it
(tests/test_worker_faults_more_compose.py). Fast mode's was not: the cancellation left
`first_success` with no record written at all, so neither the call in flight (which the provider
may bill) nor the calls given up before it were anywhere in the ledger. Now fast mode books it as a
workflow does, plain and streamed (a stream cut before its first byte; one cut mid-way is the
answer's record, as for a client that hangs up, and no attempt).

No timing bets: the worker's first call fails at once and its retry is held at the test upstream
(`FakeUpstream.hold(..., after=1)`), so the shutdown falls on that retry; the test waits until the
retry reached the upstream, then stops the gateway (uvicorn cancels the request after its 5 s
graceful timeout, then runs the lifespan's shutdown, which closes the ledger).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_compose_accounting import requests_in
from tests.test_worker_faults_more_books import REFUSED_503, entry, holding

WAIT_S = 60.0
CANCELLED = {"outcome": "cancelled", "status": 503, "may_be_billed": True}

pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


def cut_cheaps_retry_at_shutdown(fake, gw, body: dict) -> None:
    """cheap refuses (503) and its retry is held at the upstream when the gateway stops: the request
    is cancelled after the graceful timeout (5 s); what it left is in the ledger."""
    fake.behave("cheap-model", status=503, fail_times=1)

    def client() -> None:
        try:
            httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=WAIT_S)
        except httpx.HTTPError:  # the connection goes with the server
            pass

    thread = threading.Thread(target=client)
    with holding(fake, "cheap-model", after=1):
        thread.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while len(fake.requests_for("cheap-model")) < 2:  # the retry is in flight, held
                assert time.monotonic() < deadline, "cheap's retry never reached the upstream"
                time.sleep(0.05)
        finally:
            gw.server.stop()
            thread.join(WAIT_S)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_fast_mode_call_cut_at_shutdown_is_booked_as_cancelled(fake, tmp_path, stream):
    """cheap refuses (503), its retry is in flight when the gateway stops: the ledger's 503 record
    lists both of cheap's calls, the cut one as `cancelled` (it was sent: the provider may bill it),
    and no other worker was called after the cut."""
    gw = start_gateway(parse_catalog(catalog_yaml_for(fake.url)), tmp_path / "data", retries=1)
    body = {"model": "auto", "messages": [{"role": "user", "content": "Say hello"}], "stream": stream}
    cut_cheaps_retry_at_shutdown(fake, gw, body)
    assert not gw.server.thread.is_alive()
    assert not fake.requests_for("mid-model") and not fake.requests_for("pricey-model")
    [record] = requests_in(gw.data_dir)  # written before the ledger closed
    assert record["status"] == 503, record
    assert record["worker"] is None and record["strategy"] == "fast"
    assert record["trace"]["ended"] == "cancelled"
    assert record["trace"]["attempts"] == [entry("cheap", REFUSED_503), entry("cheap", CANCELLED)]
    assert record["cost_micros"] == 0  # neither call answered: no cost is guessed for the cut one
