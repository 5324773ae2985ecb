"""router.quality: every quality model learns a synthetic routing problem, handles sparse labels, is
deterministic, fails loudly on bad shapes and survives a joblib round trip; model selection picks and
refits the best candidate.

Synthetic problem: worker A succeeds iff feature 0 > 0 (5% label noise); worker B always succeeds except
in the region feature 1 > 0.8. Labels are missing at random.
"""

from __future__ import annotations

import io
import json
import time

import joblib
import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from router.quality import (
    QUALITY_MODEL_NAMES,
    KNNQuality,
    MatrixFactorization,
    PerWorkerClassifier,
    make_quality_model,
    score_predictions,
    select_quality_model,
)

N_FEATURES = 10


def synthetic(n: int, seed: int, missing: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES))
    a = (X[:, 0] > 0).astype(float)
    a = np.where(rng.random(n) < 0.05, 1.0 - a, a)
    b = np.where(X[:, 1] > 0.8, 0.0, 1.0)
    Y = np.stack([a, b], axis=1)
    Y[rng.random(Y.shape) < missing] = np.nan
    return X, Y


# Small, fast settings; defaults are tuned for ~10k rows x ~400 features.
FACTORIES = {
    "logreg": lambda seed=0: PerWorkerClassifier("logreg", random_state=seed),
    "lightgbm": lambda seed=0: PerWorkerClassifier("lightgbm", random_state=seed, n_estimators=60),
    "mf": lambda seed=0: MatrixFactorization(dim=16, epochs=20, lr=2e-2, random_state=seed),
    "knn": lambda seed=0: KNNQuality(k=15, random_state=seed),
}


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    X, Y = synthetic(1200, seed=0)
    X_test, Y_test = synthetic(600, seed=1, missing=0.0)
    return {"X": X, "Y": Y, "X_test": X_test, "Y_test": Y_test}


@pytest.fixture(scope="module")
def fitted(data: dict[str, np.ndarray]) -> dict[str, object]:
    return {name: make().fit(data["X"], data["Y"]) for name, make in FACTORIES.items()}


def brier_per_worker(P: np.ndarray, Y: np.ndarray) -> np.ndarray:
    return np.array([e["brier"] for e in score_predictions(P, Y)["per_worker"]])


# ---------------------------------------------------------------------- learning
@pytest.mark.parametrize("name", list(FACTORIES))
def test_beats_constant_predictor_on_held_out_brier(name: str, fitted: dict, data: dict) -> None:
    model = fitted[name]
    constant = np.tile(np.nanmean(data["Y"], axis=0), (len(data["X_test"]), 1))
    base = brier_per_worker(constant, data["Y_test"])
    learned = brier_per_worker(model.predict(data["X_test"]), data["Y_test"])
    assert (learned < 0.7 * base).all(), (name, learned, base)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_predict_shape_range_and_fitted_attributes(name: str, fitted: dict, data: dict) -> None:
    model = fitted[name]
    P = model.predict(data["X_test"])
    assert P.shape == (len(data["X_test"]), 2)
    assert np.isfinite(P).all() and (P >= 0).all() and (P <= 1).all()
    assert model.predict(data["X_test"][:1]).shape == (1, 2)
    assert model.predict(data["X_test"][:0]).shape == (0, 2)
    assert model.n_workers_ == 2 and model.n_features_in_ == N_FEATURES
    np.testing.assert_array_equal(model.observed_counts_, (~np.isnan(data["Y"])).sum(axis=0))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_deterministic_with_same_random_state(name: str, fitted: dict, data: dict) -> None:
    again = FACTORIES[name]().fit(data["X"], data["Y"])
    np.testing.assert_array_equal(again.predict(data["X_test"]), fitted[name].predict(data["X_test"]))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_joblib_round_trip_gives_identical_predictions(name: str, fitted: dict, data: dict) -> None:
    buffer = io.BytesIO()
    joblib.dump(fitted[name], buffer)
    if name == "mf":
        assert b"torch" not in buffer.getvalue()  # weights are numpy: loading must not need torch
    buffer.seek(0)
    loaded = joblib.load(buffer)
    np.testing.assert_array_equal(loaded.predict(data["X_test"]), fitted[name].predict(data["X_test"]))


