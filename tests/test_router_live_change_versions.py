"""Router versions changed under live traffic, as an operator changes them: `router activate` of a
version no gateway can serve, a gateway (a restarted or new replica) starting while the pointer names
such a version, a version whose cost model cannot predict, two replicas sharing one router store, and
two writers of one router dir (replicas are each PID 1 of their container)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import httpx
import numpy as np
import pytest

from gateway.router_state import RouterHolder
from policies import parse_catalog
from router import RouterLoadError, activate_version, read_pointer, save_artifact, train_artifact
from router.costs import CostModel
from router.shipped import install_shipped_prior, shipped_version
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.test_router_learned import synthetic
from tests.test_router_live_change_plan import wait_for


@pytest.fixture(scope="module")
def artifact():
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


def copy_of(artifact, note: str):
    """A fresh copy of ``artifact`` that saves as a version of its own (its card differs)."""
    copy = pickle.loads(pickle.dumps(artifact))
    copy.version = ""
    copy.card = {**copy.card, "note": note}
    return copy


def unservable(artifact):
    """A version whose model loads but whose features no gateway builds: trained by another polyroute
    (here an embedding backend this one does not know)."""
    bad = copy_of(artifact, "other features")
    bad.features = {**bad.features, "backend": "transformer-v9"}
    return bad


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polyroute.cli", "router", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "400", "HF_HUB_OFFLINE": "1"},
    )


def test_router_activate_refuses_a_version_no_gateway_can_serve(tmp_path, artifact):
    """Before, `activate` only unpickled the model: it answered "in force" for a version every gateway
    then refused, and every gateway started after it served the rule-based router."""
    root = tmp_path / "router"
    good = save_artifact(root, copy_of(artifact, "good")).name
    bad = save_artifact(root, unservable(artifact), activate=False).name
    with pytest.raises(RouterLoadError, match=f"router model {bad}: .*unknown embedding backend"):
        activate_version(root, bad)
    assert read_pointer(root) == {"version": good, "previous": None}
    done = cli("activate", bad, "--router-dir", str(root))
    assert done.returncode == 1 and "unknown embedding backend" in done.stdout + done.stderr
    assert read_pointer(root)["version"] == good


def test_a_gateway_starting_while_the_pointer_names_a_refused_version_serves_the_previous_one(
    tmp_path, artifact
):
    """`router train` puts its version in force unchecked (it has just written it). When a gateway
    refuses it, a running replica keeps the version it served; a replica that starts then (a restart,
    a scale-out) served nothing yet, and used to serve the rule-based router: replicas disagreed until
    the pointer was fixed. It now serves the pointer's previous version, and says why."""
    root = tmp_path / "router"
    good = save_artifact(root, copy_of(artifact, "good")).name
    running = RouterHolder(root)
    bad = save_artifact(root, unservable(artifact)).name  # in force, unchecked, as `router train` does
    assert read_pointer(root) == {"version": bad, "previous": good}
    assert running.changed() and not running.reload()
    assert running.current.version == good  # the running replica keeps it
    started = RouterHolder(root)  # a replica that starts now
    assert started.current.name == "learned" and started.current.version == good
    status = started.status()
    assert status["version"] == good and not status["fallback"]
    assert bad in status["error"] and "unknown embedding backend" in status["error"]
    assert f"serving {good}" in status["error"]
    assert not started.changed()  # the refused pointer is not retried every tick
    activate_version(root, good)  # the operator rolls back: both agree, and the error is gone
    for holder in (running, started):
        if holder.changed():
            holder.reload()
        assert holder.current.version == good and holder.status()["error"] is None


def test_without_a_servable_previous_version_the_rules_serve_and_say_why(tmp_path, artifact):
    root = tmp_path / "router"
    bad = save_artifact(root, unservable(artifact)).name
    holder = RouterHolder(root)
    assert holder.current.name == "rules-cheapest" and bad in holder.status()["error"]


