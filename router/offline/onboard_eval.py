"""Offline evaluation of onboarding: how much of a worker's routing value N graded probes recover.

`polyroute router eval --format F --train ... --test ... --onboard WORKER --probes N --out R.json`:

* ``full``: the router trained with every label of every worker (today's router);
* ``without``: the same router with WORKER out of the pool;
* ``ours``: WORKER onboarded from N random training queries only (router/onboard.py): its vector is
  fitted on those N labels on top of a model trained on the other workers, and its cost from those N
  queries' recorded costs (:func:`onboard_cost`). Every other worker keeps all its labels.

All three are swept over λ on the test files and scored by AIQ on one cost axis (the full pool's
dearest single worker), so ``gain_recovered = (ours − without) / (full − without)`` compares like with
like. A single draw of N probes is noisy (the denominator is often a hundredth of AIQ), so ``ours`` is
the mean over ``repeats`` seeded draws, each draw's figure reported too.

Honesty: the probes' log-odds come from a model fitted without them (as in the product, where the
probe set is not training data of the shipped prior); test labels and costs only score choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from router.costs import CostModel
from router.offline.dataset import RoutingDataset
from router.offline.intervals import METHOD, PerQuery, interval, resampled_aiq
from router.offline.metrics import DEFAULT_LAMBDAS
from router.offline.onboard_curve import log_loss, share_recovered
from router.offline.pool import PoolData, fit_quality_model, score_aiq, single_workers, swept_router
from router.onboard import DEFAULT_ALPHA, fit_vector
from router.quality import _logit, _sigmoid

DEFAULT_REPEATS = 3
FORMULA = "(ours - without) / (full - without), AIQ on the full pool's cost axis"


def onboard_cost(known_log_cost: np.ndarray, probe_known_log_cost: np.ndarray, probe_cost: np.ndarray) -> Any:
    """A newcomer's predicted cost per query from its probes' recorded costs.

    Its log cost is an affine function of the known workers' mean predicted log cost (price and answer
    length scale alike across workers: a code answer is long for everyone), fitted by least squares on
    the probes and mapped back with Duan's smearing like router/costs.py. Two numbers, so 25 probes are
    enough; a ridge on the query's features, as for known workers, is not. In the gateway a newcomer's
    cost comes from its catalog price and its median completion tokens on the probes instead."""
    x = probe_known_log_cost.mean(axis=1)
    A = np.c_[x, np.ones_like(x)]
    target = np.log(np.maximum(probe_cost, 1e-9))
    coef, *_ = np.linalg.lstsq(A, target, rcond=None)
    smearing = float(np.mean(np.exp(target - A @ coef)))
    return np.exp(np.c_[known_log_cost.mean(axis=1), np.ones(len(known_log_cost))] @ coef) * smearing


def _column_loss(p: np.ndarray, y: np.ndarray) -> float:
    """Log loss of one worker's predicted P(success) on its labelled test queries."""
    rows = ~np.isnan(y)
    return log_loss(p[rows], y[rows])


def _column_summary(ours: Sequence[float], full: np.ndarray, y: np.ndarray, base_rate: float) -> dict:
    """The worker's own column on the test queries, by log loss: unlike the AIQ ratio, a figure that does
    not hang on which queries the routers happen to win (router/offline/onboard_curve.py measures it
    by probe count on training files)."""
    base = _column_loss(np.full(len(y), base_rate), y)
    mean = float(np.mean(ours))
    full_loss = _column_loss(full, y)
    return {
        "ours": mean,
        "full": full_loss,
        "base": base,
        "recovered": share_recovered(base, full_loss, mean),
        "note": "base: the worker's mean training label for every query; recovered = (base - ours) / (base - full)",
    }


def check_probes(probes: int, worker: str, labelled: int, data: PoolData) -> None:
    """Refuse a probe count no draw can honour, before the long fits. Probes are drawn from the
    worker's labelled training queries, and the model that gives them log-odds is fitted on the other
    training queries (see the module's honesty note), so at least one training query must be left."""
    if probes > labelled:
        dropped = data.counts["n_train_dropped_overlap"]
        why = f" ({dropped} training rows were dropped as queries of the --test files)" if dropped else ""
        raise ValueError(f"--probes {probes}: {worker} has only {labelled} labelled training queries{why}")
    rows = len(data.train)
    if probes >= rows:
        raise ValueError(
            f"--probes {probes}: must be below {rows}, the number of training queries: the probes are "
            "scored by a model fitted on the training queries that are not probes"
        )


