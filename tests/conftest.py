"""Shared fixtures: the test upstream, a gateway in front of it, keys. All on loopback."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# OpenMP threads that spin while they wait (libgomp's default) make LightGBM's training 20-100x slower
# on a 2-core machine busy with anything else; read when libgomp loads, so set before any import.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from gateway import Settings, create_app  # noqa: E402
from gateway.state import AppState  # noqa: E402
from policies import Catalog, parse_catalog  # noqa: E402
from tests.fakes.server import RunningServer, serve_in_thread  # noqa: E402
from tests.fakes.upstream import FakeUpstream  # noqa: E402

FAKE_KEY_ENV = "POLYROUTE_TEST_UPSTREAM_KEY"
ADMIN_KEY = "pr-test-admin-key"


def catalog_yaml_for(upstream_url: str) -> str:
    """Five workers on the test upstream, priced apart so the cheapest rule orders them."""
    common = f"api_base: {upstream_url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192"
    return f"""
version: 1
workers:
  - name: cheap
    model: openai/cheap-model
    {common}
    input_price_per_m: 0.10
    output_price_per_m: 0.20
    tier: specialist
    license: Apache-2.0
    provider: fake
    jurisdiction: FR
    capabilities: [general, tools]
  - name: mid
    model: openai/mid-model
    {common}
    input_price_per_m: 1.00
    output_price_per_m: 2.00
    tier: open-moe
    license: MIT
    provider: fake
    jurisdiction: CN
    capabilities: [general, tools]
  - name: pricey
    model: openai/pricey-model
    {common}
    input_price_per_m: 5.00
    output_price_per_m: 15.00
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
  - name: nokey
    model: openai/nokey-model
    api_base: {upstream_url}/v1
    api_key_env: POLYROUTE_TEST_UNSET_KEY
    context_window: 8192
    input_price_per_m: 0.01
    output_price_per_m: 0.01
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
"""


@contextmanager
def running_upstream() -> Iterator[FakeUpstream]:
    """A test upstream of its own on loopback, stopped on exit (its held calls released first)."""
    fake = FakeUpstream()
    running = serve_in_thread(fake.app)
    fake.url = running.url  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        fake.release_all()
        running.stop()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    """A test upstream of this module's own: the calls it holds hold up no other module's. Its
    modules reset it before each test (`reset_fake`), which releases the previous test's held calls."""
    with running_upstream() as upstream:
        yield upstream


@pytest.fixture
def reset_fake(fake: FakeUpstream) -> None:
    fake.reset()


@pytest.fixture
def held() -> Iterator[FakeUpstream]:
    """A test upstream of this test's own, for holding a worker's calls (`FakeUpstream.hold`)."""
    with running_upstream() as fake:
        yield fake


@pytest.fixture(scope="session")
def upstream() -> Iterator[FakeUpstream]:
    with running_upstream() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _reset_upstream(request: pytest.FixtureRequest) -> None:
    if "upstream" in request.fixturenames:
        request.getfixturevalue("upstream").reset()


@dataclass
class Gateway:
    url: str
    api_key: str
    admin_key: str
    state: AppState
    server: RunningServer
    data_dir: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.api_key}"}


def start_gateway(catalog: Catalog, data_dir: Path, **settings) -> Gateway:
    os.environ[FAKE_KEY_ENV] = "sk-test-upstream"
    # router_prior=False: these tests pin the rule-based router's choices; tests/test_shipped_prior.py
    # starts gateways with the shipped prior in force.
    defaults = dict(
        admin_key=ADMIN_KEY,
        local_workers=False,
        retry_backoff_s=0.01,
        key_reload_interval_s=0,
        router_prior=False,
    )
    config = Settings(data_dir=data_dir, **{**defaults, **settings})
    app = create_app(config, catalog)
    state: AppState = app.state.polyroute
    _, key = state.auth.store.create("acme", "test key")
    running = serve_in_thread(app)
    return Gateway(running.url, key, ADMIN_KEY, state, running, data_dir)


