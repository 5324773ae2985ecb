"""How far answer-agreement cascades can go on RouterBench: a bound for issue 13's cost target.

Issue 13 asks for the best single model's accuracy at ≤ 50% of its cost. The learned planner
(`polyroute router eval --strategy cascade`) reaches GPT-4's accuracy at about 90% of its cost on
our validation split. This script asks whether a simpler family of plans could do better, and how
much of any answer is noise. The family, per query cluster (the answer kind the query asks for and
its number of options — features that carry across tasks, no task names):

* ``single e`` — ask one worker;
* ``pair a b → e`` — ask a and b; if their normalised answers agree return a's, else ask e;
* ``triple a b c → e`` — the same with three voters.

Answers are keyed exactly as the planner keys them (router/answers.py; code by behaviour on the
inputs the called workers' answers and the prompt provide, router/offline/code_runs.py), and every
call is charged at its recorded cost. For each λ (accuracy per unit of the best single model's mean
cost) one plan per cluster is picked on the train files and measured on the test files. The second
column set picks on the test files themselves: an optimistic bound, not a result — it shows how much
the family could give if choosing among its ~3,000 plans were free of noise.

``--hindsight`` adds the question the cost target turns on: could *any* choice of plans from this
family reach the best single model's accuracy at half its cost on these workers? It pools the train
and test files, scores every plan of every cell on every query of the cell, and takes the frontier
of the per-cell frontiers (a mix of two plans reaches any point between two of its corners): the
best accuracy at 50% of the best single's cost and the least cost at its accuracy, with plans chosen
in hindsight on the very queries they are scored on. Cells are the clusters, then each cluster cut
into terciles of the query-only prior's edge for the best single model (cross-fitted: the fast
router's quality model, each query predicted by a model that never saw it). Chosen in hindsight the
figures are optimistic; if they miss the target, no plan of the family chosen from data will meet it.
The same cells with plans chosen by 5-fold cross-validation over the pooled queries (each fold's
plans, and its tercile cuts, from the other four) say what choosing from data gives, so finer
cells that only look better in hindsight show up as what they are: more room to overfit.

    .venv/bin/python bench/cascade_bound.py --train <split>/train/*.csv --test <split>/test/*.csv [--hindsight]

Writes bench/results/cascade_bound.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.offline.book import AnswerBook  # noqa: E402
from router.offline.code_runs import code_runs_for  # noqa: E402
from router.offline.metrics import aiq_within, summed_frontier, upper_hull  # noqa: E402
from router.offline.plan_table_fit import PlanScores, clusters_of  # noqa: E402
from router.offline.routerbench import load_routerbench  # noqa: E402
from router.offline.single import DEFAULT_MODEL  # noqa: E402
from router.offline.split import cross_fit, folds  # noqa: E402

HINDSIGHT_BUDGET = 0.5  # the cost target: a share of the best single model's cost
PRIOR_BINS = 3

LAMBDAS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)


class Plans:
    """One dataset's recorded answers, clustered as the plan table clusters questions."""

    def __init__(self, files: list[str]) -> None:
        ds = load_routerbench(files)
        assert ds.responses is not None and ds.costs is not None
        self.dataset = ds
        self.workers = ds.workers
        self.labels = np.nan_to_num(ds.labels)
        self.costs = np.asarray(ds.costs, dtype=float)
        self.book = AnswerBook(ds.texts, ds.responses, code_runs_for(ds.texts, ds.responses))
        self.clusters = clusters_of(self.book)

    def table(self, rows: np.ndarray) -> tuple[PlanScores, np.ndarray, np.ndarray]:
        """Every plan of the family (all workers as voters), scored on ``rows``: (the scores, mean
        accuracy, mean cost) per plan, in the family's fixed order."""
        scores = PlanScores(
            self.book,
            rows,
            self.labels,
            self.costs,
            np.zeros(len(rows), dtype=int),
            1,
            range(len(self.workers)),
        )
        accuracy, cost, _, _ = scores.measured()
        return scores, accuracy, cost


def query_prior_edge(plans: Plans, best: int, seed: int = 0) -> np.ndarray:
    """Per query, the best single model's predicted P(right) minus the best other's, each query
    predicted by the fast router's quality model fitted on the other folds."""
    from router.offline.pool import fit_quality_model
    from router.training import feature_builder

    ds = plans.dataset
    X = feature_builder("static").transform(list(ds.texts), list(ds.turns), progress=False)
    Y = plans.labels
    prior = cross_fit(
        len(Y), 5, seed, lambda a, b: fit_quality_model(DEFAULT_MODEL, X[a], Y[a], seed).predict(X[b])
    )
    return prior[:, best] - np.delete(prior, best, axis=1).max(axis=1)


