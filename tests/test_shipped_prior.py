"""The shipped prior (router/prior/, router/shipped.py): a learned router in force on a gateway's first
start, which says per catalog worker whether it is calibrated or runs on its tier's prior."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np

from policies import parse_catalog
from router import feature_builder_for, load_current, read_pointer, save_artifact, train_artifact
from router.onboard import onboard_artifact
from router.shipped import SHIPPED_DIR, install_shipped_prior, shipped_version
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
        assert workers[name] == {"basis": "calibrated", "labels": 20, "from": "calibration probes"}
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