def ledger_record(gw, request_id: str, timeout_s: float = 60.0) -> dict:
    """The ledger record of one request, once written (a stream's is settled in its own task)."""
    deadline = time.monotonic() + timeout_s
    path = Path(gw.data_dir) / "ledger.jsonl"
    while True:
        if path.exists():
            for line in path.read_text().splitlines():
                if request_id in line:
                    record = json.loads(line)
                    if record.get("id") == request_id:
                        return record
        assert time.monotonic() < deadline, f"no ledger record for {request_id}"
        time.sleep(0.05)


def stream_and_hang_up(
    url: str, headers: dict[str, str], body: dict, marker: str, after: int = 10
) -> tuple[str, int]:
    """A client that reads a stream's data lines and hangs up after `after` of them hold `marker`.
    Returns the request id and how many such lines it received."""
    import httpx

    received = 0
    with httpx.Client(timeout=60) as http, http.stream("POST", url, headers=headers, json=body) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-polyroute-request-id"]
        for line in response.iter_lines():
            if line.startswith("data:") and marker in line:
                received += 1
                if received == after:
                    break  # hang up: leaving the block closes the connection mid-stream
    return request_id, received


def budget_gateway(upstream: FakeUpstream, data_dir: Path, daily_usd: str) -> Gateway:
    """The test catalog's gateway with one policy: tenant acme (the test key's) may spend daily_usd a day."""
    import yaml

    policy_file = data_dir / "policy.yaml"
    data_dir.mkdir(parents=True, exist_ok=True)
    policy_file.write_text(
        yaml.safe_dump({"version": "b", "tenants": {"acme": {"budget": {"daily_usd": daily_usd}}}})
    )
    return start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), data_dir / "data", policy_file=policy_file
    )


@pytest.fixture(scope="session")
def gateway(upstream: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    catalog = parse_catalog(catalog_yaml_for(upstream.url), "test catalog")
    gw = start_gateway(catalog, tmp_path_factory.mktemp("gateway"), max_body_bytes=64 * 1024)
    yield gw
    gw.server.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RedisServer:
    """A real redis-server on a random loopback port, without persistence; stopped after use."""

    def __init__(self, persist_dir: Path | None = None) -> None:
        """`persist_dir`: keep the data across stop()/start() (append-only file), as a real Redis would."""
        import shutil
        import socket

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: `make test` installs it (apt-get install redis-server)"
            )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.binary = binary
        self.persist_dir = persist_dir
        self.start()

    def start(self) -> None:
        """Launch (or relaunch, on the same port) and wait until it answers PING."""
        import subprocess

        persistence = ["--appendonly", "no"]
        if self.persist_dir is not None:
            persistence = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.persist_dir)]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def backend_redis_url(request: pytest.FixtureRequest) -> str | None:
    """The Redis URL for a fixture parametrised "redis" or not ("memory", "file"): the session's
    redis-server, flushed so that no earlier test's state is seen, or None (no Redis)."""
    if request.param != "redis":
        return None
    import redis

    server: RedisServer = request.getfixturevalue("redis_server")
    redis.Redis.from_url(server.url).flushdb()
    return server.url


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path):
    """The shared-state stores on both backends: in-process, and a real redis-server (flushed)."""
    from gateway.store import open_stores

    opened = open_stores(tmp_path, backend_redis_url(request))
    yield opened
    await opened.close()
    opened.ledger.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@contextmanager
def gateway_with(
    fake: FakeUpstream, data_dir: Path, workers: str, base: str | None = None
) -> Iterator[Gateway]:
    """A gateway on the test catalog (or the catalog text `base`) with `workers` added: catalog YAML
    entries whose `{url}` and `{key_env}` are the upstream's URL and its key's env var. Stopped on exit."""
    text = (catalog_yaml_for(fake.url) if base is None else base) + workers.format(
        url=fake.url, key_env=FAKE_KEY_ENV
    )
    gateway = start_gateway(parse_catalog(text, f"{data_dir.name} catalog"), data_dir)
    try:
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture(scope="module")
def exporter():
    """OpenTelemetry on for a module's tests: the spans the in-process gateway ends, in memory (the
    SDK's own exporter; `exporter.provider` is the TracerProvider installed)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway import tracing

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    assert tracing.setup(provider=provider, capture_content=False) is provider
    memory.provider = provider  # type: ignore[attr-defined]
    yield memory
    tracing.shutdown(provider)
