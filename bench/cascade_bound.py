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
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.answers import Kind, choice_letters, detect_kind  # noqa: E402
from router.offline.book import AnswerBook  # noqa: E402
from router.offline.code_runs import code_runs_for  # noqa: E402
from router.offline.metrics import aiq  # noqa: E402
from router.offline.routerbench import load_routerbench  # noqa: E402

LAMBDAS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)


def cluster_of(query: str) -> str:
    kind = detect_kind(query)
    if kind is Kind.CHOICE:
        return "choice-2" if len(choice_letters(query)) == 2 else "choice-3+"
    return kind.name.lower()


class Plans:
    """Accuracy and cost of every plan of the family on some rows of one dataset."""

    def __init__(self, files: list[str]) -> None:
        ds = load_routerbench(files)
        assert ds.responses is not None and ds.costs is not None
        self.workers = ds.workers
        self.labels = np.nan_to_num(ds.labels)
        self.costs = np.asarray(ds.costs, dtype=float)
        self.clusters = np.array([cluster_of(q) for q in ds.texts])
        self.book = AnswerBook(ds.texts, ds.responses, code_runs_for(ds.texts, ds.responses))

    def agree(self, rows: np.ndarray, voters: tuple[int, ...]) -> np.ndarray:
        """Whether all voters' keys agree (and exist), as the planner would read them."""
        out = np.zeros(len(rows), dtype=bool)
        for n, i in enumerate(rows):
            keys = self.book.read(int(i), list(voters)).keys
            out[n] = keys[0] is not None and all(k == keys[0] for k in keys[1:])
        return out

    def table(self, rows: np.ndarray, plans: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """(mean accuracy, mean cost) per plan over ``rows``."""
        Y, C = self.labels[rows], self.costs[rows]
        agreement: dict[tuple[int, ...], np.ndarray] = {}
        acc, cost = np.zeros(len(plans)), np.zeros(len(plans))
        for p, plan in enumerate(plans):
            *voters, fallback = plan
            if not voters:
                acc[p], cost[p] = Y[:, fallback].mean(), C[:, fallback].mean()
                continue
            voters = tuple(voters)
            if voters not in agreement:
                agreement[voters] = self.agree(rows, voters)
            ok = agreement[voters]
            acc[p] = np.where(ok, Y[:, voters[0]], Y[:, fallback]).mean()
            cost[p] = (C[:, list(voters)].sum(1) + np.where(ok, 0.0, C[:, fallback])).mean()
        return acc, cost


def family(k: int) -> list[tuple]:
    plans: list[tuple] = [(e,) for e in range(k)]
    for a, b in itertools.combinations(range(k), 2):
        plans += [(a, b, e) for e in range(k) if e not in (a, b)]
    for a, b, c in itertools.combinations(range(k), 3):
        plans += [(a, b, c, e) for e in range(k) if e not in (a, b, c)]
    return plans


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
    k = len(train.workers)
    plans = family(k)
    best = int(np.argmax(train.labels.mean(0)))
    unit = float(train.costs[:, best].mean())  # λ is in accuracy per this cost
    best_test_acc, best_test_cost = float(test.labels[:, best].mean()), float(test.costs[:, best].mean())
    clusters = sorted(set(train.clusters) | set(test.clusters))
    scored = {}
    with console.status(f"scoring {len(plans)} plans on {len(clusters)} clusters"):
        for c in clusters:
            tr, te = np.where(train.clusters == c)[0], np.where(test.clusters == c)[0]
            if len(tr) and len(te):
                scored[c] = (train.table(tr, plans), test.table(te, plans), len(te))

    def name(plan: tuple) -> str:
        short = [train.workers[j].split("/")[-1][:18] for j in plan]
        return short[0] if len(plan) == 1 else f"{' + '.join(short[:-1])} agree, else {short[-1]}"

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
                    row["clusters"][c] = {"plan": name(plans[p]), "train_accuracy": round(float(a_tr[p]), 4)}
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
        "plans": len(plans),
        "aiq_picked_on_train": round(aiqs["train"], 4),
        "aiq_bound_picked_on_test": round(aiqs["test"], 4),
        "cluster_sizes_test": {c: int(v[2]) for c, v in scored.items()},
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
