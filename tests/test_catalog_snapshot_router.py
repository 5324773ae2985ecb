"""A routing call uses one worker catalog: the one its request started with (gateway/router_state.py
set_catalog, router/learned.py ``with_catalog``), whatever a catalog reload does while it runs.

The learned router reads the catalog for ``profile_like`` priors only: a worker the model has no
column for, whose ``profile_like`` names another worker the model has no column for either, starts
from that worker's own prior, its tier's. Here ``newbie`` is like ``nokey`` (an unavailable worker,
so never in the pool), and the reload changes nokey's tier: open-moe, which the model never saw (the
worst known worker's prediction, 0 for arithmetic), or frontier (the frontier tier's mean, 1.0).
Asked for the cheapest worker predicted to reach quality 0.9, routing picks ``pricey`` under the
first catalog and ``newbie`` (cheaper) under the second.
"""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest
import yaml

from gateway.router_state import RouterHolder
from policies import Worker, parse_catalog
from router import RouteRequest, save_artifact, train_artifact
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_catalog_reload import BASE_POLICY, TIMEOUT_S, TOKENS, wait_applied, write_text
from tests.test_router_learned import synthetic

MATH = "Compute 101 * 7 + 108 and show every step of the arithmetic."
NEWBIE = """
  - name: newbie
    model: openai/newbie-model
    api_base: {url}/v1
    api_key_env: POLYROUTE_TEST_UPSTREAM_KEY
    context_window: 8192
    input_price_per_m: 3.00
    output_price_per_m: 4.00
    tier: specialist
    license: MIT
    provider: fake
    profile_like: nokey
"""


def catalogs(url: str) -> tuple[str, str]:
    """(nokey unseen by the model's tiers, nokey frontier): the same catalog but for nokey's tier."""
    text = catalog_yaml_for(url) + NEWBIE.format(url=url)
    head, nokey = text.split("  - name: nokey\n")
    unseen = head + "  - name: nokey\n" + nokey.replace("tier: frontier", "tier: open-moe")
    return unseen, text


def by_name(text: str) -> dict[str, Worker]:
    return {w.name: w for w in parse_catalog(text).workers}


def start(upstream, tmp_path, text: str):
    """As tests/test_catalog_reload.py starts a gateway, with a body that may take its time: a test
    holds a request's body while the catalog reloads."""
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(text)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(BASE_POLICY))
    gw = start_gateway(
        None,
        tmp_path / "data",
        workers_file=workers_file,
        policy_file=policy_file,
        policy_reload_interval_s=0.05,
        body_timeout_s=TIMEOUT_S * 2,
    )
    gw.state.catalog_file.interval_s = 0  # every check looks at the file
    for model in ("pricey-model", "newbie-model"):
        upstream.behave(model, **TOKENS)
    return gw, workers_file


@pytest.fixture(scope="module")
def trained():
    """pricey answers arithmetic, cheap does not; tiers known: specialist (cheap), frontier (pricey)."""
    return train_artifact(
        *synthetic(),
        backend="static",
        model="logreg",
        random_state=0,
        tiers={"cheap": "specialist", "pricey": "frontier"},
    )


@pytest.fixture
def holder(trained, tmp_path):
    save_artifact(tmp_path / "router", trained)
    unseen, _ = catalogs("http://127.0.0.1:1")
    holder = RouterHolder(tmp_path / "router", catalog=by_name(unseen))
    assert holder.current.name == "learned", holder.error
    return holder


def pool_of(text: str) -> list[Worker]:
    return [w for w in parse_catalog(text).workers if w.name != "nokey"]  # nokey: no key, never admitted


def test_the_router_a_request_holds_keeps_its_catalog_across_a_reload(holder):
    unseen, frontier = catalogs("http://127.0.0.1:1")
    request = RouteRequest(len(MATH), text=MATH, min_quality=0.9)
    held = holder.current  # as a request takes it, with its catalog, when it starts
    holder.set_catalog(by_name(frontier))
    assert held.route(request, tuple(pool_of(unseen))).workers[0].name == "pricey"  # its own catalog
    after = holder.current  # a request started after the reload: the new catalog
    assert after.route(request, tuple(pool_of(frontier))).workers[0].name == "newbie"
    assert after.version == held.version and after.artifact is held.artifact  # the same model
    # a listing given the catalog it shows reads the router's basis from it, whatever the router's own
    assert after.basis(by_name(unseen)["newbie"], by_name(unseen))["from"].startswith(
        "nokey's prior: the worst"
    )