def evaluate_onboarding(
    train: RoutingDataset,
    test: RoutingDataset,
    features: Any,
    *,
    worker: str,
    probes: int,
    model: str = "ensemble",
    seed: int = 0,
    repeats: int = DEFAULT_REPEATS,
    alpha: float = DEFAULT_ALPHA,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict:
    """The result body: ``routers`` (ours, full, without), ``onboarding`` (gain_recovered and its inputs)."""
    say = say or (lambda _: None)
    if probes < 5:
        raise ValueError(f"--probes {probes}: onboarding needs at least 5 probes")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    data = PoolData.prepare(train, test, features, progress)
    if worker not in data.workers:
        raise ValueError(
            f"--onboard {worker!r} is not a worker of these files; they have: {', '.join(data.workers)}"
        )
    w = data.workers.index(worker)
    others = [j for j in range(len(data.workers)) if j != w]
    labelled = np.flatnonzero(~np.isnan(data.train.labels[:, w]) & ~np.isnan(data.train_costs[:, w]))
    check_probes(probes, worker, len(labelled), data)
    Y, C = data.train.labels, data.train_costs
    every = range(len(data.workers))

    per_query: dict[str, PerQuery] = {}  # for the bootstrap interval of gain_recovered

    def router(
        name: str, quality: np.ndarray, cost: np.ndarray, columns: Sequence[int], key: str | None = None
    ) -> dict:
        """The swept router, its outcome per query kept under ``key`` (default: ``name``)."""
        result, choices = swept_router(name, quality, cost, data.test, lambdas, columns)
        per_query[key or name] = PerQuery.from_choices(choices, data.test.labels, data.test_costs)
        return result

    say(f"fitting the full router ({model}, every label) and the one without {worker}")
    full_q = fit_quality_model(model, data.X_train, Y, seed).predict(data.X_test)
    full_cost = CostModel().fit(data.X_train, C).predict(data.X_test)
    known_q = fit_quality_model(model, data.X_train, Y[:, others], seed).predict(data.X_test)
    known_cost = full_cost[:, others]  # the cost model is per worker: the same without WORKER
    without_q = np.zeros_like(full_q)
    without_q[:, others] = known_q  # a router that never saw WORKER: the representation ours builds on
    routers = {
        "full": router("full", full_q, full_cost, every),
        "without": router("without", without_q, full_cost, others),
    }
    draws: list[dict] = []
    column_losses: list[float] = []
    for r in range(repeats):
        rng = np.random.default_rng(seed + r)
        rows = np.sort(rng.choice(labelled, size=probes, replace=False))
        say(f"draw {r + 1}/{repeats}: {worker} onboarded from {probes} probes")
        rest = np.setdiff1d(np.arange(len(Y)), rows)
        probe_q = fit_quality_model(model, data.X_train[rest], Y[rest][:, others], seed).predict(
            data.X_train[rows]
        )
        beta, delta = fit_vector(_logit(probe_q), Y[rows, w], alpha)
        quality = np.empty_like(full_q)
        quality[:, others] = known_q
        quality[:, w] = _sigmoid(_logit(known_q) @ beta + delta)
        cost = np.empty_like(full_cost)
        cost[:, others] = known_cost
        probe_known_cost = CostModel().fit(data.X_train[rest], C[rest][:, others]).predict(data.X_train[rows])
        cost[:, w] = onboard_cost(np.log(known_cost), np.log(probe_known_cost), C[rows, w])
        column_losses.append(_column_loss(quality[:, w], data.test.labels[:, w]))
        draws.append(
            {
                "seed": seed + r,
                "router": router("ours", quality, cost, every, key=f"draw{r}"),
                "vector": dict(
                    zip([data.workers[j] for j in others], np.round(beta, 4).tolist(), strict=True)
                ),
                "offset": delta,
            }
        )
    singles = single_workers(data)
    scored = {**routers, **{f"draw{i}": d["router"] for i, d in enumerate(draws)}}
    max_cost = score_aiq(scored, singles)
    ours_aiq = float(np.mean([d["router"]["aiq"] for d in draws]))
    first = draws[0]["router"]
    routers["ours"] = {**first, "aiq": ours_aiq, "aiq_first_draw": first["aiq"]}
    full, without = routers["full"]["aiq"], routers["without"]["aiq"]
    span = full - without

    def recovered(value: float) -> float | None:
        return None if abs(span) < 1e-12 else (value - without) / span

    say("paired bootstrap of gain_recovered")
    samples = resampled_aiq(per_query, max_cost, seed=seed)
    ours_samples = np.mean([samples[f"draw{i}"] for i in range(len(draws))], axis=0)
    spans = samples["full"] - samples["without"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(np.abs(spans) < 1e-12, np.nan, (ours_samples - samples["without"]) / spans)

    return {
        **data.summary(max_cost),
        "routers": routers,
        "singles": singles,
        "onboarding": {
            "worker": worker,
            "probes": probes,
            "repeats": repeats,
            "alpha": alpha,
            "model": model,
            "gain_recovered": recovered(ours_aiq),
            "gain_recovered_interval": interval(ratios),
            "full_minus_without_interval": interval(spans),
            "interval_method": METHOD,
            "formula": FORMULA,
            "aiq": {"ours": ours_aiq, "full": full, "without": without},
            "column_log_loss": _column_summary(
                column_losses, full_q[:, w], data.test.labels[:, w], float(np.nanmean(Y[:, w]))
            ),
            "draws": [
                {
                    "seed": d["seed"],
                    "aiq": d["router"]["aiq"],
                    "gain_recovered": recovered(d["router"]["aiq"]),
                    "vector": d["vector"],
                    "offset": d["offset"],
                }
                for d in draws
            ],
            "note": "ours is the mean AIQ over the draws; each draw keeps a different random set of "
            f"{probes} labelled training queries for {worker}",
        },
        "lambdas": list(lambdas),
    }
