"""The cascade's acceptance model belongs to a router version: `router rollback` rolls it back, a new
version brings its own (or keeps the one in force), and the gateway's cascade reads the one of the
version in force.

Before, it was one file, `<router dir>/acceptance.joblib`, outside every version: a rollback left a
bad acceptance model in force, and a new version could not replace it together with the quality
model. It now lives in `<router dir>/<version>/acceptance.joblib` (router/artifacts.py); the old file
is still read for a version without one, for one release, with a log line.

The two acceptance models here disagree on purpose: one is trained on the GSM8K fixture (a wrong
multiplication is a wrong answer: escalate), the other on the same answers with the labels flipped
(accept it). Which one the gateway used shows in the cascade's first step: accepted or escalated.
Real parts only: trained models, router versions on disk, a gateway in front of the test upstream.
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path

import httpx
import joblib
import numpy as np
import pytest

from policies import parse_catalog
from router import read_pointer, save_artifact, train_artifact
from router.artifacts import activate_version, rollback
from router.compose.acceptance import AcceptanceModel
from router.offline.cascade import fit_and_save_acceptance
from router.offline.routellm import load_gsm8k_answers
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_router_learned import synthetic

ACCEPTANCE = "acceptance.joblib"
FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_small.csv"
QUESTION = "A box holds 4 rows of 3 apples. How many?"
WRONG = "4 * 3 = <<4*3=13>>13\n#### 13"  # wrong arithmetic: the fixture's model escalates it


@pytest.fixture(scope="module")
def artifact():
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


@pytest.fixture(scope="module")
def flipped() -> AcceptanceModel:
    """An acceptance model that learned the opposite: wrong arithmetic is a right answer."""
    data = load_gsm8k_answers(FIXTURE)
    wrong = ~np.asarray(data["y_weak"], dtype=bool)
    return AcceptanceModel(seed=0).fit(data["prompts"], data["weak_answers"], wrong)


def version_of(artifact, note: str):
    """A copy of ``artifact`` that saves as a version of its own (its card differs)."""
    copy = pickle.loads(pickle.dumps(artifact))
    copy.version = ""
    copy.card = {**copy.card, "note": note}
    return copy


def accepts(path: Path) -> bool:
    """Whether the acceptance model in ``path`` accepts the wrong answer (P(correct) > 0.5)."""
    return float(joblib.load(path).predict_proba([QUESTION], [WRONG])[0]) > 0.5


def verdict(gw) -> str:
    """The cascade's first step on the wrong answer, with the learned acceptance model as verifier."""
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers={**gw.auth(), "x-polyroute-trace": "1"},
        json={
            "model": "compose:cascade",
            "messages": [{"role": "user", "content": QUESTION}],
            "metadata": {"verifier": "model"},
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    first = response.json()["polyroute"]["trace"]["steps"][0]
    assert first["worker"] == "cheap", first
    return first["verdict"]


def wait_for_version(gw, version: str, timeout_s: float = 60.0) -> None:
    """Until the gateway's watcher has put ``version`` in force (it checks current.json every second)."""
    deadline = time.monotonic() + timeout_s
    while gw.state.router.current.version != version:
        assert time.monotonic() < deadline, f"the gateway never put {version} in force"
        time.sleep(0.05)


# ---- on disk -------------------------------------------------------------------------------------------
def test_each_version_keeps_its_own_acceptance_model(tmp_path, artifact, flipped):
    from router.artifacts import acceptance_path

    root = tmp_path / "router"
    first = save_artifact(root, version_of(artifact, "first")).name
    saved = fit_and_save_acceptance(FIXTURE, root)  # into the version in force
    assert saved == root / first / ACCEPTANCE and not accepts(saved)
    second = save_artifact(root, version_of(artifact, "second"), acceptance=flipped).name
    assert accepts(root / second / ACCEPTANCE) and not accepts(root / first / ACCEPTANCE)
    assert not (root / ACCEPTANCE).exists()  # nothing outside the versions
    assert acceptance_path(root, second).path == root / second / ACCEPTANCE
    assert acceptance_path(root, first).path == root / first / ACCEPTANCE


def test_a_new_version_keeps_the_acceptance_model_in_force(tmp_path, artifact, flipped):
    """Retraining the quality model does not drop the verifier trained apart from it."""
    root = tmp_path / "router"
    first = save_artifact(root, version_of(artifact, "first"), acceptance=flipped).name
    second = save_artifact(root, version_of(artifact, "second")).name
    assert (root / second / ACCEPTANCE).read_bytes() == (root / first / ACCEPTANCE).read_bytes()


def test_the_old_cli_call_still_lands_in_the_version_in_force(tmp_path, artifact):
    """polyroute/cli.py passes `<router dir>/acceptance.joblib`, the old file's path."""
    root = tmp_path / "router"
    version = save_artifact(root, version_of(artifact, "only")).name
    saved = fit_and_save_acceptance(FIXTURE, root / ACCEPTANCE)
    assert saved == root / version / ACCEPTANCE and not (root / ACCEPTANCE).exists()


def test_without_a_version_the_router_dir_holds_it_and_the_first_version_takes_it(tmp_path, artifact):
    from router.artifacts import acceptance_path

    root = tmp_path / "router"
    saved = fit_and_save_acceptance(FIXTURE, root)
    assert saved == root / ACCEPTANCE  # no router trained yet: the rule-based router's cascade reads it
    found = acceptance_path(root, None)
    assert found.path == saved and not found.legacy
    version = save_artifact(root, version_of(artifact, "first")).name
    assert (root / version / ACCEPTANCE).read_bytes() == saved.read_bytes()


def test_saving_into_a_version_that_is_not_there_is_refused(tmp_path, flipped):
    from router import RouterLoadError
    from router.artifacts import save_acceptance

    with pytest.raises(RouterLoadError, match="no router model version"):
        save_acceptance(tmp_path / "router", flipped, version="nope")


# ---- the gateway's cascade -----------------------------------------------------------------------------
def test_the_cascade_uses_the_acceptance_model_of_the_version_in_force(upstream, tmp_path, artifact, flipped):
    root = tmp_path / "gw" / "router"
    escalating = save_artifact(root, version_of(artifact, "escalating")).name
    fit_and_save_acceptance(FIXTURE, root)  # the fixture's model, into `escalating`
    accepting = save_artifact(root, version_of(artifact, "accepting"), acceptance=flipped).name
    assert read_pointer(root) == {"version": accepting, "previous": escalating}
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "gw")
    try:
        upstream.behave("cheap-model", text=WRONG)
        upstream.behave("pricey-model", text="#### 12")
        assert gw.state.router.current.version == accepting
        assert verdict(gw).startswith("accepted (model")

        assert rollback(root) == escalating  # `polyroute router rollback`
        wait_for_version(gw, escalating)
        assert verdict(gw).startswith("escalated (model")  # the rolled-back version's own model

        activate_version(root, accepting)  # `polyroute router activate`
        wait_for_version(gw, accepting)
        assert verdict(gw).startswith("accepted (model")
    finally:
        gw.server.stop()


