"""Held-out evaluation of the N-worker router on files anyone can hold (RouterBench / LLMRouter formats).

`polyroute router eval --format F --train FILE... --test FILE... --out RESULT.json [--plot RESULT.png]`
runs :func:`run_multi_eval`: train the quality and cost models on the train files, sweep λ on the test
files, and compare against the baselines on the same queries:

* ``random`` — a uniformly random worker per query (its expectation: every worker's mean, averaged);
* ``cheapest`` — the worker with the lowest mean cost in the training data;
* ``best_single`` — the worker with the best accuracy in the training data;
* ``knn`` — the same decision rule and cost model over a kNN quality model (most routers land near it);
* ``oracle`` — the same rule over the true labels and costs: the best any router could do per λ;
* ``singles`` — every worker on its own.

Honesty rules: test labels and costs are read only to score choices; train rows whose query text also
appears in the test files are dropped; test rows with a blank score or cost for any worker are skipped
and counted (never read as wrong); the λ of the reported operating point is chosen on a validation
split of the *training* files (the cheapest λ whose validation accuracy reaches the best single model's),
while the curve-based metrics (AIQ, the two goal metrics) summarize the whole test curve.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from router.costs import CostModel
from router.datasets import RoutingDataset
from router.frontier import (
    DEFAULT_LAMBDAS,
    aiq,
    best_accuracy_within,
    cheapest_reaching,
    route,
    score_choices,
)
from router.multi_datasets import load_format
from router.multi_split import split_ids

VALIDATION_FRACTION = 0.2
BASELINES = ("random", "cheapest", "best_single", "knn", "oracle")
MODELS = ("ensemble", "logreg", "mf", "knn", "lightgbm")
DEFAULT_MODEL = "ensemble"
# The kNN baseline's k is chosen on the validation split too, so the baseline is as tuned as ours.
KNN_KS = (10, 20, 50, 100)


# --------------------------------------------------------------------------------------------- data prep


def align(train: RoutingDataset, test: RoutingDataset) -> tuple[RoutingDataset, RoutingDataset, dict]:
    """Test columns in train's worker order; train rows sharing a query text with test dropped; test rows
    with any blank label or cost skipped. Returns (train, test, counts for the report)."""
    if sorted(test.workers) != sorted(train.workers):
        raise ValueError(
            f"test files have models {sorted(test.workers)}, train files {sorted(train.workers)}"
        )
    order = [test.workers.index(w) for w in train.workers]
    assert test.costs is not None and train.costs is not None
    test = RoutingDataset(
        name=test.name,
        texts=test.texts,
        workers=list(train.workers),
        labels=test.labels[:, order],
        groups=test.groups,
        turns=test.turns,
        meta=test.meta,
        ids=test.ids,
        costs=test.costs[:, order],
    )
    test_texts = set(test.texts)
    keep = np.array([t not in test_texts for t in train.texts], dtype=bool)
    complete = ~(np.isnan(test.labels).any(axis=1) | np.isnan(test.costs).any(axis=1))
    counts = {
        "n_train_files_rows": len(train),
        "n_train_dropped_overlap": int((~keep).sum()),
        "n_test_files_rows": len(test),
        "n_test_skipped_blank": int((~complete).sum()),
    }
    train = train.subset(keep)
    labelled = ~np.isnan(train.labels).all(axis=1)
    counts["n_train_skipped_unlabelled"] = int((~labelled).sum())
    return train.subset(labelled), test.subset(complete), counts


# ------------------------------------------------------------------------------------------------ curves


def _points(accuracy: np.ndarray, cost: np.ndarray, lambdas: Sequence[float]) -> list[dict]:
    return [
        {"lambda": float(lam), "accuracy": float(a), "cost_usd": float(c)}
        for lam, a, c in zip(lambdas, accuracy, cost, strict=True)
    ]


def _xy(points: list[dict]) -> np.ndarray:
    return np.array([[p["cost_usd"], p["accuracy"]] for p in points], dtype=float)


def _constant(name: str, accuracy: float, cost: float, lambdas: Sequence[float], **extra: Any) -> dict:
    """A router that ignores λ: the same point at every λ."""
    n = len(lambdas)
    return {
        "name": name,
        "accuracy": accuracy,
        "cost_usd": cost,
        "lambda_independent": True,
        "curve": _points(np.full(n, accuracy), np.full(n, cost), lambdas),
        **extra,
    }


def _swept(name: str, quality: np.ndarray, cost: np.ndarray, test: RoutingDataset, lambdas: Sequence[float]):
    choices = route(quality, cost, lambdas)
    assert test.costs is not None
    accuracy, spent = score_choices(choices, test.labels, test.costs)
    return {"name": name, "curve": _points(accuracy, spent, lambdas)}, choices


def _shares(
    choices: np.ndarray, groups: Sequence[str], workers: Sequence[str]
) -> dict[str, dict[str, float]]:
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


# --------------------------------------------------------------------------------------------- pipeline


def _fit(model: str, X: np.ndarray, Y: np.ndarray, seed: int, k: int | None = None):
    from router.quality import make_quality_model

    fitted = make_quality_model(model, random_state=seed)
    if k is not None:
        fitted.k = k
    return fitted.fit(X, Y)


class _Validation:
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
        quality = _fit(model, self.X_fit, self.fit_labels, self.seed, k).predict(self.X_val)
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


def evaluate(
    train: RoutingDataset,
    test: RoutingDataset,
    features: Any,
    *,
    model: str = "mf",
    seed: int = 0,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    progress: bool = False,
) -> dict:
    """Fit on ``train``, score ``test`` (aligned by :func:`align`); the JSON-ready result body."""
    train, test, counts = align(train, test)
    if len(test) == 0:
        raise ValueError("no test row has a score and a cost for every worker")
    workers = list(train.workers)
    started = time.perf_counter()
    X_train = features.transform(train.texts, train.turns, progress=progress)
    X_test = features.transform(test.texts, test.turns, progress=progress)
    embed_seconds = time.perf_counter() - started
    assert train.costs is not None and test.costs is not None

    started = time.perf_counter()
    validation = _Validation(train, X_train, seed, lambdas)
    operating = validation.operating_lambda(model)
    knn_k = validation.best_k()
    cost_model = CostModel().fit(X_train, train.costs)
    predicted_cost = cost_model.predict(X_test)
    ours_q = _fit(model, X_train, train.labels, seed).predict(X_test)
    knn_q = _fit("knn", X_train, train.labels, seed, knn_k).predict(X_test)
    fit_seconds = time.perf_counter() - started

    Y, C = test.labels, test.costs
    ours, ours_choices = _swept("ours", ours_q, predicted_cost, test, lambdas)
    knn, _ = _swept("knn", knn_q, predicted_cost, test, lambdas)
    knn["k"] = knn_k
    oracle, _ = _swept("oracle", Y, C, test, lambdas)
    train_acc = np.nanmean(train.labels, axis=0)
    train_cost = np.nanmean(train.costs, axis=0)
    best, cheap = int(np.nanargmax(train_acc)), int(np.nanargmin(train_cost))
    singles = {
        w: {
            "accuracy": float(Y[:, j].mean()),
            "cost_usd": float(C[:, j].mean()),
            "train_accuracy": float(train_acc[j]),
        }
        for j, w in enumerate(workers)
    }
    routers = {
        "ours": ours,
        "random": _constant("random", float(Y.mean()), float(C.mean()), lambdas),
        "cheapest": _constant(
            "cheapest", float(Y[:, cheap].mean()), float(C[:, cheap].mean()), lambdas, worker=workers[cheap]
        ),
        "best_single": _constant(
            "best_single", float(Y[:, best].mean()), float(C[:, best].mean()), lambdas, worker=workers[best]
        ),
        "knn": knn,
        "oracle": oracle,
    }
    max_cost = max(
        max(p["cost_usd"] for r in routers.values() for p in r["curve"]),
        max(s["cost_usd"] for s in singles.values()),
    )
    for r in routers.values():
        r["aiq"] = aiq(_xy(r["curve"]), max_cost)
    for s in singles.values():
        s["aiq"] = aiq(np.array([[s["cost_usd"], s["accuracy"]]]), max_cost)

    target = routers["best_single"]
    reach = cheapest_reaching(_xy(ours["curve"]), target["accuracy"])
    ours["best_accuracy_at_cost_of_best_single"] = best_accuracy_within(
        _xy(ours["curve"]), target["cost_usd"]
    )
    ours["cost_ratio_at_best_single_accuracy"] = None if reach is None else reach / target["cost_usd"]
    i = lambdas.index(operating["lambda"]) if operating["lambda"] in lambdas else len(lambdas) // 2
    operating.update(test_accuracy=ours["curve"][i]["accuracy"], test_cost_usd=ours["curve"][i]["cost_usd"])
    ours["operating_point"] = operating
    ours["model"] = model
    shares = _shares(ours_choices[i], test.groups, workers)
    per_task = {}
    for group in sorted(set(test.groups)):
        rows = np.array(test.groups) == group
        accs = Y[rows].mean(axis=0)
        per_task[group] = {
            "n": int(rows.sum()),
            "best_worker": workers[int(np.argmax(accs))],
            "best_worker_accuracy": float(accs.max()),
            "worker_accuracy": {w: float(a) for w, a in zip(workers, accs, strict=True)},
            "ours_shares": shares[group],
            "ours_accuracy": float(Y[rows, ours_choices[i][rows]].mean()),
            "ours_cost_usd": float(C[rows, ours_choices[i][rows]].mean()),
        }
    cost_error = np.abs(predicted_cost - C) / np.maximum(C, 1e-12)
    return {
        "workers": workers,
        "n_train": len(train),
        "n_test": len(test),
        **counts,
        "max_cost_usd": max_cost,
        "routers": routers,
        "singles": singles,
        "per_task": per_task,
        "shares_at_operating_point": shares["all"],
        "cost_model": {
            "kind": "ridge on log cost per worker (router/costs.py)",
            "median_abs_pct_error": {w: float(np.median(cost_error[:, j])) for j, w in enumerate(workers)},
        },
        "seconds": {"embed": round(embed_seconds, 1), "fit_predict": round(fit_seconds, 1)},
        "lambdas": list(lambdas),
    }


def run_multi_eval(
    fmt: str,
    train_files: Sequence[str | Path],
    test_files: Sequence[str | Path],
    out_json: str | Path,
    out_png: str | Path | None = None,
    *,
    prices: str | Path | None = None,
    backend: str = "static",
    model: str = "mf",
    seed: int = 0,
    progress: bool = True,
    console: Any = None,
) -> dict:
    """Load, evaluate, write RESULT.json (and the plot), print the table; returns the JSON."""
    import json

    from rich.console import Console

    from router.evaluate import _jsonable
    from router.training import feature_builder

    console = console or (Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=130))
    train = load_format(fmt, train_files, prices)
    test = load_format(fmt, test_files, prices)
    body = evaluate(train, test, feature_builder(backend), model=model, seed=seed, progress=progress)
    report = _jsonable(
        {
            "format": fmt,
            "train_files": [str(f) for f in train_files],
            "test_files": [str(f) for f in test_files],
            "backend": backend,
            "seed": seed,
            **body,
            "definitions": {
                "aiq": "area under the non-decreasing convex hull of (cost, accuracy) points from the "
                "router's cheapest point, extended flat to max_cost_usd (the largest cost among all compared "
                "routers and single models), divided by max_cost_usd (RouterBench)",
                "best_accuracy_at_cost_of_best_single": "best test accuracy among our λ points costing at most "
                "best_single's cost (no mixing of points)",
                "cost_ratio_at_best_single_accuracy": "lowest cost among our λ points reaching best_single's "
                "accuracy, divided by best_single's cost; null if no point reaches it",
                "decision": "per query, argmax over workers of predicted quality - λ·predicted cost / (the "
                "query's most expensive predicted cost); ties to the cheaper worker",
                "random": "expected accuracy and cost of a uniformly random worker per query",
                "text": train.meta.get("text", "the query as given"),
            },
            "data": {"train": _meta(train), "test": _meta(test)},
        }
    )
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if out_png is not None:
        from router.multi_plot import plot_frontier

        plot_frontier(report, out_png)
    print_summary(report, console)
    return report


def _meta(ds: RoutingDataset) -> dict:
    return {k: v for k, v in ds.meta.items() if k != "prompt_chars"}


def print_summary(report: dict, console: Any) -> None:
    """Single models, baselines and ours as one table, then the goal metrics."""
    from rich.table import Table

    table = Table(
        title=f"{report['format']}: {report['n_test']} test queries, {len(report['workers'])} workers"
    )
    for col in ("router", "accuracy", "cost $/1k queries", "AIQ"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for name, s in sorted(report["singles"].items(), key=lambda kv: kv[1]["cost_usd"]):
        table.add_row(name, f"{s['accuracy']:.3f}", f"{1000 * s['cost_usd']:.4f}", f"{s['aiq']:.4f}")
    for name in ("random", "cheapest", "best_single", "knn", "oracle", "ours"):
        r = report["routers"][name]
        if r.get("lambda_independent"):
            acc, cost = f"{r['accuracy']:.3f}", f"{1000 * r['cost_usd']:.4f}"
        else:
            accs = [p["accuracy"] for p in r["curve"]]
            costs = [p["cost_usd"] for p in r["curve"]]
            acc, cost = f"{min(accs):.3f}–{max(accs):.3f}", f"{1000 * min(costs):.4f}–{1000 * max(costs):.4f}"
        table.add_row(f"[bold]{name}[/]", acc, cost, f"{r['aiq']:.4f}")
    console.print(table)
    ours = report["routers"]["ours"]
    op = ours["operating_point"]
    ratio = ours["cost_ratio_at_best_single_accuracy"]
    console.print(
        f"best single ({report['routers']['best_single']['worker']}): "
        f"{report['routers']['best_single']['accuracy']:.3f} at ${report['routers']['best_single']['cost_usd']:.6f}; "
        f"ours at that cost: {ours['best_accuracy_at_cost_of_best_single']}; "
        f"cost ratio at its accuracy: {'never reached' if ratio is None else f'{ratio:.3f}'}; "
        f"validated λ={op['lambda']:g}: accuracy {op['test_accuracy']:.3f} at ${op['test_cost_usd']:.6f}"
    )
