"""The worker catalog (validation, defaults) and the rule-based router."""

from __future__ import annotations

from decimal import Decimal

import pytest

from policies import CatalogError, admit, load_catalog, parse_catalog
from router import CheapestRouter, RouteRequest

WORKER = """
  - name: {name}
    model: openai/{name}
    api_base: http://127.0.0.1:1/v1
    input_price_per_m: {price}
    output_price_per_m: {price}
    tier: specialist
    license: MIT
    provider: p
    context_window: 1000
    capabilities: {caps}
"""


def catalog_of(*workers: tuple[str, float, str]) -> str:
    body = "".join(WORKER.format(name=n, price=p, caps=c) for n, p, c in workers)
    return "version: 1\nworkers:\n" + body


def test_default_catalog_has_the_required_kinds_of_worker():
    catalog = load_catalog()
    tiers = {w.tier.value for w in catalog.workers}
    assert {"local", "frontier", "open-moe", "specialist"} <= tiers
    jurisdictions = {w.jurisdiction for w in catalog.workers if w.tier.value == "open-moe"}
    assert "CN" in jurisdictions and jurisdictions & {"US", "FR"}
    local = [w for w in catalog.workers if w.local is not None]
    assert len(local) == 1 and local[0].local.gguf.startswith("package:")
    for worker in catalog.workers:
        assert worker.license and worker.provider and worker.context_window > 0
        if worker.tier.value != "local":
            assert worker.input_price_per_m > 0 and worker.api_key_env
            # an embedding worker has no output tokens, so no output price
            assert worker.output_price_per_m > 0 or worker.kind == "embedding"


def test_workers_without_keys_are_unavailable_not_errors():
    catalog = load_catalog()
    admission = admit(catalog, env={})
    assert [w.name for w in admission.pool] == ["gemma-3-270m-local"]
    reasons = {e.worker: e.reason for e in admission.excluded}
    assert reasons["gpt-4.1"] == "env var OPENAI_API_KEY is not set"
    with_key = admit(catalog, env={"OPENAI_API_KEY": "sk-x"})
    assert with_key.admits("gpt-4.1")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("workers: [", "invalid YAML"),
        ("- just a list", "mapping"),
        ("version: 1\nworkers: []", "workers"),
        (catalog_of(("a", 1, "[]"), ("a", 2, "[]")), "duplicate worker name 'a'"),
        (catalog_of(("auto", 1, "[]")), "reserved"),
        (catalog_of(("a", -1, "[]")), "input_price_per_m"),
        ("version: 1\nworkers:\n  - name: x\n    model: openai/x\n", "license"),
        (catalog_of(("a", 1, "[]")).replace("tier: specialist", "tier: galactic"), "tier"),
        (catalog_of(("a", 1, "[]")) + "    colour: blue\n", "colour"),
    ],
)
def test_invalid_catalogs_are_refused_with_the_reason(text, fragment):
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, "workers.yaml")
    assert "workers.yaml" in str(info.value) and fragment in str(info.value)


def test_missing_catalog_file(tmp_path):
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "nope.yaml")


def test_active_params_cannot_exceed_total():
    text = catalog_of(("a", 1, "[]")) + "    total_params_b: 7\n    active_params_b: 13\n"
    with pytest.raises(CatalogError, match="active_params_b"):
        parse_catalog(text)


def test_cost_is_exact_decimal():
    worker = parse_catalog(catalog_of(("a", 0.3, "[]"))).workers[0]
    assert worker.cost_usd(1_000_000, 1_000_000) == Decimal("0.6")
    assert worker.cost_usd(3, 0) == Decimal("0.0000009")


def test_cheapest_router_orders_by_predicted_cost_and_breaks_ties_by_name():
    catalog = parse_catalog(catalog_of(("b", 2, "[]"), ("c", 1, "[]"), ("a", 1, "[]")))
    decision = CheapestRouter().route(RouteRequest(prompt_chars=400), catalog.workers)
    assert [w.name for w in decision.workers] == ["a", "c", "b"]
    assert decision.strategy == "fast" and "cheapest" in decision.reason
    assert decision.predicted_cost_usd == catalog.get("a").cost_usd(100, 256)


def test_cheapest_router_prefers_tool_capable_workers_when_tools_are_sent():
    catalog = parse_catalog(catalog_of(("cheap", 1, "[]"), ("tooly", 5, "[tools]")))
    decision = CheapestRouter().route(RouteRequest(prompt_chars=10, needs_tools=True), catalog.workers)
    assert decision.workers[0].name == "tooly"
    no_tools = parse_catalog(catalog_of(("cheap", 1, "[]")))
    assert (
        CheapestRouter().route(RouteRequest(10, needs_tools=True), no_tools.workers).workers[0].name
        == "cheap"
    )


def test_router_refuses_an_empty_pool():
    with pytest.raises(ValueError, match="empty"):
        CheapestRouter().route(RouteRequest(prompt_chars=1), ())
