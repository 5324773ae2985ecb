"""Quality models: per query, P(success) for each worker model, learned from sparse correctness labels.

Training data is a matrix ``Y[n_queries, n_workers]`` of labels in [0, 1] (0/1 correctness or a soft
score) with NaN where a worker was never run on that query. Every model here follows the same small
contract so the router and the model-selection code can treat them alike:

* ``fit(X, Y) -> self`` and ``predict(X) -> [n, n_workers]`` probabilities in [0, 1];
* ``n_features_in_``, ``n_workers_``, ``observed_counts_`` (labels per worker) and ``base_rates_``
  (mean label per worker) after fitting;
* deterministic for a given ``random_state``; ``ValueError`` with a readable message on bad shapes.

Inference is plain numpy on arrays extracted at fit time (LightGBM boosters excepted), for two reasons:
``predict`` for one row sits on the request path (sub-millisecond budget - sklearn's per-call validation
alone costs ~1 ms per calibrated estimator), and a pickled model must load without importing torch.
Inputs are the *raw* features of :class:`router.features.FeatureBuilder`; each model standardizes them
with statistics from its own training data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

QUALITY_MODEL_NAMES = ("logreg", "lightgbm", "mf", "knn")
# Probabilities are kept off exactly 0/1 so log loss and downstream log-odds stay finite.
PROB_EPS = 1e-4
# Calibration needs held-out scores from a 3-fold split; below these counts it is skipped.
CALIBRATION_FOLDS = 3
MIN_CALIBRATION_ROWS = 50
MIN_CALIBRATION_CLASS_COUNT = 2 * CALIBRATION_FOLDS
# Isotonic regression is more flexible than Platt's sigmoid but overfits small samples.
ISOTONIC_MIN_ROWS = 1000


# ---------------------------------------------------------------------- shared helpers
def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50.0, 50.0)))


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), PROB_EPS, 1.0 - PROB_EPS)
    return np.log(p / (1.0 - p))


def _as_features(X: Any, n_features: int | None = None) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D [n_queries, n_features], got shape {X.shape}")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(
            f"X has {X.shape[1]} features but the model was fit on {n_features}; "
            "were the features built with a different FeatureBuilder (backend, lexical features)?"
        )
    if X.shape[0] and not np.isfinite(X).all():
        raise ValueError("X contains NaN or infinite values")
    return X


def _as_labels(Y: Any, n_rows: int) -> np.ndarray:
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim != 2:
        raise ValueError(
            f"Y must be 2-D [n_queries, n_workers] with NaN for missing labels, got shape {Y.shape}"
        )
    if Y.shape[0] != n_rows:
        raise ValueError(f"X has {n_rows} rows but Y has {Y.shape[0]}")
    if Y.shape[1] == 0:
        raise ValueError("Y has no worker columns")
    observed = ~np.isnan(Y)
    values = Y[observed]
    if values.size and (values.min() < 0.0 or values.max() > 1.0):
        raise ValueError("labels in Y must lie in [0, 1] (NaN marks a missing label)")
    missing = np.flatnonzero(observed.sum(axis=0) == 0)
    if missing.size:
        raise ValueError(f"no labels for worker column(s) {missing.tolist()}; drop them before fitting")
    return Y


class _QualityModel:
    """Fit-time bookkeeping and input checks shared by every quality model."""

    n_features_in_: int
    n_workers_: int
    observed_counts_: np.ndarray
    base_rates_: np.ndarray

    def _start_fit(self, X: Any, Y: Any) -> tuple[np.ndarray, np.ndarray]:
        X = _as_features(X)
        if X.shape[0] == 0:
            raise ValueError("cannot fit on zero rows")
        Y = _as_labels(Y, X.shape[0])
        self.n_features_in_ = X.shape[1]
        self.n_workers_ = Y.shape[1]
        self.observed_counts_ = (~np.isnan(Y)).sum(axis=0).astype(np.int64)
        self.base_rates_ = np.nanmean(Y, axis=0)
        return X, Y

    def _check_predict(self, X: Any) -> np.ndarray:
        if not hasattr(self, "n_features_in_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError(f"{type(self).__name__} is not fitted yet; call fit(X, Y) first")
        return _as_features(X, self.n_features_in_)

    def predict(self, X: Any) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError


def _standardizer(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column mean and scale as StandardScaler computes them (constant columns get scale 1)."""
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    scale[scale < 1e-12] = 1.0
    return mean, scale


@dataclass
class CrossFit:
    """Out-of-fold results of :meth:`PerWorkerClassifier.cross_fit`.

    ``proba`` is [n, n_workers] (NaN where unlabelled); ``raw[w]`` holds worker w's out-of-fold raw
    scores over its labelled rows in row order, or None where fit() would not calibrate it.
    """

    proba: np.ndarray
    raw: list[np.ndarray | None]


def _calibratable(y: np.ndarray) -> bool:
    n_pos = int(np.sum(y))
    return y.size >= MIN_CALIBRATION_ROWS and min(n_pos, y.size - n_pos) >= MIN_CALIBRATION_CLASS_COUNT


