"""The learned router: training, artifacts, hot swap, fallback, exploration, and the gateway path
(feedback over HTTP, training from the ledger, a new model taking over without a restart)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.router_state import RouterHolder
from policies import parse_catalog
from router import (
    LearnedRouter,
    RouteRequest,
    RouterLoadError,
    feature_builder_for,
    load_current,
    load_version,
    read_pointer,
    rollback,
    save_artifact,
    train_artifact,
)
from router.offline import load_routellm
from tests.conftest import catalog_yaml_for, start_gateway

FIXTURE = Path(__file__).parent / "fixtures" / "routellm"
MATH = [
    f"Compute {a} * {b} + {a + b} and show every step of the arithmetic."
    for a in range(3, 60, 2)
    for b in (7, 11)
]
CHAT = [f"Say hello to my friend number {i} in a warm and friendly tone." for i in range(58)]


def synthetic():
    """pricey answers everything; cheap fails the arithmetic: a router should learn to split them."""
    texts = MATH + CHAT
    labels = np.array([[0.0, 1.0]] * len(MATH) + [[1.0, 1.0]] * len(CHAT))
    return texts, [1] * len(texts), labels, ["cheap", "pricey"]


@pytest.fixture(scope="module")
def trained():
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


def test_training_is_deterministic_with_a_seed():
    ds = load_routellm(FIXTURE, parts=("mmlu", "gsm8k"))
    first = train_artifact(ds.texts, ds.turns, ds.labels, ds.workers, backend="static", model="logreg")
    second = train_artifact(ds.texts, ds.turns, ds.labels, ds.workers, backend="static", model="logreg")
    builder = feature_builder_for(first.features)
    X = builder.transform(ds.texts, ds.turns)
    assert np.array_equal(first.model.predict(X), second.model.predict(X))
    assert first.observed == {w: int(np.sum(~np.isnan(ds.labels[:, i]))) for i, w in enumerate(ds.workers)}


def test_the_model_learns_who_answers_what(trained):
    router = LearnedRouter(trained, feature_builder_for(trained.features))
    math = router.predict_quality("Compute 101 * 7 + 108 and show every step of the arithmetic.")
    chat = router.predict_quality("Say hello to my friend number 99 in a warm and friendly tone.")
    assert math["pricey"] > math["cheap"] + 0.3
    assert chat["cheap"] > 0.7


def test_route_respects_pool_and_lambda(trained, upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    router = LearnedRouter(trained, feature_builder_for(trained.features))
    math = "Compute 101 * 7 + 108 and show every step of the arithmetic."
    pool = tuple(w for w in catalog.workers if w.name in ("cheap", "pricey"))
    assert router.route(RouteRequest(len(math), text=math, cost_weight=0.1), pool).workers[0].name == "pricey"
    assert router.route(RouteRequest(len(math), text=math, cost_weight=50), pool).workers[0].name == "cheap"
    only_cheap = tuple(w for w in pool if w.name == "cheap")
    decision = router.route(RouteRequest(len(math), text=math, cost_weight=0), only_cheap)
    assert [w.name for w in decision.workers] == ["cheap"]  # never widens the pool
    target = router.route(RouteRequest(len(math), text=math, min_quality=0.8), pool)
    assert target.workers[0].name == "pricey" and "reach quality 0.8" in target.reason


def test_unknown_worker_gets_a_pessimistic_prior(trained, upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    router = LearnedRouter(trained, feature_builder_for(trained.features))
    math = "Compute 101 * 7 + 108 and show every step of the arithmetic."
    estimates = {
        e.worker: e for e in router.estimates(RouteRequest(len(math), text=math), list(catalog.workers[:3]))
    }
    assert estimates["mid"].known is False
    assert estimates["mid"].quality == pytest.approx(
        min(estimates["cheap"].quality, estimates["pricey"].quality)
    )


def test_exploration_is_bounded_and_only_for_under_observed_workers(trained, upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    pool = tuple(catalog.workers[:3])  # cheap, pricey (observed 116 each), mid (never seen)
    router = LearnedRouter(
        trained, feature_builder_for(trained.features), exploration=0.2, min_examples=50, seed=1
    )
    text = "Say hello to my friend number 3 in a warm and friendly tone."
    decisions = [router.route(RouteRequest(len(text), text=text), pool) for _ in range(1000)]
    explored = [d for d in decisions if d.strategy == "explore"]
    assert 150 <= len(explored) <= 250
    assert {d.workers[0].name for d in explored} == {"mid"}
    with pytest.raises(ValueError):
        LearnedRouter(trained, feature_builder_for(trained.features), exploration=0.9)


# ---- artifacts -------------------------------------------------------------------------------
def test_save_load_activate_rollback(trained, tmp_path):
    first = save_artifact(tmp_path, trained).name
    assert read_pointer(tmp_path) == {"version": first, "previous": None}
    card = json.loads((tmp_path / first / "card.json").read_text())
    assert card["workers"] == ["cheap", "pricey"] and card["model"] == "logreg" and card["rows"] == 116
    assert card["features"]["backend"] == "static" and "selection" in card
    again = train_artifact(*synthetic(), backend="static", model="logreg", random_state=1)
    second = save_artifact(tmp_path, again).name
    assert load_current(tmp_path).version == second
    assert rollback(tmp_path) == first
    assert load_current(tmp_path).version == first


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda d: (d / "model.joblib").write_bytes(b"not a pickle"), "cannot load model"),
        (lambda d: (d / "model.joblib").unlink(), "missing"),
    ],
)
def test_corrupt_model_files_give_clear_errors(trained, tmp_path, damage, fragment):
    version = save_artifact(tmp_path, trained).name
    damage(tmp_path / version)
    with pytest.raises(RouterLoadError, match=fragment):
        load_version(tmp_path, version)


def test_mismatched_features_are_refused(trained):
    wrong = {**trained.features, "dim": 999}
    with pytest.raises(RouterLoadError, match="feature mismatch"):
        feature_builder_for(wrong)
    with pytest.raises(RouterLoadError, match="unusable features"):
        feature_builder_for({"nothing": 1})


def test_holder_falls_back_to_rules_and_recovers(trained, tmp_path):
    holder = RouterHolder(tmp_path)
    assert holder.current.name == "rules-cheapest" and holder.error is None
    good = save_artifact(tmp_path, trained).name
    assert holder.changed() and holder.reload()
    assert holder.current.version == good
    bad = save_artifact(
        tmp_path, train_artifact(*synthetic(), backend="static", model="logreg", random_state=3)
    ).name
    (tmp_path / bad / "model.joblib").write_bytes(b"garbage")
    assert holder.changed() and not holder.reload()
    assert holder.current.version == good  # the last good model stays
    assert bad in holder.error and not holder.changed()  # a broken version is not retried in a loop
    status = holder.status()
    assert status["active"] == "learned" and status["error"]


# ---- through the gateway ---------------------------------------------------------------------
@pytest.fixture
def learned_gateway(upstream, tmp_path, trained):
    router_dir = tmp_path / "data" / "router"
    version = save_artifact(router_dir, trained).name
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", router_reload_interval_s=0.05
    )
    gw.version = version
    yield gw
    gw.server.stop()


def ask(gw, text: str, **extra) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=30)


def test_gateway_routes_with_the_learned_model(learned_gateway, upstream):
    math = ask(
        learned_gateway,
        "Compute 205 * 11 + 216 and show every step of the arithmetic.",
        metadata={"cost_weight": 0.1},
    )
    assert math.status_code == 200
    assert math.headers["x-polyroute-router-version"] == learned_gateway.version
    assert math.headers["x-polyroute-worker"] == "pricey"
    chat = ask(learned_gateway, "Say hello to my friend number 77 in a warm and friendly tone.")
    assert chat.headers["x-polyroute-worker"] == "cheap"
    header_weight = httpx.post(
        learned_gateway.v1 + "/chat/completions",
        headers={**learned_gateway.auth(), "x-polyroute-cost-weight": "100"},
        json={"model": "auto", "messages": [{"role": "user", "content": "Compute 9 * 9 + 18 step by step."}]},
    )
    assert header_weight.headers["x-polyroute-worker"] == "cheap"
    bad = ask(learned_gateway, "hi", metadata={"cost_weight": "lots"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.cost_weight"
    ready = httpx.get(learned_gateway.url + "/readyz").json()
    assert ready["router"]["active"] == "learned" and ready["router"]["version"] == learned_gateway.version


def test_feedback_round_trip_and_training_from_the_ledger(learned_gateway, upstream, tmp_path):
    gw = learned_gateway
    ids = []
    for i in range(60):  # traffic the model knows nothing about yet, pinned to mid
        r = httpx.post(
            gw.v1 + "/chat/completions",
            headers=gw.auth(),
            timeout=30,
            json={"model": "mid", "messages": [{"role": "user", "content": f"Translate word {i} to French"}]},
        )
        ids.append(r.headers["x-polyroute-request-id"])
    for i, request_id in enumerate(ids):
        body = (
            {"request_id": request_id, "thumbs": "up"} if i % 2 else {"request_id": request_id, "score": 0.9}
        )
        response = httpx.post(gw.v1 + "/feedback", headers=gw.auth(), json=body)
        assert response.status_code == 201 and response.json()["worker"] == "mid"
    assert (
        httpx.post(
            gw.v1 + "/feedback", headers=gw.auth(), json={"request_id": "req_nope", "score": 1}
        ).status_code
        == 404
    )
    both = httpx.post(
        gw.v1 + "/feedback", headers=gw.auth(), json={"request_id": ids[0], "score": 1, "thumbs": "up"}
    )
    assert both.status_code == 400
    _, other_key = gw.state.auth.store.create("someone-else")
    foreign = httpx.post(
        gw.v1 + "/feedback", headers=gw.auth(other_key), json={"request_id": ids[0], "score": 0}
    )
    assert foreign.status_code == 404  # another tenant's request id is not even confirmed to exist

    ledger = [json.loads(line) for line in (gw.data_dir / "ledger.jsonl").read_text().splitlines()]
    assert sum(1 for r in ledger if r["type"] == "feedback") == 60
    request = next(r for r in ledger if r["type"] == "request" and r["id"] == ids[0])
    assert request["worker"] == "mid" and request["query"] == "Translate word 0 to French"
    assert request["router_version"] == gw.version and request["cost_micros"] >= 0

    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyroute.cli",
            "router",
            "train",
            "--from-ledger",
            "--backend",
            "static",
            "--model",
            "logreg",
            "--data-dir",
            str(gw.data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    new_version = read_pointer(gw.data_dir / "router")["version"]
    assert new_version != gw.version
    deadline = time.monotonic() + 20
    while ask(gw, "Translate word 1000 to French").headers["x-polyroute-router-version"] != new_version:
        assert time.monotonic() < deadline, "the new model never took over"
        time.sleep(0.1)
    assert load_current(gw.data_dir / "router").observed == {"mid": 60}


def test_pii_queries_never_reach_the_ledger(learned_gateway, upstream):
    response = ask(learned_gateway, "Email the report to jane.doe@example.com please")
    assert response.status_code == 200 and response.headers["x-polyroute-data-class"] == "pii"
    ledger = (learned_gateway.data_dir / "ledger.jsonl").read_text()
    assert "jane.doe" not in ledger
    request_id = response.headers["x-polyroute-request-id"]
    record = next(json.loads(x) for x in ledger.splitlines() if request_id in x)
    assert record["query"] is None and record["data_class"] == "pii"


def test_corrupt_model_at_start_serves_with_rules_and_says_so(upstream, tmp_path, trained):
    router_dir = tmp_path / "data" / "router"
    version = save_artifact(router_dir, trained).name
    (router_dir / version / "model.joblib").write_bytes(b"\x00garbage")
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data")
    try:
        response = ask(gw, "hello")
        assert response.status_code == 200 and response.headers["x-polyroute-router-version"] == "rules"
        ready = httpx.get(gw.url + "/readyz").json()["router"]
        assert ready["fallback"] is True and "cannot load model" in ready["error"]
    finally:
        gw.server.stop()


def test_cli_status_and_rollback(trained, tmp_path):
    first = save_artifact(tmp_path / "router", trained).name
    save_artifact(
        tmp_path / "router", train_artifact(*synthetic(), backend="static", model="logreg", random_state=5)
    )

    def run(*a):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "polyroute.cli",
                "router",
                *a,
                "--router-dir",
                str(tmp_path / "router"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        )

    status = run("status")
    assert status.returncode == 0 and first in status.stdout and "logreg" in status.stdout
    back = run("rollback")
    assert back.returncode == 0 and read_pointer(tmp_path / "router")["version"] == first
    assert run("rollback").returncode == 0  # back and forth: the pointer keeps one previous version
