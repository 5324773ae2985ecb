"""The shipped prior (router/prior/, router/shipped.py): a learned router in force on a gateway's first
start, which says per catalog worker whether it is calibrated or runs on its tier's prior."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import numpy as np
import pytest

from gateway.router_state import RouterHolder
from policies import parse_catalog
from router import (
    LearnedRouter,
    RouteRequest,
    feature_builder_for,
    load_current,
    load_version,
    read_pointer,
    save_artifact,
    train_artifact,
)
from router.onboard import onboard_artifact
from router.shipped import (
    SHIPPED_DIR,
    ShippedPriorError,
    install_shipped_prior,
    shipped_version,
    try_install_shipped_prior,
)
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_router_learned import CHAT, MATH, synthetic


def test_the_shipped_prior_is_small_and_names_its_public_models_tiers():
    card = json.loads((SHIPPED_DIR / "card.json").read_text())
    assert sum(f.stat().st_size for f in SHIPPED_DIR.iterdir()) < 1_000_000
    assert card["version"] == shipped_version() and card["kind"] == "shipped prior"
    assert set(card["public_tiers"]) == set(card["workers"]) and len(card["workers"]) >= 15
    assert {"frontier", "open-moe", "specialist", "local"} == set(card["public_tiers"].values())
    assert all(rows["rows"] > 0 for rows in card["data"]["rows"].values())


def test_install_puts_the_prior_in_force_once_and_never_over_a_trained_router(tmp_path):
    root = tmp_path / "router"
    assert install_shipped_prior(root) == shipped_version()
    assert read_pointer(root)["version"] == shipped_version()
    assert install_shipped_prior(root) is None  # already in force: nothing to do
    trained = tmp_path / "trained"
    version = save_artifact(trained, train_artifact(*synthetic(), backend="static", model="logreg")).name
    assert install_shipped_prior(trained) is None and read_pointer(trained)["version"] == version
    assert not any(p.name.startswith(".") for p in root.iterdir())  # no staging left behind


def _get(gw, path: str) -> dict:
    response = httpx.get(gw.url + path, headers={"authorization": f"Bearer {gw.admin_key}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_first_start_routes_auto_with_the_prior_and_says_which_workers_are_calibrated(upstream, tmp_path):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    gw = start_gateway(catalog, tmp_path / "data", router_prior=True, router_reload_interval_s=0.05)
    try:
        status = _get(gw, "/admin/router")
        assert status["active"] == "learned" and status["version"] == shipped_version()
        assert {b["basis"] for b in status["workers"].values()} == {"prior"}
        models = httpx.get(gw.v1 + "/models", headers=gw.auth(), timeout=30).json()["data"]
        auto = next(m for m in models if m["id"] == "auto")["polyroute"]
        assert auto["router"] == "learned" and auto["calibrated"] == []
        body = {"model": "auto", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
        answer = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=30)
        assert answer.status_code == 200
        assert answer.headers["x-polyroute-router-version"] == shipped_version()

        # calibrating one worker (as `router calibrate` does) hot-swaps a router that names it calibrated
        root = tmp_path / "data" / "router"
        prior = load_current(root)
        name = catalog.workers[0].name
        texts = MATH[:10] + CHAT[:10]
        onboarded = onboard_artifact(
            prior, feature_builder_for(prior.features), texts, [1] * 20, np.ones((20, 1)), [name]
        )
        save_artifact(root, onboarded)
        deadline = time.monotonic() + 60
        while _get(gw, "/admin/router")["version"] != onboarded.version and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _get(gw, "/admin/router")["workers"]
        assert workers[name] == {
            "basis": "calibrated",
            "labels": 20,
            "from": "calibration probes",
            "available": True,
            "unavailable_reason": None,
        }
        assert all(b["basis"] == "prior" for w, b in workers.items() if w != name)
    finally:
        gw.server.stop()


def test_without_the_prior_the_rules_serve_and_say_so(upstream, tmp_path):
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data")  # router_prior=False
    try:
        status = _get(gw, "/admin/router")
        assert status["active"] == "rules-cheapest" and {b["basis"] for b in status["workers"].values()} == {
            "rules"
        }
        assert not (tmp_path / "data" / "router" / "current.json").exists()
    finally:
        gw.server.stop()


# ---- a damaged install, and what the prior says of workers it has no column for ------------------
def _damaged_copy(tmp_path, drop: str | None = None, card_text: str | None = None):
    source = tmp_path / "damaged-prior"
    shutil.copytree(SHIPPED_DIR, source, ignore=shutil.ignore_patterns("__pycache__"))
    if drop:
        (source / drop).unlink()
    if card_text is not None:
        (source / "card.json").write_text(card_text)
    return source


@pytest.mark.parametrize(
    "damage, says",
    [
        ({"drop": "model.joblib"}, "no model.joblib"),
        ({"card_text": "{ truncated"}, "card .* is unreadable"),
        ({"card_text": '{"version": "../x"}'}, "names no valid version"),
    ],
)
def test_a_damaged_shipped_prior_is_refused_with_its_reason_and_leaves_nothing(tmp_path, damage, says):
    root = tmp_path / "router"
    with pytest.raises(ShippedPriorError, match=says):
        install_shipped_prior(root, _damaged_copy(tmp_path, **damage))
    assert not root.exists() or list(root.iterdir()) == []
    reason = try_install_shipped_prior(root, _damaged_copy(tmp_path / "again", **damage))
    assert reason and re.search(says, reason)
    holder = RouterHolder(root, startup_error=reason)  # what build_state does with it
    assert holder.status()["active"] == "rules-cheapest" and holder.status()["error"] == reason


def test_an_unloadable_shipped_model_is_refused_and_not_left_installed(tmp_path):
    source = _damaged_copy(tmp_path)
    (source / "model.joblib").write_bytes(b"\x00" * 64)
    root = tmp_path / "router"
    assert "cannot load model" in try_install_shipped_prior(root, source)
    assert not (root / "current.json").exists() and not (root / shipped_version()).exists()
    assert install_shipped_prior(root) == shipped_version()  # a repaired install goes in force


def test_a_version_directory_left_without_its_model_is_set_aside_and_installed_afresh(tmp_path):
    root = tmp_path / "router"
    (root / shipped_version()).mkdir(parents=True)
    (root / shipped_version() / "card.json").write_text("{}")
    assert install_shipped_prior(root) == shipped_version()
    assert (root / shipped_version() / "model.joblib").is_file()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] != []  # kept, not deleted


def _prior_router(catalog) -> LearnedRouter:
    artifact = load_version(SHIPPED_DIR.parent, SHIPPED_DIR.name)
    return LearnedRouter(
        artifact, feature_builder_for(artifact.features), catalog={w.name: w for w in catalog.workers}
    )


EXTRA = """
  - name: base-local
    model: openai/tiny-model
    local: {{kind: llama_cpp, gguf: /nonexistent/tiny.gguf, instruct: false}}
    context_window: 2048
    input_price_per_m: 0
    output_price_per_m: 0
    active_params_b: 0.27
    tier: local
    license: gemma
    provider: local
    jurisdiction: local
  - name: newbie
    model: openai/cheap-model
    api_base: {url}/v1
    context_window: 8192
    input_price_per_m: 1.00
    output_price_per_m: 2.00
    tier: local
    license: MIT
    provider: fake
    jurisdiction: US
    profile_like: pricey
