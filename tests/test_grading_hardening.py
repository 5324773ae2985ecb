"""The answer readers on hostile and unusual answers: they finish in time linear in the answer's length,
never raise, and read the letter or number a worker meant from the way reasoning models write it.
Probe files that the graders could not grade are refused when loaded.

No timing is asserted (the machine may be busy): a reader that used to backtrack for minutes or hours
on an adversarial answer is run in a fresh interpreter that must finish inside a generous timeout.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.answers import choice_key, choice_letters, code_key, parse_python, python_source
from router.compose.acceptance import answer_features, statements
from router.grading import grade_choice, grade_code, grade_number, parse_number
from router.probes import ProbeError, load_probes

ROOT = Path(__file__).resolve().parents[1]
GENEROUS_S = 60  # each input below took minutes (or far longer) before; linear readers need milliseconds


def finishes(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter; fail the test if it does not finish within GENEROUS_S."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=GENEROUS_S,
            cwd=ROOT,
            env=environment,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {GENEROUS_S} s: {code}")
    assert done.returncode == 0, done.stderr
    return done


# ---- 1. linear readers --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        # choice_key's `^\s*\**\s*([A-J])\s*\**\s*$` (MULTILINE) was cubic on runs of blank lines
        "grade_choice('\\n' * 200_000, 'B')",
        "grade_choice(' \\n' * 100_000, 'B')",
        "grade_choice('The answer is unclear.' + '\\n' * 200_000, 'B')",
        # `answer\s*(?:is|:)?\s*` and the fence's `[ \t]*(?:python)?[ \t]*`: two runs sharing the blanks
        "grade_choice('answer' + ' ' * 200_000, 'B')",
        "python_source('```' + ' ' * 200_000 + 'x')",
        # `^\s*` at every line start of the query (option lines) and answers (a `def` line)
        "detect_kind('\\n' * 200_000, ['\\n' * 200_000])",
        "choice_letters('\\n' * 200_000)",
    ],
)
def test_readers_finish_on_adversarial_whitespace(call):
    finishes(
        "from router.answers import choice_letters, detect_kind, python_source\n"
        f"from router.grading import grade_choice\nprint({call})"
    )


def test_adversarial_whitespace_reads_as_nothing():
    assert choice_key("\n" * 2000, "ABCD") is None
    assert grade_choice(" \n" * 2000, "B").extracted is None
    assert choice_letters("\n" * 5000) == ""


# ---- 5. arithmetic statements in linear time ---------------------------------------------------------------
def test_answer_features_finish_on_a_long_chain_without_equals():
    """STATEMENT failed at every digit of a chain with no `=` and rescanned the rest: 64 KB took ~8-30 s
    on the gateway's event loop, 256 KB would take minutes."""
    done = finishes(
        "from router.compose.acceptance import answer_features\n"
        "print(answer_features('what is 1+1?', '+'.join(['1'] * 128_000))[5])"
    )
    assert float(done.stdout) == 0.0  # no statement: nothing to check


# The regex the linear reader replaced: the oracle its findings are compared with on short strings.
OLD_STATEMENT = re.compile(
    r"(\d[\d,.]*\s*[-+*/x×]\s*\d[\d,.]*(?:\s*[-+*/x×]\s*\d[\d,.]*)*)\s*=\s*\$?(-?\d[\d,]*\.?\d*)"
)


def test_statements_are_read_as_before():
    gsm8k = (
        " Janet starts with 16 eggs per day.\nShe eats 3 for breakfast, so she has 16 - 3 = 13 eggs left."
        "\nShe uses 4 for baking, so she has 13 - 4 = 9 eggs left.\nShe sells these 9 eggs at the farmers'"
        " market for 9 * $2 = $<<9*2=18>>18.\n#### 18"
    )
    assert statements(gsm8k) == [("16 - 3", "13"), ("13 - 4", "9"), ("9*2", "18")]
    assert statements("2023 = 2023, 1,000 x 3 = 3,000") == [("1,000 x 3", "3,000")]
    rng = random.Random(7)
    for _ in range(20_000):
        text = "".join(rng.choice("1239.,+-*/x× =$\na(") for _ in range(rng.randint(1, 30)))
        assert statements(text) == OLD_STATEMENT.findall(text), text


# ---- 4. readers that never raise -------------------------------------------------------------------------
def test_acceptance_features_survive_long_expressions():
    calc = "<<" + "+".join(["1"] * 1100) + "=1100>>\n#### 1100"
    statement = "+".join(["1"] * 1100) + " = 1100\n#### 1100"
    for answer in (calc, statement):
        features = answer_features("How many?", answer)
        assert all(math.isfinite(x) for x in features)
        assert features[3] + features[5] == 0  # too long to re-evaluate: not counted as checked


