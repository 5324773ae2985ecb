"""Code answers compared by behaviour, on RouterBench MBPP answers as the data has them and on hostile
answers (loops, exits, prints, memory and recursion bombs) that must only spoil their own key."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from router.answers import code_key
from router.code_behaviour import (
    Behaviour,
    behaviour_keys,
    behaviour_keys_async,
    harvest_inputs,
    prompt_asserts,
    run_behaviour,
    run_behaviour_async,
)

REMOVE_PROMPT = "Write a function to remove all elements from a given list present in another list."
FENCED = (
    "Here's a Python function ...\n\n```python\ndef remove_elements_from_list(main_list, elements_to_remove):\n"
    "    return [element for element in main_list if element not in elements_to_remove]\n\n# Example usage\n"
    "main_list = [1, 2, 3, 4, 5]\nelements_to_remove = [2, 4]\n"
    "result = remove_elements_from_list(main_list, elements_to_remove)\nprint(result)  # Output: [1, 3, 5]\n```"
)
TAGGED = (
    " \n[PYTHON]\ndef remove_elements(list1, list2):\n    return [x for x in list1 if x not in list2]\n[/PYTHON]\n"
    "[TESTS]\n# Test case 1:\nassert remove_elements([1, 2, 3, 4, 5, 6], [1, 2]) == [3, 4, 5, 6]\n"
    "# Test case 2:\nassert remove_elements([1, 2, 3], [4, 5]) == [1, 2, 3]\n# Test case 3:\nassert remove_el...[/TESTS]\n"
)
BUGGY = "```python\ndef remove(a, b):\n    return [x for x in a if x in b]\n```"
JS = "```js\nfunction removeElements(a, b) { return a.filter(x => !b.includes(x)); }\nremove_elements([9], [9]);\n```"

SIMILAR_PROMPT = (
    "Write a function to find the similar elements from the given two tuple lists.\n"
    "Your code should pass these tests:\n\n"
    "assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)\n"
    "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)\n"
    "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"
)
SIMILAR_INPUTS = [
    "((3, 4, 5, 6), (5, 7, 4, 10))",
    "((1, 2, 3, 4), (5, 4, 3, 7))",
    "((11, 12, 14, 13), (17, 15, 14, 13))",
]


def fenced(code: str) -> str:
    return f"Sure:\n\n```python\n{code}\n```\n"


# ---- harvesting -----------------------------------------------------------------------------------
def test_inputs_from_an_assignment_then_call_example() -> None:
    assert harvest_inputs(REMOVE_PROMPT, [FENCED]) == ["([1, 2, 3, 4, 5], [2, 4])"]


def test_inputs_from_tests_blocks_even_truncated() -> None:
    assert harvest_inputs(REMOVE_PROMPT, [TAGGED]) == ["([1, 2, 3, 4, 5, 6], [1, 2])", "([1, 2, 3], [4, 5])"]


def test_inputs_from_the_prompts_asserts_come_first_and_are_deduplicated() -> None:
    answer = fenced(
        "def common(a, b):\n    return a\n\nprint(common((3, 4, 5, 6), (5, 7, 4, 10)))\nprint(common((1,), ()))"
    )
    assert harvest_inputs(SIMILAR_PROMPT, [answer]) == [*SIMILAR_INPUTS, "((1,), ())"]
    assert harvest_inputs(SIMILAR_PROMPT, [], limit=2) == SIMILAR_INPUTS[:2]


def test_only_literal_positional_arguments_to_main_functions_count() -> None:
    code = (
        "def f(a, b=0):\n    return a\n\n"
        "x = [1]\nprint(f(x, 2))\n"  # resolved: ([1], 2)
        "x = g()\nprint(f(x, 3))\n"  # x no longer a literal
        "print(f([5], b=1))\n"  # keyword: skipped
        "print(f(*[6, 7]))\n"  # starred: skipped
        "print(len([8]), f(list(range(3)), 9))\n"  # not a literal
        f"print(f({list(range(1000))}, 10))\n"  # longer than 2,000 characters
        "print(other([11], 12))\n"  # not a main function
        "if __name__ == '__main__':\n    y = (13,)\n    f(y, {'k': None})\n"
    )
    assert harvest_inputs("", [fenced(code), JS]) == ["([1], 2)", "((13,), {'k': None})"]


def test_prompt_asserts_are_the_parseable_assert_lines() -> None:
    query = (
        SIMILAR_PROMPT
        + "\nassert similar_elements((1, 2), (2,) == (2,)\nassert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)"
    )
    assert prompt_asserts(query) == [
        line for line in SIMILAR_PROMPT.splitlines() if line.startswith("assert")
    ]
    assert prompt_asserts(REMOVE_PROMPT) == []


# ---- keys ---------------------------------------------------------------------------------------------
def test_equivalent_answers_share_a_key_a_buggy_one_does_not_and_javascript_has_none() -> None:
    keys, shares = behaviour_keys(REMOVE_PROMPT, [FENCED, TAGGED, BUGGY, JS])
    assert keys[0] is not None and keys[0] == keys[1]
    assert keys[2] is not None and keys[2] != keys[0]
    assert keys[3] is None
    assert shares == [None] * 4  # the prompt has no asserts


def test_prompt_asserts_pass_share_whatever_the_function_is_called() -> None:
    correct = fenced("def common_elements(t1, t2):\n    return tuple(sorted(set(t1) & set(t2)))")
    helper_first = fenced(
        "def to_set(x):\n    return set(x)\n\ndef similar_elements(a, b):\n    return tuple(sorted(to_set(a) & to_set(b)))"
    )
    union = fenced("def similar(t1, t2):\n    return tuple(sorted(set(t1) | set(t2)))")
    constant = fenced("def similar_elements(a, b):\n    return (4, 5)")
    keys, shares = behaviour_keys(SIMILAR_PROMPT, [correct, helper_first, union, constant, JS])
    assert shares == [1.0, 1.0, 0.0, pytest.approx(1 / 3), None]
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3]}) == 3 and keys[4] is None


def test_without_inputs_the_key_is_the_canonical_code() -> None:
    answers = [fenced("def f(a):\n    return a + 1"), fenced("def g(b):\n    return b + 1"), JS]
    assert behaviour_keys("Write a function that adds one.", answers) == (
        [code_key(a) for a in answers],
        [None] * 3,
    )


HOSTILE = {
    "loop": "def remove(a, b):\n    while True:\n        pass",
    "exit_in_call": "import sys\ndef remove(a, b):\n    sys.exit(0)",
    "memory_bomb": "def remove(a, b):\n    return [0] * 10**10",
    "recursion_bomb": "def remove(a, b):\n    return remove(b, a)",
    "no_function": "class Remover:\n    pass",
}
STILL_RIGHT = {  # correct functions whose surroundings misbehave
    "exit_at_top": "import sys\ndef remove(a, b):\n    return [x for x in a if x not in b]\nsys.exit(3)",
    "prints": (
        "def remove(a, b):\n    print('{\"results\": []}' * 1000)\n    return [x for x in a if x not in b]\n"
        "print('garbage')\nimport sys\nsys.__stdout__.write('not json')"
    ),
    "shell": (
        "import os\ndef remove(a, b):\n    os.system('echo pwned; echo pwned >&2; sleep 31.7 &')\n"
        "    return [x for x in a if x not in b]"
    ),
    "loop_at_top": "def remove(a, b):\n    return [x for x in a if x not in b]\nwhile True:\n    pass",
    "wrong_example": "def remove(a, b):\n    return [x for x in a if x not in b]\nassert remove([1], []) == []",
}


def test_hostile_answers_spoil_only_their_own_key() -> None:
    syntax_error = fenced("def remove(a, b)\n    return a")
    huge = fenced("def remove(a, b):\n    return 'x' * 10**7")
    answers = [
        FENCED,
        *map(fenced, HOSTILE.values()),
        syntax_error,
        huge,
        *map(fenced, STILL_RIGHT.values()),
        TAGGED,
    ]
    keys, _ = behaviour_keys(REMOVE_PROMPT, answers)
    good = keys[0]
    assert good is not None and keys[-1] == good
    assert keys[1 : 2 + len(HOSTILE)] == [None] * (len(HOSTILE) + 1)
    assert keys[2 + len(HOSTILE)] not in (None, good)  # huge output: a behaviour of its own
    assert keys[3 + len(HOSTILE) : -1] == [good] * len(STILL_RIGHT)
    assert not _left_behind(b"31.7")  # nothing the answers spawned outlives the run


def _left_behind(marker: bytes, patience_s: float = 30.0) -> list[Path]:
    """Live processes whose command line holds ``marker``. SIGKILL is asynchronous: a killed process
    can be listed for a moment on a loaded machine, so this waits (bounded) for the list to empty;
    a process that was never killed (a `sleep 31.7`) is still there after it."""
    deadline = time.monotonic() + patience_s
    while True:
        alive = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker in _read(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def test_outputs_are_reprs_or_exception_names() -> None:
    sources = [
        "def f(a):\n    a.append(1)\n    return a",  # each call gets its own copy of the arguments
        "def f(a):\n    return 'x' * (1000 // len(a))",
        "def f(a=1 / 0):\n    return a",
        None,
    ]
    inputs = ["([],)", "([],)", "([2],)"]
    assert run_behaviour(sources, inputs) == [
        Behaviour(("[1]", "[1]", "[2, 1]"), None),
        Behaviour(("!ZeroDivisionError", "!ZeroDivisionError", repr("x" * 1000)), None),
        Behaviour(("!exec:ZeroDivisionError",) * 3, None),
        None,
    ]


def test_the_child_inherits_no_environment_and_runs_in_a_temporary_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POLYROUTE_TEST_SECRET", "s3cret")
    source = (
        "import os, sys\ndef f(name, here):\n"
        "    return (os.environ.get(name), os.environ['PATH'], os.getcwd() != here, os.listdir('.'), "
        "any('site-packages' in p for p in sys.path))"
    )
    [behaviour] = run_behaviour([source], [repr(("POLYROUTE_TEST_SECRET", os.getcwd()))])
    assert behaviour is not None and behaviour.outputs == ("(None, '/usr/bin:/bin', True, [], False)",)


SWALLOWS_TIMEOUTS = (  # catches the per-call timer's exception and loops on: only the whole timeout ends it
    "def remove(a, b):\n    n = 0\n    while True:\n        try:\n            while True:\n                n += 1\n"
    "        except BaseException:\n            pass"
)


def test_a_child_that_times_out_as_a_whole_gives_no_behaviour_and_keys_fall_back_to_code() -> None:
    answers = [FENCED, fenced(SWALLOWS_TIMEOUTS)]
    assert behaviour_keys(REMOVE_PROMPT, answers, timeout_s=1.0) == (
        [code_key(a) for a in answers],
        [None, None],
    )


# ---- async ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [REMOVE_PROMPT, SIMILAR_PROMPT])
def test_async_matches_sync(prompt: str) -> None:
    answers = [FENCED, TAGGED, BUGGY, JS, fenced(HOSTILE["loop"]), fenced("def s(a, b):\n    return (4, 5)")]
    assert asyncio.run(behaviour_keys_async(prompt, answers)) == behaviour_keys(prompt, answers)


def test_async_timeout_kills_the_child() -> None:
    sources = ["def remove(a, b):\n    return 1", SWALLOWS_TIMEOUTS]
    assert asyncio.run(run_behaviour_async(sources, ["(1, 2)"], timeout_s=1.0)) == [None, None]
