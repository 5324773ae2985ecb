"""The cascade strategy: call a cheap worker first, read its answer, and escalate only when it looks wrong.

Replayed on recorded answers, so no worker is called: each plan is charged for every answer it would
have obtained. Today one replay is registered, on RouteLLM's GSM8K responses (Mixtral-8x7B first,
GPT-4 on escalation):

The acceptance model (router/compose/acceptance.py, the one the gateway's cascade runs) scores
Mixtral's recorded answer (query + answer features), and below a threshold the query escalates to
GPT-4 — paying for both. Scores are cross-fitted (k folds: each query is scored by a model that never
saw it), so every one of the 1,319 questions is a held-out test point. Next to it, on the same queries
and prices:

- the fast router: the learned quality model from the query alone (no answer seen), routing to
  GPT-4 when P(Mixtral right) is low — it pays for one model per query;
- random routing, always-weak, always-strong, and two oracles (fast: knows which model is right;
  cascade: a perfect verifier).

Costs per query: prompt tokens ≈ chars/4 at each model's input price, output tokens ≈ the recorded
answer's chars/4 at its output price (Mixtral $0.24/$0.24, GPT-4-1106 $10/$30 per 1M, SOURCE.md).

A replay over N workers on files (RouterBench records every model's answer) belongs here too, as an
N-worker strategy beside :func:`router.offline.single.evaluate_pool`, registered in
:data:`router.offline.harness.POOL_STRATEGIES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from router.compose.acceptance import AcceptanceModel
from router.offline.metrics import baselines, evaluate_router
from router.offline.routellm import GSM8K_FILE, PRICES_PER_M, STRONG, WEAK, WORKER_ALIASES, load_gsm8k_answers
from router.offline.split import cross_fit


def cross_fitted_acceptance(data: dict[str, Any], k: int = 5, seed: int = 0) -> np.ndarray:
    """P(Mixtral's answer is right) for every query, each from a model trained on the other folds."""
    prompts, answers = data["prompts"], data["weak_answers"]

    def fit_score(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        model = AcceptanceModel(seed=seed).fit(
            [prompts[i] for i in train], [answers[i] for i in train], data["y_weak"][train]
        )
        return model.predict_proba([prompts[i] for i in fold], [answers[i] for i in fold])

    return cross_fit(len(prompts), k, seed, fit_score)


def cross_fitted_fast(data: dict[str, Any], k: int = 5, seed: int = 0, backend: str = "static") -> np.ndarray:
    """P(Mixtral right | query alone) from the fast router's quality model, cross-fitted the same way."""
    from router.training import feature_builder, fit_quality

    n = len(data["prompts"])
    X = feature_builder(backend).transform(list(data["prompts"]), [1] * n)
    labels = np.column_stack([data["y_weak"], data["y_strong"]])

    def fit_score(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        fitted, _ = fit_quality(X[train], labels[train], "logreg", seed)
        return np.asarray(fitted.predict(X[fold]))[:, 0]

    return cross_fit(n, k, seed, fit_score)


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
    accept = cross_fitted_acceptance(data, k, seed)
    fast = cross_fitted_fast(data, k, seed)
    from sklearn.metrics import roc_auc_score

    results = {
        # escalation = the "strong" choice, and it pays for both answers
        "cascade": evaluate_router(
            "cascade", 1 - accept, yw, ys, cw, cw + cs, bootstrap=bootstrap, seed=seed
        ),
        "fast_router": evaluate_router(
            "fast_router", 1 - fast, yw, ys, cw, cs, bootstrap=bootstrap, seed=seed
        ),
        "cascade_oracle": evaluate_router("cascade_oracle", 1 - yw, yw, ys, cw, cw + cs),
        **baselines(yw, ys, cw, cs, random_state=seed),
    }
    strong_acc, strong_cost = float(ys.mean()), float(cs.mean())
    for name in ("cascade", "fast_router"):
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
        "weak": WEAK,
        "strong": STRONG,
        "prices_per_m": {m: list(PRICES_PER_M[WORKER_ALIASES[m]]) for m in (WEAK, STRONG)},
        "acceptance_auc": float(roc_auc_score(yw, accept)),
        "fast_router_auc": float(roc_auc_score(yw, fast)),
        "results": {name: _compact(r) for name, r in results.items()},
    }


def fit_and_save_acceptance(path: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Train on every row and save for the gateway's cascade (`<router dir>/acceptance.joblib`)."""
    import joblib

    data = load_gsm8k_answers(path)
    model = AcceptanceModel(seed=seed).fit(data["prompts"], data["weak_answers"], data["y_weak"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, out)
    return out
