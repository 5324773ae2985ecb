"""Fixes to the offline evaluation harness, each checked against what it promises:

1. a plan state's code keys are what the gateway computes from that state's own answers and inputs
   (router/offline/code_runs.py against router/code_behaviour.behaviour_keys), whatever the answers
   the plan did not pay for do;
2. every stacked model of a cross-fit shares one fold assignment (priors, planner, plan table);
3. a blank score or cost is "not graded" in the plan table's means, never wrong or free;
4. `router eval --format llmrouter` prices the test files from the train side's price file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from polyroute.cli import app
from router.code_behaviour import behaviour_keys, run_behaviour
from router.offline.book import AnswerBook
from router.offline.code_runs import cache_dir, code_runs_for
from router.offline.plan_table_fit import cross_fit_tables
from router.offline.planner_fit import Recorded, fit_planner
from router.offline.split import cross_fit, cross_fit_on, fold_assignment, write_split
from tests.test_planner import synthetic

FIX = Path(__file__).parent / "fixtures" / "multi"

# ---- 1. code keys per plan state -------------------------------------------------------------------
DOUBLE = "Write a python function to double a number.\nassert dbl(3) == 6"
PROPOSES_NEGATIVES = "```python\ndef dbl(n):\n    return 2 * n\nprint(dbl(-5))\nprint(dbl(-7))\n```"
LOOPS_ON_NEGATIVES = (
    "```python\ndef dbl(n):\n    while n < 0:\n        pass\n    return 2 * n\nprint(dbl(4))\n```"
)
RIGHT = "```python\ndef dbl(n):\n    return n + n\nprint(dbl(5))\n```"
KILLER = "```python\nimport os\ndef dbl(n):\n    return 2 * n\nos._exit(0)\n```"
RIGHT_TOO = "```python\ndef dbl(x):\n    y = x\n    return x + y\n```"
COUNTS_CALLS = "```python\ndef dbl(n, seen=[]):\n    seen.append(n)\n    return 2 * n + len(seen) - 1\nprint(dbl(8))\n```"


def _live(query: str, answers: list[str]) -> tuple[list, list]:
    return behaviour_keys(query, answers, timeout_s=30.0)


def test_unpaid_answers_inputs_do_not_make_a_paid_answer_give_up(tmp_path: Path) -> None:
    """Answer 1 loops on the negative inputs only answer 0 proposes; a state without answer 0 must not
    see those timeouts (before: the shared child gave up on answer 1 and failed its asserts)."""
    answers = [PROPOSES_NEGATIVES, LOOPS_ON_NEGATIVES, RIGHT]
    runs = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]
    live = _live(DOUBLE, [LOOPS_ON_NEGATIVES, RIGHT])
    assert live[0][0] == live[0][1] and live[1] == [1.0, 1.0]
    assert runs.keys([1, 2]) == live


def test_the_give_up_rule_is_applied_on_the_states_own_inputs(tmp_path: Path) -> None:
    """Holding the answer that proposes the negative inputs, the looping answer times out twice and
    is given up on (its later inputs and the prompt's assert count as timeouts), exactly as live."""
    answers = [PROPOSES_NEGATIVES, LOOPS_ON_NEGATIVES, RIGHT]
    runs = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]
    for members in ([1, 0], [0, 1, 2], [2, 1, 0]):
        live = _live(DOUBLE, [answers[j] for j in members])
        assert runs.keys(members) == live
    shares = runs.keys([0, 1])[1]
    assert shares == [1.0, 0.0]  # the looping answer passes the assert alone, not after giving up


def test_an_unpaid_answer_that_kills_the_child_changes_nothing(tmp_path: Path) -> None:
    """Before: the one shared child died, so every state of the query fell back to text keys. A state
    holding the killer still loses every key, as live."""
    answers = [KILLER, RIGHT_TOO, RIGHT]
    runs = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]
    live = _live(DOUBLE, [RIGHT_TOO, RIGHT])
    assert live[0][0] is not None and live[0][0] == live[0][1]
    assert runs.keys([1, 2]) == live
    assert runs.keys([2, 0]) == _live(DOUBLE, [RIGHT, KILLER])


