"""How long /readyz takes while Redis does not answer, the figure the chart's readiness probe
timeout must exceed (helm/polyroute/values.yaml readinessProbe; tests/test_helm_audit_chart.py).

A Redis that refuses connections is noticed at once; one that accepts and never answers (a stalled
process, a partitioned or dead node before its endpoints go) costs /readyz the Redis timeout of
the key store and the shared stores, pinged at once. Here a real redis-server is stopped with SIGSTOP (the
kernel still accepts connections, nothing replies), and /readyz is asked, as the kubelet asks.

The timing check is a lower bound only (a socket timeout never fires early; load only makes it
later), so it cannot fail because the machine is slow.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from gateway.store.health import REDIS_TIMEOUT_S
from policies import parse_catalog
from tests.conftest import RedisServer, catalog_yaml_for, start_gateway
from tests.test_helm import gateway as gateway_container
from tests.test_helm import render
from tests.test_helm_audit_chart import chart  # noqa: F401  (the fixture)

OLD_CHART_PROBE_TIMEOUT_S = 3  # helm/polyroute/values.yaml before this audit


@pytest.fixture
def gateway_on_stalled_redis(upstream, tmp_path):
    server = RedisServer()  # its own: the test stops it
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", redis_url=server.url)
    stopped = False
    try:
        first = httpx.get(gw.url + "/readyz", timeout=120)
        assert first.status_code == 200 and first.json()["degraded"] is False, first.text  # reached it
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped = True
        yield gw
    finally:
        if stopped:
            os.kill(server.proc.pid, signal.SIGCONT)
        gw.server.stop()
        server.stop()


def test_readyz_answers_ready_and_degraded_only_after_the_redis_timeouts(gateway_on_stalled_redis, chart):  # noqa: F811
    started = time.monotonic()
    answer = httpx.get(gateway_on_stalled_redis.url + "/readyz", timeout=120)
    waited = time.monotonic() - started
    # docs/replicas.md: a replica that reached Redis stays ready, degraded, while Redis is down
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["ready"] is True and body["degraded"] is True
    assert body["keys"]["ok"] is False and body["store"]["ok"] is False
    # ...but only after the Redis timeout: a probe that gives up sooner marks every pod unready
    assert waited >= REDIS_TIMEOUT_S - 0.5 > OLD_CHART_PROBE_TIMEOUT_S, waited
    probe = gateway_container(render(chart))["readinessProbe"]
    assert probe["timeoutSeconds"] > 2 * REDIS_TIMEOUT_S  # the timeout, and as much for a loaded node
