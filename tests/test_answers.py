"""Answer normalisers on real answer strings: RouterBench's recorded responses (ARC, Winogrande, MBPP)
and RouteLLM's GSM8K answers (Mixtral-8x7B, GPT-4), quoted as the data has them."""

from __future__ import annotations

import pytest

from router.answers import (
    Kind,
    agreement,
    answer_key,
    canonical_number,
    choice_key,
    choice_letters,
    code_key,
    detect_kind,
    final_number,
    form,
    span_key,
)

ARC_PROMPT = (
    "George wants to warm his hands quickly by rubbing them. Which skin surface will produce the most "
    "heat?\nA) dry palms\nB) wet palms\nC) palms covered with oil\nD) palms covered with lotion\nPrint only "
    'a single choice  from "A" or "B" or "C" or "D" without explanation.\nAnswer:\nA\n\nWhich of the '
    "following statements best explains why magnets usually stick to a refrigerator door?\nA) The "
    "refrigerator door is smooth.\nB) The refrigerator door contains iron.\nC) The refrigerator door is a "
    "good conductor.\nD) The refrigerator door has electric wires in it.\nPrint only a single choice  from "
    '"A" or "B" or "C" or "D" without explanation.\nAnswer:'
)
WINOGRANDE_PROMPT = (
    "Please answer with the letter of the correct answer.\n\nIan volunteered to eat Dennis's menudo after "
    "already having a bowl because _ despised eating intestine.\nA) Ian\nB) Dennis\nPrint only a single "
    'choice  from "A" or "B" without explanation. Answer:'
)


def test_choice_letters_are_those_of_the_question_asked():
    assert choice_letters(ARC_PROMPT) == "ABCD"
    assert choice_letters(WINOGRANDE_PROMPT) == "AB"
    assert choice_letters("What is the capital of France?") == ""
    assert detect_kind(ARC_PROMPT) is Kind.CHOICE


@pytest.mark.parametrize(
    ("answer", "letters", "key"),
    [
        ("C", "ABCD", "C"),  # gpt-4-1106-preview
        ("C\n", "ABCD", "C"),  # mistralai/mixtral-8x7b-chat
        ("D)", "ABCD", "D"),  # claude-instant-v1
        ("A.", "AB", "A"),  # claude-v2
        ("D (", "ABCD", "D"),  # gpt-3.5-turbo-1106
        ("A questioning", "ABCD", "A"),  # claude-v2, scored correct in the data
        ("Based on", "ABCD", None),  # claude-instant-v1: a word, not the letter B
        ("Erin", "AB", None),  # mixtral: a name from the sentence, not a choice
        ("G\n", "ABCD", None),  # mistral-7b: a letter the question did not offer
        ("I do", "ABCD", None),  # claude-v2 (truncated refusal)
        ("Unfortunately I", "AB", None),
        ("The answer is (B).", "ABCD", "B"),
        ("Answer: d", "ABCD", "D"),
    ],
)
def test_choice_keys(answer, letters, key):
    assert choice_key(answer, letters) == key
    assert answer_key(answer, Kind.CHOICE, letters) == key


@pytest.mark.parametrize(
    ("answer", "number"),
    [
        (  # Mixtral, GSM8K question 1
            " Janet starts with 16 eggs per day.\nShe eats 3 for breakfast, so she has 16 - 3 = 13 eggs left."
            "\nShe uses 4 for baking, so she has 13 - 4 = 9 eggs left.\nShe sells these 9 eggs at the farmers'"
            " market for 9 * $2 = $<<9*2=18>>18.\n#### 18",
            "18",
        ),
        (  # GPT-4, same question: no marker, the last number
            "She lays 16 eggs per day, so the remainder that she sells is 16 - 7 = 9 eggs.\nShe sells each egg"
            " for $2, so she makes 9 * $2 = $18 every day at the farmers' market.",
            "18",
        ),
        (  # Mixtral, question 2: a wrong final after a right intermediate
            " A robe takes 2 bolts of blue fiber and 2/2 * 1/2 = 1/2 bolt of white fiber.\nSo in total, it "
            "takes 2 + 1/2 = 5/2 = <<5/2=2.5>>2.5 bolts.\nHowever, since you can't have half a bolt, the robe "
            "actually takes 3 bolts in total.\n#### 3\n\n",
            "3",
        ),
        (  # GPT-4, question 3
            "The profit Josh made is the final value of the house minus his total investment, which is "
            "$155,000 - $130,000 = $25,000.",
            "25000",
        ),
        ("The answer is 1,234.50.", "1234.5"),
        ("I cannot tell.", None),
    ],
)
def test_number_keys(answer, number):
    assert final_number(answer) == number
    assert answer_key(answer, Kind.NUMBER) == number