def test_an_answer_whose_outputs_depend_on_earlier_calls_is_run_per_state(tmp_path: Path) -> None:
    """A mutable default makes each output depend on the calls before it, so the inputs an unpaid
    answer proposes would shift it: it is replayed on the state's own inputs instead."""
    answers = [PROPOSES_NEGATIVES, COUNTS_CALLS, RIGHT]
    runs = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]
    assert runs.outcomes[1] is None and runs.outcomes[0] is not None
    for members in ([1, 2], [1], [0, 1]):
        assert runs.keys(members) == _live(DOUBLE, [answers[j] for j in members])


def test_runs_cached_under_the_old_scheme_are_not_read(tmp_path: Path) -> None:
    answers = [RIGHT, RIGHT_TOO]
    old_name = hashlib.sha256(json.dumps([DOUBLE, answers]).encode()).hexdigest()[:32]
    (tmp_path / f"{old_name}.json").write_text(
        json.dumps({"inputs": ["(3,)"], "outputs": [["'stale'"], ["'stale'"]], "passes": [0.0, 0.0]})
    )
    first = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]
    assert first.keys([0, 1]) == _live(DOUBLE, answers)
    assert len(list(tmp_path.glob("*.json"))) == 2  # a new entry beside the old one
    again = code_runs_for([DOUBLE], [answers], directory=tmp_path)[0]  # read back from disk
    assert again.outcomes == first.outcomes and again.keys([1, 0]) == _live(DOUBLE, answers[::-1])
    assert cache_dir().name == "code-runs"