def _cells(
    plans: Plans, rows: np.ndarray, edge: np.ndarray, cuts_from: np.ndarray, bins: int
) -> list[np.ndarray]:
    """``rows`` cut into their cluster's ``bins`` prior-edge quantiles (cuts taken on ``cuts_from``)."""
    cells = []
    for c in sorted(set(plans.clusters)):  # every cluster, so two calls' cells line up
        mine, basis = rows[plans.clusters[rows] == c], cuts_from[plans.clusters[cuts_from] == c]
        cuts = np.quantile(edge[basis], np.linspace(0, 1, bins + 1)[1:-1]) if len(basis) else np.array([])
        where = np.searchsorted(cuts, edge[mine])
        cells += [mine[where == b] for b in range(bins)]
    return cells


def _frontier_figures(points: np.ndarray, unit: float, target: float) -> dict:
    """Accuracy at the budget and the cost share at ``target`` on the hull of (cost, accuracy) points."""
    hull = upper_hull(points)
    share, accuracy = hull[:, 0] / unit, hull[:, 1]
    return {
        "accuracy_at_budget": round(float(np.interp(HINDSIGHT_BUDGET, share, accuracy)), 4),
        "cost_share_at_best_single_accuracy": (
            round(float(np.interp(target, accuracy, share)), 4) if target <= accuracy[-1] + 1e-12 else None
        ),
        "best_accuracy": round(float(accuracy[-1]), 4),
    }


