"""Fast mode's given-up worker calls in the ledger trace and the x-polyroute-attempts header.

Needs gateway/completions.py to pass the attempts on (/tmp/h9/proposed/completions.patch); the
WorkerClient and workflow halves are tests/test_accounting_attempts.py.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.upstream import ATTEMPTS_HEADER
from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway

MESSAGES = [{"role": "user", "content": "Say hello in five words"}]
STALL_S = 30.0
TIMEOUT_S = 0.5
PATHS = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])
TIMED_OUT = {"worker": "cheap", "outcome": "timeout", "status": 504, "may_be_billed": True}


def _gateway(upstream, tmp_path, fast_path: bool, retries: int):
    catalog = parse_catalog(catalog_yaml_for(upstream.url), "accounting attempts")
    workers = tuple(
        w.model_copy(update={"timeout_s": TIMEOUT_S}) if w.name == "cheap" else w for w in catalog.workers
    )
    catalog = catalog.model_copy(update={"workers": workers})
    return start_gateway(catalog, tmp_path / "gw", retries=retries, fast_path=fast_path)


def _post(gw, model: str, stream: bool) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "stream": stream}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=120)


@PATHS
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_timeouts_before_a_fallback_are_in_the_trace_and_the_header(upstream, tmp_path, fast_path, stream):
    gw = _gateway(upstream, tmp_path, fast_path, retries=1)
    try:
        upstream.behave("cheap-model", latency_s=STALL_S)
        response = _post(gw, "auto", stream)
        assert response.status_code == 200, response.text
        assert response.headers["x-polyroute-worker"] == "mid"
        assert response.headers["x-polyroute-fallbacks"] == "cheap"  # as before: the workers
        assert response.headers[ATTEMPTS_HEADER] == "cheap:timeout:may-be-billed,cheap:timeout:may-be-billed"
        record = ledger_record(gw, response.headers["x-polyroute-request-id"])
        assert record["trace"]["attempts"] == [TIMED_OUT, TIMED_OUT]
    finally:
        gw.server.stop()


@PATHS
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_worker_retried_then_answering_keeps_its_given_up_call(upstream, tmp_path, fast_path, stream):
    gw = _gateway(upstream, tmp_path, fast_path, retries=2)
    try:
        upstream.behave("mid-model", status=503, fail_times=1)
        response = _post(gw, "mid", stream)
        assert response.status_code == 200, response.text
        assert "x-polyroute-fallbacks" not in response.headers  # mid answered: it is no fallback
        assert response.headers[ATTEMPTS_HEADER] == "mid:http_503"
        record = ledger_record(gw, response.headers["x-polyroute-request-id"])
        assert record["trace"]["attempts"] == [
            {"worker": "mid", "outcome": "http_503", "status": 503, "may_be_billed": False}
        ]
    finally:
        gw.server.stop()


@PATHS
def test_a_request_no_worker_answered_lists_every_call(upstream, tmp_path, fast_path):
    gw = _gateway(upstream, tmp_path, fast_path, retries=1)
    try:
        upstream.behave("cheap-model", latency_s=STALL_S)
        response = _post(gw, "cheap", stream=False)
        assert response.status_code == 504, response.text
        assert response.headers[ATTEMPTS_HEADER] == "cheap:timeout:may-be-billed,cheap:timeout:may-be-billed"
        record = ledger_record(gw, response.headers["x-polyroute-request-id"])
        assert record["trace"]["attempts"] == [TIMED_OUT, TIMED_OUT]
    finally:
        gw.server.stop()
