"""Per-worker cost model: the USD a query will cost on each worker, predicted before calling any.

The router decides on *predicted* cost, the bill is the *actual* cost. On RouterBench the two differ by
the answer's length (a code answer costs many times a letter), which the query's features predict well
(what kind of task, how long the prompt). Costs are positive and spread over orders of magnitude, so
the model is a ridge regression of log(cost) per worker on standardized features, mapped back with
Duan's smearing factor (the mean of exp(residual)) so predictions are unbiased on the dollar scale
rather than the log scale. One matrix solve per worker; inference is a matmul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from router.quality import _as_features, _standardizer

MIN_COST = 1e-9  # a zero-cost row (a free local worker) is floored before the log


class CostModel:
    """``fit(X, C)`` on costs ``C[n, k]`` (USD, NaN = unknown) → ``predict(X)`` USD ``[n, k]``.

    ``alpha`` is the ridge penalty on standardized features. A worker with fewer than
    ``min_rows`` known costs gets its median cost for every query.
    """

    def __init__(self, alpha: float = 10.0, min_rows: int = 10) -> None:
        self.alpha = alpha
        self.min_rows = min_rows

    def fit(self, X: Any, C: Any) -> CostModel:
        X = _as_features(X)
        C = np.asarray(C, dtype=np.float64)
        if C.ndim != 2 or C.shape[0] != X.shape[0]:
            raise ValueError(f"costs must be [n_queries={X.shape[0]}, n_workers], got shape {C.shape}")
        if np.any(C[~np.isnan(C)] < 0):
            raise ValueError("costs must be >= 0")
        self.n_features_in_ = X.shape[1]
        self.mean_, self.scale_ = _standardizer(X)
        Z = np.hstack([(X - self.mean_) / self.scale_, np.ones((X.shape[0], 1))])
        k = C.shape[1]
        self.coef_ = np.zeros((Z.shape[1], k))
        self.smearing_ = np.ones(k)
        penalty = self.alpha * np.eye(Z.shape[1])
        penalty[-1, -1] = 0.0  # no shrinkage of the intercept
        for w in range(k):
            rows = ~np.isnan(C[:, w])
            logc = np.log(np.maximum(C[rows, w], MIN_COST))
            if rows.sum() < self.min_rows:
                self.coef_[-1, w] = float(np.median(logc)) if logc.size else np.log(MIN_COST)
                continue
            Zw = Z[rows]
            self.coef_[:, w] = np.linalg.solve(Zw.T @ Zw + penalty, Zw.T @ logc)
            self.smearing_[w] = float(np.mean(np.exp(logc - Zw @ self.coef_[:, w])))
        return self

    def predict(self, X: Any) -> np.ndarray:
        X = _as_features(X, getattr(self, "n_features_in_", None))
        Z = np.hstack([(X - self.mean_) / self.scale_, np.ones((X.shape[0], 1))])
        return np.exp(Z @ self.coef_) * self.smearing_
