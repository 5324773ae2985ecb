"""Offline replay of the cascade on RouteLLM's GSM8K responses (Mixtral-8x7B first, GPT-4 on escalation).

The data holds each model's full answer and whether it was right, so a cascade can be replayed
without calling anyone: the acceptance model scores Mixtral's recorded answer (query + answer
features), and below a threshold the query escalates to GPT-4 — paying for both. Scores are
cross-fitted (k folds: each query is scored by a model that never saw it), so every one of the
1,319 questions is a held-out test point. Next to it, on the same queries and prices:

- the fast router: the learned quality model from the query alone (no answer seen), routing to
  GPT-4 when P(Mixtral right) is low — it pays for one model per query;
- random routing, always-weak, always-strong, and two oracles (fast: knows which model is right;
  cascade: a perfect verifier).

Costs per query: prompt tokens ≈ chars/4 at each model's input price, output tokens ≈ the recorded
answer's chars/4 at its output price (Mixtral $0.24/$0.24, GPT-4-1106 $10/$30 per 1M, SOURCE.md).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from router.compose.acceptance import AcceptanceModel
from router.evaluate import baselines, evaluate_router

WEAK, STRONG = "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"
PRICES = {WEAK: (0.24, 0.24), STRONG: (10.0, 30.0)}  # USD per 1M tokens, input/output
DEFAULT_FILE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "routellm" / "gsm8k" / "gsm8k_responses.csv"
)


def load_gsm8k(path: str | Path = DEFAULT_FILE) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (RouteLLM's gsm8k_responses.csv)")
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        needed = {"prompt", WEAK, STRONG, WEAK + "_response", STRONG + "_response"}
        missing = needed - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        rows = []
        for line, row in enumerate(reader, start=2):
            if row[WEAK] not in ("True", "False") or row[STRONG] not in ("True", "False"):
                raise ValueError(
                    f"{path}:{line}: correctness must be True/False, got {row[WEAK]!r}/{row[STRONG]!r}"
                )
            rows.append(row)

    def cost(model: str, prompt: str, answer: str) -> float:
        price_in, price_out = PRICES[model]
        return (len(prompt) / 4 * price_in + len(answer) / 4 * price_out) / 1e6

    return {
        "prompts": [r["prompt"] for r in rows],
        "weak_answers": [r[WEAK + "_response"] for r in rows],
        "y_weak": np.array([r[WEAK] == "True" for r in rows], dtype=float),
        "y_strong": np.array([r[STRONG] == "True" for r in rows], dtype=float),
        "cost_weak": np.array([cost(WEAK, r["prompt"], r[WEAK + "_response"]) for r in rows]),
        "cost_strong": np.array([cost(STRONG, r["prompt"], r[STRONG + "_response"]) for r in rows]),
    }


def _folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


def cross_fitted_acceptance(data: dict[str, Any], k: int = 5, seed: int = 0) -> np.ndarray:
    """P(Mixtral's answer is right) for every query, each from a model trained on the other folds."""
    n = len(data["prompts"])
    scores = np.empty(n)
    for fold in _folds(n, k, seed):
        train = np.setdiff1d(np.arange(n), fold)
        model = AcceptanceModel(seed=seed).fit(
            [data["prompts"][i] for i in train],
            [data["weak_answers"][i] for i in train],
            data["y_weak"][train],
        )
        scores[fold] = model.predict_proba(
            [data["prompts"][i] for i in fold], [data["weak_answers"][i] for i in fold]
        )
    return scores


def cross_fitted_fast(data: dict[str, Any], k: int = 5, seed: int = 0, backend: str = "static") -> np.ndarray:
    """P(Mixtral right | query alone) from the fast router's quality model, cross-fitted the same way."""
    from router.training import feature_builder, fit_quality

    n = len(data["prompts"])
    X = feature_builder(backend).transform(list(data["prompts"]), [1] * n)
    labels = np.column_stack([data["y_weak"], data["y_strong"]])
    scores = np.empty(n)
    for fold in _folds(n, k, seed):
        train = np.setdiff1d(np.arange(n), fold)
        fitted, _ = fit_quality(X[train], labels[train], "logreg", seed)
        scores[fold] = np.asarray(fitted.predict(X[fold]))[:, 0]
    return scores


def _compact(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "curve"} | {
        "curve": [
            {"strong_share": p["strong_share"], "accuracy": p["accuracy"], "cost_usd": p["cost_usd"]}
            for p in result.get("curve", [])
        ][::5]
    }


def run_cascade_eval(
    path: str | Path = DEFAULT_FILE, k: int = 5, seed: int = 0, bootstrap: int = 200
) -> dict[str, Any]:
    data = load_gsm8k(path)
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
        "prices_per_m": {m: list(p) for m, p in PRICES.items()},
        "acceptance_auc": float(roc_auc_score(yw, accept)),
        "fast_router_auc": float(roc_auc_score(yw, fast)),
        "results": {name: _compact(r) for name, r in results.items()},
    }


def fit_and_save_acceptance(path: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Train on every row and save for the gateway's cascade (`<router dir>/acceptance.joblib`)."""
    import joblib

    data = load_gsm8k(path)
    model = AcceptanceModel(seed=seed).fit(data["prompts"], data["weak_answers"], data["y_weak"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, out)
    return out


def plot_cost_curves(report: dict[str, Any], path: str | Path) -> None:
    """Accuracy vs mean cost per query (log scale): the cascade pays for the cheap answer every time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    styles = {"cascade": "-", "fast_router": "-", "cascade_oracle": ":", "oracle": ":", "random": "--"}
    for name, style in styles.items():
        res = report["results"][name]
        ax.plot(
            [p["cost_usd"] * 1000 for p in res["curve"]],
            [p["accuracy"] for p in res["curve"]],
            linestyle=style,
            label=f"{name} (APGR {res['apgr']:.3f})",
        )
    for name, marker in (("always_weak", "o"), ("always_strong", "s")):
        res = report["results"][name]
        ax.plot([res["cost_usd"] * 1000], [res["accuracy"]], marker=marker, linestyle="", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("mean cost per query (USD per 1,000 queries)")
    ax.set_ylabel("accuracy")
    ax.set_title(
        f"GSM8K: cascade Mixtral→GPT-4 vs fast routing ({report['queries']} queries, {report['folds']}-fold)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=120)


def write(report: dict[str, Any], out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        json.dumps(
            report, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else float(o)
        )
    )