def test_a_reload_during_a_routing_call_does_not_reach_it_part_way(holder):
    """Two workers like nokey, estimated one after the other; the reload lands between the two."""
    unseen, frontier = catalogs("http://127.0.0.1:1")
    twin = by_name(unseen)["newbie"].model_copy(update={"name": "newbie2"})
    router = holder.current

    def pool():  # the estimates loop reads it worker by worker: the reload comes after the first
        yield by_name(unseen)["newbie"]
        holder.set_catalog(by_name(frontier))
        yield twin

    estimates = router.estimates(RouteRequest(len(MATH), text=MATH), pool())
    assert [e.worker for e in estimates] == ["newbie", "newbie2"]
    assert estimates[0].quality == estimates[1].quality == pytest.approx(0.0, abs=0.05)


# ---- through the gateway ---------------------------------------------------------------------
def _headers_then_wait(url: str, path: str, headers: dict[str, str], body: bytes) -> socket.socket:
    """Send a request's head with `expect: 100-continue` and return once the gateway has started
    reading its body (its "100 Continue": the request has taken its catalog and router by then)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    head = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "connection: close", "expect: 100-continue"]
    head += [f"{k}: {v}" for k, v in {**headers, "content-length": str(len(body))}.items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    interim = b""
    while b"\r\n\r\n" not in interim:
        chunk = sock.recv(4096)
        assert chunk, f"the gateway closed the connection: {interim!r}"
        interim += chunk
    assert interim.startswith(b"HTTP/1.1 100"), interim
    return sock


def _response(sock: socket.socket, body: bytes) -> tuple[int, dict[str, str], bytes]:
    sock.sendall(body)
    raw = b""
    while chunk := sock.recv(65536):  # connection: close, so the answer ends with the connection
        raw += chunk
    sock.close()
    head, _, content = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, content


def test_a_request_in_flight_is_routed_on_the_catalog_it_started_with(upstream, trained, tmp_path):
    unseen, frontier = catalogs(upstream.url)
    save_artifact(tmp_path / "data" / "router", trained)
    gw, workers_file = start(upstream, tmp_path, unseen)
    try:
        assert gw.state.router.current.name == "learned", gw.state.router.error
        body = orjson.dumps(
            {
                "model": "auto",
                "messages": [{"role": "user", "content": MATH}],
                "metadata": {"min_quality": 0.9},
            }
        )
        headers = {**gw.auth(), "content-type": "application/json"}
        sock = _headers_then_wait(gw.url, "/v1/chat/completions", headers, body)
        try:
            write_text(workers_file, frontier)
            wait_applied(gw, frontier)
        finally:
            status, answer, content = _response(sock, body)
        assert status == 200, content
        # admitted on the first catalog, routed on it too: newbie's prior is nokey's there (0 for this)
        assert answer["x-polyroute-worker"] == "pricey", answer["x-polyroute-route-reason"]
        after = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), content=body, timeout=30)
        assert after.headers["x-polyroute-worker"] == "newbie"  # the next request: the new catalog
    finally:
        gw.server.stop()


def test_listings_read_one_catalog_and_the_router_basis_follows_a_reload(upstream, trained, tmp_path):
    """/admin/router and /v1/models list the workers of the catalog in force, the router's basis for
    each read from the same version (a profile's prior: nokey's tier in that catalog)."""
    unseen, frontier = catalogs(upstream.url)
    save_artifact(tmp_path / "data" / "router", trained)
    gw, workers_file = start(upstream, tmp_path, unseen)
    admin = gw.auth(gw.admin_key)
    try:
        before = httpx.get(gw.url + "/admin/router", headers=admin, timeout=30).json()["workers"]
        assert before["newbie"]["from"] == "nokey's prior: the worst known worker's quality for each query"
        write_text(workers_file, frontier)
        wait_applied(gw, frontier)
        after = httpx.get(gw.url + "/admin/router", headers=admin, timeout=30).json()["workers"]
        assert after["newbie"]["from"] == "nokey's prior: the tier's mean quality"
        assert after["nokey"] == {**after["nokey"], "available": False, "basis": "prior", "tier": "frontier"}
        models = httpx.get(gw.v1 + "/models", headers=gw.auth(), timeout=30).json()["data"]
        cards = {m["id"]: m for m in models}
        assert cards["nokey"]["polyroute"]["tier"] == "frontier"
        assert cards["auto"]["polyroute"]["calibrated"] == ["cheap", "pricey"]
    finally:
        gw.server.stop()
