"""Observability audit, health (docs/api.md `GET /readyz`, `GET /healthz`): /readyz promises "every
worker's state", and listed chat workers only, so an operator could not see from it why an embedding
worker was down (its key env var unset) although /metrics' polyroute_worker_up had it at 0. Embedding
workers are listed now, marked `"kind": "embedding"`; readiness still needs a chat worker (an
in-process embedder is always up: it must not make a gateway whose every chat request fails ready).

Real parts only: gateways on uvicorn in front of the loopback test upstream."""

from __future__ import annotations

import httpx

from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, gateway_with
from tests.test_embeddings import embedding_workers

UNSET_ENV = "POLYROUTE_OBSERVE_AUDIT_UNSET_KEY"


def worker_up(gw) -> dict[str, float]:
    lines = httpx.get(gw.url + "/metrics", timeout=60).text.splitlines()
    prefix = 'polyroute_worker_up{worker="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


def test_readyz_lists_embedding_workers_as_metrics_does(fake, tmp_path):
    with gateway_with(fake, tmp_path / "data", embedding_workers(fake.url)) as gw:
        ready = httpx.get(gw.url + "/readyz", timeout=60)
        assert ready.status_code == 200, ready.text
        workers = ready.json()["workers"]
        assert workers["cheap"] == {"ready": True}  # chat workers as before
        assert workers["embed-remote"] == {"ready": True, "kind": "embedding"}
        down = workers["embed-nokey"]
        assert down["ready"] is False and down["kind"] == "embedding"
        assert "POLYROUTE_TEST_UNSET_KEY" in down["reason"]
        # /readyz and polyroute_worker_up tell the same story, worker by worker
        up = worker_up(gw)
        assert {name: bool(value) for name, value in up.items()} == {
            name: state["ready"] for name, state in workers.items()
        }


def test_embedding_workers_alone_do_not_make_the_gateway_ready(fake, tmp_path):
    chat_without_keys = catalog_yaml_for(fake.url).replace(FAKE_KEY_ENV, UNSET_ENV)
    with gateway_with(fake, tmp_path / "data", embedding_workers(fake.url), base=chat_without_keys) as gw:
        ready = httpx.get(gw.url + "/readyz", timeout=60)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["ready"] is False
        assert body["workers"]["embed-remote"] == {"ready": True, "kind": "embedding"}
        assert all(
            not state["ready"] for state in body["workers"].values() if state.get("kind") != "embedding"
        )
        assert httpx.get(gw.url + "/healthz", timeout=60).json() == {"status": "ok"}  # alive, not ready
