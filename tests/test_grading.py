"""The calibration graders (router/grading.py) on answers as workers write them.

Code answers really run, in the sandboxed child interpreter of router/code_behaviour.py.
"""

from __future__ import annotations

import os
import time

import pytest

from router.grading import (
    final_number,
    grade,
    grade_choice,
    grade_code,
    grade_match,
    grade_number,
    parse_number,
    token_f1,
)
from router.probes import Probe, load_probes


# ---- choice ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("C", "C"),
        ("c", "C"),
        ("C) selective breeding", "C"),
        ("(C)", "C"),
        ("The answer is C.", "C"),
        ("The correct answer is: **C**", "C"),
        ("**C. selective breeding**", "C"),
        ("Answer: C", "C"),
        (
            "Crossing a resistant plant with a large-fruited one on purpose is selective breeding, so (C).",
            "C",
        ),
        ("Based on the clues, the bird keeper lives in house 2, so the answer is B.", "B"),
        ("I am not sure which one is right.", None),
        ("", None),
    ],
)
def test_choice_reads_the_letter_as_workers_write_it(answer, read):
    graded = grade_choice(answer, "C", "ABCD")
    assert graded.extracted == read
    assert graded.score == (1.0 if read == "C" else 0.0)


def test_choice_ignores_letters_the_question_did_not_offer():
    assert grade_choice("E", "A", "AB").extracted is None  # a two-house puzzle has A and B only
    assert grade_choice("B", "B", "AB").score == 1.0


def test_a_walk_through_the_options_chooses_only_by_a_marker():
    walk = "A) Mars is rocky. B) Venus is hot. C) Jupiter is the largest planet. D) Saturn has rings."
    assert grade_choice(walk, "A").extracted is None  # its first line starts with "A)": not a choice
    assert grade_choice(walk + "\n\nSo the answer is C.", "C").score == 1.0
    assert grade_choice("A) Mars\nB) Venus\n\nThe answer is (B).", "B").score == 1.0
    # an answer that leads with its choice and names another option afterwards keeps its choice
    assert grade_choice("C) Jupiter. Unlike A) Mars, it is a gas giant.", "C").score == 1.0
    assert grade_choice("A) True. B) would need the opposite premise.", "A", "AB").extracted is None
    assert grade_choice("A) True.", "A", "AB").score == 1.0


# ---- number ------------------------------------------------------------------------------------------
GSM8K_ANSWER = (
    "Janet's ducks lay 16 eggs. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 eggs are left.\n"
    "She sells them at $2 each: 9 * 2 = $18.\nAnswer: 18"
)


@pytest.mark.parametrize(
    ("answer", "gold", "score", "read"),
    [
        (GSM8K_ANSWER, "18", 1.0, "18"),
        (
            "Half of the sale is $30,000, so the land sold for $60,000 and cost $20,000.\n#### 20,000",
            "20000",
            1.0,
            "20,000",
        ),
        ("So the answer is $\\boxed{\\frac{36}{49}}$.", "36/49", 1.0, "\\frac{36}{49}"),
        ("The probability is 3/4, i.e. 0.75.\nAnswer: 0.75", "3/4", 1.0, "0.75"),
        ("We get $b=\\boxed{-1}$.", "-1", 1.0, "-1"),
        ("Step 1: 12 * 4 = 48. Step 2: 48 + 2 = 50.", "50", 1.0, "50"),  # no marker: the last number
        ("The total is 50.\nAnswer: 49", "50", 0.0, "49"),  # the marked answer wins over earlier numbers
        ("Answer: $1,200.", "1200", 1.0, "1,200"),
        ("The answer is 45\\%.", "45", 1.0, "45"),
        ("I cannot compute that.", "7", 0.0, None),
    ],
)
def test_number_reads_the_final_number(answer, gold, score, read):
    graded = grade_number(answer, gold)
    assert (graded.score, graded.extracted) == (score, read)