# ---- 2. one fold assignment for every stacked model ---------------------------------------------------
def test_the_planner_is_cross_fitted_on_the_priors_folds() -> None:
    """cascade.py cross-fits the GSM8K priors with split.cross_fit(n, k, seed); the planner fitted with
    the same k and seed must use those folds (before: folds(n, k, seed + 7))."""
    book, priors, labels, _ = synthetic(60, seed=2)
    prior_fold = np.full(len(book), -1)
    calls = iter(range(3))

    def record(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        prior_fold[fold] = next(calls)  # the fold each prior was predicted in
        return priors[fold]

    stacked = cross_fit(len(book), 3, 0, record)
    planners = fit_planner(Recorded.from_priors(book, stacked, labels), k=3, seed=0)
    for i in range(len(book)):  # the same rows share i's fold under both assignments
        assert np.array_equal(prior_fold == prior_fold[i], planners.fold_of == planners.fold_of[i])
    assert np.array_equal(planners.fold_of, fold_assignment(len(book), 3, 0))


def test_cross_fit_on_fits_each_fold_on_the_other_folds_only() -> None:
    fold_of = fold_assignment(23, 4, 5)
    seen: dict[int, set[int]] = {}

    def record(train: np.ndarray, fold: np.ndarray) -> np.ndarray:
        for r in fold:
            seen[int(r)] = set(train.tolist())
        return fold.astype(float)

    assert np.array_equal(cross_fit_on(fold_of, record), np.arange(23.0))
    assert all(seen[i] == set(np.flatnonzero(fold_of != fold_of[i]).tolist()) for i in range(23))


def test_plan_tables_share_the_planners_folds() -> None:
    book, _, labels, costs = synthetic(120, seed=4)
    default = cross_fit_tables(book, labels, costs, ["a", "b", "c"], k=4, seed=1)
    assert np.array_equal(default.fold_of, fold_assignment(len(book), 4, 1))  # before: seed + 11
    given = np.arange(len(book)) % 4
    assert np.array_equal(
        cross_fit_tables(book, labels, costs, ["a", "b", "c"], k=4, fold_of=given).fold_of, given
    )
    with pytest.raises(ValueError, match="fold_of"):
        cross_fit_tables(book, labels, costs, ["a", "b", "c"], k=4, fold_of=given[:-1])


# ---- 3. blank scores and costs in the plan table ------------------------------------------------------
QUESTION = "Which is a mammal?\nA) shark\nB) whale\nC) trout\nD) eel\nAnswer with the letter."


def _singles(table) -> dict[int, float]:
    plans = table.clusters["*"]
    return {plans.fallback[p]: float(plans.accuracy[p]) for p in range(len(plans)) if not plans.voters[p]}


def test_a_blank_score_is_left_out_not_counted_wrong() -> None:
    n = 50
    book = AnswerBook([QUESTION] * n, [["B", "B"]] * n)
    Y, C = np.ones((n, 2)), np.tile([0.1, 1.0], (n, 1))
    Y[:10, 1] = np.nan  # worker 1 ungraded on 10 questions, right on every graded one
    assert _singles(cross_fit_tables(book, Y, C, ["cheap", "dear"], k=1).final)[1] == 1.0


def test_a_blank_cost_is_left_out_not_counted_free() -> None:
    """Worker 0 is right everywhere but its cost is blank on most rows: read as free, it made the
    voter plan (0, 1) → 2 look almost free; its measured cost must be the priced rows' mean."""
    n = 40
    book = AnswerBook([QUESTION] * n, [["B", "B", "B"]] * n)
    Y = np.ones((n, 3))
    C = np.tile([1.0, 1.0, 1.0], (n, 1))
    C[:30, 0] = np.nan
    from router.offline.plan_table_fit import PlanScores

    scores = PlanScores(book, np.arange(n), Y, C, np.zeros(n, dtype=int), 1)
    accuracy, cost, _, _ = scores.measured()
    single0 = scores.fallback.index(0)
    assert cost[single0] == pytest.approx(1.0) and accuracy[single0] == 1.0
    voted = next(p for p, v in enumerate(scores.voters) if v == (0, 1) and scores.fallback[p] == 2)
    assert cost[voted] == pytest.approx(2.0)  # the voters agree: 1 + 1, over the 10 priced rows


def test_a_worker_graded_nowhere_is_left_out_of_the_table() -> None:
    n = 20
    book = AnswerBook([QUESTION] * n, [["B", "C"]] * n)
    Y, C = np.ones((n, 2)), np.ones((n, 2))
    Y[:, 1] = np.nan
    table = cross_fit_tables(book, Y, C, ["a", "ungraded"], k=1).final
    assert _singles(table) == {0: 1.0}
    json.dumps(table.clusters["*"].as_dict(table.workers), allow_nan=False)  # strict JSON still


# ---- 4. LLMRouter prices -------------------------------------------------------------------------------
def test_llmrouter_test_files_are_priced_from_the_train_sides_file(tmp_path: Path) -> None:
    """`router eval --help`: the price file defaults to default_llm.json beside the first --train
    file. A different default_llm.json beside the test files must not price them."""
    files = [FIX / "llmrouter_tiny.json", FIX / "llmrouter_tiny_queries.jsonl"]
    write_split("llmrouter", files, tmp_path, 0.25, seed=0)
    shutil.copy(FIX / "default_llm.json", tmp_path / "train" / "default_llm.json")
    prices = json.loads((FIX / "default_llm.json").read_text())
    dearer = {m: {k: 10 * v for k, v in p.items()} for m, p in prices.items()}
    (tmp_path / "test" / "default_llm.json").write_text(json.dumps(dearer))
    args = ["router", "eval", "--format", "llmrouter", "--model", "knn", "--out", str(tmp_path / "r.json")]
    for side in ("train", "test"):
        for name in ("llmrouter_tiny.json", "llmrouter_tiny_queries.jsonl"):
            args += [f"--{side}", str(tmp_path / side / name)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())["data"]
    assert (
        data["test"]["prices_file"]
        == data["train"]["prices_file"]
        == str(tmp_path / "train" / "default_llm.json")
    )
    assert data["test"]["prices_per_m_tokens"] == data["train"]["prices_per_m_tokens"]


def test_set_reprs_are_the_same_in_every_child() -> None:
    """Answers run in separate children (per answer offline, per state live) are compared by their
    outputs, so a set of strings must print the same in each: PYTHONHASHSEED=0 is honoured (before:
    `python -I` ignored it, and equal sets printed in a different order per child)."""
    source = "def f(s):\n    return ''.join(sorted(set(s), key=lambda c: hash(c)))"
    seen = {run_behaviour([source], ["('hello world',)"])[0] for _ in range(4)}
    assert len(seen) == 1 and None not in seen
