"""The cascade on RouteLLM's GSM8K answers: the planner (router/planner.py) over two workers.

RouteLLM's GSM8K file records both Mixtral-8x7B's and GPT-4's answers, so the same planner that
routes N workers replays here with N = 2: Mixtral answers first, and the planner's expected gain from
also asking GPT-4 decides the escalation. The planner escalates when gain > λ·price (GPT-4's price is
the pool's highest, so 1), so sweeping λ is sweeping a threshold on the gain, and the curve is
summarised by RouteLLM's APGR over the share of queries escalated; an escalation pays for both
answers. Everything is cross-fitted on one fold assignment (k folds: each query is planned by
models — prior, post-hoc estimator, gain — fitted on the other folds only; router/offline/planner_fit.py
says what plain stacking leaves), so every one of the 1,319 questions is a held-out point.

The gain comes in two forms (router/offline/planner_fit.py, ``FittedPlanners.myopic``): from the
gain model (``planner``), or myopic, GPT-4's prior over the post-hoc estimate of Mixtral's answer
(``myopic_planner``). ``cascade``, the live policy, is for each fold the one that a router trained
on the other folds would choose — a nested choice (:func:`planner_escalation`), as
``router train --strategy cascade`` chooses on its training files.

Next to it, on the same queries and prices: the planner's post-hoc estimate used directly
(``posthoc_threshold``: escalate when P(Mixtral's answer is right) is low), the previous acceptance
model alone (FrugalGPT-style features, router/compose/acceptance.py), the fast router (the query
alone, paying for one model), random routing, always-weak, always-strong, and two oracles (fast:
knows which model is right; cascade: a perfect verifier). Costs per query: prompt tokens ≈ chars/4
at each model's input price, output tokens ≈ the recorded answer's chars/4 at its output price
(Mixtral $0.24/$0.24, GPT-4-1106 $10/$30 per 1M, SOURCE.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from router.compose.acceptance import AcceptanceModel
from router.offline.book import AnswerBook
from router.offline.metrics import baselines, evaluate_router
from router.offline.planner_fit import FittedPlanners, Recorded, fit_planner
from router.offline.routellm import (
    GSM8K_FILE,
    PRICES_PER_M,
    STRONG,
    WEAK,
    WORKER_ALIASES,
    gsm8k_dataset,
    load_gsm8k_answers,
)
from router.offline.split import cross_fit_on, fold_assignment

# The rows that learn something, in the order the table prints them (the oracles and baselines follow).
LEARNED = ("cascade", "planner", "myopic_planner", "posthoc_threshold", "acceptance_model", "fast_router")


def cross_fitted_acceptance(data: dict[str, Any], fold_of: np.ndarray, seed: int = 0) -> np.ndarray:
    """P(Mixtral's answer is right) for every query, each from a model trained on the other folds
    of ``fold_of``."""
    prompts, answers = data["prompts"], data["weak_answers"]

    def fit_score(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        model = AcceptanceModel(seed=seed).fit(
            [prompts[i] for i in train], [answers[i] for i in train], data["y_weak"][train]
        )
        return model.predict_proba([prompts[i] for i in fold], [answers[i] for i in fold])

    return cross_fit_on(fold_of, fit_score)


def cross_fitted_fast(
    data: dict[str, Any], fold_of: np.ndarray, seed: int = 0, backend: str = "static"
) -> np.ndarray:
    """P(each model right | query alone), [n, 2] (Mixtral, GPT-4), from the fast router's quality model,
    cross-fitted the same way: the planner's priors, so on the planner's folds (``fold_of``)."""
    from router.training import feature_builder, fit_quality

    n = len(data["prompts"])
    X = feature_builder(backend).transform(list(data["prompts"]), [1] * n)
    labels = np.column_stack([data["y_weak"], data["y_strong"]])

    def fit_score(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        fitted, _ = fit_quality(X[train], labels[train], "logreg", seed)
        return np.asarray(fitted.predict(X[fold]))

    return cross_fit_on(fold_of, fit_score)


def _compact(result: dict) -> dict:
    """Every fifth curve point: the report stays readable and the plot loses nothing visible."""
    return {k: v for k, v in result.items() if k != "curve"} | {
        "curve": [
            {"strong_share": p["strong_share"], "accuracy": p["accuracy"], "cost_usd": p["cost_usd"]}
            for p in result.get("curve", [])
        ][::5]
    }


def evaluate_gsm8k_cascade(
    path: str | Path = GSM8K_FILE, k: int = 5, seed: int = 0, bootstrap: int = 200
) -> dict[str, Any]:
    """The GSM8K cascade replay next to the fast router and the baselines; the report (plain JSON types)."""
    data = load_gsm8k_answers(path)
    yw, ys, cw, cs = data["y_weak"], data["y_strong"], data["cost_weak"], data["cost_strong"]
    fold_of = fold_assignment(len(yw), k, seed)  # one assignment for every model below
    accept = cross_fitted_acceptance(data, fold_of, seed)
    priors = cross_fitted_fast(data, fold_of, seed)
    fast = priors[:, 0]
    escalation, policies = planner_escalation(data, priors, k, seed, fold_of)
    posthoc = escalation["posthoc"]
    from sklearn.metrics import roc_auc_score

    def escalating(name: str, score: np.ndarray) -> dict:  # escalating pays for both answers
        return evaluate_router(name, score, yw, ys, cw, cw + cs, bootstrap=bootstrap, seed=seed)

    results = {
        # the live policy: per fold, the planner chosen on the other folds (nested)
        "cascade": escalating("cascade", escalation["cascade"]),
        "planner": escalating("planner", escalation["planner"]),
        "myopic_planner": escalating("myopic_planner", escalation["myopic_planner"]),
        "acceptance_model": escalating("acceptance_model", 1 - accept),
        # the planner's post-hoc estimate of Mixtral's answer, used directly: escalate when it is low
        "posthoc_threshold": escalating("posthoc_threshold", 1 - posthoc),
        "fast_router": evaluate_router(
            "fast_router", 1 - fast, yw, ys, cw, cs, bootstrap=bootstrap, seed=seed
        ),
        "cascade_oracle": evaluate_router("cascade_oracle", 1 - yw, yw, ys, cw, cw + cs),
        **baselines(yw, ys, cw, cs, random_state=seed),
    }
    strong_acc, strong_cost = float(ys.mean()), float(cs.mean())
    for name in LEARNED:
        curve = results[name]["curve"]
        reaching = [p for p in curve if p["accuracy"] >= strong_acc - 1e-12]
        results[name]["cost_share_to_match_strong"] = (
            min(p["cost_usd"] for p in reaching) / strong_cost if reaching else None
        )
        best = max(curve, key=lambda p: p["accuracy"])
        results[name]["best_accuracy"] = best["accuracy"]
        results[name]["cost_share_at_best"] = best["cost_usd"] / strong_cost
    return {
        "dataset": "routellm/gsm8k",
        "file": str(path),
        "queries": len(yw),
        "folds": k,
        "cascade_policy_per_fold": policies,
        "weak": WEAK,
        "strong": STRONG,
        "prices_per_m": {m: list(PRICES_PER_M[WORKER_ALIASES[m]]) for m in (WEAK, STRONG)},
        "acceptance_auc": float(roc_auc_score(yw, accept)),
        "posthoc_auc": float(roc_auc_score(yw, posthoc)),
        "fast_router_auc": float(roc_auc_score(yw, fast)),
        "results": {name: _compact(r) for name, r in results.items()},
    }


def _escalation(planners: FittedPlanners, book: AnswerBook, log_odds: np.ndarray) -> dict[str, np.ndarray]:
    """Per query, each by its fold's planner: the expected gain of asking GPT-4 once Mixtral has
    answered, with the gain model (``planner``) and without it (``myopic_planner``), and the post-hoc
    P(Mixtral's answer is right)."""
    n = len(book)
    myopic = planners.myopic()
    out = {name: np.empty(n) for name in ("planner", "myopic_planner", "posthoc")}
    for i in range(n):
        state = book.state(i, [0])
        scores = planners.for_row(i).answer_scores(state, log_odds[i])
        out["posthoc"][i] = scores[0]
        for name, fitted in (("planner", planners), ("myopic_planner", myopic)):
            out[name][i] = fitted.for_row(i).call_values(state, scores, log_odds[i], [(1,)], [1])[0]
    return out


def _apgr(score: np.ndarray, data: dict[str, Any], rows: np.ndarray) -> float:
    yw, ys, cw, cs = (data[key][rows] for key in ("y_weak", "y_strong", "cost_weak", "cost_strong"))
    return float(evaluate_router("inner", score, yw, ys, cw, cw + cs)["apgr"])


def planner_escalation(
    data: dict[str, Any],
    priors: np.ndarray,
    k: int,
    seed: int,
    fold_of: np.ndarray,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Per query, cross-fitted: the escalation scores of :func:`_escalation`, plus ``cascade``: the
    planner (with or without its gain model) that a router trained on the other folds would use.
    ``fold_of`` is the fold assignment (``k`` folds) the ``priors`` were cross-fitted on; the planners
    use it too.

    That choice is nested: for each fold, the planner is refitted on the other folds alone and
    cross-fitted there (on those same folds), and the policy with the higher APGR on them plans this
    one (as ``router train --strategy cascade`` chooses on the training files). No planner whose
    replay picks a fold's policy was fitted on that fold's labels; the query-only priors of the
    other folds' rows were (they are cross-fitted over the whole file), but on GSM8K they know next
    to nothing (the fast router's AUC is about 0.5). Returns the scores and the policy per fold."""
    if k < 3:
        raise ValueError(f"the nested choice cross-fits on k - 1 folds: k must be at least 3, not {k}")
    ds = gsm8k_dataset(data)
    assert ds.responses is not None
    book = AnswerBook(ds.texts, ds.responses)
    rec = Recorded.from_priors(book, priors, ds.labels)
    planners = fit_planner(rec, k=k, seed=seed, fold_of=fold_of)
    scores = _escalation(planners, book, rec.log_odds)
    cascade, chosen = np.empty(len(book)), []
    for f in range(k):
        outer = np.flatnonzero(planners.fold_of == f)
        inner = np.flatnonzero(planners.fold_of != f)
        sub = ds.subset(inner)
        assert sub.responses is not None
        sub_book = AnswerBook(sub.texts, sub.responses)
        sub_rec = Recorded(sub_book, rec.log_odds[inner], rec.labels[inner])
        inner_folds = planners.fold_of[inner] - (planners.fold_of[inner] > f)  # the other k - 1 folds
        inner_planners = fit_planner(sub_rec, k=k - 1, seed=seed, fold_of=inner_folds)
        inner_scores = _escalation(inner_planners, sub_book, sub_rec.log_odds)
        apgr = {name: _apgr(inner_scores[name], data, inner) for name in ("planner", "myopic_planner")}
        chosen.append(max(apgr, key=lambda name: apgr[name]))
        cascade[outer] = scores[chosen[-1]][outer]
    scores["cascade"] = cascade
    return scores, chosen


def fit_and_save_acceptance(
    path: str | Path, router_dir: str | Path, seed: int = 0, version: str | None = None
) -> Path:
    """Train on every row and save for the gateway's cascade: into router ``version`` under
    ``router_dir`` (default: the version in force), so it is rolled back and replaced with the
    version (router/artifacts.py `save_acceptance`); returns the file written.

    ``router_dir`` may also be given as `<router dir>/acceptance.joblib`, the file this wrote before
    versions carried it."""
    from router.artifacts import ACCEPTANCE, save_acceptance

    data = load_gsm8k_answers(path)
    model = AcceptanceModel(seed=seed).fit(data["prompts"], data["weak_answers"], data["y_weak"])
    root = Path(router_dir)
    if root.name == ACCEPTANCE:
        root = root.parent
    return save_acceptance(root, model, version)