def _calibration_folds(y: np.ndarray, random_state: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import StratifiedKFold

    folds = StratifiedKFold(n_splits=CALIBRATION_FOLDS, shuffle=True, random_state=random_state)
    return list(folds.split(np.zeros((y.size, 1)), y))


def _fit_calibration(scores: np.ndarray, y: np.ndarray) -> tuple[str, Any]:
    """Map raw scores to probabilities: isotonic from ISOTONIC_MIN_ROWS rows, Platt's sigmoid below."""
    from sklearn.isotonic import IsotonicRegression
    from sklearn.linear_model import LogisticRegression

    if y.size >= ISOTONIC_MIN_ROWS:
        iso = IsotonicRegression(y_min=PROB_EPS, y_max=1.0 - PROB_EPS, out_of_bounds="clip").fit(scores, y)
        return "isotonic", (np.asarray(iso.X_thresholds_), np.asarray(iso.y_thresholds_))
    platt = LogisticRegression(C=1e4, max_iter=1000).fit(scores[:, None], y)
    return "sigmoid", (float(platt.coef_[0, 0]), float(platt.intercept_[0]))


def _apply_calibration(kind: str, fitted: Any, scores: np.ndarray) -> np.ndarray:
    if kind == "isotonic":
        return np.interp(scores, fitted[0], fitted[1])
    return _sigmoid(scores * fitted[0] + fitted[1])


# ---------------------------------------------------------------------- 1. per-worker classifiers
class PerWorkerClassifier(_QualityModel):
    """One binary classifier per worker, trained on the rows labelled for that worker.

    Soft labels are binarized at 0.5. ``kind="logreg"`` standardizes features and fits a
    LogisticRegression; ``kind="lightgbm"`` fits an LGBMClassifier with defaults sized for ~10k rows x
    ~400 features on 2 cores. ``**params`` override the estimator's parameters.

    Calibration (``calibrate=True``) follows ``CalibratedClassifierCV(cv=3, ensemble=False)``: out-of-fold
    scores from a stratified 3-fold split fit a calibrator (Platt sigmoid; isotonic from
    ISOTONIC_MIN_ROWS labelled rows), and the classifier is refit on all of the worker's rows. It is done
    with public sklearn pieces instead of the wrapper itself so the fitted map is two numbers (or an
    isotonic step table) applied in numpy: the wrapper's ``predict_proba`` costs ~1.3 ms per worker per
    row. Workers with fewer than MIN_CALIBRATION_ROWS labels (or too few of either class) are left
    uncalibrated; a worker whose labels are all one class gets a constant, Laplace-smoothed rate.
    """

    def __init__(
        self,
        kind: Literal["logreg", "lightgbm"] = "logreg",
        calibrate: bool = True,
        random_state: int = 0,
        **params: Any,
    ) -> None:
        if kind not in ("logreg", "lightgbm"):
            raise ValueError(f"kind must be 'logreg' or 'lightgbm', got {kind!r}")
        self.kind = kind
        self.calibrate = calibrate
        self.random_state = random_state
        self.params = dict(params)

    def _make_estimator(self, n_rows: int, n_features: int) -> Any:
        if self.kind == "logreg":
            from sklearn.linear_model import LogisticRegression

            return LogisticRegression(**{"C": 1.0, "max_iter": 2000, **self.params})
        from lightgbm import LGBMClassifier

        defaults = {
            "n_estimators": 200,
            "learning_rate": 0.05,
            "num_leaves": 31,
            "min_child_samples": 20,
            # 63 histogram bins instead of 255: half the fit time on RouteLLM's 15k x 394 features, and
            # a lower Brier score there too (0.1610 vs 0.1622 on a held-out fifth, uncalibrated).
            "max_bin": 63,
            "subsample": 0.8,
            "subsample_freq": 1,
            "colsample_bytree": 0.8,
            # A second OpenMP thread pays off on ~10k x 400 inputs but makes small fits several times
            # slower on a busy 2-core machine (thread spin-waits), so small problems use one thread.
            "n_jobs": 2 if n_rows * n_features >= 500_000 else 1,
            "verbose": -1,
            "deterministic": True,
            "force_col_wise": True,
            "random_state": self.random_state,
        }
        return LGBMClassifier(**{**defaults, **self.params})

    def _raw_scores(self, estimator: Any, X: np.ndarray) -> np.ndarray:
        """Log-odds before calibration: the quantity the calibrator maps to a probability."""
        if self.kind == "logreg":
            return estimator.decision_function(X)
        return estimator.predict(X, raw_score=True)

    def fit(
        self,
        X: Any,
        Y: Any,
        oof_raw: Sequence[np.ndarray | None] | None = None,
        on_fit: Callable[[], None] | None = None,
    ) -> PerWorkerClassifier:
        """Fit every worker's classifier and its calibrator.

        ``oof_raw`` is :meth:`cross_fit`'s ``raw`` for the same X and Y: the calibrators then reuse
        those out-of-fold scores instead of refitting the folds (the same folds, so the same model).
        ``on_fit`` is called after each estimator fit, for progress bars (see :meth:`planned_fits`).
        """
        self._on_fit = on_fit
        try:
            return self._fit(X, Y, oof_raw)
        finally:
            self._on_fit = None  # a callback must not be pickled with the model

    def _fit(self, X: Any, Y: Any, oof_raw: Sequence[np.ndarray | None] | None) -> PerWorkerClassifier:
        X, Y = self._start_fit(X, Y)
        d, k = X.shape[1], Y.shape[1]
        if oof_raw is not None and len(oof_raw) != k:
            raise ValueError(f"oof_raw has {len(oof_raw)} workers, Y has {k}")
        if self.kind == "logreg":
            self.mean_, self.scale_ = _standardizer(X)
            X = (X - self.mean_) / self.scale_
        # predict(): scores S = X @ coef_ + intercept_ (logreg) or booster raw scores (lightgbm);
        # P = sigmoid(cal_a_ * S + cal_b_), replaced by the isotonic table where one was fit.
        self.coef_ = np.zeros((d, k))
        self.intercept_ = np.zeros(k)
        self.boosters_: list[Any] = [None] * k
        self.cal_a_ = np.ones(k)
        self.cal_b_ = np.zeros(k)
        self.isotonic_: list[tuple[np.ndarray, np.ndarray] | None] = [None] * k
        self.calibration_: list[str] = ["none"] * k
        for w in range(k):
            rows = ~np.isnan(Y[:, w])
            self._fit_worker(w, X[rows], Y[rows, w], None if oof_raw is None else oof_raw[w])
        if self.kind == "logreg":  # fold the standardization into the weights: one matmul at predict
            self.coef_ = self.coef_ / self.scale_[:, None]
            self.intercept_ = self.intercept_ - self.mean_ @ self.coef_
        return self

    def _fit_worker(self, w: int, Xw: np.ndarray, soft: np.ndarray, oof: np.ndarray | None = None) -> None:
        y = (soft >= 0.5).astype(np.int64)
        n_pos = int(y.sum())
        n_neg = y.size - n_pos
        if n_pos == 0 or n_neg == 0:
            rate = (soft.sum() + 1.0) / (soft.size + 2.0)
            self.cal_a_[w], self.cal_b_[w] = 0.0, float(_logit(rate))
            self.calibration_[w] = "constant"
            return
        estimator = self._make_estimator(*Xw.shape).fit(Xw, y)
        self._fitted()
        if self.kind == "logreg":
            self.coef_[:, w] = estimator.coef_[0]
            self.intercept_[w] = estimator.intercept_[0]
        else:
            self.boosters_[w] = estimator.booster_
        if self.calibrate and _calibratable(y):
            scores = self._oof_scores(Xw, y) if oof is None else np.asarray(oof, dtype=np.float64)
            if scores.shape != y.shape:
                raise ValueError(
                    f"out-of-fold scores for worker {w} have shape {scores.shape}, need {y.shape}"
                )
            self._set_calibrator(w, _fit_calibration(scores, y))

    def _fitted(self) -> None:
        """Tell a caller's progress bar that one estimator fit finished (set only during a fit)."""
        callback = getattr(self, "_on_fit", None)
        if callback is not None:
            callback()

    def _oof_scores(self, Xw: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Raw scores of each row from a classifier that did not see it (stratified 3 folds)."""
        scores = np.empty(y.size)
        for train, held_out in _calibration_folds(y, self.random_state):
            estimator = self._make_estimator(*Xw.shape).fit(Xw[train], y[train])
            self._fitted()
            scores[held_out] = self._raw_scores(estimator, Xw[held_out])
        return scores

    def _set_calibrator(self, w: int, calibration: tuple[str, Any]) -> None:
        kind, fitted = calibration
        self.calibration_[w] = kind
        if kind == "isotonic":
            self.isotonic_[w] = fitted
        else:
            self.cal_a_[w], self.cal_b_[w] = fitted

    def planned_fits(self, Y: Any, stage: Literal["fit", "cross_fit", "fit_after_cross_fit"] = "fit") -> int:
        """How many estimator fits a stage makes on Y, so a progress bar can show an ETA."""
        Y = np.asarray(Y, dtype=np.float64)
        total = 0
        for w in range(Y.shape[1]):
            y = Y[~np.isnan(Y[:, w]), w] >= 0.5
            if not 0 < y.sum() < y.size:
                continue  # one class: a constant, no estimator
            calibrated = self.calibrate and _calibratable(y)
            if stage == "cross_fit":
                total += CALIBRATION_FOLDS if calibrated else min(CALIBRATION_FOLDS, y.size)
            else:
                total += 1 + (CALIBRATION_FOLDS if calibrated and stage == "fit" else 0)
        return total

    def cross_fit(self, X: Any, Y: Any, on_fit: Callable[[], None] | None = None) -> CrossFit:
        """Out-of-fold predictions for every labelled (query, worker), at the cost of the folds alone.

        Each worker's rows are split into the same stratified folds that calibration uses; each fold
        is scored by a classifier fit on the others, and its probabilities by a calibrator fit on the
        other folds' out-of-fold scores, so no row is scored by a classifier or calibrator fit on it. Model selection scores
        these; the chosen model's :meth:`fit` then reuses ``raw`` for its calibrator, so choosing
        between candidates costs no fit beyond what fitting one calibrated model costs anyway.
        Workers too small to calibrate get plain k-fold scores through the sigmoid.
        """
        self._on_fit = on_fit
        try:
            return self._cross_fit(X, Y)
        finally:
            self._on_fit = None

    def _cross_fit(self, X: Any, Y: Any) -> CrossFit:
        X, Y = _as_features(X), _as_labels(Y, np.asarray(X).shape[0])
        if self.kind == "logreg":
            mean, scale = _standardizer(X)
            X = (X - mean) / scale
        proba = np.full(Y.shape, np.nan)
        raw: list[np.ndarray | None] = []
        for w in range(Y.shape[1]):
            rows = np.flatnonzero(~np.isnan(Y[:, w]))
            soft = Y[rows, w]
            y = (soft >= 0.5).astype(np.int64)
            if y.size == 0:
                raw.append(None)
                continue
            if y.sum() in (0, y.size) or not (self.calibrate and _calibratable(y)):
                raw.append(None)
                proba[rows, w] = self._plain_oof(X[rows], y, soft)
                continue
            scores = self._oof_scores(X[rows], y)
            raw.append(scores)
            for train, held_out in _calibration_folds(y, self.random_state):
                kind, fitted = _fit_calibration(scores[train], y[train])
                proba[rows[held_out], w] = _apply_calibration(kind, fitted, scores[held_out])
        return CrossFit(proba=np.clip(proba, PROB_EPS, 1.0 - PROB_EPS), raw=raw)

    def _plain_oof(self, Xw: np.ndarray, y: np.ndarray, soft: np.ndarray) -> np.ndarray:
        """Out-of-fold probabilities for a worker that fit() would leave uncalibrated or constant."""
        from sklearn.model_selection import KFold

        out = np.empty(y.size)
        if y.size < 2:
            out[:] = 0.5
            return out
        folds = KFold(n_splits=min(CALIBRATION_FOLDS, y.size), shuffle=True, random_state=self.random_state)
        for train, held_out in folds.split(Xw):
            if 0 < y[train].sum() < train.size:
                estimator = self._make_estimator(train.size, Xw.shape[1]).fit(Xw[train], y[train])
                self._fitted()
                out[held_out] = _sigmoid(self._raw_scores(estimator, Xw[held_out]))
            else:
                out[held_out] = (soft[train].sum() + 1.0) / (train.size + 2.0)
        return out

    def predict(self, X: Any) -> np.ndarray:
        X = self._check_predict(X)
        if self.kind == "logreg":
            scores = X @ self.coef_ + self.intercept_
        else:
            scores = np.zeros((X.shape[0], self.n_workers_))
            # Request-path calls (a few rows) skip OpenMP fan-out: no gain, and spikes on a busy machine.
            threads = {"num_threads": 1} if X.shape[0] < 64 else {}
            for w, booster in enumerate(self.boosters_):
                if booster is not None and X.shape[0]:
                    scores[:, w] = booster.predict(X, raw_score=True, **threads)
        proba = _sigmoid(scores * self.cal_a_ + self.cal_b_)
        for w, table in enumerate(self.isotonic_):
            if table is not None:
                proba[:, w] = np.interp(scores[:, w], table[0], table[1])
        return np.clip(proba, PROB_EPS, 1.0 - PROB_EPS)


# ---------------------------------------------------------------------- 2. matrix factorization
class MatrixFactorization(_QualityModel):
    """RouteLLM-style factorization: ``P(success | x, w) = sigmoid(b_w + v_w . (W x + c))``.

    The projection ``W`` is shared by all workers and trained with BCE on every observed
    (query, worker, label) triple, so a worker with few labels borrows the query representation learned
    from well-observed workers and only has to fit its own ``dim + 1`` numbers. Features are
    standardized first; worker biases start at the logit of each worker's mean label.

    Training uses torch (CPU, threads as configured) with Adam; weight decay applies to ``W`` and the
    worker vectors, not to biases. Early stopping watches BCE on ``val_fraction`` of the queries and
    restores the best epoch (workers with fewer than ``min_val_labels`` labels keep all their labels in
    training). ``num_threads`` (default 1) sets torch's intra-op threads for the duration of ``fit`` and
    restores the previous value after; ``None`` leaves torch alone. The batches are far too small to
    gain from a second thread, and on the busy 2-core target machine two threads made a 15k-row fit
    40x slower (42 s vs 1 s for 5 epochs, identical weights). Initialization and shuffling come from a
    numpy generator seeded with ``random_state``, so fitting neither needs nor disturbs torch's global
    RNG. The fitted weights are stored as numpy arrays: inference and unpickling do not import torch.
    """

    def __init__(
        self,
        dim: int = 64,
        epochs: int = 30,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        batch_size: int = 256,
        random_state: int = 0,
        val_fraction: float = 0.1,
        patience: int = 5,
        min_val_labels: int = 20,
        num_threads: int | None = 1,
    ) -> None:
        self.dim = dim
        self.epochs = epochs
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.random_state = random_state
        self.val_fraction = val_fraction
        self.patience = patience
        self.min_val_labels = min_val_labels
        self.num_threads = num_threads

    def _split_triples(
        self, Y: np.ndarray, rng: np.random.Generator
    ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...] | None]:
        rows, cols = np.nonzero(~np.isnan(Y))
        labels = Y[rows, cols]
        n_rows = Y.shape[0]
        n_val_rows = int(round(self.val_fraction * n_rows))
        if self.val_fraction <= 0 or n_val_rows < 5 or n_rows - n_val_rows < 5:
            return (rows, cols, labels), None
        val_rows = np.zeros(n_rows, dtype=bool)
        val_rows[rng.permutation(n_rows)[:n_val_rows]] = True
        in_val = val_rows[rows] & (self.observed_counts_[cols] >= self.min_val_labels)
        if not in_val.any():
            return (rows, cols, labels), None
        train = (rows[~in_val], cols[~in_val], labels[~in_val])
        return train, (rows[in_val], cols[in_val], labels[in_val])

    def fit(self, X: Any, Y: Any) -> MatrixFactorization:
        if self.dim < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("dim, epochs and batch_size must be >= 1")
        X, Y = self._start_fit(X, Y)
        import torch

        previous_threads = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            self._train(torch, X, Y)
        finally:
            if self.num_threads is not None:
                torch.set_num_threads(previous_threads)
        return self

    def _train(self, torch: Any, X: np.ndarray, Y: np.ndarray) -> None:
        rng = np.random.default_rng(self.random_state)
        self.mean_, self.scale_ = _standardizer(X)
        Xs = torch.from_numpy(((X - self.mean_) / self.scale_).astype(np.float32))
        d, k = X.shape[1], Y.shape[1]
        train, val = self._split_triples(Y, rng)

        # Glorot-scaled projection, small worker vectors, biases at the workers' base rates.
        params = {
            "proj": rng.normal(0.0, np.sqrt(2.0 / (d + self.dim)), size=(d, self.dim)),
            "proj_bias": np.zeros(self.dim),
            "worker_emb": rng.normal(0.0, 0.1 / np.sqrt(self.dim), size=(k, self.dim)),
            "worker_bias": _logit(self.base_rates_),
        }
        tensors = {
            name: torch.tensor(v, dtype=torch.float32, requires_grad=True) for name, v in params.items()
        }
        optimizer = torch.optim.Adam(
            [
                {"params": [tensors["proj"], tensors["worker_emb"]], "weight_decay": self.weight_decay},
                {"params": [tensors["proj_bias"], tensors["worker_bias"]], "weight_decay": 0.0},
            ],
            lr=self.lr,
        )

        def logits(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            hidden = Xs[rows] @ tensors["proj"] + tensors["proj_bias"]
            return tensors["worker_bias"][cols] + (hidden * tensors["worker_emb"][cols]).sum(dim=1)

        as_torch = [torch.from_numpy(a) for a in (train[0], train[1], train[2].astype(np.float32))]
        val_torch = (
            None
            if val is None
            else [torch.from_numpy(a) for a in (val[0], val[1], val[2].astype(np.float32))]
        )
        loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
        best_loss, best_state, stale = np.inf, None, 0
        self.history_: list[float] = []
        for _epoch in range(self.epochs):
            order = torch.from_numpy(rng.permutation(len(train[0])))
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                optimizer.zero_grad()
                loss = loss_fn(logits(as_torch[0][batch], as_torch[1][batch]), as_torch[2][batch])
                loss.backward()
                optimizer.step()
            if val_torch is None:
                continue
            with torch.no_grad():
                val_loss = float(loss_fn(logits(val_torch[0], val_torch[1]), val_torch[2]))
            self.history_.append(val_loss)
            if val_loss < best_loss - 1e-5:
                best_loss, stale = val_loss, 0
                best_state = {name: t.detach().clone() for name, t in tensors.items()}
            else:
                stale += 1
                if stale >= self.patience:
                    break
        final = best_state if best_state is not None else {n: t.detach() for n, t in tensors.items()}
        self.proj_ = final["proj"].numpy().astype(np.float64)
        self.proj_bias_ = final["proj_bias"].numpy().astype(np.float64)
        self.worker_emb_ = final["worker_emb"].numpy().astype(np.float64)
        self.worker_bias_ = final["worker_bias"].numpy().astype(np.float64)
        self.n_epochs_ = len(self.history_) if val_torch is not None else self.epochs
        self.best_val_loss_ = None if val_torch is None else float(best_loss)

    def predict(self, X: Any) -> np.ndarray:
        X = self._check_predict(X)
        hidden = ((X - self.mean_) / self.scale_) @ self.proj_ + self.proj_bias_
        proba = _sigmoid(hidden @ self.worker_emb_.T + self.worker_bias_)
        return np.clip(proba, PROB_EPS, 1.0 - PROB_EPS)


# ---------------------------------------------------------------------- 3. k nearest neighbours
class KNNQuality(_QualityModel):
    """P(success | x, w) = mean label of w over the ``k`` most cosine-similar training queries labelled for w.

    The baseline most learned routers land near. Features are standardized (so the raw lexical columns
    do not swamp the unit-norm embedding), optionally reduced to ``n_components`` with PCA, then
    L2-normalized; similarity is a dot product. The PCA step is for latency: a brute-force search over
    15k x 394 float32 rows is memory-bound at 1-3 ms per query on the target machine, 15k x 64 about
    0.1 ms. ``n_components=None`` keeps all features. A worker with fewer than ``k`` labelled training
    queries gets its global mean label.
    """

    def __init__(
        self,
        k: int = 20,
        metric: Literal["cosine"] = "cosine",
        n_components: int | None = 64,
        random_state: int = 0,
    ) -> None:
        self.k = k
        self.metric = metric
        self.n_components = n_components
        self.random_state = random_state

    _CHUNK = 512  # query rows per similarity block, bounds memory at 512 x n_train floats

    def _embed(self, X: np.ndarray) -> np.ndarray:
        Z = (X - self.mean_) / self.scale_
        if self.components_ is not None:
            Z = (Z - self.pca_mean_) @ self.components_
        norms = np.linalg.norm(Z, axis=1, keepdims=True)
        return (Z / np.maximum(norms, 1e-12)).astype(np.float32)

    def fit(self, X: Any, Y: Any) -> KNNQuality:
        if self.metric != "cosine":
            raise ValueError(f"only metric='cosine' is supported, got {self.metric!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        X, Y = self._start_fit(X, Y)
        self.mean_, self.scale_ = _standardizer(X)
        self.components_: np.ndarray | None = None
        n_comp = self.n_components
        if n_comp is not None and n_comp < min(X.shape):
            from sklearn.decomposition import PCA

            pca = PCA(n_components=n_comp, random_state=self.random_state).fit((X - self.mean_) / self.scale_)
            self.pca_mean_ = pca.mean_
            self.components_ = np.ascontiguousarray(pca.components_.T)
        self.train_ = self._embed(X)
        observed = ~np.isnan(Y)
        self.fully_observed_ = observed.all(axis=0)
        self.labelled_rows_ = [np.flatnonzero(observed[:, w]) for w in range(Y.shape[1])]
        self.labels_ = [Y[rows, w] for w, rows in enumerate(self.labelled_rows_)]
        return self

    def predict(self, X: Any) -> np.ndarray:
        X = self._check_predict(X)
        out = np.tile(self.base_rates_, (X.shape[0], 1))
        usable = [w for w in range(self.n_workers_) if self.observed_counts_[w] >= self.k]
        for start in range(0, X.shape[0], self._CHUNK):
            sims = self._embed(X[start : start + self._CHUNK]) @ self.train_.T
            shared_top = None  # neighbours among all rows, reused by every fully observed worker
            for w in usable:
                if self.fully_observed_[w]:
                    if shared_top is None:
                        shared_top = np.argpartition(-sims, self.k - 1, axis=1)[:, : self.k]
                    top = shared_top
                    labels = self.labels_[w]  # rows == all rows, so labels index directly
                else:
                    sub = sims[:, self.labelled_rows_[w]]
                    top = np.argpartition(-sub, self.k - 1, axis=1)[:, : self.k]
                    labels = self.labels_[w]
                out[start : start + len(sims), w] = labels[top].mean(axis=1)
        return np.clip(out, PROB_EPS, 1.0 - PROB_EPS)


# ---------------------------------------------------------------------- 4. ensemble
ENSEMBLE_MEMBERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("logreg", {"C": 0.1}),
    ("mf", {}),
    ("knn", {"k": 50}),
)


class EnsembleQuality(_QualityModel):
    """The mean of several quality models' probabilities.

    The three families err differently: per-worker logistic regression fits each worker's own linear
    boundary, the factorization shares one query representation across workers, kNN reads the labels
    of similar past queries without assuming any shape. On held-out splits of the training parts of
    RouterBench and LLMRouter no single family was best on both, and the average was at least as good
    as the best one on each (README, "Many workers"). ``members`` is a sequence of (name, params) with
    names from QUALITY_MODEL_NAMES; params override the member's defaults.
    """

    def __init__(
        self, members: Sequence[tuple[str, dict[str, Any]]] = ENSEMBLE_MEMBERS, random_state: int = 0
    ) -> None:
        self.members = tuple(members)
        self.random_state = random_state

    def fit(self, X: Any, Y: Any, on_fit: Callable[[], None] | None = None) -> EnsembleQuality:
        """Fit every member on all rows; ``on_fit`` is called after each member, for a progress bar
        (a local callback, never stored, so it is not pickled with the model)."""
        if not self.members:
            raise ValueError("an ensemble needs at least one member")
        X, Y = self._start_fit(X, Y)
        self.models_ = []
        for name, params in self.members:
            model = make_quality_model(name, self.random_state)
            for key, value in params.items():
                if key in model.__dict__:
                    setattr(model, key, value)
                elif isinstance(model, PerWorkerClassifier):
                    model.params[key] = value
                else:
                    raise ValueError(f"{name} has no parameter {key!r}")
            self.models_.append(model.fit(X, Y))
            if on_fit is not None:
                on_fit()
        return self

    def predict(self, X: Any) -> np.ndarray:
        X = self._check_predict(X)
        return np.mean([m.predict(X) for m in self.models_], axis=0)


# ---------------------------------------------------------------------- model selection
QualityModel = PerWorkerClassifier | MatrixFactorization | KNNQuality | EnsembleQuality


def make_quality_model(name: str, random_state: int = 0) -> QualityModel:
    """A fresh, unfitted model for one of QUALITY_MODEL_NAMES with its default settings."""
    if name == "logreg":
        return PerWorkerClassifier("logreg", random_state=random_state)
    if name == "lightgbm":
        return PerWorkerClassifier("lightgbm", random_state=random_state)
    if name == "mf":
        return MatrixFactorization(random_state=random_state)
    if name == "knn":
        return KNNQuality(random_state=random_state)
    if name == "ensemble":
        return EnsembleQuality(random_state=random_state)
    raise ValueError(f"unknown quality model {name!r}; expected one of {QUALITY_MODEL_NAMES}")


def score_predictions(P: Any, Y: Any) -> dict:
    """Brier score and log loss per worker on observed labels (soft labels allowed), plus ROC AUC where
    both classes (labels binarized at 0.5) are present. Means are over workers with at least one label,
    so a rarely-labelled worker weighs as much as a frequent one. JSON-ready: missing values are None.
    """
    from sklearn.metrics import roc_auc_score

    P = np.asarray(P, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    if P.shape != Y.shape or P.ndim != 2:
        raise ValueError(f"predictions {P.shape} and labels {Y.shape} must be 2-D with the same shape")
    per_worker = []
    for w in range(Y.shape[1]):
        rows = ~np.isnan(Y[:, w])
        y, p = Y[rows, w], np.clip(P[rows, w], PROB_EPS, 1.0 - PROB_EPS)
        entry: dict[str, Any] = {"n": int(rows.sum()), "brier": None, "log_loss": None, "auc": None}
        if y.size:
            entry["brier"] = float(np.mean((p - y) ** 2))
            entry["log_loss"] = float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))
            binary = y >= 0.5
            if 0 < binary.sum() < binary.size:
                entry["auc"] = float(roc_auc_score(binary, p))
        per_worker.append(entry)

    def mean_of(key: str) -> float | None:
        values = [e[key] for e in per_worker if e[key] is not None]
        return float(np.mean(values)) if values else None

    return {
        "brier": mean_of("brier"),
        "log_loss": mean_of("log_loss"),
        "auc": mean_of("auc"),
        "per_worker": per_worker,
    }


def _train_val_split(Y: np.ndarray, val_fraction: float, random_state: int) -> tuple[np.ndarray, np.ndarray]:
    """Random row split; a worker whose labels all fell into validation gets one row moved back to train,
    so every candidate can be fit on the training part."""
    n = Y.shape[0]
    order = np.random.default_rng(random_state).permutation(n)
    n_val = int(round(val_fraction * n))
    is_val = np.zeros(n, dtype=bool)
    is_val[order[:n_val]] = True
    observed = ~np.isnan(Y)
    for w in range(Y.shape[1]):
        if not (observed[:, w] & ~is_val).any():
            is_val[np.flatnonzero(observed[:, w])[0]] = False
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


ProgressFn = Callable[[str, int, int], None]  # (stage, fits done, fits planned)
CROSS_FIT_KINDS = ("logreg", "lightgbm")


def select_quality_model(
    X: Any,
    Y: Any,
    candidates: Sequence[str] = ("logreg", "lightgbm"),
    val_fraction: float = 0.2,
    random_state: int = 0,
    progress: ProgressFn | None = None,
) -> tuple[QualityModel, dict]:
    """Score each candidate on rows it did not see, keep the lowest Brier score, fit it on all rows.

    "Best" is the lowest mean-over-workers Brier score (ties keep the earlier candidate). When every
    candidate is a per-worker classifier (logreg, lightgbm), the scores are out-of-fold over all rows
    (:meth:`PerWorkerClassifier.cross_fit`), and the chosen model reuses its folds for calibration, so
    selection costs nothing beyond fitting each candidate's calibration folds once. Otherwise the
    candidates are fit on a random train split and scored on ``val_fraction`` of the rows. The report,
    ``{"chosen", "scores": {name: score_predictions(...) + fit_seconds}, "baseline", "validation",
    "n_train" and "n_val" or "n_rows" and "folds", ...}``, is JSON-ready; ``baseline`` scores a constant predictor (each worker's
    training mean rate), which tells whether learning from the query helps at all. ``progress`` hears
    (stage, fits done, fits planned) after each estimator fit of the per-worker classifiers, and after
    each whole model fit of the others (mf, kNN).
    """
    names = [candidates] if isinstance(candidates, str) else list(candidates)
    if not names:
        raise ValueError("candidates must name at least one model")
    for name in names:
        if name not in QUALITY_MODEL_NAMES:
            raise ValueError(f"unknown quality model {name!r}; expected one of {QUALITY_MODEL_NAMES}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    X = _as_features(X)
    Y = _as_labels(Y, X.shape[0])
    if all(name in CROSS_FIT_KINDS for name in names):
        return _select_by_cross_fit(X, Y, names, random_state, progress)
    train, val = _train_val_split(Y, val_fraction, random_state)
    if val.size == 0 or np.isnan(Y[val]).all():
        raise ValueError(
            f"{X.shape[0]} rows leave no labelled validation rows at val_fraction={val_fraction}"
        )

    # One tick per model fit (an mf or kNN fit has no inner estimators to count); each stage is
    # announced at 0 so a bar shows it, and its elapsed time, while its first fit runs.
    stage = f"scoring {', '.join(names)} on a {val_fraction:g} holdout"
    if progress is not None:
        progress(stage, 0, len(names))
    scores: dict[str, dict] = {}
    for done, name in enumerate(names, 1):
        started = time.perf_counter()
        model = make_quality_model(name, random_state).fit(X[train], Y[train])
        fit_seconds = time.perf_counter() - started
        scores[name] = {
            **score_predictions(model.predict(X[val]), Y[val]),
            "fit_seconds": round(fit_seconds, 3),
        }
        if progress is not None:
            progress(stage, done, len(names))
    chosen = min(names, key=lambda n: scores[n]["brier"])
    base_rates = np.nanmean(Y[train], axis=0)
    baseline = score_predictions(np.tile(base_rates, (val.size, 1)), Y[val])
    if progress is not None:
        progress(f"fitting {chosen} on all rows", 0, 1)
    model = make_quality_model(chosen, random_state).fit(X, Y)
    if progress is not None:
        progress(f"fitting {chosen} on all rows", 1, 1)
    report = {
        "chosen": chosen,
        "scores": scores,
        "baseline": baseline,
        "validation": f"holdout {val_fraction:g}",
        "n_train": int(train.size),
        "n_val": int(val.size),
        "val_fraction": val_fraction,
        "random_state": random_state,
    }
    return model, report


def _select_by_cross_fit(
    X: np.ndarray, Y: np.ndarray, names: list[str], random_state: int, progress: ProgressFn | None
) -> tuple[QualityModel, dict]:
    if (~np.isnan(Y)).sum() < 2 * CALIBRATION_FOLDS:
        raise ValueError(f"{X.shape[0]} rows hold too few labels to score candidates out of fold")
    models = {name: PerWorkerClassifier(name, random_state=random_state) for name in names}
    plans = {name: model.planned_fits(Y, "cross_fit") for name, model in models.items()}
    done = 0

    def tick(stage: str, total: int) -> Callable[[], None]:
        def on_fit() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(stage, done, total)

        return on_fit

    scores: dict[str, dict] = {}
    folds: dict[str, CrossFit] = {}
    for name, model in models.items():
        done = 0
        started = time.perf_counter()
        folds[name] = model.cross_fit(X, Y, on_fit=tick(f"scoring {name} out of fold", plans[name]))
        scores[name] = {
            **score_predictions(np.where(np.isnan(Y), 0.5, folds[name].proba), Y),
            "fit_seconds": round(time.perf_counter() - started, 3),
        }
    chosen = min(names, key=lambda n: scores[n]["brier"])
    done = 0
    model = models[chosen]
    total = model.planned_fits(Y, "fit_after_cross_fit")
    model.fit(X, Y, oof_raw=folds[chosen].raw, on_fit=tick(f"fitting {chosen} on all rows", total))
    report = {
        "chosen": chosen,
        "scores": scores,
        "baseline": score_predictions(_out_of_fold_rates(Y, random_state), Y),
        "validation": f"{CALIBRATION_FOLDS}-fold out-of-fold",
        "n_rows": int(X.shape[0]),
        "folds": CALIBRATION_FOLDS,
        "random_state": random_state,
    }
    return model, report


def _out_of_fold_rates(Y: np.ndarray, random_state: int) -> np.ndarray:
    """Each row's worker rates from the other folds: the constant predictor, scored out of fold."""
    from sklearn.model_selection import KFold

    out = np.full(Y.shape, 0.5)
    folds = KFold(n_splits=CALIBRATION_FOLDS, shuffle=True, random_state=random_state)
    for train, held_out in folds.split(Y):
        observed = ~np.isnan(Y[train])
        counts = observed.sum(axis=0)
        sums = np.where(observed, Y[train], 0.0).sum(axis=0)
        out[held_out] = np.where(counts > 0, sums / np.maximum(counts, 1), 0.5)
    return out
