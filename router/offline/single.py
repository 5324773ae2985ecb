"""The single strategy: each query goes to one worker, chosen from the query alone (today's fast router).

Two shapes of the same question, "does the query say which worker to pay for?":

* :func:`evaluate_pair` — two workers (RouteLLM: Mixtral vs GPT-4). The router is reduced to one score
  per query, its predicted gain from the strong model, and summarised by APGR/CPT over the strong share.
* :func:`evaluate_pool` — N workers on held-out files (RouterBench, LLMRouter): per query the worker of
  highest predicted quality − λ·predicted cost, swept over λ, summarised by AIQ and the goal metrics,
  next to the baselines of :mod:`router.offline.pool`. The operating λ is chosen on a validation split of
  the *training* files (the cheapest λ whose validation accuracy reaches the best single worker's),
  while the curve-based metrics summarise the whole test curve.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from router.costs import CostModel
from router.offline.dataset import RoutingDataset
from router.offline.intervals import METHOD, PerQuery, differences, interval, resampled_aiq
from router.offline.metrics import DEFAULT_LAMBDAS, baselines, evaluate_router
from router.offline.pool import (
    PoolData,
    Validation,
    baseline_routers,
    cost_model_report,
    fit_quality_model,
    goal_metrics,
    per_task,
    score_aiq,
    shares,
    single_workers,
    swept_router,
)
from router.offline.routellm import dataset_costs

FitPredict = Callable[[RoutingDataset, RoutingDataset], np.ndarray]  # (train, test) -> P(success) [n_test, k]
MODELS = ("ensemble", "logreg", "mf", "knn", "lightgbm")
DEFAULT_MODEL = "ensemble"
STRONG_SCORE_DOC = (
    "strong_score = P_strong - P_weak: the router's expected quality gain from paying for the strong "
    "model on this query, so the queries where the strong model helps most are upgraded first"
)
DECISION = (
    "per query, argmax over workers of predicted quality - λ·predicted cost / (the "
    "query's most expensive predicted cost); ties to the cheaper worker"
)


# ------------------------------------------------------------------------------------------ two workers


def _blind(test: RoutingDataset) -> RoutingDataset:
    """The test set as fit_predict sees it: labels and recorded answers (whose length hints at correctness)
    replaced by NaN, so a router cannot peek at what it is scored on."""
    return dataclasses.replace(
        test,
        labels=np.full_like(test.labels, np.nan),
        response_chars=np.full_like(test.labels, np.nan),
        meta={**test.meta, "blinded": True},
    )


def evaluate_pair(
    fit_predict: FitPredict,
    train: RoutingDataset,
    test: RoutingDataset,
    weak: str,
    strong: str,
    seed: int,
    points: int,
    random_repeats: int,
    bootstrap: int,
) -> dict:
    """Fit on ``train``, score the blinded ``test``; our curve and metrics plus RouteLLM's baselines."""
    w, s = test.worker_index(weak), test.worker_index(strong)
    started = time.perf_counter()
    pred = np.asarray(fit_predict(train, _blind(test)), dtype=float)
    fit_seconds = time.perf_counter() - started
    if pred.shape != (len(test), len(test.workers)):
        raise ValueError(
            f"fit_predict returned shape {pred.shape}, expected ({len(test)}, {len(test.workers)})"
        )

    labelled = np.isfinite(test.labels[:, w]) & np.isfinite(test.labels[:, s])
    scored = test.subset(labelled)
    score = pred[labelled, s] - pred[labelled, w]
    if not np.all(np.isfinite(score)):
        raise ValueError("fit_predict returned NaN/inf for a labelled test row")
    yw, ys = scored.labels[:, w], scored.labels[:, s]
    cw, cs = dataset_costs(scored, weak), dataset_costs(scored, strong)
    result = evaluate_router("ours", score, yw, ys, cw, cs, points, bootstrap=bootstrap, seed=seed)
    result.update(
        n_train=len(train),
        n_test=len(scored),
        n_test_unlabelled=int((~labelled).sum()),
        cost_weak_usd=float(cw.mean()),
        cost_strong_usd=float(cs.mean()),
        fit_predict_seconds=fit_seconds,
        baselines=baselines(yw, ys, cw, cs, random_state=seed, random_repeats=random_repeats, points=points),
    )
    return result