def test_a_version_without_one_reads_the_old_file_and_says_so(upstream, tmp_path, artifact, flipped, caplog):
    """An acceptance model saved by the previous release (`<router dir>/acceptance.joblib`) still
    serves a version that has none, with a log line; one saved into the version then wins."""
    root = tmp_path / "gw" / "router"
    version = save_artifact(root, version_of(artifact, "before")).name  # nothing to carry: none yet
    assert not (root / version / ACCEPTANCE).exists()
    data = load_gsm8k_answers(FIXTURE)
    old = AcceptanceModel(seed=0).fit(data["prompts"], data["weak_answers"], data["y_weak"])
    joblib.dump(old, root / ACCEPTANCE)  # as the previous release wrote it
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "gw")
    try:
        upstream.behave("cheap-model", text=WRONG)
        upstream.behave("pricey-model", text="#### 12")
        with caplog.at_level(logging.WARNING, logger="polyroute.router"):
            assert verdict(gw).startswith("escalated (model")  # the old file's model
        said = [r.getMessage() for r in caplog.records if r.name == "polyroute.router"]
        assert any(version in line and "no acceptance model of its own" in line for line in said), said

        from router.artifacts import save_acceptance

        save_acceptance(root, flipped)  # `router eval --save-acceptance`: into the version in force
        assert verdict(gw).startswith("accepted (model")
    finally:
        gw.server.stop()