def test_canonical_numbers():
    assert canonical_number("18.0") == "18"
    assert canonical_number("-3") == "-3"
    assert canonical_number("0.125") == "0.125"
    assert canonical_number("1e999") is None
    assert canonical_number("twelve") is None


def test_word_problems_are_numeric():
    janet = (
        "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
        "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
        "fresh duck egg. How much in dollars does she make every day at the farmers' market?"
    )
    grace = (
        "Grace weighs 125 pounds. Alex weighs 2 pounds less than 4 times what Grace weighs. What are their "
        "combined weights in pounds?"
    )
    assert detect_kind(janet) is Kind.NUMBER
    assert detect_kind(grace) is Kind.NUMBER  # no "how many": two numbers and a question


WIZARD_MBPP = (  # WizardLM-13B on MBPP, with Windows line ends and a usage block after the function
    "Here's a Python function that takes two lists as input and removes all elements from the first list "
    "that are also present in the second list:\r\n\r\n```python\r\ndef remove_elements(list1, list2):\r\n    "
    "return [x for x in list1 if x not in list2]\r\n```\r\n\r\nHere's how you can use this function:\r\n\r\n"
    "```python\r\nlist1 = [1, 2, 3, 4, 5]\r\nlist2 = [3, 4, 5]\r\nresult = remove_elements(list1, list2)\r\n"
    "print(result)  # Output: [1, 2]\r\n```"
)
CODELLAMA_MBPP = (  # code-llama-instruct-34b: [PYTHON] tags, tests after
    " \n[PYTHON]\ndef find_intersection(arr1, arr2):\n    return list(set(arr1) & set(arr2))\n[/PYTHON]\n"
    "[TESTS]\n# Test case 1:\nassert find_intersection([1, 2, 3, 4], [3, 4, 5, 6]) == [3, 4]\n"
)
CPP_MBPP = (  # claude-instant-v1 answered a Python task in C++
    "Here is a function to check if a number is a perfect square:\n\n```cpp\nbool isPerfectSquare(int n) \n"
    "{\n    int s = sqrt(n);\n    return (s*s == n);\n}\n```"
)
JS_MBPP = (  # mixtral
    "Here is a function in JavaScript to find the intersection of two arrays:\n\n```javascript\nfunction "
    "arrayIntersection(arr1, arr2) {\n    return arr1.filter(value => arr2.includes(value));\n}\n```"
)


def test_code_keys_ignore_names_docstrings_and_usage():
    same = (
        '```python\ndef drop_all(first, second) -> list:\n    """Remove what second holds."""\n'
        "    return [x for x in first if x not in second]\n```"
    )
    assert code_key(WIZARD_MBPP) == code_key(same) is not None
    assert "f(a0, a1)" in code_key(WIZARD_MBPP)
    assert code_key(CODELLAMA_MBPP) == "def f(a0, a1):\n    return list(set(a0) & set(a1))"
    assert code_key(CPP_MBPP) is None and code_key(JS_MBPP) is None  # not Python


def test_code_is_detected_from_the_query_or_the_answers():
    assert detect_kind("Write a function to find the intersection of two arrays.") is Kind.CODE
    assert detect_kind("Write a python function to count inversions in an array.") is Kind.CODE
    assert detect_kind("Intersection of two arrays?", [WIZARD_MBPP, CODELLAMA_MBPP]) is Kind.CODE


def test_spans_and_free_text():
    assert span_key("The Eiffel Tower.") == span_key("eiffel tower") == "eiffel tower"
    assert detect_kind("Which tower is in Paris?", ["The Eiffel Tower.", "Eiffel tower"]) is Kind.SPAN
    essay = "Paris has many towers; the best known was built for the 1889 World's Fair by Gustave Eiffel."
    assert detect_kind("Tell me about Paris.", [essay]) is Kind.TEXT
    assert answer_key(essay, Kind.TEXT) is None


def test_agreement_counts_keys_and_ignores_answers_without_one():
    keys = [answer_key(a, Kind.CHOICE, "ABCD") for a in ("C", "C\n", "D)", "Based on", "I do")]
    assert agreement(keys) == {"C": 2, "D": 1}


def test_form_flags_refusals_and_off_format_answers():
    refused = form("Unfortunately I cannot answer that.", None)
    assert refused.refusal and not refused.well_formed
    fine = form("C", "C")
    assert not fine.refusal and fine.well_formed and fine.hedges == 0
    assert len(fine.vector()) == 4
