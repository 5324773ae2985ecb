"""GET /admin/router says per worker whether it can be called right now, as /v1/models and /readyz do:
a worker whose key env var is unset or whose local server is not running used to read there as
merely "running on its tier's prior", though no request could reach it."""

from __future__ import annotations

import httpx

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway

LOCAL = """
  - name: base-local
    model: openai/tiny-model
    local: {kind: llama_cpp, gguf: /nonexistent/tiny.gguf, instruct: false}
    context_window: 2048
    input_price_per_m: 0
    output_price_per_m: 0
    active_params_b: 0.27
    tier: local
    license: gemma
    provider: local
    jurisdiction: local
"""


def _get(gw, path: str, key: str) -> dict:
    response = httpx.get(gw.url + path, headers=gw.auth(key), timeout=30)
    assert response.status_code in (200, 503), response.text  # /readyz is 503 when not ready
    return response.json()


def test_admin_router_says_which_workers_cannot_be_called_and_why(upstream, tmp_path):
    # the shipped prior in force: every worker rests on a prior, the callable and the uncallable alike;
    # local workers off (start_gateway's default), so base-local's server never runs
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + LOCAL)
    gw = start_gateway(catalog, tmp_path / "data", router_prior=True)
    try:
        workers = _get(gw, "/admin/router", gw.admin_key)["workers"]
        models = {m["id"]: m["polyroute"] for m in _get(gw, "/v1/models", gw.api_key)["data"]}
        ready = _get(gw, "/readyz", gw.api_key)["workers"]

        assert workers["cheap"]["available"] is True and workers["cheap"]["unavailable_reason"] is None
        assert workers["cheap"]["basis"] == "prior"  # what the router knows is still said
        assert workers["nokey"]["available"] is False
        assert "POLYROUTE_TEST_UNSET_KEY" in workers["nokey"]["unavailable_reason"]
        assert workers["base-local"]["available"] is False
        assert "POLYROUTE_LOCAL_WORKERS=false" in workers["base-local"]["unavailable_reason"]
        # the same check and the same words as /v1/models and /readyz, for every chat worker
        assert set(workers) == {w.name for w in catalog.workers}
        for name, entry in workers.items():
            assert entry["available"] == models[name]["available"] == ready[name]["ready"], name
            assert entry["unavailable_reason"] == models[name]["unavailable_reason"], name
            assert entry["unavailable_reason"] == ready[name].get("reason"), name
    finally:
        gw.server.stop()


def test_admin_router_availability_under_the_rule_based_router(gateway):
    workers = _get(gateway, "/admin/router", gateway.admin_key)["workers"]
    assert workers["nokey"]["basis"] == "rules" and workers["nokey"]["available"] is False
    assert all(workers[name]["available"] for name in ("cheap", "mid", "pricey"))