def hindsight(plans: Plans, best: int, console: Console, folds_k: int = 5) -> dict:
    """The family's frontier with plans chosen on the queries they are scored on, and the same cells
    with plans chosen by ``folds_k``-fold cross-validation (module docstring)."""
    n = len(plans.labels)
    unit = float(plans.costs[:, best].mean())
    target = float(plans.labels[:, best].mean())
    dearest = float(plans.costs.mean(0).max())
    every = np.arange(n)
    with console.status("hindsight: the query-only prior, cross-fitted"):
        edge = query_prior_edge(plans, best)
    fold_of = np.empty(n, dtype=int)
    for k, rows in enumerate(folds(n, folds_k, 11)):
        fold_of[rows] = k
    grid = [0.0, *np.geomspace(1e-3, 10, 80)]
    out: dict = {
        "queries": n,
        "best_single_accuracy": round(target, 4),
        "budget_share": HINDSIGHT_BUDGET,
        "folds": folds_k,
        "cells": {},
    }
    for bins in (1, PRIOR_BINS):
        with console.status(f"hindsight: every plan on {bins} prior bin(s) per cluster"):
            cells = [cell for cell in _cells(plans, every, edge, every, bins) if len(cell)]
            parts = []
            for cell in cells:
                _, accuracy, cost = plans.table(cell)
                parts.append((accuracy * len(cell) / n, cost * len(cell) / n))
            frontier = summed_frontier(parts)
            in_hindsight = _frontier_figures(frontier, unit, target)
            in_hindsight["aiq"] = round(aiq_within(frontier, dearest), 4)
        with console.status(f"hindsight: {bins} prior bin(s) per cluster, plans chosen by {folds_k}-fold CV"):
            scored = []  # (train accuracy, train cost, held-out correct, held-out spent) per fold and cell
            for k in range(folds_k):
                fit, held = every[fold_of != k], every[fold_of == k]
                for on_fit, on_held in zip(
                    _cells(plans, fit, edge, fit, bins), _cells(plans, held, edge, fit, bins), strict=True
                ):
                    if len(on_held) == 0:
                        continue
                    _, a_held, c_held = plans.table(on_held)
                    fitted = plans.table(on_fit)[1:] if len(on_fit) else None
                    scored.append((fitted, a_held * len(on_held), c_held * len(on_held)))
            curve = []
            for lam in grid:
                correct = spent = 0.0
                for fitted, a_held, c_held in scored:
                    p = best if fitted is None else int(np.argmax(fitted[0] - lam * fitted[1] / unit))
                    correct, spent = correct + a_held[p], spent + c_held[p]
                curve.append((spent / n, correct / n))
            points = np.array(curve)
            chosen = _frontier_figures(points, unit, target)
            chosen["aiq"] = round(aiq_within(points, dearest), 4)
        out["cells"][f"{bins}_per_cluster"] = {
            "cells": len(cells),
            "smallest_cell": int(min(len(cell) for cell in cells)),
            "in_hindsight": in_hindsight,
            "chosen_by_cross_validation": chosen,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--test", nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cascade_bound.json")
    parser.add_argument(
        "--hindsight",
        action="store_true",
        help="also the family's frontier on train and test pooled, plans chosen in hindsight",
    )
    args = parser.parse_args()
    console = Console()
    train, test = Plans(args.train), Plans(args.test)
    if train.workers != test.workers:
        raise SystemExit("the train and test files name different workers")
    best = int(np.argmax(train.labels.mean(0)))
    unit = float(train.costs[:, best].mean())  # λ is in accuracy per this cost
    best_test_acc, best_test_cost = float(test.labels[:, best].mean()), float(test.costs[:, best].mean())
    clusters = sorted(set(train.clusters) | set(test.clusters))
    scored = {}
    with console.status(f"scoring every plan on {len(clusters)} clusters"):
        for c in clusters:
            tr, te = np.where(train.clusters == c)[0], np.where(test.clusters == c)[0]
            if len(tr) and len(te):
                plans, *on_train = train.table(tr)
                _, *on_test = test.table(te)
                scored[c] = (tuple(on_train), tuple(on_test), len(te))

    def name(p: int) -> str:
        short = [train.workers[j].split("/")[-1][:18] for j in (*plans.voters[p], plans.fallback[p])]
        return short[0] if len(short) == 1 else f"{' + '.join(short[:-1])} agree, else {short[-1]}"

    def sweep(lam: float, pick: str) -> tuple[float, float]:
        """(test accuracy, test $/query) with one plan per cluster picked on ``pick`` at ``lam``."""
        correct = spent = n = 0.0
        for (a_tr, c_tr), (a_te, c_te), n_te in scored.values():
            a, co = (a_tr, c_tr) if pick == "train" else (a_te, c_te)
            p = int(np.argmax(a - lam * co / unit))
            correct, spent, n = correct + a_te[p] * n_te, spent + c_te[p] * n_te, n + n_te
        return correct / n, spent / n

    # AIQ as the harness computes it (area under the hull up to the dearest single model's cost)
    dearest = float(test.costs.mean(0).max())
    grid = [0.0, *np.geomspace(1e-3, 10, 80)]
    curves = {pick: np.array([sweep(lam, pick)[::-1] for lam in grid]) for pick in ("train", "test")}
    # points dearer than the dearest single model are left out, as the harness does (pool.score_aiq)
    aiqs = {pick: aiq_within(c, dearest) for pick, c in curves.items()}

    rows = []
    for lam in LAMBDAS:
        row: dict = {"lambda": lam, "clusters": {}}
        for pick in ("train", "test"):
            correct = spent = n = 0.0
            for c, ((a_tr, c_tr), (a_te, c_te), n_te) in scored.items():
                a, co = (a_tr, c_tr) if pick == "train" else (a_te, c_te)
                p = int(np.argmax(a - lam * co / unit))
                correct += a_te[p] * n_te
                spent += c_te[p] * n_te
                n += n_te
                if pick == "train":
                    row["clusters"][c] = {"plan": name(p), "train_accuracy": round(float(a_tr[p]), 4)}
            row[f"picked_on_{pick}"] = {
                "accuracy": round(correct / n, 4),
                "cost_share_of_best_single": round(spent / n / best_test_cost, 4),
            }
        rows.append(row)

    table = Table(
        title=f"answer-agreement plans per cluster vs {train.workers[best]} (test: {best_test_acc:.4f})"
    )
    for col in ("λ", "accuracy", "cost share", "bound: accuracy", "bound: cost share"):
        table.add_column(col, justify="right")
    for r in rows:
        t, b = r["picked_on_train"], r["picked_on_test"]
        table.add_row(
            f"{r['lambda']:g}",
            f"{t['accuracy']:.4f}",
            f"{t['cost_share_of_best_single']:.0%}",
            f"{b['accuracy']:.4f}",
            f"{b['cost_share_of_best_single']:.0%}",
        )
    console.print(table)
    console.print(f"AIQ (λ swept): picked on train {aiqs['train']:.4f}; optimistic bound {aiqs['test']:.4f}")
    for r in rows:
        console.print(
            f"λ {r['lambda']:g}: " + "; ".join(f"{c}: {v['plan']}" for c, v in r["clusters"].items())
        )
    report = {
        "train_files": args.train,
        "test_files": args.test,
        "best_single": train.workers[best],
        "best_single_test_accuracy": round(best_test_acc, 4),
        "plans": len(plans.voters),
        "aiq_picked_on_train": round(aiqs["train"], 4),
        "aiq_bound_picked_on_test": round(aiqs["test"], 4),
        "cluster_sizes_test": {c: int(v[2]) for c, v in scored.items()},
        "rows": rows,
    }
    if args.hindsight:
        pooled = Plans([*args.train, *args.test])
        found = hindsight(pooled, best, console)
        report["hindsight"] = found
        table = Table(
            title=f"hindsight frontier, {found['queries']} queries pooled ({train.workers[best]}: "
            f"{found['best_single_accuracy']:.4f})"
        )
        for col in (
            "cells",
            "plans chosen",
            "accuracy at 50% of its cost",
            "cost share at its accuracy",
            "AIQ",
        ):
            table.add_column(col, justify="right")
        for name, row in found["cells"].items():
            for how in ("in_hindsight", "chosen_by_cross_validation"):
                got = row[how]
                at = got["cost_share_at_best_single_accuracy"]
                table.add_row(
                    f"{row['cells']} ({name.replace('_', ' ')})",
                    how.replace("_", " "),
                    f"{got['accuracy_at_budget']:.4f}",
                    "not reached" if at is None else f"{at:.0%}",
                    f"{got['aiq']:.4f}" if "aiq" in got else "",
                )
        console.print(table)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
