"""Multiple-choice answers that go through the options: the grader reads the option the answer commits
to, and no option when it commits to none (router/grading.py; router/answers.py, the planner's
reader, is unchanged).

Every answer below is written as workers write them. Before the fix the grader read the leading
"A)" of a walk through the options as the choice ("A) Mars is too small … so it's C" scored A),
dropped the letter of "the correct answer is C) Jupiter" once it saw a walk, and credited the first
letter of a hedged final answer ("The answer is A or C" scored A).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.answers import choice_key
from router.grading import grade, grade_choice
from router.probes import Probe

WALK = (
    "Let's look at each option:\n"
    "A) Mars - too small.\n"
    "B) Venus - about the size of Earth.\n"
    "C) Jupiter - the largest planet.\n"
    "D) Saturn - the second largest."
)


@pytest.mark.parametrize(
    "answer",
    [
        "A) Mars is too small. C) Jupiter is the largest planet, so it's C.",
        "A) Mars is too small ... C) Jupiter is the largest planet, so C is correct.",
        "A) Mars: no. C) Jupiter: yes. So C.",
        "A) Mars is small. C) Jupiter is large. I'd go with C.",
        "A) Mars is too small ... C) Jupiter is the largest planet.\n\n**C) Jupiter**",
        "A) Mars is too small ... C) Jupiter is the largest planet.\n\nC",
        "A) Mars is too small, B) Venus is Earth-sized, D) Saturn is smaller than Jupiter. That leaves C) Jupiter.",
        "Looking at the options: A) Mars, B) Venus, C) Jupiter, D) Saturn. Jupiter is the largest, "
        "so the correct answer is C) Jupiter.",
        WALK + "\n\nTherefore, C) Jupiter.",
        WALK + "\n\nThe correct choice is C) Jupiter.",
        "A) is wrong because Mars is small. C) is right because Jupiter is the largest.",
        "A is wrong since Mars is small; C is correct since Jupiter is the largest.",
        "Option A is incorrect because Mars is small. Option B is incorrect. Option C is correct "
        "because Jupiter is the largest planet. Option D is incorrect.",
        "Let's evaluate each option:\n\n- **A) Mars**: about half the size of Earth. Incorrect.\n"
        "- **B) Venus**: similar in size to Earth. Incorrect.\n"
        "- **C) Jupiter**: the largest planet. This is correct.\n- **D) Saturn**: second largest. Incorrect.",
        "A) Mars ✗\nB) Venus ✗\nC) Jupiter ✓\nD) Saturn ✗",
        "Step 1: A) Mars is 6,779 km. Step 2: C) Jupiter is 139,820 km. So C.",
        "B and D are wrong. A and C remain; A is too small. Therefore C.",
        "It's between A and C. I'll go with C.",
        "Between (A) Mars and (C) Jupiter, Jupiter is bigger, so I choose (C).",
    ],
)
def test_an_answer_that_goes_through_the_options_is_read_at_its_commitment(answer):
    graded = grade_choice(answer, "C")
    assert (graded.extracted, graded.score) == ("C", 1.0), graded.detail


@pytest.mark.parametrize(
    "answer",
    [
        "A) Mars is too small ... C) Jupiter is the largest planet.",  # goes through, commits to none
        "(A) Mars is too small. (C) Jupiter is the largest planet.",
        "A. Mars — too small\nB. Venus — Earth-sized\nC. Jupiter — largest\nD. Saturn — second",
        "Option A is too small. Option C is the largest.",
        "A) Mars or C) Jupiter",
        "A) Mars and C) Jupiter are both candidates.",
        "A) Mars\nC) Jupiter",  # a listing of two options
        "The answer is A or C.",
        "The answer is (A) or (C)",
        "Answer: A or C",
        "Answer: A) Mars or C) Jupiter",
        "A) Mars is too small ... C) Jupiter is the largest planet, so the answer is A or C",
        "The answer is A or C, depending on interpretation.",
        "\\boxed{A) or C)}",
        "A is incorrect because Mars is small.",  # calls its leading option wrong
        "Therefore, B and C are wrong.",
    ],
)
def test_an_answer_that_commits_to_no_option_is_not_credited(answer):
    """Gold A: the old grader read A (the leading option, or the first of a hedged pair) in each."""
    graded = grade_choice(answer, "A")
    assert (graded.extracted, graded.score) == (None, 0.0), graded.detail


@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("C) Jupiter. Unlike A) Mars, it is a gas giant.", "C"),  # leads with its choice
        ("C) Jupiter\n\nIt is the largest. A) Mars and B) Venus are rocky, and D) Saturn is smaller.", "C"),
        ("**C) Jupiter**\n\nA) Mars is too small. B) Venus is about Earth's size.", "C"),
        ("C\n\nExplanation: A) Mars is small. B) Venus is Earth-sized. D) Saturn is smaller.", "C"),
        ("The answer is C, but A could also be argued.", "C"),  # "but A" is no alternative answer
        ("So the answer is C, not A.", "C"),
        ("Answer: C, since A) Mars is small.", "C"),
        ("The statement is true, so A) True.", "A"),
        ("A) True\nB) False\n\nA", "A"),
        ("So A and C are both wrong, and B is right.", "B"),
        ("I'm choosing between A and C... I pick C.", "C"),
    ],
)
def test_choices_stated_around_other_options_are_kept(answer, read):
    assert grade_choice(answer, read).extracted == read


PLANET = Probe(
    id="planet",
    type="choice",
    task="science",
    source="test",
    prompt="Which planet is the largest?\nA) Mars\nB) Venus\nC) Jupiter\nD) Saturn",
    max_tokens=256,
    gold="C",
)


def test_the_probe_dispatch_grades_a_walk_at_its_commitment():
    probe = PLANET
    assert grade(probe, "A) Mars is too small. C) Jupiter is the largest planet, so it's C.").score == 1.0
    assert grade(probe, "A) Mars is too small ... C) Jupiter is the largest planet.").score == 0.0


def test_the_planners_reader_is_unchanged():
    """Only grading changed: router.answers.choice_key still reads a leading option, as the live
    planner and the offline evaluation have always read it."""
    assert choice_key("A) Mars is too small ... C) Jupiter is the largest planet.", "ABCD") == "A"
    assert choice_key("The answer is A or C.", "ABCD") == "A"


@pytest.mark.parametrize(
    "text",
    [
        "'so' + ' ' * 200_000 + 'x'",
        "'correct option' + ' ' * 200_000 + 'x'",
        "'answer: C) x' + ' ' * 200_000 + 'y'",
        "'answer: C' + ' ' * 200_000 + 'or' + ' ' * 100_000 + 'x'",
        "'C)' + ' ' * 200_000 + 'x'",
        "'option C' + ' ' * 200_000 + 'is x'",
        "'A) ' * 100_000",
        "'so C ' * 50_000",
        "'A) x. C) -' + ' ' * 200_000 + 'x'",
        "'\\n' + ' ' * 100_000 + '-' + ' ' * 100_000 + 'x'",
    ],
)
def test_the_new_readers_stay_linear_on_hostile_answers(text):
    """Answers are untrusted: each reader reads a 200 KB answer in linear time (a quadratic one would
    take minutes here). The bound is a generous deadline on a loaded machine, not a timing claim."""
    code = f"from router.grading import grade_choice\ngrade_choice({text}, 'C')\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
