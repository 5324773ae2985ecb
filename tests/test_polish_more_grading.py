"""Multiple-choice answers that compare options and state their choice after "is" (router/grading.py).

"Between A) Mars and C) Jupiter, the largest is C) Jupiter." commits to C, but the grader read no
option from it: it names two options, starts with none and uses no marker ("the answer is", "I'd go
with", "so C"). The grader now reads the last option stated after "is" where no stronger reading
exists; a question, a hedge ("A) Mars or C) Jupiter") or a description ("the first is A) Mars")
still reads none, and a leading option the answer commits to still wins.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.answers import choice_key
from router.grading import grade, grade_choice
from tests.test_leftovers_grading import PLANET


@pytest.mark.parametrize(
    "answer",
    [
        "Between A) Mars and C) Jupiter, the largest is C) Jupiter.",
        "Between (A) Mars and (C) Jupiter, the largest is (C) Jupiter.",
        "Between A) Mars and C) Jupiter, the largest is C) Jupiter, not A) Mars.",
        "Comparing A) Mars with C) Jupiter: the largest of the two is C) Jupiter",
        "Between A) Mars and C) Jupiter, the largest is: **C) Jupiter**",  # markdown and "is:"
        "A) Mars or C) Jupiter? The largest is C) Jupiter.",  # a hedged lead, then the choice
        "A) Mars is too small. B) Venus is about Earth's size. D) Saturn is smaller than Jupiter. "
        "The largest is C) Jupiter.",  # a walk that ends by stating the option left
        "Option A is too small; the largest is option C.",  # a leading option called wrong
        "The largest planet is (C).",
    ],
)
def test_an_option_stated_after_is_is_the_choice(answer):
    graded = grade_choice(answer, "C")
    assert (graded.extracted, graded.score) == ("C", 1.0), graded.detail


@pytest.mark.parametrize(
    "answer",
    [
        "I think option B. The worst is A) Mars.",
        "My answer: B) Venus. The smallest is A) Mars.",
        "The answer is B. The smallest is A) Mars.",
    ],
)
def test_a_choice_read_before_stays_over_a_later_stated_option(answer):
    """The stated option is the weakest reading: it never overrides one the grader already made."""
    graded = grade_choice(answer, "B")
    assert (graded.extracted, graded.score) == ("B", 1.0), graded.detail


@pytest.mark.parametrize(
    "answer",
    [
        "A) Mars or C) Jupiter? I am not sure.",
        "Is it A) Mars or is it C) Jupiter?",
        "Between A) Mars and C) Jupiter, which is C) Jupiter?",  # a question, not a statement
        "The largest is A) Mars or C) Jupiter.",  # the statement names an alternative
        "The largest is either A) Mars or C) Jupiter, I cannot tell.",
        "The first is A) Mars. The last is D) Saturn.",  # options listed by place
        "The closest is A) Mars, which is too small.",  # says something about A, chooses nothing
        "The one that is A) Mars is too small.",
        "B and C are both plausible, but the best is C",  # a bare letter after "is": unchanged
    ],
)
def test_what_commits_to_no_option_still_reads_none(answer):
    graded = grade_choice(answer, "A")
    assert (graded.extracted, graded.score) == (None, 0.0), graded.detail


@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("C) Jupiter. The smallest is A) Mars.", "C"),  # a leading choice wins over a later description
        ("The answer is C. Between A) Mars and B) Venus, the larger is B) Venus.", "C"),  # a marker wins
        ("Between A) Mars and C) Jupiter, the largest is C) Jupiter. I'd go with A.", "A"),
        ("A) Mars\nC) Jupiter\n\nThe largest is C) Jupiter.\n\nC", "C"),
    ],
)
def test_stronger_readings_keep_their_place(answer, read):
    assert grade_choice(answer, read).extracted == read


def test_the_probe_dispatch_reads_the_stated_option():
    probe = PLANET
    assert grade(probe, "Between A) Mars and C) Jupiter, the largest is C) Jupiter.").score == 1.0
    assert grade(probe, "Between A) Mars and C) Jupiter, the largest is A) Mars.").score == 0.0


def test_the_planners_reader_is_unchanged():
    """Only grading changed: router.answers.choice_key (the live planner and the offline evaluation)
    reads these as before."""
    assert choice_key("Between A) Mars and C) Jupiter, the largest is C) Jupiter.", "ABCD") is None
    assert choice_key("A) Mars or C) Jupiter? The largest is C) Jupiter.", "ABCD") == "A"  # its lead


@pytest.mark.parametrize(
    "text",
    [
        "'is' + ' ' * 200_000 + 'x'",
        "'is option' + ' ' * 200_000 + 'x'",
        "'the largest is C)' + ' ' * 200_000 + 'or' + ' ' * 100_000 + 'x'",
        "'Between A) Mars and ' + 'is C) ' * 50_000",
        "'x ' + 'first ' * 50_000 + 'is C) Jupiter.'",
        "'A) Mars or ' + 'the largest is (C) Jupiter, ' * 20_000",
    ],
)
def test_the_stated_option_reader_stays_linear_on_hostile_answers(text):
    """Answers are untrusted: a 200 KB answer is read in linear time (a quadratic reader would take
    minutes). The bound is a generous deadline on a loaded machine, not a timing claim."""
    code = f"from router.grading import grade_choice\ngrade_choice({text}, 'C')\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
