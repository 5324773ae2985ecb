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

    .venv/bin/python bench/cascade_bound.py --train <split>/train/*.csv --test <split>/test/*.csv

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
from router.offline.metrics import aiq  # noqa: E402
from router.offline.plan_table_fit import PlanScores, clusters_of  # noqa: E402
from router.offline.routerbench import load_routerbench  # noqa: E402

LAMBDAS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)


class Plans:
    """One dataset's recorded answers, clustered as the plan table clusters questions."""

    def __init__(self, files: list[str]) -> None:
        ds = load_routerbench(files)
        assert ds.responses is not None and ds.costs is not None
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--test", nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cascade_bound.json")
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
    aiqs = {pick: aiq(c[c[:, 0] <= dearest * (1 + 1e-9)], dearest) for pick, c in curves.items()}

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
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
