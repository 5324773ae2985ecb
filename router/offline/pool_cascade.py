"""The cascade strategy over N workers on held-out files: answer-aware plans replayed on recorded answers.

`polyroute router eval --format routerbench --strategy cascade` lands here. On the training files it
fits, all cross-fitted on one fold assignment (router/offline/planner_fit.py):

* the query-only quality model (``--model``, today's fast router): the planner's priors, and on its
  own the ``single`` router of the report;
* the cost model, whose predictions the planner decides with;
* the post-hoc estimator and the value model of router/planner.py, and the plan table
  (router/offline/plan_table_fit.py).

Three answer-aware strategies come out of them — the planner, the same planner myopic (no value
model) and the plan table — and the one whose cross-fitted replay of the training files has the
highest AIQ is ``ours`` (:func:`compare_strategies`, the same choice `router train --strategy
cascade` makes). It then replays the plans on the test files at every λ (router/offline/replay.py),
charging each query for every worker its plan called, and reports ``ours`` and all three next to
``single``, the baselines of router/offline/pool.py and the fixed agreement rule, with paired
bootstrap intervals of the AIQ differences (router/offline/intervals.py). The operating λ is chosen on the
cross-fitted replay of the *training* files (each query planned by models that never saw it): the
cheapest λ whose validation accuracy reaches the best single worker's.

Formats that record no answers (LLMRouter) cannot be replayed answer-aware: the harness says so and
evaluates single routing instead (:class:`NoAnswers`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.costs import CostModel
from router.evidence import logit
from router.offline.book import AnswerBook
from router.offline.code_runs import code_runs_for
from router.offline.dataset import CHARS_PER_TOKEN, RoutingDataset
from router.offline.intervals import METHOD, PerQuery, differences, interval, resampled_aiq
from router.offline.metrics import DEFAULT_LAMBDAS, aiq_within, lambda_curve
from router.offline.plan_table_fit import cross_fit_tables
from router.offline.planner_fit import FittedPlanners, Recorded, fit_planner
from router.offline.pool import (
    PoolData,
    Validation,
    baseline_routers,
    best_and_cheapest,
    constant_router,
    cost_model_report,
    fit_quality_model,
    goal_metrics,
    score_aiq,
    shares,
    single_workers,
    swept_router,
)
from router.offline.replay import Replay, agreement_rule, replay
from router.offline.split import cross_fit_on, fold_assignment
from router.plan_table import PlanTable
from router.planner import Plans

FOLDS = 5
DECISION = (
    "per query, a plan: at each step call the worker whose expected final quality − λ·its predicted "
    "cost / the pool's most expensive is highest, or stop and return the answer the post-hoc estimator "
    "rates best when that is worth more; every worker called is charged"
)
# The rule of issue 13: ask Mixtral and Yi-34B; accept when they agree, else ask the best single worker.
RULE_VOTERS = ("mistralai/mixtral-8x7b-chat", "zero-one-ai/Yi-34B-Chat")


class NoAnswers(ValueError):
    """The files record no worker answers, so an answer-aware plan cannot be replayed on them."""


def _rule_voters(train: RoutingDataset, best: int) -> tuple[int, int]:
    """The issue's voters when present; else the two most accurate workers costing under a fifth of the
    best single worker (the same shape of rule on any pool)."""
    if all(v in train.workers for v in RULE_VOTERS):
        return train.workers.index(RULE_VOTERS[0]), train.workers.index(RULE_VOTERS[1])
    assert train.costs is not None
    acc, cost = np.nanmean(train.labels, axis=0), np.nanmean(train.costs, axis=0)
    cheap = [j for j in np.argsort(-acc) if j != best and cost[j] < cost[best] / 5]
    if len(cheap) < 2:
        cheap = [j for j in np.argsort(-acc) if j != best]
    return int(cheap[0]), int(cheap[1])


def _curve(run: Replay) -> list[dict]:
    curve = lambda_curve(run.accuracy(), run.mean_cost(), run.lambdas)
    for at, point in enumerate(curve):
        point["calls_per_query"] = float(run.calls[at].mean())
        point["rounds_per_query"] = float(run.rounds[at].mean())
    return curve


def single_target(Y: np.ndarray, C: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """What the operating λ must reach: the best single worker's (by mean training label) accuracy and
    mean cost on the replayed training ``rows``."""
    best = int(np.nanargmax(np.nanmean(Y, axis=0)))
    return float(Y[rows, best].mean()), float(C[rows, best].mean())


def operating_cost_weight(found: Strategies, Y: np.ndarray, C: np.ndarray) -> tuple[float, str]:
    """The operating λ of the chosen strategy and why: :func:`_operating` (the harness's rule) on the
    cross-fitted replay of the training files, so `router train` stores the λ `router eval` validates."""
    target, budget = single_target(Y, C, found.rows)
    run = found.held[found.chosen]
    at, how = _operating(run, target, budget)
    accuracy, spent = float(run.accuracy()[at]), float(run.mean_cost()[at])
    return float(run.lambdas[at]), (
        f"{how}: the {found.chosen.replace('_', ' ')}'s cross-fitted replay of the {len(found.rows)} "
        f"training queries reaches {accuracy:.3f} at ${spent:.6f}/query (best single worker {target:.3f} "
        f"at ${budget:.6f})"
    )


def _operating(run: Replay, target: float, budget: float) -> tuple[int, str]:
    """The cheapest λ whose (validation) accuracy reaches ``target`` (the best single worker's) at no
    more than ``budget`` (its cost); else the most accurate λ within that budget; else the cheapest λ."""
    accuracy, spent = run.accuracy(), run.mean_cost()
    within = spent <= budget * (1 + 1e-9)
    reaching = np.flatnonzero((accuracy >= target - 1e-12) & within)
    if reaching.size:
        at = int(reaching[np.argmin(spent[reaching])])
        return at, (
            f"cheapest λ whose validation accuracy reaches the best single worker's ({target:.3f}) "
            "at no more than its cost"
        )
    if within.any():
        candidates = np.flatnonzero(within)
        at = int(candidates[np.argmax(accuracy[candidates])])
        return at, (
            f"no λ reached the best single worker's validation accuracy ({target:.3f}) at its cost: "
            "the most accurate λ within its cost"
        )
    return int(np.argmin(spent)), "every λ cost more than the best single worker on validation: the cheapest"


@dataclass
class Strategies:
    """The answer-aware strategies replayed on the training files, each question planned by fold
    models that never saw it, and the one with the highest AIQ there (``chosen``)."""

    rows: np.ndarray  # the training rows replayed (every worker's label and cost recorded)
    held: dict[str, Replay]
    aiq: dict[str, float]
    final: dict[str, Plans]  # each fitted on every training row
    chosen: str

    @property
    def table(self) -> PlanTable:
        table = self.final["plan_table"]
        assert isinstance(table, PlanTable)
        return table


def compare_strategies(
    book: AnswerBook,
    rec: Recorded,
    planners: FittedPlanners,
    cost_cf: np.ndarray,
    Y: np.ndarray,
    C: np.ndarray,
    workers: Sequence[str],
    lambdas: Sequence[float],
    seed: int,
    say: Callable[[str], None],
) -> Strategies:
    """Which answer-aware strategy a trained router should use — the planner with its gain model,
    the same planner myopic (no gain model), or the plan table: each is cross-fitted on the training
    files and replayed at every λ; the highest AIQ (up to the dearest worker's mean cost) wins."""
    rows = np.flatnonzero(~(np.isnan(Y).any(axis=1) | np.isnan(C).any(axis=1)))
    tables = cross_fit_tables(book, Y, C, workers, k=FOLDS, seed=seed, fold_of=planners.fold_of, progress=say)
    fitted = {"planner": planners, "myopic_planner": planners.myopic(), "plan_table": tables}
    held = {}
    for name, strategy in fitted.items():
        say(f"validation: replaying the training files with the fold models of the {name.replace('_', ' ')}")
        held[name] = replay(strategy.for_row, book, rows, rec.log_odds, cost_cf, C, Y, lambdas)
    dearest = float(C[rows].mean(axis=0).max())
    scores = {name: replay_aiq(run, dearest) for name, run in held.items()}
    final = {name: strategy.final for name, strategy in fitted.items()}
    return Strategies(rows, held, scores, final, max(scores, key=lambda name: scores[name]))


def replay_aiq(run: Replay, max_cost: float) -> float:
    """AIQ of a replay's λ curve up to ``max_cost`` (points dearer than it left out, as score_aiq does)."""
    return aiq_within(np.c_[run.mean_cost(), run.accuracy()], max_cost)


def _cascade_router(
    name: str, run: Replay, held: Replay, at: int, how: str, validation_rows: int, test, data
) -> dict[str, Any]:
    """The report of one answer-aware strategy: its test curve, and the operating point chosen on
    the cross-fitted replay of the training files."""
    return {
        "name": name,
        "strategy": "cascade",
        "curve": _curve(run),
        "validation_curve": _curve(held),
        "operating_point": {
            "lambda": run.lambdas[at],
            "how": how,
            "validation_rows": validation_rows,
            "validation_accuracy": float(held.accuracy()[at]),
            "validation_cost_usd": float(held.mean_cost()[at]),
            "test_accuracy": float(run.accuracy()[at]),
            "test_cost_usd": float(run.mean_cost()[at]),
            "calls_per_query": float(run.calls[at].mean()),
            "rounds_per_query": float(run.rounds[at].mean()),
            "stop_shares": run.stop_shares(at),
            "first_call_shares": shares(run.first[at], test.groups, data.workers)["all"],
        },
    }


def evaluate_cascade(
    train: RoutingDataset,
    test: RoutingDataset,
    features: Any,
    *,
    model: str = "ensemble",
    seed: int = 0,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Fit on ``train``, replay plans on ``test``; the result body (see the module docstring)."""
    if train.responses is None or test.responses is None:
        raise NoAnswers(f"{train.meta.get('format', train.name)} files record no answers")
    say = say or (lambda _: None)
    lambdas = list(lambdas)
    started = time.perf_counter()
    data = PoolData.prepare(train, test, features, progress)
    train, test = data.train, data.test
    assert train.responses is not None and test.responses is not None
    Y, C = train.labels, data.train_costs
    n = len(train)

    say("query-only router (the planner's prior) and the baselines")
    validation = Validation(train, data.X_train, seed, lambdas)
    knn_k = validation.best_k()
    quality = fit_quality_model(model, data.X_train, Y, seed).predict(data.X_test)
    knn_q = fit_quality_model("knn", data.X_train, Y, seed, knn_k).predict(data.X_test)
    predicted_cost = CostModel().fit(data.X_train, C).predict(data.X_test)
    single, single_choices = swept_router("single", quality, predicted_cost, test, lambdas)
    single["model"] = model
    baseline, knn_choices = baseline_routers(data, knn_q, knn_k, predicted_cost, lambdas)
    routers: dict[str, dict] = {"single": single, **baseline}

    say(f"cross-fitting the prior and the cost model ({FOLDS} folds)")
    X = data.X_train
    fold_of = fold_assignment(n, FOLDS, seed)  # one assignment for every stacked model
    prior_cf = cross_fit_on(fold_of, lambda a, b: fit_quality_model(model, X[a], Y[a], seed).predict(X[b]))
    cost_cf = cross_fit_on(fold_of, lambda a, b: CostModel().fit(X[a], C[a]).predict(X[b]))

    say("running code answers (behaviour keys)")
    book_train = AnswerBook(train.texts, train.responses, code_runs_for(train.texts, train.responses))
    book_test = AnswerBook(test.texts, test.responses, code_runs_for(test.texts, test.responses))
    say(f"code answers run for {len(book_train.behaviour)} + {len(book_test.behaviour)} queries")
    rec = Recorded.from_priors(book_train, prior_cf, Y)
    planners = fit_planner(rec, k=FOLDS, seed=seed, fold_of=fold_of, progress=say)
    fit_seconds = time.perf_counter() - started

    strategies = compare_strategies(
        book_train, rec, planners, cost_cf, Y, C, train.workers, lambdas, seed, say
    )
    complete, helds, chosen = strategies.rows, strategies.held, strategies.chosen
    table = strategies.table
    validation_aiq = strategies.aiq
    best, _ = best_and_cheapest(train)
    target, budget = single_target(Y, C, complete)  # the rule train_cascade stores the λ of

    say("test: replaying the test files")
    test_log_odds = logit(np.nan_to_num(quality, nan=0.5))

    def on_test(strategy: Any) -> Replay:
        return replay(
            lambda i: strategy,
            book_test,
            range(len(test)),
            test_log_odds,
            predicted_cost,
            data.test_costs,
            test.labels,
            lambdas,
        )

    replay_started = time.perf_counter()
    runs = {"planner": on_test(planners.final)}
    planner_steps = runs["planner"].rounds.sum() + runs["planner"].rounds.size
    per_query_ms = 1000 * (time.perf_counter() - replay_started) / max(1, planner_steps)
    for name, final in strategies.final.items():
        if name not in runs:
            runs[name] = on_test(final)
    points = {name: _operating(helds[name], target, budget) for name in runs}
    for name, run in runs.items():
        at, how = points[name]
        routers[name] = _cascade_router(name, run, helds[name], at, how, len(complete), test, data)
        routers[name]["validation_aiq"] = round(validation_aiq[name], 4)
    ours = {**routers[chosen], "name": "ours", "chosen": chosen}
    others = ", ".join(f"{name} {value:.4f}" for name, value in validation_aiq.items() if name != chosen)
    ours["chosen_because"] = (
        f"the highest AIQ on the cross-fitted replay of the training files ({validation_aiq[chosen]:.4f}; "
        f"{others})"
    )
    run, (at, _) = runs[chosen], points[chosen]
    voters = _rule_voters(train, best)
    rule = agreement_rule(book_test, range(len(test)), voters, best, data.test_costs, test.labels)
    routers["ours"] = ours
    routers["agreement_rule"] = constant_router(
        "agreement_rule",
        rule["accuracy"],
        rule["cost_usd"],
        lambdas,
        voters=[train.workers[v] for v in voters],
        fallback=train.workers[best],
        escalated_share=rule["escalated_share"],
    )
    singles = single_workers(data)
    max_cost = score_aiq(routers, singles)
    for name in ("ours", "single", *runs):
        routers[name].update(goal_metrics(routers[name], routers["best_single"]))
    say("paired bootstrap of the AIQ differences")
    per_query = {
        "ours": PerQuery(run.score, run.cost),
        **{name: PerQuery(r.score, r.cost) for name, r in runs.items()},
        "single": PerQuery.from_choices(single_choices, test.labels, data.test_costs),
        "knn": PerQuery.from_choices(knn_choices, test.labels, data.test_costs),
    }
    samples = resampled_aiq(per_query, max_cost, seed=seed)
    for name, drawn in samples.items():
        routers[name]["aiq_interval"] = interval(drawn)
    pairs = [
        ("ours", "knn"),
        ("ours", "single"),
        ("plan_table", "planner"),
        ("planner", "myopic_planner"),
        ("single", "knn"),
    ]
    groups = np.array(test.groups)
    per_task = {}
    for group in sorted(set(test.groups)):
        rows = groups == group
        per_task[group] = {
            "n": int(rows.sum()),
            "best_worker_accuracy": float(test.labels[rows].mean(axis=0).max()),
            "best_worker": data.workers[int(np.argmax(test.labels[rows].mean(axis=0)))],
            "ours_accuracy": float(np.nanmean(run.score[at, rows])),
            "ours_cost_usd": float(run.cost[at, rows].mean()),
            "ours_calls_per_query": float(run.calls[at, rows].mean()),
            "single_accuracy_at_same_lambda": float(
                test.labels[np.flatnonzero(rows), single_choices[at, rows]].mean()
            ),
        }
    return {
        "workers": data.workers,
        "n_train": n,
        "n_test": len(test),
        **data.counts,
        "max_cost_usd": max_cost,
        "routers": routers,
        "singles": singles,
        "per_task": per_task,
        "cascade": {
            **planners.final.card,
            "strategy": chosen,
            "plan_table": table.card,
            "validation": "cross-fitted replay of the training files: each query planned by fold models "
            "(prior, cost, post-hoc, gain) that never saw it",
            "replay_ms_per_decision": round(per_query_ms, 3),
        },
        "intervals": {
            "method": METHOD,
            **differences(samples, pairs, lambda name: routers[name]["aiq"]),
        },
        "cost_model": cost_model_report(predicted_cost, data),
        "seconds": {"embed": round(data.embed_seconds, 1), "fit": round(fit_seconds, 1)},
        "lambdas": lambdas,
    }


def train_cascade(
    ds: RoutingDataset,
    *,
    backend: str = "static",
    model: str = "ensemble",
    seed: int = 0,
    sources: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
    tiers: dict[str, str] | None = None,
    progress: bool = False,
):
    """A router artifact whose ``cascade`` is a planner fitted on every row of ``ds`` (which must carry
    the workers' answers); its query-only model is the planner's prior and the fast router's model.

    ``tiers`` (catalog worker -> tier) gives the artifact its per-tier priors, as `router train
    --strategy fast` does; ``progress`` shows the embedding and fitting bars of the query-only model."""
    from router.training import feature_builder, fit_quality, train_artifact

    if ds.responses is None:
        raise NoAnswers(f"{ds.meta.get('format', ds.name)} data records no answers: a planner needs them")
    say = say or (lambda _: None)
    say("query-only model (the prior)")
    artifact = train_artifact(
        ds.texts,
        ds.turns,
        ds.labels,
        ds.workers,
        backend=backend,
        model=model,
        # live costs price each worker's recorded answer length, as for single routing
        output_tokens=ds.output_tokens(),
        tiers=tiers,
        sources=sources,
        progress=progress,
        random_state=seed,
        text_rule=ds.text_rule,  # the live router reads the part of a query the training texts hold
    )
    X = feature_builder(backend).transform(ds.texts, ds.turns)
    if artifact.output_tokens:  # the answers' lengths per query, as the cost model predicts the recorded USD
        assert ds.response_chars is not None
        artifact.output_model = CostModel().fit(X, ds.response_chars / CHARS_PER_TOKEN)
        artifact.card["output_tokens"] = {
            "median": artifact.output_tokens,
            "per_query": "ridge regression of log completion tokens on the query's features per worker "
            "(router/costs.py), fitted on the recorded answers' lengths (characters / 4); live costs are "
            "the catalog's prices at the prompt's and these tokens",
            "columns": list(ds.workers),  # the model's, by worker
        }
    chosen = artifact.card.get("model", model)
    say(f"cross-fitting the prior ({FOLDS} folds)")
    folds_done = 0

    def prior_fold(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        nonlocal folds_done
        predicted = fit_quality(X[a], ds.labels[a], chosen, seed)[0].predict(X[b])
        folds_done += 1
        say(f"prior, fold {folds_done}/{FOLDS}")  # each fold refits the prior: the slow part on big data
        return predicted

    fold_of = fold_assignment(len(ds), FOLDS, seed)  # one assignment for every stacked model
    prior = cross_fit_on(fold_of, prior_fold)
    say("running code answers (behaviour keys)")
    book = AnswerBook(ds.texts, ds.responses, code_runs_for(ds.texts, ds.responses))
    rec = Recorded.from_priors(book, prior, ds.labels)
    planners = fit_planner(rec, k=FOLDS, seed=seed, fold_of=fold_of, progress=say)
    # how code answers were compared in training: live, the gateway compares them so only with
    # POLYROUTE_PLAN_CODE_EXEC on (else by canonical source), which /admin/router warns of
    code = {"code_answers": "behaviour", "code_questions": len(book.behaviour)}
    artifact.cascade = planners.final
    artifact.card["cascade"] = {**planners.final.card, "strategy": "planner", **code}
    if ds.costs is not None:  # a plan table is scored on recorded costs (RouterBench has them)
        C = np.asarray(ds.costs, dtype=float)
        say(f"cross-fitting the cost model ({FOLDS} folds)")
        cost_cf = cross_fit_on(fold_of, lambda a, b: CostModel().fit(X[a], C[a]).predict(X[b]))
        found = compare_strategies(
            book, rec, planners, cost_cf, ds.labels, C, ds.workers, DEFAULT_LAMBDAS, seed, say
        )
        say(
            "strategy: "
            + ", ".join(f"{name} AIQ {value:.4f}" for name, value in found.aiq.items())
            + f" on the cross-fitted training replay: {found.chosen}"
        )
        artifact.cascade = found.final[found.chosen]
        artifact.card["cascade"] = {
            **found.final[found.chosen].card,
            "strategy": found.chosen,
            "validation_aiq": {name: round(value, 4) for name, value in found.aiq.items()},
            **code,
        }
        # the λ `router eval` validates, chosen by its rule on this very replay (never on test files):
        # the gateway's default λ unless the operator sets POLYROUTE_COST_WEIGHT
        weight, why = operating_cost_weight(found, ds.labels, C)
        artifact.card["operating_cost_weight"] = weight
        artifact.card["operating_cost_weight_reason"] = why
        say(f"operating λ {weight:g}: {why}")
    artifact.card["strategy"] = "cascade"
    return artifact