@pytest.mark.parametrize("name", ["logreg", "mf", "knn"])
def test_single_row_predict_is_fast(name: str, fitted: dict, data: dict) -> None:
    model, row = fitted[name], data["X_test"][:1]
    model.predict(row)
    times = []
    for _ in range(50):
        started = time.perf_counter()
        model.predict(row)
        times.append(time.perf_counter() - started)
    assert np.median(times) < 0.002  # well under 0.2 ms here; generous for a loaded CI machine


@pytest.mark.parametrize("name", list(FACTORIES))
def test_worker_with_one_class_only(name: str, data: dict) -> None:
    X, Y = data["X"], data["Y"].copy()
    always = np.ones((len(X), 1))
    always[::3] = np.nan
    model = FACTORIES[name]().fit(X, np.hstack([Y, always]))
    P = model.predict(data["X_test"])
    assert P.shape == (len(data["X_test"]), 3)
    assert (P[:, 2] > 0.9).all()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_soft_labels_are_accepted(name: str, data: dict) -> None:
    X = data["X"]
    rng = np.random.default_rng(3)
    soft = np.clip(0.5 + 0.4 * np.tanh(X[:, :1]) + 0.05 * rng.normal(size=(len(X), 1)), 0.0, 1.0)
    P = FACTORIES[name]().fit(X, soft).predict(X[:5])
    assert P.shape == (5, 1) and np.isfinite(P).all()


def test_mf_shares_strength_with_a_well_observed_worker(data: dict) -> None:
    """Worker C behaves like A but has only 15 labels: the shared projection still ranks its queries."""
    X, Y = data["X"], data["Y"]
    rng = np.random.default_rng(7)
    c = np.full(len(X), np.nan)
    few = rng.choice(len(X), size=15, replace=False)
    c[few] = (X[few, 0] > 0).astype(float)
    model = MatrixFactorization(dim=16, epochs=20, lr=2e-2, random_state=0).fit(X, np.column_stack([Y, c]))
    assert model.observed_counts_[2] == 15

    X_test = data["X_test"]
    truth = (X_test[:, 0] > 0).astype(float)
    brier_mf = np.mean((model.predict(X_test)[:, 2] - truth) ** 2)
    brier_mean = np.mean((np.nanmean(c) - truth) ** 2)
    assert brier_mf < 0.75 * brier_mean, (brier_mf, brier_mean)


def test_mf_restores_torch_thread_setting(data: dict) -> None:
    import torch

    before = torch.get_num_threads()
    model = MatrixFactorization(dim=4, epochs=2, num_threads=1).fit(data["X"], data["Y"])
    assert torch.get_num_threads() == before
    assert model.n_epochs_ == 2 and len(model.history_) == 2


def test_logreg_calibration_is_recorded_and_sane(data: dict) -> None:
    big = PerWorkerClassifier("logreg").fit(*synthetic(2500, seed=4))
    assert big.calibration_ == ["isotonic", "isotonic"]
    small = PerWorkerClassifier("logreg").fit(data["X"][:60], data["Y"][:60])
    assert all(method in ("sigmoid", "none", "constant") for method in small.calibration_)
    uncalibrated = PerWorkerClassifier("logreg", calibrate=False).fit(data["X"], data["Y"])
    assert uncalibrated.calibration_ == ["none", "none"]
    sigmoid = PerWorkerClassifier("logreg").fit(data["X"][:600], data["Y"][:600])
    assert "sigmoid" in sigmoid.calibration_
    # Calibrated probabilities average out near the observed success rate.
    P = big.predict(data["X_test"])
    np.testing.assert_allclose(P.mean(axis=0), data["Y_test"].mean(axis=0), atol=0.05)


def test_knn_falls_back_to_global_mean_for_sparse_worker(data: dict) -> None:
    X, Y = data["X"], data["Y"]
    sparse = np.full((len(X), 1), np.nan)
    sparse[:5, 0] = [1, 0, 1, 1, 0]
    model = KNNQuality(k=15).fit(X, np.hstack([Y, sparse]))
    np.testing.assert_allclose(model.predict(data["X_test"])[:, 2], 0.6)


def test_knn_pca_option(data: dict) -> None:
    full = KNNQuality(k=15, n_components=None).fit(data["X"], data["Y"])
    reduced = KNNQuality(k=15, n_components=4).fit(data["X"], data["Y"])
    assert full.components_ is None and reduced.components_.shape == (N_FEATURES, 4)
    assert reduced.predict(data["X_test"]).shape == (len(data["X_test"]), 2)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", list(FACTORIES))