def test_code_readers_survive_deep_or_long_code():
    deep = "def f():\n    return " + "-" * 20000 + "1\n"  # the parser raises MemoryError, not SyntaxError
    assert python_source(deep) is None
    assert grade_code(deep, ["assert f() == -1"]).score == 0.0
    long_sum = "def f(x):\n    return " + "+".join(["x"] * 400) + "\n"  # the visitor recurses too deep
    assert python_source(long_sum) is not None and code_key(long_sum) is None
    assert parse_python("+".join(["1"] * 5000)) is None  # RecursionError in the parser
    assert parse_python("def f():\n    return '\0'") is None  # a null byte
    assert parse_python("x = 1\n" * 30_000) is None  # beyond MAX_SOURCE_CHARS: not parsed


# ---- 7. choice letters as reasoning models write them --------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("\\boxed{B}", "B"),
        ("**Final Answer**\n\\boxed{B}", "B"),
        ("The options compare... so the final answer is $\\boxed{\\text{(B)}}$", "B"),
        ("A drought would reduce the population, so the answer is B.", "B"),  # not the article "A"
        ("The answer is a drought lasting twelve months (B).", "B"),  # not the lower-case article "a"
        ("Option A fails and option C too. Therefore the answer is B.", "B"),
        ("The answer is C. Wait, that is wrong: the answer is B.", "B"),  # the last explicit answer
        ("A or B", None),  # several letters choose none
        ("B and C are both plausible, but the best is C", None),
        ("(A) or (B)", None),
        ("answer: b", "B"),  # lower case in a marker form still counts
        ("The answer is (b).", "B"),
        ("B is right, because A and C are not.", "B"),  # only a leading list is no choice
    ],
)
def test_choice_reads_the_final_choice(answer, read):
    assert grade_choice(answer, "B", "ABCD").extracted == read


def test_the_cascade_reads_letters_as_the_grader_does():
    """router.answers.choice_key (the live planner's reader) on the same forms, markdown left in."""
    assert choice_key("**Final Answer**\n\\boxed{B}", "ABCD") == "B"
    assert choice_key("A drought would reduce the population, so the answer is B.", "ABCD") == "B"
    assert choice_key("The answer is a drought lasting twelve months.", "ABCD") is None
    assert choice_key("A or B", "ABCD") is None
    assert choice_key("Reasoning...\n**C**\n", "ABCD") == "C"  # a letter alone on its line


def test_a_hedged_or_wrong_final_choice_is_not_credited():
    assert grade_choice("A or B", "A", "ABCD").score == 0.0
    assert grade_choice("B and C are both plausible, but the best is C", "B", "ABCD").score == 0.0


# ---- 8. numbers as MATH and reasoning models write them ------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("The total is \\boxed{10{,}000}.", "10000"),  # LaTeX thousands separator: not 000
        ("So the area is \\boxed{12\\text{ cm}^2}", "12"),  # a unit's power: not 2, not 144
        ("The area is \\boxed{12 \\mathrm{m}^{2}}", "12"),
        ("The answer is \u22125.", "-5"),  # Unicode minus: not 5
        ("\\boxed{\u22121{,}250}", "-1250"),
    ],
)
def test_number_reads_latex_separators_units_and_minus(answer, gold):
    assert grade_number(answer, gold).score == 1.0


def test_number_gold_with_unicode_minus_or_separator():
    assert parse_number("\u22125") == -5
    assert parse_number("10{,}000") == 10000


# ---- 10. probes the graders could not grade --------------------------------------------------------------
BASE = {"id": "p-bad", "task": "t", "source": "mine", "prompt": "Q?", "max_tokens": 16}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"type": "match", "gold": ["The"]}, "is empty once normalised"),
        ({"type": "number", "gold": "7", "grader": {"rel_tol": "tight"}}, "rel_tol must be a number"),
        ({"type": "number", "gold": "7", "grader": {"rel-tol": 0.01}}, "does not take 'rel-tol'"),
        ({"type": "choice", "gold": "A", "grader": {"letters": "A1"}}, "letters must be"),
        ({"type": "match", "gold": ["Paris"], "grader": {"partial": "F1"}}, "partial must be"),
        ({"type": "code", "tests": ["assert f(1) == "]}, "test is not Python"),
        ({"type": "code", "tests": ["f(1)"]}, "holds no assert"),
        ({"type": "code", "tests": ["assert f(1)"], "setup": "def ("}, "setup is not Python"),
        ({"type": "code", "tests": ["assert f(1)"], "grader": {"timeout_s": 0}}, "timeout_s must be"),
    ],
)
def test_an_ungradable_probe_is_refused_at_load_naming_it(tmp_path, fields, message):
    path = tmp_path / "probes.jsonl"
    path.write_text(json.dumps({**BASE, "id": "ok", "type": "choice", "gold": "A"}) + "\n")
    with path.open("a") as out:
        out.write(json.dumps({**BASE, **fields}) + "\n")
    with pytest.raises(ProbeError, match=message) as refused:
        load_probes(path)
    assert f"{path}:2: not a valid probe 'p-bad'" in str(refused.value)


def test_the_shipped_probes_still_load():
    assert len(load_probes()) >= 300
