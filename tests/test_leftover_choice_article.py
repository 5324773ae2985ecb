"""The choice grader and a leading article "A": "A planet that is large is C) Jupiter." chose C, not A.

A leading "A" followed by ordinary words is the article when the answer goes on to state an option
("… is C) Jupiter", a later sentence or line "C) Jupiter"); every other leading "A" reads as before.
Over every recorded answer in the RouterBench (arc_challenge, mbpp, winogrande) and RouteLLM GSM8K
training files the change alters no reading (54,226 readings checked with the old and new grader).
"""

from __future__ import annotations

import pytest

from router.grading import chosen_letter, grade_choice


@pytest.mark.parametrize(
    ("answer", "chosen"),
    [
        ("A planet that is large is C) Jupiter.", "C"),
        ("A planet that is large is (C) Jupiter", "C"),
        ("A gas giant: (C) Jupiter", "C"),
        ("A planet that is large: C) Jupiter.", "C"),
        ("**A planet that is large is C) Jupiter.**", "C"),
    ],
)
def test_a_leading_article_is_no_choice_when_a_later_option_is_stated(answer, chosen):
    assert chosen_letter(answer, "ABCD") == chosen
    grade = grade_choice(answer, "C")
    assert (grade.score, grade.extracted) == (1.0, "C"), grade


@pytest.mark.parametrize(
    ("answer", "chosen"),
    [
        # a chosen A, written as a choice is written
        ("A", "A"),
        ("A) Mars", "A"),
        ("(A) Mars", "A"),
        ("A. Mars", "A"),
        ("A questioning", "A"),  # RouterBench arc_challenge: the option's text after its letter
        # a chosen A with a reason that names another option
        ("A because Mars is the smallest; the largest is C) Jupiter.", "A"),
        ("A, since the largest is C) Jupiter and we want the smallest.", "A"),
        ("A is correct: the largest is C) Jupiter, but the question asks for the smallest.", "A"),
        # an article with no later explicit choice, or with a hedged one: the old reading stands
        ("A drought.", "A"),
        ("A planet that is large is Jupiter, C.", "A"),
        ("A planet that is large: C) Jupiter and D) Saturn.", "A"),
        ("A planet that is large is C) Jupiter or D) Saturn.", "A"),
        # an explicit final answer wins, as it did
        ("A large planet. The answer is C", "C"),
        ("A large planet.\nC) Jupiter", "C"),
    ],
)
def test_other_leading_a_forms_read_as_before(answer, chosen):
    assert chosen_letter(answer, "ABCD") == chosen