def test_a_version_whose_output_length_model_cannot_predict_is_refused_at_load(tmp_path, artifact):
    """The warm-up ran the quality model only: a version whose per-query output-length model was
    fitted on other features went in force, and every request it routed failed (500). The warm-up
    now estimates each catalog worker, as a request does, so the version is refused and the one in
    force stays."""
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    root = tmp_path / "router"
    good = save_artifact(root, copy_of(artifact, "good")).name
    holder = RouterHolder(root, catalog={w.name: w for w in catalog.workers})
    bad = copy_of(artifact, "output model of other features")
    bad.output_model = CostModel().fit(np.random.default_rng(0).random((20, 5)), np.ones((20, 2)))
    bad.output_tokens = dict.fromkeys(bad.workers[:2], 40.0)
    bad.card = {**bad.card, "output_tokens": {"columns": bad.workers[:2]}}
    name = save_artifact(root, bad).name
    assert holder.changed() and not holder.reload()
    assert holder.current.version == good and name in holder.status()["error"]
    with pytest.raises(RouterLoadError, match="cannot serve"):
        activate_version(root, name)


def test_another_writers_temporary_files_are_never_touched(tmp_path):
    """Replicas sharing a router dir each run as PID 1 of their container: a name made of the process
    id is the same in every one. Two first starts at once used to copy the shipped prior into one
    staging directory (each deleting the other's copy first), and two activations to write one
    temporary pointer file. What another process has under such a name is left alone."""
    root = tmp_path / "router"
    root.mkdir()
    version = shipped_version()
    assert version is not None
    theirs = root / f".{version}.installing.{os.getpid()}"  # another replica's copy, under way
    theirs.mkdir()
    (theirs / "card.json").write_text("being copied")
    pointer = root / f"current.tmp.{os.getpid()}"  # another replica's pointer, being written
    pointer.write_text('{"version": "theirs"}')
    assert install_shipped_prior(root) == version
    assert read_pointer(root)["version"] == version
    assert (theirs / "card.json").read_text() == "being copied"
    assert pointer.read_text() == '{"version": "theirs"}'
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]  # none of its own left behind


# ---- two replicas sharing one router store (docs/helm.md routerStore) --------------------------------
def ask(gw: Gateway) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60)


def test_a_version_activated_through_one_replica_reaches_the_other(upstream, tmp_path, artifact):
    """Two gateways, their own data dirs, one router store. Until the second has looked at the
    pointer it serves the version it had, and every answer names the version that routed it, in
    its header and its ledger record; once it has, both serve the new one."""
    store = tmp_path / "router-store"
    old = save_artifact(store, copy_of(artifact, "old")).name
    new = save_artifact(store, copy_of(artifact, "new"), activate=False).name
    catalog = catalog_yaml_for(upstream.url)
    # the first watches every 50 ms; the second is made to look by the test (its tick never comes)
    one = start_gateway(
        parse_catalog(catalog), tmp_path / "one", router_dir=store, router_reload_interval_s=0.05
    )
    two = start_gateway(
        parse_catalog(catalog), tmp_path / "two", router_dir=store, router_reload_interval_s=3600
    )
    try:
        for gw in (one, two):
            assert gw.state.router.current.version == old
        activate_version(store, new)  # `kubectl exec <a pod> -- polyroute router activate NEW`
        wait_for(lambda: one.state.router.current.version == new, "the first replica's swap")
        first, second = ask(one), ask(two)
        assert first.status_code == second.status_code == 200
        assert first.headers["x-polyroute-router-version"] == new
        assert second.headers["x-polyroute-router-version"] == old  # between: it has not looked yet
        assert ledger_record(two, second.headers["x-polyroute-request-id"])["router_version"] == old
        assert two.state.router.changed() and two.state.router.reload()  # its watcher's next tick
        again = ask(two)
        assert again.headers["x-polyroute-router-version"] == new
        assert ledger_record(two, again.headers["x-polyroute-request-id"])["router_version"] == new
    finally:
        one.server.stop()
        two.server.stop()
