"""Onboarding a worker from a few probes (router/onboard.py) and its offline evaluation
(`router eval --onboard`, router/offline/onboard_eval.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from polyroute.cli import app
from router import LearnedRouter, feature_builder_for, load_current, save_artifact, train_artifact
from router.offline.onboard_curve import known_worker_vectors, probe_curve
from router.offline.split import write_split
from router.onboard import OnboardedQuality, fit_vector, onboard_artifact, prior_vector
from router.quality import _sigmoid
from tests.test_router_learned import CHAT, MATH, synthetic

FIX = Path(__file__).parent / "fixtures" / "multi"


def _known_log_odds(n: int, seed: int) -> np.ndarray:
    """Three known workers' log-odds over n queries: a shared difficulty plus each worker's own part."""
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0, 1.5, n)
    return np.column_stack([difficulty + rng.normal(0, 1.0, n) + b for b in (-1.0, 0.5, 1.5)])


def test_a_newcomer_that_behaves_like_a_known_worker_is_placed_on_it():
    Z = _known_log_odds(400, 0)
    truth = _sigmoid(Z[:, 1] + 0.7)  # worker 1, a little better
    y = (np.random.default_rng(1).random(400) < truth).astype(float)
    weights = prior_vector(Z, y)
    assert int(np.argmax(weights)) == 1 and weights[1] > 0.9
    beta, delta = fit_vector(Z, y)
    fitted = _sigmoid(Z @ beta + delta)
    assert np.corrcoef(fitted, truth)[0, 1] > 0.95
    assert abs(fitted.mean() - truth.mean()) < 0.05


def test_the_prior_keeps_few_probes_from_overfitting():
    """On 12 probes a free logistic fit would run off; the pull towards the mixture keeps the estimate
    close to the truth on the other queries."""
    Z = _known_log_odds(600, 2)
    truth = _sigmoid(Z[:, 2] - 0.5)
    y = (np.random.default_rng(3).random(600) < truth).astype(float)
    beta, delta = fit_vector(Z[:12], y[:12])
    error = np.abs(_sigmoid(Z[12:] @ beta + delta) - truth[12:]).mean()
    assert error < 0.15
    assert np.abs(beta).sum() < 3  # no blown-up weights


@pytest.mark.parametrize(
    "Z, y, message",
    [
        (np.zeros((3, 2)), np.ones(3), "at least 5"),
        (np.zeros((6, 2)), np.full(6, 2.0), r"\[0, 1\]"),
        (np.zeros((6, 2)), np.ones(5), "Z must be"),
        (np.zeros((6, 2)), np.array([1, 0, np.nan, 1, 0, 1.0]), r"\[0, 1\]"),
    ],
)
def test_bad_probe_labels_are_refused(Z, y, message):
    with pytest.raises(ValueError, match=message):
        fit_vector(Z, y)


@pytest.fixture(scope="module")
def base():
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


def test_onboarding_adds_a_worker_to_a_saved_artifact_the_router_loads(base, tmp_path):
    features = feature_builder_for(base.features)
    texts = MATH[:10] + CHAT[:10]
    # "tutor" does arithmetic and not chat: the opposite of "cheap"
    labels = np.array([[1.0]] * 10 + [[0.0]] * 10)
    new = onboard_artifact(base, features, texts, [1] * 20, labels, ["tutor"], {"tutor": 80.0})
    assert (
        new.workers == ["cheap", "pricey", "tutor"]
        and new.version == ""
        and base.workers == ["cheap", "pricey"]
    )
    assert new.observed["tutor"] == 20 and new.output_tokens["tutor"] == 80.0
    assert new.card["onboarding"]["tutor"]["probes"] == 20
    save_artifact(tmp_path, new)
    router = LearnedRouter(load_current(tmp_path), features)
    math = router.predict_quality("Compute 17 * 23 - 4 and show every step of the arithmetic.")
    chat = router.predict_quality("Say good morning to my neighbour in a friendly tone.")
    assert math["tutor"] > chat["tutor"]
    assert chat["cheap"] > math["cheap"]  # the known workers' columns are untouched


def test_onboarding_again_keeps_earlier_newcomers_and_can_recalibrate_a_known_worker(base):
    features = feature_builder_for(base.features)
    texts = MATH[:8] + CHAT[:8]
    first = onboard_artifact(base, features, texts, [1] * 16, np.ones((16, 1)), ["alpha"])
    second = onboard_artifact(
        first, features, texts, [1] * 16, np.array([[0.0]] * 8 + [[1.0]] * 8), ["beta-worker"]
    )
    assert second.workers == ["cheap", "pricey", "alpha", "beta-worker"]
    assert isinstance(second.model, OnboardedQuality) and second.model.base is base.model
    X = features.transform(texts, [1] * 16)
    assert np.allclose(second.model.predict(X)[:, 2], first.model.predict(X)[:, 2])
    # a known worker graded on probes gets a vector too, in its own column (no duplicate name)
    third = onboard_artifact(second, features, texts, [1] * 16, np.zeros((16, 1)), ["pricey"])
    assert third.workers == second.workers
    assert third.model.predict(X)[:, 1].mean() < second.model.predict(X)[:, 1].mean()


def test_onboarding_refuses_mismatched_labels(base):
    features = feature_builder_for(base.features)
    with pytest.raises(ValueError, match="labels must be"):
        onboard_artifact(base, features, ["a", "b"], [1, 1], np.ones((3, 1)), ["x"])
    with pytest.raises(ValueError, match="named twice"):
        onboard_artifact(base, features, ["a"], [1], np.ones((1, 2)), ["x", "x"])


# ---- router eval --onboard -----------------------------------------------------------------------
def _split(tmp_path: Path) -> list[str]:
    write_split("routerbench", [FIX / "routerbench_tiny.csv"], tmp_path / "split", 0.25, seed=0)
    args = []
    for side in ("train", "test"):
        for f in sorted((tmp_path / "split" / side).iterdir()):
            args += [f"--{side}", str(f)]
    return args


def test_eval_onboard_writes_three_routers_and_the_recovered_gain(tmp_path):
    out = tmp_path / "onboard.json"
    args = ["router", "eval", "--format", "routerbench", *_split(tmp_path), "--model", "logreg"]
    result = CliRunner().invoke(
        app, [*args, "--onboard", "frontier-xl", "--probes", "8", "--onboard-repeats", "2", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"ours", "full", "without"} <= set(report["routers"])
    ob = report["onboarding"]
    aiq = {name: report["routers"][name]["aiq"] for name in ("ours", "full", "without")}
    assert ob["aiq"] == pytest.approx(aiq)
    assert ob["worker"] == "frontier-xl" and ob["probes"] == 8 and len(ob["draws"]) == 2
    assert ob["aiq"]["ours"] == pytest.approx(np.mean([d["aiq"] for d in ob["draws"]]))
    if ob["gain_recovered"] is not None:
        assert ob["gain_recovered"] == pytest.approx(
            (aiq["ours"] - aiq["without"]) / (aiq["full"] - aiq["without"])
        )
    # only the frontier model does arithmetic in the fixture: losing it costs AIQ
    assert aiq["full"] > aiq["without"]
    assert "gain_recovered" in result.output
    # the worker's own column by log loss, printed. The fixture's frontier model is right on every
    # training query, so its mean label alone already scores best and the share is undefined
    column = ob["column_log_loss"]
    assert all(column[key] > 0 for key in ("ours", "full", "base"))
    assert column["base"] < column["full"] and column["recovered"] is None
    assert "log loss on the test queries" in result.output and "recovered n/a" in result.output
    # the paired bootstrap: an interval around the figures; losing the frontier model never helps
    low, high = ob["full_minus_without_interval"]
    assert 0 <= low <= aiq["full"] - aiq["without"] <= high
    low, high = ob["gain_recovered_interval"]
    assert low <= high and "95% interval of gain_recovered" in result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--onboard", "ghost", "--probes", "8"], "not a worker"),
        (["--onboard", "frontier-xl", "--probes", "500"], "only"),
    ],
)
def test_eval_onboard_bad_input_is_one_clear_line(tmp_path, extra, message):
    args = ["router", "eval", "--format", "routerbench", *_split(tmp_path), "--model", "logreg"]
    result = CliRunner().invoke(app, [*args, *extra, "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 1 and message in result.output
    assert not (tmp_path / "r.json").exists()


def test_eval_onboard_needs_files_and_enough_probes(tmp_path):
    result = CliRunner().invoke(app, ["router", "eval", "--onboard", "x", "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and "--format" in result.output
    args = ["router", "eval", "--format", "routerbench", *_split(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--onboard", "frontier-xl", "--probes", "2", "--out", "r.json"])
    assert result.exit_code == 2 and "at least 5" in result.output


def test_the_onboarding_table_prints_when_the_ratio_is_undefined_on_every_resample():
    """full − without of exactly 0 on every resample leaves no interval for gain_recovered (null in
    the JSON): the table says n/a and prints no interval, rather than failing after the job ran."""
    import io

    from rich.console import Console

    from router.offline.report import print_onboarding

    aiq = {"ours": 0.8, "full": 0.8, "without": 0.8}
    report = {
        "n_test": 10,
        "onboarding": {
            "worker": "w",
            "probes": 5,
            "repeats": 1,
            "aiq": aiq,
            "gain_recovered": None,
            "gain_recovered_interval": [None, None],
            "full_minus_without_interval": [0.0, 0.0],
            "interval_method": "paired bootstrap",
            "formula": "(ours - without) / (full - without)",
            "draws": [{"gain_recovered": None}],
        },
    }
    out = io.StringIO()
    print_onboarding(report, Console(file=out, width=200))
    assert "gain_recovered = n/a" in out.getvalue() and "95% interval" not in out.getvalue()


# ---------------------------------------------------------------- the probe curve (onboard_curve.py)
def test_the_identity_mixture_is_the_products_prior():
    Z = _known_log_odds(200, 4)
    y = (np.random.default_rng(5).random(200) < _sigmoid(Z[:, 0])).astype(float)
    assert np.allclose(prior_vector(Z, y, components=np.eye(3)), prior_vector(Z, y))


def test_an_explicit_prior_is_the_vector_few_probes_stay_near():
    Z = _known_log_odds(300, 6)
    y = (np.random.default_rng(7).random(300) < _sigmoid(Z[:, 2])).astype(float)
    toward_0, _ = fit_vector(Z[:10], y[:10], alpha=1000.0, prior=np.array([1.0, 0.0, 0.0]))
    assert np.allclose(toward_0, [1.0, 0.0, 0.0], atol=0.05)
    with pytest.raises(ValueError, match="prior must be a vector over the 3"):
        fit_vector(Z, y, prior=np.ones(2))


def test_known_worker_vectors_express_each_worker_in_the_others():
    rng = np.random.default_rng(8)
    Z = _known_log_odds(2000, 8)
    Z[:, 2] = Z[:, 0] + rng.normal(0, 0.3, 2000)  # worker 2 is worker 0 plus a little noise
    Y = (rng.random((2000, 3)) < _sigmoid(Z)).astype(float)
    Y[rng.random((2000, 3)) < 0.2] = np.nan  # sparse labels are skipped
    vectors = known_worker_vectors(Z, Y)
    assert vectors.shape == (3, 3) and np.all(np.diag(vectors) == 0)
    assert vectors[2, 0] > 0.5 and vectors[2, 0] > abs(vectors[2, 1])  # 2 leans on its twin
    with pytest.raises(ValueError, match="Y_known must be"):
        known_worker_vectors(Z, Y[:, :2])


def test_the_probe_curve_climbs_towards_the_full_labels():
    """A newcomer that is a shifted known worker: the representation holds it (ceiling near 1), and
    more probes recover more of what full labels know."""
    Z = _known_log_odds(3000, 9)
    truth = _sigmoid(Z[:, 1] + 0.4)
    y = (np.random.default_rng(10).random(3000) < truth).astype(float)
    y[::10] = np.nan  # queries the worker was never run on
    known_labels = (np.random.default_rng(12).random((3000, 3)) < _sigmoid(Z)).astype(float)
    vectors = known_worker_vectors(Z, known_labels)
    result = probe_curve(Z, y, truth, vectors, probe_counts=(5, 400), draws=4)
    assert result["n_pool"] + result["n_scored"] == 2700
    assert result["ceiling_recovered"] > 0.95
    few, many = (row["shifted"]["recovered"] for row in result["curve"])
    assert many > 0.9 and many > few
    assert result["curve"][1]["known_vectors"]["log_loss"] > 0
    assert (
        result["base_log_loss"] > result["curve"][1]["shifted"]["log_loss"] > result["full_log_loss"] - 0.01
    )


def test_the_probe_curve_refuses_more_probes_than_its_pool():
    Z = _known_log_odds(100, 11)
    y = np.ones(100)
    with pytest.raises(ValueError, match="pool's 50 queries"):
        probe_curve(Z, y, np.full(100, 0.9), probe_counts=(60,))
    with pytest.raises(ValueError, match="Z must be"):
        probe_curve(Z, y[:50], np.full(100, 0.9))


def test_the_column_summary_reads_as_a_share_of_full_labels_gain():
    from router.offline.onboard_eval import _column_summary

    y = np.array([1.0, 0.0, np.nan])  # the unlabelled query is left out
    summary = _column_summary([0.5, 0.6], np.array([0.9, 0.1, 0.5]), y, base_rate=0.5)
    assert summary["base"] == pytest.approx(np.log(2))
    assert summary["full"] == pytest.approx(-np.log(0.9))
    assert summary["ours"] == pytest.approx(0.55)
    assert summary["recovered"] == pytest.approx((np.log(2) - 0.55) / (np.log(2) + np.log(0.9)))
