"""The in-chart Redis's rendered arguments, run by a real redis-server: they parse, the memory cap is
in force, and at the cap Redis refuses the ledger's writes while keeping every key (noeviction), the
behaviour the chart's comment and the gateway's outage handling count on."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis

from gateway import Settings
from tests.test_helm import FULLNAME, one, render
from tests.test_helm import gateway as gateway_container
from tests.test_helm_audit_chart import chart  # noqa: F401  (the fixture)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def chart_redis(chart, tmp_path):  # noqa: F811
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    docs = render(chart, {"replicaCount": 2, "redis": {"enabled": True, "maxmemory": "3mb"}})
    [container] = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["redis-server"]
    args = list(container["args"])
    port = _free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)  # the PVC's mount point, here a temporary dir
    proc = subprocess.Popen(
        [binary, *args, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None, f"redis-server refused the chart's arguments: {args}"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield client
    proc.terminate()
    proc.wait(timeout=30)


def test_at_the_cap_redis_refuses_ledger_writes_and_evicts_no_key(chart_redis):
    client = chart_redis
    assert client.config_get("maxmemory") == {"maxmemory": str(3 * 1024 * 1024)}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    client.set("polyroute:keys:hash:abc", "an API key record")
    record = {"r": "x" * 4096}
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for _ in range(10_000):  # 40 MB at most: far past the 3 MB cap
            client.xadd("polyroute:ledger", record)
    assert client.get("polyroute:keys:hash:abc") == b"an API key record"  # nothing evicted


def test_the_ledger_stream_is_bounded_by_default_and_the_bound_can_be_lifted(chart):  # noqa: F811
    """Without a bound the stream fills Redis up to its memory cap (noeviction), then every write is
    refused: the chart bounds it by default (POLYROUTE_LEDGER_STREAM_MAX), 0 lifts the bound."""
    env = {
        e["name"]: e.get("value")
        for e in gateway_container(render(chart, {"redis": {"enabled": True}}))["env"]
    }
    assert env["POLYROUTE_LEDGER_STREAM_MAX"] == "50000"
    assert Settings.from_env(env).ledger_stream_max == 50_000
    unbounded = gateway_container(render(chart, {"redis": {"enabled": True}, "ledgerStreamMax": 0}))["env"]
    assert "POLYROUTE_LEDGER_STREAM_MAX" not in {e["name"] for e in unbounded}
    without_redis = gateway_container(render(chart))["env"]
    assert "POLYROUTE_LEDGER_STREAM_MAX" not in {e["name"] for e in without_redis}