def quality_fit_predict(features: Any, model: str, seed: int, progress: bool = True) -> FitPredict:
    """The learned router as a :data:`FitPredict`: query features → a quality model of kind ``model``."""
    from router.training import fit_quality

    def fit_predict(train: RoutingDataset, test: RoutingDataset) -> np.ndarray:
        X_train = features.transform(train.texts, train.turns, progress=progress)
        fitted, _ = fit_quality(X_train, train.labels, model, seed)
        return fitted.predict(features.transform(test.texts, test.turns, progress=progress))

    return fit_predict


def group_mean_fit_predict(train: RoutingDataset, test: RoutingDataset) -> np.ndarray:
    """A text-free reference router: each worker's mean train label in the query's group, else its benchmark,
    else overall. Any learned router should beat it on held-out subjects, where it only knows the benchmark."""
    k = len(train.workers)
    overall = np.nan_to_num(np.nanmean(train.labels, axis=0) if len(train) else np.zeros(k), nan=0.5)

    def means(keys: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for key in set(keys):
            rows = train.labels[[i for i, g in enumerate(keys) if g == key]]
            with np.errstate(all="ignore"):
                m = np.nanmean(rows, axis=0) if np.isfinite(rows).any() else np.full(k, np.nan)
            out[key] = np.where(np.isfinite(m), m, overall)
        return out

    by_group, by_part = means(train.groups), means(train.parts)
    return np.array(
        [by_group.get(g, by_part.get(p, overall)) for g, p in zip(test.groups, test.parts, strict=True)],
        dtype=float,
    ).reshape(len(test), k)


# -------------------------------------------------------------------------------------------- N workers


def evaluate_pool(
    train: RoutingDataset,
    test: RoutingDataset,
    features: Any,
    *,
    model: str = "mf",
    seed: int = 0,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Fit on ``train``, score ``test`` (aligned by :func:`router.offline.split.align`); the result body.
    ``say`` hears the stages of the job."""
    say = say or (lambda _: None)
    data = PoolData.prepare(train, test, features, progress)
    say(f"fitting the quality model ({model}), the cost model and the baselines")
    started = time.perf_counter()
    validation = Validation(data.train, data.X_train, seed, lambdas)
    operating = validation.operating_lambda(model)
    knn_k = validation.best_k()
    predicted_cost = CostModel().fit(data.X_train, data.train_costs).predict(data.X_test)
    ours_q = fit_quality_model(model, data.X_train, data.train.labels, seed).predict(data.X_test)
    knn_q = fit_quality_model("knn", data.X_train, data.train.labels, seed, knn_k).predict(data.X_test)
    fit_seconds = time.perf_counter() - started

    ours, ours_choices = swept_router("ours", ours_q, predicted_cost, data.test, lambdas)
    baseline, knn_choices = baseline_routers(data, knn_q, knn_k, predicted_cost, lambdas)
    routers = {"ours": ours, **baseline}
    singles = single_workers(data)
    max_cost = score_aiq(routers, singles)
    ours.update(goal_metrics(ours, routers["best_single"]))
    i = lambdas.index(operating["lambda"]) if operating["lambda"] in lambdas else len(lambdas) // 2
    operating.update(test_accuracy=ours["curve"][i]["accuracy"], test_cost_usd=ours["curve"][i]["cost_usd"])
    ours["operating_point"] = operating
    ours["model"] = model
    say("paired bootstrap of the AIQ difference to kNN")
    per_query = {
        "ours": PerQuery.from_choices(ours_choices, data.test.labels, data.test_costs),
        "knn": PerQuery.from_choices(knn_choices, data.test.labels, data.test_costs),
    }
    samples = resampled_aiq(per_query, max_cost, seed=seed)
    for name, drawn in samples.items():
        routers[name]["aiq_interval"] = interval(drawn)
    task_shares = shares(ours_choices[i], data.test.groups, data.workers)
    return {
        **data.summary(max_cost),
        "routers": routers,
        "singles": singles,
        "per_task": per_task(data, ours_choices[i], task_shares),
        "shares_at_operating_point": task_shares["all"],
        "intervals": {
            "method": METHOD,
            **differences(samples, [("ours", "knn")], lambda name: routers[name]["aiq"]),
        },
        "cost_model": cost_model_report(predicted_cost, data),
        "seconds": {"embed": round(data.embed_seconds, 1), "fit_predict": round(fit_seconds, 1)},
        "lambdas": list(lambdas),
    }