def test_clear_errors_on_bad_shapes(name: str, fitted: dict, data: dict) -> None:
    X, Y = data["X"], data["Y"]
    make = FACTORIES[name]
    with pytest.raises(ValueError, match="Y must be 2-D"):
        make().fit(X, Y[:, 0])
    with pytest.raises(ValueError, match="rows"):
        make().fit(X, Y[:-1])
    with pytest.raises(ValueError, match="X must be 2-D"):
        make().fit(X[:, 0], Y)
    with pytest.raises(ValueError, match=r"no labels for worker column\(s\) \[1\]"):
        make().fit(X, np.column_stack([Y[:, 0], np.full(len(X), np.nan)]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        make().fit(X, Y * 2)
    with pytest.raises(ValueError, match="NaN or infinite"):
        bad = X.copy()
        bad[0, 0] = np.nan
        make().fit(bad, Y)
    with pytest.raises(ValueError, match="fit on 10"):
        fitted[name].predict(np.zeros((1, N_FEATURES + 1)))
    with pytest.raises(ValueError, match="X must be 2-D"):
        fitted[name].predict(np.zeros(N_FEATURES))
    with pytest.raises(NotFittedError):
        make().predict(X[:1])


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        PerWorkerClassifier("svm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metric"):
        KNNQuality(metric="euclidean").fit(np.zeros((3, 2)), np.ones((3, 1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown quality model"):
        make_quality_model("forest")


# ---------------------------------------------------------------------- scoring and selection
def test_score_predictions_values() -> None:
    Y = np.array([[1.0, np.nan], [0.0, 1.0], [1.0, 1.0]])
    P = np.array([[0.8, 0.5], [0.2, 0.9], [0.6, 0.7]])
    scores = score_predictions(P, Y)
    worker0, worker1 = scores["per_worker"]
    assert worker0["n"] == 3 and worker1["n"] == 2
    assert worker0["brier"] == pytest.approx((0.04 + 0.04 + 0.16) / 3)
    assert worker1["brier"] == pytest.approx((0.01 + 0.09) / 2)
    assert worker0["auc"] == 1.0 and worker1["auc"] is None  # one class only
    assert scores["brier"] == pytest.approx((worker0["brier"] + worker1["brier"]) / 2)
    assert scores["auc"] == 1.0
    with pytest.raises(ValueError, match="same shape"):
        score_predictions(P[:, :1], Y)


def test_select_quality_model_picks_refits_and_reports(data: dict) -> None:
    X, Y = data["X"], data["Y"]
    model, report = select_quality_model(X, Y, candidates=("knn", "logreg", "mf"), random_state=0)
    assert report["chosen"] in ("knn", "logreg", "mf")
    assert set(report["scores"]) == {"knn", "logreg", "mf"}
    best = min(report["scores"], key=lambda n: report["scores"][n]["brier"])
    assert report["chosen"] == best
    for scores in report["scores"].values():
        assert {"brier", "log_loss", "auc", "per_worker", "fit_seconds"} <= set(scores)
        assert scores["brier"] < report["baseline"]["brier"]
        assert len(scores["per_worker"]) == 2
    assert report["n_train"] + report["n_val"] == len(X)
    json.dumps(report)  # stored in model cards
    # Refit on all rows, not only the training split.
    np.testing.assert_array_equal(model.observed_counts_, (~np.isnan(Y)).sum(axis=0))
    assert model.predict(data["X_test"]).shape == (len(data["X_test"]), 2)


def test_select_keeps_a_rare_worker_in_training(data: dict) -> None:
    X, Y = data["X"][:200], data["Y"][:200]
    rare = np.full((200, 1), np.nan)
    rare[17] = 1.0
    model, report = select_quality_model(X, np.hstack([Y, rare]), candidates=("logreg",), random_state=3)
    assert report["chosen"] == "logreg" and model.n_workers_ == 3


def test_select_rejects_bad_arguments(data: dict) -> None:
    X, Y = data["X"], data["Y"]
    with pytest.raises(ValueError, match="unknown quality model"):
        select_quality_model(X, Y, candidates=("logreg", "svm"))
    with pytest.raises(ValueError, match="at least one"):
        select_quality_model(X, Y, candidates=())
    with pytest.raises(ValueError, match="val_fraction"):
        select_quality_model(X, Y, val_fraction=1.0)
    with pytest.raises(ValueError, match="rows"):
        select_quality_model(X, Y[:10])


def test_model_names_cover_factory() -> None:
    assert QUALITY_MODEL_NAMES == ("logreg", "lightgbm", "mf", "knn")
    assert isinstance(make_quality_model("lightgbm"), PerWorkerClassifier)
    assert make_quality_model("lightgbm").kind == "lightgbm"
    assert isinstance(make_quality_model("mf", random_state=5), MatrixFactorization)
    assert isinstance(make_quality_model("knn"), KNNQuality)


# ---------------------------------------------------------------------- selection by cross-fitting
@pytest.mark.parametrize("kind", ["logreg", "lightgbm"])
def test_fit_reusing_cross_fit_scores_is_the_same_model(kind: str, data: dict) -> None:
    """The folds that scored a candidate calibrate the chosen one: no refit, identical predictions."""
    X, Y = data["X"][:600], data["Y"][:600]
    fresh = FACTORIES[kind]().fit(X, Y)
    candidate = FACTORIES[kind]()
    folds = candidate.cross_fit(X, Y)
    reused = candidate.fit(X, Y, oof_raw=folds.raw)
    np.testing.assert_allclose(reused.predict(data["X_test"]), fresh.predict(data["X_test"]), atol=1e-12)
    assert reused.calibration_ == fresh.calibration_ == ["sigmoid", "sigmoid"]


def test_cross_fit_scores_every_label_out_of_fold(data: dict) -> None:
    X, Y = data["X"], data["Y"].copy()
    Y[:, 1] = np.where(np.isnan(Y[:, 1]), np.nan, 1.0)  # one class: a Laplace rate, not an estimator
    folds = PerWorkerClassifier("logreg").cross_fit(X, Y)
    labelled = ~np.isnan(Y)
    assert np.isfinite(folds.proba[labelled]).all() and np.isnan(folds.proba[~labelled]).all()
    assert folds.raw[0] is not None and folds.raw[0].shape == (labelled[:, 0].sum(),)
    assert folds.raw[1] is None
    # worker 0 is learnable (X[:, 0] > 0): out of fold it still beats its base rate by far
    oof = score_predictions(folds.proba[:, :1], Y[:, :1])["brier"]
    base = score_predictions(np.full((len(Y), 1), np.nanmean(Y[:, 0])), Y[:, :1])["brier"]
    assert oof < 0.5 * base
    # an in-sample fit scores better than out of fold: the folds did not see their own rows
    in_sample = score_predictions(PerWorkerClassifier("logreg").fit(X, Y).predict(X)[:, :1], Y[:, :1])[
        "brier"
    ]
    assert in_sample < oof
    with pytest.raises(ValueError, match="oof_raw has 1 workers"):
        PerWorkerClassifier("logreg").fit(X, Y, oof_raw=folds.raw[:1])


def test_select_by_cross_fit_reports_progress_and_pickles_clean(data: dict) -> None:
    X, Y = data["X"], data["Y"]
    heard: list[tuple[str, int, int]] = []
    model, report = select_quality_model(
        X, Y, candidates=("logreg", "lightgbm"), progress=lambda *event: heard.append(event)
    )
    assert report["validation"] == "3-fold out-of-fold" and report["n_rows"] == len(X)
    best = min(report["scores"], key=lambda n: report["scores"][n]["brier"])
    assert report["chosen"] == best == model.kind
    for scores in report["scores"].values():
        assert scores["brier"] < report["baseline"]["brier"]
    stages = {}
    for stage, done, total in heard:
        stages.setdefault(stage, []).append((done, total))
    assert list(stages) == [
        "scoring logreg out of fold",
        "scoring lightgbm out of fold",
        f"fitting {model.kind} on all rows",
    ]
    for events in stages.values():  # each stage counts 1..total, and total was planned right
        assert [done for done, _ in events] == list(range(1, len(events) + 1))
        assert all(total == len(events) for _, total in events)
    assert stages[f"fitting {model.kind} on all rows"][-1][1] == 2  # one fit per worker, no folds again
    json.dumps(report)
    buffer = io.BytesIO()
    joblib.dump(model, buffer)  # the progress callback is not kept on the model
    np.testing.assert_array_equal(
        joblib.load(io.BytesIO(buffer.getvalue())).predict(X[:5]), model.predict(X[:5])
    )