def test_number_parsing():
    assert parse_number("1,234.50") == 1234.5
    assert parse_number("\\dfrac{6}{11}") == pytest.approx(6 / 11)
    assert parse_number("-\\frac32") == -1.5
    assert parse_number("12 \\text{ cm}") == 12
    assert parse_number("y=-2x+1") is None and parse_number("inf") is None and parse_number("1/0") is None
    assert final_number("") == (None, None)


# ---- match -------------------------------------------------------------------------------------------
def test_match_normalises_and_accepts_the_gold_inside_a_longer_answer():
    assert grade_match("Bayreuth", ["Bayreuth"]).score == 1.0
    assert grade_match("It is held in Bayreuth, Germany.", ["bayreuth"]).score == 1.0
    assert grade_match("Sammy Davis Jr.", ["Sammy Davis, Jr"]).score == 1.0  # punctuation, case
    assert grade_match("The Tremeloes", ["the Tremeloes"]).score == 1.0  # articles
    assert grade_match("Shakespeare", ["William Shakespeare", "Shakespeare"]).score == 1.0  # any alias


def test_match_gives_partial_credit_by_token_f1_or_none():
    partial = grade_match("Bayreuth", ["bayreuth germany"])
    assert partial.score == pytest.approx(2 / 3, abs=1e-3)
    assert grade_match("Bayreuth", ["bayreuth germany"], partial=None).score == 0.0
    assert grade_match("Salzburg", ["Bayreuth"]).score == 0.0
    assert grade_match("", ["Bayreuth"]).detail == "empty answer"
    assert token_f1("a b", "c") == 0.0


def test_match_ignores_accents_on_either_side():
    assert grade_match("It is in Zurich.", ["Zürich"]).score == 1.0
    assert grade_match("ZÜRICH", ["Zurich"]).score == 1.0
    assert grade_match("Café de Flore", ["cafe de flore"]).score == 1.0
    assert grade_match("Zürich", ["Geneva"], partial=None).score == 0.0  # a wrong city is still wrong


def test_number_reads_space_grouped_thousands_after_a_marker_only():
    assert grade_number("The answer is 1 234.", "1234").score == 1.0
    assert grade_number("**Answer**: 12 500 000 people", "12500000").score == 1.0
    assert grade_number("#### -1 234", "-1234").score == 1.0
    assert grade_number("\\boxed{1 234}", "1234").score == 1.0
    assert grade_number("The answer is 1 234.5 metres", "1234.5").score == 1.0
    # not a grouped number: a count before a compound, groups of other sizes, prose without a marker
    assert final_number("The answer is 3 100-metre races")[1] == 3
    assert final_number("The answer is 12 34")[1] == 12
    assert final_number("She has 3 apples and 234 pears.")[1] == 234


# ---- code --------------------------------------------------------------------------------------------
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def test_code_that_passes_every_test_scores_one():
    answer = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nThis adds two numbers."
    graded = grade_code(answer, ADD_TESTS)
    assert (graded.score, graded.extracted) == (1.0, "2/2")


def test_code_that_passes_some_tests_scores_zero():
    graded = grade_code("```python\ndef add(a, b):\n    return abs(a) + b\n```", ADD_TESTS)
    assert (graded.score, graded.extracted) == (0.0, "1/2")


def test_code_under_another_name_is_still_tested():
    """MBPP's tests call the task's name; the answer's main function is bound to it."""
    assert grade_code("```python\ndef add_numbers(x, y):\n    return x + y\n```", ADD_TESTS).score == 1.0


@pytest.mark.parametrize(
    "answer",
    [
        "I can't help with that.",  # no code at all
        "```python\ndef add(a, b)\n    return a + b\n```",  # a syntax error
        "```javascript\nfunction add(a, b) { return a + b; }\n```",  # not Python
        "```python\nimport sys\ndef add(a, b):\n    sys.exit(3)\n```",  # exits
        "```python\nimport os\ndef add(a, b):\n    os._exit(0)\n```",  # kills its interpreter
        "```python\ndef add(a, b):\n    return add(a, b)\n```",  # recursion
    ],
)
def test_code_that_fails_in_any_way_scores_zero(answer):
    assert grade_code(answer, ADD_TESTS).score == 0.0


