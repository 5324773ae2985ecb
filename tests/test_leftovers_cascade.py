"""A forced `compose:cascade` whose strongest admissible worker is also the cheapest still answers when
that worker fails, from another admissible worker, through the gateway against the test upstream.

Its chain is one level (nobody is predicted cheaper than the strongest, so nobody answers before it),
and before the fix one failure of that worker was a 502 `workflow_failed`, where fast mode would have
fallen back. Now the pool's other workers stay as fallbacks, cheapest first, `depth - 1` of them
(POLYROUTE_COMPOSE_DEPTH, 2 by default: one fallback), tried only when the strongest failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import httpx
import numpy as np
import pytest

from policies import parse_catalog
from router import save_artifact, train_artifact
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway

QUESTION = "What is six times seven?"
QUERIES = [f"Question number {i} about the weather in town {i % 7}." for i in range(60)]


@pytest.fixture
def cheap_is_strongest(upstream, tmp_path) -> Iterator[Gateway]:
    """A learned router that finds cheap always right and mid and pricey right two times in three:
    cheap, the cheapest worker of the catalog, is also the best-ranked one."""
    others = [float(i % 3 != 0) for i in range(len(QUERIES))]
    labels = np.array([[1.0, o, o] for o in others])
    artifact = train_artifact(
        QUERIES, [1] * len(QUERIES), labels, ["cheap", "mid", "pricey"], backend="static", model="logreg"
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", retries=0)
    yield gw
    gw.server.stop()


def cascade(gw: Gateway) -> httpx.Response:
    body = {"model": "compose:cascade", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 50}
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    return httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=60)


def test_the_strongest_is_the_cheapest_and_answers_alone_when_it_can(cheap_is_strongest, upstream):
    """The setting of the tests below, checked: cheap answers first and alone (no judge, nobody else)."""
    upstream.behave("cheap-model", text="42")
    answer = cascade(cheap_is_strongest)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "cheap"
    trace = answer.json()["polyroute"]["trace"]
    assert [(s["role"], s["worker"], s.get("verdict")) for s in trace["steps"]] == [
        ("answer", "cheap", "final level")
    ]
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")


def test_a_failing_strongest_and_cheapest_worker_falls_back_to_the_next_cheapest(
    cheap_is_strongest, upstream
):
    gw = cheap_is_strongest
    upstream.behave("cheap-model", status=500)
    upstream.behave("mid-model", text="42")
    answer = cascade(gw)
    assert answer.status_code == 200, answer.text  # was: 502 workflow_failed, "every level failed"
    assert answer.headers["x-polyroute-worker"] == "mid"
    assert answer.headers["x-polyroute-strategy"] == "compose:cascade"
    assert answer.headers["x-polyroute-compose"] == "answered by fallback mid: cheap failed"
    assert answer.json()["choices"][0]["message"]["content"] == "42"
    steps = answer.json()["polyroute"]["trace"]["steps"]
    assert [(s["role"], s["worker"]) for s in steps] == [("answer", "cheap"), ("answer", "mid")]
    assert "500" in steps[0]["error"]
    assert steps[1]["verdict"] == "fallback: cheap, the strongest and cheapest, failed"
    assert not upstream.requests_for("pricey-model")  # one fallback at the default depth of 2
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["worker"] == "mid"
    assert record["strategy"] == "compose:cascade"
    assert Decimal(record["cost_micros"]) > 0  # mid's answer is billed
    assert [s["worker"] for s in record["trace"]["steps"]] == ["cheap", "mid"]


def test_the_fallbacks_are_bounded_by_the_cascade_depth(cheap_is_strongest, upstream):
    """At depth 2 a cascade has at most two workers answer: cheap and one fallback. When both fail it
    is a 502, and pricey, the dearest, is not called."""
    upstream.behave("cheap-model", status=500)
    upstream.behave("mid-model", status=500)
    upstream.behave("pricey-model", text="42")
    answer = cascade(cheap_is_strongest)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "workflow_failed"
    assert "every level failed" in answer.json()["error"]["message"]
    assert not upstream.requests_for("pricey-model")


def test_deeper_cascades_keep_more_fallbacks_in_cost_order(upstream, tmp_path):
    others = [float(i % 3 != 0) for i in range(len(QUERIES))]
    labels = np.array([[1.0, o, o] for o in others])
    artifact = train_artifact(
        QUERIES, [1] * len(QUERIES), labels, ["cheap", "mid", "pricey"], backend="static", model="logreg"
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", retries=0, compose_depth=3
    )
    try:
        upstream.behave("cheap-model", status=500)
        upstream.behave("mid-model", status=503)
        upstream.behave("pricey-model", text="42")
        answer = cascade(gw)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-worker"] == "pricey"
        steps = answer.json()["polyroute"]["trace"]["steps"]
        assert [s["worker"] for s in steps] == ["cheap", "mid", "pricey"]
    finally:
        gw.server.stop()


def test_fallbacks_are_kept_only_for_a_one_level_chain():
    """Units of the same rule: a chain with a cheaper level is unchanged (its failure stays a 502 for
    a forced cascade, tests/test_compose_accounting.py); a one-level chain keeps the others."""
    from policies import Worker
    from router.compose.cascade import chain, fallbacks

    def worker(name: str, price: str) -> Worker:
        return Worker.model_validate(
            {
                "name": name,
                "model": f"openai/{name}",
                "api_base": "http://127.0.0.1:9/v1",
                "input_price_per_m": price,
                "output_price_per_m": price,
                "tier": "specialist",
                "license": "MIT",
                "provider": "fake",
                "jurisdiction": "FR",
                "context_window": 8192,
            }
        )

    free, mid, dear = worker("free", "0"), worker("mid", "1"), worker("dear", "5")
    assert [w.name for w in chain((free, dear, mid), 2)] == ["free"]
    assert [w.name for w in fallbacks((free, dear, mid), 2)] == ["mid"]
    assert [w.name for w in fallbacks((free, dear, mid), 3)] == ["mid", "dear"]
    cost = {"free": Decimal(0), "mid": Decimal(3), "dear": Decimal(2)}  # predicted, not list, order
    assert [w.name for w in fallbacks((free, dear, mid), 3, lambda w: cost[w.name])] == ["dear", "mid"]