"""


def test_workers_without_a_column_get_a_pessimistic_prior_or_their_profile(upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + EXTRA.format(url=upstream.url))
    router = _prior_router(catalog)
    workers = {w.name: w for w in catalog.workers}
    text = "Which of the following is a prime number? A) 4 B) 6 C) 7 D) 9"
    predicted = router.predict_quality(text)
    estimates = {
        e.worker: e.quality
        for e in router.estimates(RouteRequest(prompt_chars=len(text), text=text), catalog.workers)
    }
    tiers = router.artifact.card["public_tiers"]
    local = [predicted[name] for name, tier in tiers.items() if tier == "local"]
    # a worker on its tier's prior: the mean of its tier's public models for this query
    assert estimates["mid"] == pytest.approx(
        np.mean([predicted[n] for n, t in tiers.items() if t == "open-moe"])
    )
    # a base model is no better than the worst public model of any kind
    assert estimates["base-local"] == pytest.approx(min(predicted.values()))
    assert estimates["base-local"] <= min(local)
    # profile_like names a catalog worker the prior has no column for: it lends its own prior
    assert estimates["newbie"] == pytest.approx(estimates["pricey"])
    assert router.basis(workers["newbie"])["basis"] == "profile_like"
    assert "pricey's prior" in router.basis(workers["newbie"])["from"]
    assert "base model" in router.basis(workers["base-local"])["from"]
    assert "mean of" in router.basis(workers["mid"])["from"]


def test_a_free_base_model_on_the_prior_does_not_win_on_price_alone(upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + EXTRA.format(url=upstream.url))
    router = _prior_router(catalog)
    pool = tuple(w for w in catalog.workers if w.name in ("base-local", "cheap", "mid", "pricey"))
    prompts = [
        "Explain quantum entanglement simply.",
        "Write an email to my landlord asking to fix the heating.",
        "What is 17 * 23? Show your work.",
        "Which of these is a mammal? A) shark B) dolphin C) trout D) eel",
        "Summarise the causes of World War I in three sentences.",
    ]
    chosen = [router.route(RouteRequest(prompt_chars=len(p), text=p), pool).workers[0].name for p in prompts]
    assert "base-local" not in chosen, chosen


def test_the_policy_preference_for_small_workers_reaches_the_learned_router(upstream):
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    router = _prior_router(catalog)
    workers = {w.name: w for w in catalog.workers}
    pool = (
        workers["mid"].model_copy(update={"active_params_b": 400.0}),
        workers["pricey"].model_copy(update={"active_params_b": 3.0}),
    )
    text = "Explain how a transformer language model works."
    plain = router.route(RouteRequest(prompt_chars=len(text), text=text), pool)
    small = router.route(
        RouteRequest(prompt_chars=len(text), text=text, prefer_fewer_active_params=1.0), pool
    )
    assert plain.workers[0].name == "mid"  # cheaper, and its tier's prior is close enough
    assert small.workers[0].name == "pricey" and "active params" in small.reason


def test_a_calibrated_version_has_its_own_card(tmp_path):
    root = tmp_path / "router"
    install_shipped_prior(root)
    prior = load_current(root)
    onboarded = onboard_artifact(
        prior, feature_builder_for(prior.features), MATH[:10], [1] * 10, np.ones((10, 1)), ["cheap"]
    )
    save_artifact(root, onboarded)
    card = json.loads((root / onboarded.version / "card.json").read_text())
    assert card["kind"] == "onboarded" and card["based_on"]["version"] == prior.version
    assert card["based_on"]["kind"] == "shipped prior" and "train_seconds" not in card
    assert (
        card["created_at"] >= prior.card["created_at"] and card["public_tiers"] == prior.card["public_tiers"]
    )