def test_a_looping_answer_is_stopped_and_scores_zero():
    started = time.monotonic()
    graded = grade_code(
        "```python\ndef add(a, b):\n    while True:\n        pass\n```", ADD_TESTS, per_call_s=0.5
    )
    assert graded.score == 0.0
    assert time.monotonic() - started < 60  # bounded by the timeout, not by the loop


def test_code_runs_isolated_from_this_process(monkeypatch, tmp_path):
    """`python -I` in a fresh temporary directory, without this process's environment."""
    monkeypatch.setenv("POLYROUTE_GRADING_SECRET", "do-not-leak")
    monkeypatch.chdir(tmp_path)
    answer = (
        "```python\nimport os\n"
        "def probe():\n    return (os.environ.get('POLYROUTE_GRADING_SECRET'), os.getcwd())\n```"
    )
    tests = ["assert probe()[0] is None", f"assert probe()[1] != {str(tmp_path)!r}"]
    assert grade_code(answer, tests).score == 1.0
    assert os.listdir(tmp_path) == []


def test_humaneval_setup_runs_before_the_answer():
    """The prompt's stub (its imports) runs first: an answer that leaves out `from typing import List`
    still defines its annotated function."""
    probe = next(p for p in load_probes().probes if p.task == "human_eval" and p.setup and "List" in p.setup)
    entry = probe.grader["entry_point"]
    assert entry in probe.prompt and all(entry in test for test in probe.tests)
    stub_only = grade(probe, f"```python\n{probe.setup}\n```")  # the stub returns None: tests fail
    assert stub_only.score == 0.0 and stub_only.extracted is not None


def test_a_shipped_humaneval_probe_graded_with_a_correct_answer():
    probe = load_probes().get("human_eval-b2f5b4973f")  # largest_divisor
    answer = (
        "```python\ndef largest_divisor(n: int) -> int:\n"
        "    for i in range(n - 1, 0, -1):\n        if n % i == 0:\n            return i\n```"
    )
    assert grade(probe, answer).score == 1.0
    assert grade(probe, "```python\ndef largest_divisor(n):\n    return 1\n```").score == 0.0


# ---- dispatch ----------------------------------------------------------------------------------------
def test_grade_dispatches_on_the_probe_type():
    def probe(**fields) -> Probe:
        return Probe(id="x", task="t", source="test", prompt="?", max_tokens=16, **fields)

    assert grade(probe(type="choice", gold="B", grader={"letters": "AB"}), "B").score == 1.0
    assert grade(probe(type="number", gold="7"), "Answer: 7").score == 1.0
    assert grade(probe(type="match", gold=["Paris"]), "paris").score == 1.0
    assert grade(probe(type="code", tests=ADD_TESTS), "def add(a, b):\n    return a + b").score == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"type": "choice", "gold": "E", "grader": {"letters": "ABCD"}}, "gold must be one of its letters"),
        ({"type": "number", "gold": "seven"}, "gold must be a number"),
        ({"type": "match", "gold": []}, "non-empty list"),
        ({"type": "code"}, "needs tests"),
    ],
)
def test_a_probe_that_cannot_be_graded_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Probe(id="x", task="t", source="test", prompt="?", max_tokens=16, **fields)


def test_every_shipped_probe_grades_its_own_gold_as_right():
    """The graders read the golds they are given: a choice, number or match probe answered with its
    own gold scores 1 (code has no gold answer to replay)."""
    for probe in load_probes().probes:
        if probe.type == "code":
            continue
        gold = probe.gold[0] if isinstance(probe.gold, list) else probe.gold
        answer = f"Answer: {gold}" if probe.type == "number" else str(gold)
        assert grade(probe, answer).score == 1.0, probe.id
