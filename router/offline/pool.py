"""What every N-worker strategy is measured against, on held-out files: the shared half of an evaluation.

A strategy (:mod:`router.offline.single`, and a cascade next to it) decides how our router spends its
calls; everything else is the same for all of them and lives here, so two strategies are compared on
the same queries, baselines and yardsticks:

* :class:`PoolData` — the aligned train/test pair (see :func:`router.offline.split.align`) and its features;
* :class:`Validation` — a split of the *training* rows for choices that must not look at the test files
  (the operating λ, the kNN baseline's k);
* :func:`baseline_routers` — ``random`` (a uniformly random worker per query: every worker's mean,
  averaged), ``cheapest`` and ``best_single`` (by the training data), ``knn`` (the same decision rule and
  cost model over a kNN quality model: most routers land near it) and ``oracle`` (the same rule over the
  true labels and costs: the best any router could do per λ);
* :func:`single_workers` — every worker on its own;
* :func:`score_aiq`, :func:`goal_metrics`, :func:`per_task` — AIQ on a common cost axis, the two goal
  metrics against the best single worker, and per-task accuracy and routing shares.

Honesty rules: test labels and costs are read only to score choices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.costs import CostModel
from router.offline.dataset import RoutingDataset
from router.offline.metrics import (
    aiq,
    aiq_within,
    best_accuracy_within,
    cheapest_reaching,
    cost_accuracy,
    lambda_curve,
    route,
    score_choices,
)
from router.offline.split import align, split_ids

VALIDATION_FRACTION = 0.2
BASELINES = ("random", "cheapest", "best_single", "knn", "oracle")
# The kNN baseline's k is chosen on the validation split too, so the baseline is as tuned as ours.
KNN_KS = (10, 20, 50, 100)


def fit_quality_model(model: str, X: np.ndarray, Y: np.ndarray, seed: int, k: int | None = None):
    """A quality model of kind ``model`` (router/quality.py) fitted on ``X`` → labels ``Y``."""
    from router.quality import make_quality_model

    fitted = make_quality_model(model, random_state=seed)
    if k is not None:
        fitted.k = k
    return fitted.fit(X, Y)


def no_training_rows(counts: dict) -> str:
    """Why align left no training row, from its counts: said before any fitting, since the fits that
    follow fail on an empty table with messages that hide the cause (a train file equal to a test file)."""
    held = counts["n_train_files_rows"]
    if held == 0:
        return "no training rows: the --train files hold no data rows (header only, or empty)"
    overlap, unscored = counts["n_train_dropped_overlap"], counts["n_train_skipped_unlabelled"]
    causes = [f"{overlap} share a query with the --test files"] if overlap else []
    causes += [f"{unscored} have no score for any worker"] if unscored else []
    hint = " (give --train files apart from the --test files, e.g. from `polyroute router split`)"
    return f"no training rows left: of the {held} rows of the --train files, {' and '.join(causes)}" + (
        hint if overlap else ""
    )


@dataclass(frozen=True)
class PoolData:
    """An aligned train/test pair and the features of both: the input of every N-worker strategy."""

    train: RoutingDataset
    test: RoutingDataset
    counts: dict  # rows dropped or skipped by align, for the report
    X_train: np.ndarray
    X_test: np.ndarray
    embed_seconds: float

    @classmethod
    def prepare(cls, train: RoutingDataset, test: RoutingDataset, features: Any, progress: bool) -> PoolData:
        train, test, counts = align(train, test)
        if len(train) == 0:
            raise ValueError(no_training_rows(counts))
        if len(test) == 0:
            raise ValueError("no test row has a score and a cost for every worker")
        blank = np.isnan(train.labels).all(axis=0)
        if blank.any():
            names = ", ".join(w for w, empty in zip(train.workers, blank, strict=True) if empty)
            raise ValueError(
                f"no training scores for worker(s) {names}: each of its scores in the --train files is "
                "blank or on a query of the --test files"
            )
        started = time.perf_counter()
        X_train = features.transform(train.texts, train.turns, progress=progress)
        X_test = features.transform(test.texts, test.turns, progress=progress)
        return cls(train, test, counts, X_train, X_test, time.perf_counter() - started)

    @property
    def workers(self) -> list[str]:
        return list(self.train.workers)

    def summary(self, max_cost: float) -> dict:
        """The head every N-worker result body starts with: workers, row counts, the AIQ cost axis."""
        return {
            "workers": self.workers,
            "n_train": len(self.train),
            "n_test": len(self.test),
            **self.counts,
            "max_cost_usd": max_cost,
        }

    @property
    def test_costs(self) -> np.ndarray:
        assert self.test.costs is not None  # align refuses files without costs
        return self.test.costs

    @property
    def train_costs(self) -> np.ndarray:
        assert self.train.costs is not None
        return self.train.costs


class Validation:
    """A stratified split of the *training* rows: fit on one part, route on the other, for choices that
    must not look at the test files (the operating λ, the kNN baseline's k)."""

    def __init__(self, train: RoutingDataset, X: np.ndarray, seed: int, lambdas: Sequence[float]) -> None:
        held = split_ids(train.ids, train.groups, VALIDATION_FRACTION, seed + 1)
        is_val = np.array([i in held for i in train.ids])
        assert train.costs is not None
        fit_rows, val_rows = np.flatnonzero(~is_val), np.flatnonzero(is_val)
        Y, C = train.labels[val_rows], train.costs[val_rows]
        complete = ~(np.isnan(Y).any(axis=1) | np.isnan(C).any(axis=1))
        self.fit_labels = train.labels[fit_rows]
        self.usable = complete.sum() >= 2 and not np.isnan(self.fit_labels).all(axis=0).any()
        self.lambdas = list(lambdas)
        self.seed = seed
        self.X_fit, self.X_val = X[fit_rows], X[val_rows][complete]
        self.Y, self.C = Y[complete], C[complete]
        if self.usable:
            self.cost = CostModel().fit(self.X_fit, train.costs[fit_rows]).predict(self.X_val)

    def curve(self, model: str, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        quality = fit_quality_model(model, self.X_fit, self.fit_labels, self.seed, k).predict(self.X_val)
        return score_choices(route(quality, self.cost, self.lambdas), self.Y, self.C)

    def best_k(self) -> int | None:
        """The k of highest validation AIQ for the kNN baseline (None: the model's default)."""
        if not self.usable:
            return None
        curves = {k: self.curve("knn", k) for k in KNN_KS if k <= len(self.fit_labels)}
        if not curves:
            return None
        top = max(float(c.max()) for _, c in curves.values())
        return max(curves, key=lambda k: aiq(np.c_[curves[k][1], curves[k][0]], top))

    def operating_lambda(self, model: str) -> dict:
        """The cheapest λ whose validation accuracy reaches that of the worker best on the fit part,
        else the λ of highest validation accuracy."""
        if not self.usable:
            return {"lambda": float(np.median(self.lambdas)), "how": "too few rows to validate: median λ"}
        accuracy, spent = self.curve(model)
        target = float(self.Y[:, int(np.nanargmax(np.nanmean(self.fit_labels, axis=0)))].mean())
        reaching = np.flatnonzero(accuracy >= target - 1e-12)
        if reaching.size:
            i = int(reaching[np.argmin(spent[reaching])])
            how = f"cheapest λ whose validation accuracy reaches the best single worker's ({target:.3f})"
        else:
            i = int(np.argmax(accuracy))
            how = f"no λ reached the best single worker's validation accuracy ({target:.3f}): most accurate λ"
        return {
            "lambda": float(self.lambdas[i]),
            "how": how,
            "validation_rows": len(self.Y),
            "validation_accuracy": float(accuracy[i]),
            "validation_cost_usd": float(spent[i]),
        }


# -------------------------------------------------------------------------------------------- routers


def constant_router(name: str, accuracy: float, cost: float, lambdas: Sequence[float], **extra: Any) -> dict:
    """A router that ignores λ: the same point at every λ."""
    n = len(lambdas)
    return {
        "name": name,
        "accuracy": accuracy,
        "cost_usd": cost,
        "lambda_independent": True,
        "curve": lambda_curve(np.full(n, accuracy), np.full(n, cost), lambdas),
        **extra,
    }


def swept_router(
    name: str,
    quality: np.ndarray,
    cost: np.ndarray,
    test: RoutingDataset,
    lambdas: Sequence[float],
    columns: Sequence[int] | None = None,
) -> tuple[dict, np.ndarray]:
    """quality − λ·cost routing over a λ sweep, scored on the test labels and costs; (result, choices).
    ``columns`` restricts the pool to those workers (choices stay indices into all of them)."""
    if columns is None:
        choices = route(quality, cost, lambdas)
    else:
        pool = np.asarray(columns)
        choices = pool[route(quality[:, pool], cost[:, pool], lambdas)]
    assert test.costs is not None
    accuracy, spent = score_choices(choices, test.labels, test.costs)
    return {"name": name, "curve": lambda_curve(accuracy, spent, lambdas)}, choices


def baseline_routers(
    data: PoolData,
    knn_quality: np.ndarray,
    knn_k: int | None,
    predicted_cost: np.ndarray,
    lambdas: Sequence[float],
) -> tuple[dict[str, dict], np.ndarray]:
    """random, cheapest, best_single, knn and oracle on the test queries (in :data:`BASELINES`
    order), and kNN's choice per (λ, query) (for the intervals of router/offline/intervals.py)."""
    Y, C = data.test.labels, data.test_costs
    workers = data.workers
    knn, knn_choices = swept_router("knn", knn_quality, predicted_cost, data.test, lambdas)
    knn["k"] = knn_k
    oracle, _ = swept_router("oracle", Y, C, data.test, lambdas)
    best, cheap = best_and_cheapest(data.train)
    routers = {
        "random": constant_router("random", float(Y.mean()), float(C.mean()), lambdas),
        "cheapest": constant_router(
            "cheapest", float(Y[:, cheap].mean()), float(C[:, cheap].mean()), lambdas, worker=workers[cheap]
        ),
        "best_single": constant_router(
            "best_single", float(Y[:, best].mean()), float(C[:, best].mean()), lambdas, worker=workers[best]
        ),
        "knn": knn,
        "oracle": oracle,
    }
    return routers, knn_choices


def best_and_cheapest(train: RoutingDataset) -> tuple[int, int]:
    """Indices of the most accurate and of the cheapest worker on the training data."""
    assert train.costs is not None
    return int(np.nanargmax(np.nanmean(train.labels, axis=0))), int(
        np.nanargmin(np.nanmean(train.costs, axis=0))
    )


def single_workers(data: PoolData) -> dict[str, dict]:
    """Every worker on its own: test accuracy and cost, and its training accuracy."""
    Y, C = data.test.labels, data.test_costs
    train_acc = np.nanmean(data.train.labels, axis=0)
    return {
        w: {
            "accuracy": float(Y[:, j].mean()),
            "cost_usd": float(C[:, j].mean()),
            "train_accuracy": float(train_acc[j]),
        }
        for j, w in enumerate(data.workers)
    }


def score_aiq(routers: dict[str, dict], singles: dict[str, dict]) -> float:
    """Set ``aiq`` on every router and single worker, on one cost axis; returns its end (max cost).

    The axis ends at the dearest single worker. A router choosing one worker per query never goes past
    it; a cascade can (it pays for several answers), and its points beyond are left out of its AIQ, so
    spending more than any single model earns a cascade nothing and moves nobody else's AIQ."""
    max_cost = max(s["cost_usd"] for s in singles.values())
    for r in routers.values():
        r["aiq"] = aiq_within(cost_accuracy(r["curve"]), max_cost)
    for s in singles.values():
        s["aiq"] = aiq(np.array([[s["cost_usd"], s["accuracy"]]]), max_cost)
    return max_cost


def goal_metrics(router: dict, best_single: dict) -> dict[str, float | None]:
    """The best accuracy at the best single worker's cost, and the cost share needed to reach its accuracy."""
    points = cost_accuracy(router["curve"])
    reach = cheapest_reaching(points, best_single["accuracy"])
    return {
        "best_accuracy_at_cost_of_best_single": best_accuracy_within(points, best_single["cost_usd"]),
        "cost_ratio_at_best_single_accuracy": None if reach is None else reach / best_single["cost_usd"],
    }


def shares(choices: np.ndarray, groups: Sequence[str], workers: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per task (and "all"), the share of queries sent to each worker (workers with a share only)."""
    out: dict[str, dict[str, float]] = {}
    names = np.array(workers)
    groups_arr = np.array(groups)
    for group in ["all", *sorted(set(groups))]:
        picked = names[choices] if group == "all" else names[choices[groups_arr == group]]
        values, counts = np.unique(picked, return_counts=True)
        out[group] = {
            str(v): round(float(c) / len(picked), 4)
            for v, c in sorted(zip(values, counts, strict=True), key=lambda t: -t[1])
        }
    return out


def per_task(
    data: PoolData, choices: np.ndarray, task_shares: dict[str, dict[str, float]]
) -> dict[str, dict]:
    """Per task: the best worker there, every worker's accuracy, and where and how well ``choices`` did."""
    Y, C = data.test.labels, data.test_costs
    workers = data.workers
    out = {}
    for group in sorted(set(data.test.groups)):
        rows = np.array(data.test.groups) == group
        accs = Y[rows].mean(axis=0)
        out[group] = {
            "n": int(rows.sum()),
            "best_worker": workers[int(np.argmax(accs))],
            "best_worker_accuracy": float(accs.max()),
            "worker_accuracy": {w: float(a) for w, a in zip(workers, accs, strict=True)},
            "ours_shares": task_shares[group],
            "ours_accuracy": float(Y[rows, choices[rows]].mean()),
            "ours_cost_usd": float(C[rows, choices[rows]].mean()),
        }
    return out


def cost_model_report(predicted_cost: np.ndarray, data: PoolData) -> dict:
    """How far the predicted costs were from the recorded ones on the test queries."""
    cost_error = np.abs(predicted_cost - data.test_costs) / np.maximum(data.test_costs, 1e-12)
    return {
        "kind": "ridge on log cost per worker (router/costs.py)",
        "median_abs_pct_error": {w: float(np.median(cost_error[:, j])) for j, w in enumerate(data.workers)},
    }
