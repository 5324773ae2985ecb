"""The code sandbox (router/code_behaviour.py) against what an answer could do to the process that runs
it, each fix checked by what it promises:

1. an answer cannot read this process's environment (the workers' API keys): as root it runs as
   nobody; not as root, this process is non-dumpable;
2. nothing an answer forks outlives the run, and a process holding the result pipe does not make the
   run wait for its timeout;
3. harvesting inputs (in this process, not the child) is bounded and never raises;
4. outputs that differ after their first 300 characters give different behaviour keys;
5. an answer cannot forge its grade: by writing a result of its own, by rebinding what the harness
   uses, or by returning an object equal to everything;
6. the process limit holds for the answers (it would not for root).

Every child here is real; the one stand-in is the small child of (2), run through the sandbox's own
exchange because no answer may fork.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from router.code_behaviour import (
    OUTPUT_CHARS,
    SANDBOX_UID,
    _results,
    behaviour_keys,
    harvest_inputs,
    run_behaviour,
)
from router.grading import grade_code

ROOT = Path(__file__).resolve().parent.parent
AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not AS_ROOT, reason="the answers run as nobody only when this process is root"
)


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def _only_output(source: str, args: tuple[object, ...] = ()) -> str:
    [behaviour] = run_behaviour([source], [repr(args)], timeout_s=60.0, per_call_s=20.0)
    assert behaviour is not None, "the child died"
    return behaviour.outputs[0]


# ---- 1. the environment of the process that runs the sandbox ---------------------------------------
@needs_root
def test_as_root_the_answers_run_as_nobody_without_groups() -> None:
    source = "import os\ndef ids():\n    return (os.getresuid(), os.getresgid(), os.getgroups())"
    nobody = (SANDBOX_UID,) * 3
    assert _only_output(source) == repr((nobody, nobody, []))


@needs_root
def test_as_root_an_answer_cannot_read_this_processs_environment() -> None:
    source = (
        "import os\ndef leak(parent):\n"
        "    assert os.getppid() == parent\n"
        "    return open(f'/proc/{parent}/environ', 'rb').read()"
    )
    assert _only_output(source, (os.getpid(),)) == "!PermissionError"


@needs_root
def test_as_root_the_answers_own_directory_is_writable_and_imports_work() -> None:
    source = (
        "import heapq, math, os\ndef scratch():\n"
        "    open('scratch.txt', 'w').write('x')\n"
        "    return (os.listdir('.'), heapq.nsmallest(1, [3, 1]), math.isqrt(9))"
    )
    assert _only_output(source) == "(['scratch.txt'], [1], 3)"


@needs_root
def test_as_root_an_answer_imports_submodules_of_packages_loaded_before_the_switch() -> None:
    """collections, encodings … were imported by the child as root; their search paths must follow it
    to nobody, or the many MBPP answers that start `from typing import List` fail as a whole."""
    source = (
        "from typing import List\nfrom collections.abc import Iterable\nimport dataclasses, json\n"
        "def f(xs: List[int]):\n"
        "    return (isinstance(xs, Iterable), json.dumps(dataclasses.asdict(dataclasses.make_dataclass('P', ['x'])(1))))"
    )
    assert _only_output(source, ([1],)) == repr((True, '{"x": 1}'))


DRIVER = r"""
import json, os, sys, types
# router/__init__ imports the ML stack; the sandbox needs only router.code_behaviour and router.answers.
package = types.ModuleType("router")
package.__path__ = [os.path.join(sys.argv[1], "router")]
sys.modules["router"] = package
from router.code_behaviour import run_behaviour

marker = os.environ["POLYROUTE_FAKE_SECRET"]
own = marker.encode() in open("/proc/self/environ", "rb").read()
source = "import os\ndef leak(marker):\n    return marker.encode() in open(f'/proc/{os.getppid()}/environ', 'rb').read()"
[behaviour] = run_behaviour([source], [repr((marker,))], timeout_s=60.0, per_call_s=20.0)
outputs = None if behaviour is None else list(behaviour.outputs)
print(json.dumps({"uid": os.getuid(), "own": own, "outputs": outputs}))
"""
NOBODY = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def _interpreter_nobody_can_run() -> str | None:
    """An interpreter (3.11+, for -P) that uid 65534 can start and that can read this checkout."""
    check = f"import sys; open({str(ROOT / 'router' / 'code_behaviour.py')!r}).close(); sys.exit(sys.version_info < (3, 11))"
    for exe in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if exe is None:
            continue
        try:
            done = subprocess.run([exe, "-c", check], cwd="/", capture_output=True, timeout=120, **NOBODY)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return exe
    return None


def test_not_as_root_an_answer_cannot_read_the_environment_of_the_process_that_runs_it() -> None:
    """The non-root path: a driver that is not root (as root: run as uid 65534) holds a fake key in its
    environment and runs an answer that reads its parent's /proc environ."""
    if AS_ROOT:
        exe = _interpreter_nobody_can_run()
        if exe is None:
            pytest.skip("no Python 3.11+ that uid 65534 can run and that can read this checkout")
        switch = NOBODY
    else:
        exe, switch = sys.executable, {}
    marker = "sk-fake-" + os.urandom(8).hex()
    done = subprocess.run(
        [exe, "-c", DRIVER, str(ROOT)],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "POLYROUTE_FAKE_SECRET": marker},
        capture_output=True,
        text=True,
        timeout=300,
        **switch,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid"] == (SANDBOX_UID if AS_ROOT else os.getuid())
    assert seen["own"], "the fake key is not in the driver's environment: the test proves nothing"
    assert seen["outputs"] == ["!PermissionError"]


# ---- 2. nothing outlives the run --------------------------------------------------------------------
FORKS = r"""
import json, os, sys, time
nonce = sys.stdin.buffer.read().partition(b"\n")[0]
pid = os.fork()
if pid == 0:
    if sys.argv[1] == "closes":
        os.close(1)
    time.sleep(600)
    os._exit(0)
os.write(1, nonce + b"\n" + json.dumps({"results": [pid]}).encode())
os._exit(0)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _ended(pid: int, within_s: float = 60.0) -> bool:
    """Whether `pid` is gone, waiting for the kill to land (generously: the machine may be loaded)."""
    deadline = time.monotonic() + within_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("pipe", ["holds", "closes"])
def test_the_run_ends_with_the_child_and_what_it_forked_is_killed(pipe: str) -> None:
    """The child forks a process (holding its stdout, or not) and exits by itself: the run still gets
    its result (not the timeout's None: it waits for the child, not for the pipe) and the forked
    process is killed with the child's group."""
    results = _results({}, timeout_s=300.0, command=(sys.executable, "-c", FORKS, pipe))
    assert results is not None and len(results) == 1
    (pid,) = results
    try:
        assert _ended(pid), f"process {pid}, forked by the child, outlived the run"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


# ---- 3. harvesting is bounded and never raises ----------------------------------------------------
def test_a_long_argument_is_skipped_and_the_rest_harvested() -> None:
    answer = fenced("def f(x):\n    return x\nf(" + "+".join(["1"] * 300) + ")\nf(" + "-" * 400 + "1)\nf(2)")
    assert harvest_inputs("assert f(1) == 1", [answer]) == ["(1,)", "(2,)"]


@pytest.mark.parametrize(
    "body",
    [
        "f(" + "[" * 90 + "]" * 90 + ")",  # deeper than the harvest reads
        "\n".join("f(" * 150 + "0" + ")" * 150 for _ in range(20)),  # nested calls
        "a = [0]\n" + "\n".join(f"a = [a, a]\nf(a, {i})" for i in range(60)),  # doubling literals
        "f(" + " + ".join(["x"] * 5000) + ")",
    ],
)
def test_harvesting_never_raises(body: str) -> None:
    found = harvest_inputs("Write f.", [fenced("def f(x, y=0):\n    return x\n" + body)], limit=10_000)
    assert all(len(args) <= 2000 for args in found)


def test_a_name_used_many_times_is_not_expanded_in_memory() -> None:
    """The auditor's 6.6 KB answer: 1,600 uses of a 2,000-character list (11 s and 430 MB before)."""
    answer = fenced(
        "def f(x):\n    return x\n\na = ["
        + ", ".join(["0"] * 600)
        + "]\nf(["
        + ", ".join(["a"] * 1600)
        + "])"
    )
    tracemalloc.start()
    try:
        found = harvest_inputs("Write a python function f.", [answer])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == []
    assert peak < 50 << 20, f"harvesting took {peak >> 20} MB"


def test_names_are_still_resolved() -> None:
    answer = fenced(
        "def f(a, b):\n    return 1\nx = [1, 2]\ny = (x, {'k': x})\nf(x, 5)\nf(y, -1)\nf()\n"
        "if __name__ == '__main__':\n    z = 'q'\n    f(z, x)"
    )
    assert harvest_inputs("assert f([1, 2], 3) == 4", [answer]) == [
        "([1, 2], 3)",
        "([1, 2], 5)",
        "(([1, 2], {'k': [1, 2]}), -1)",
        "()",
        "('q', [1, 2])",
    ]


# ---- 4. behaviour keys see whole outputs ------------------------------------------------------------
def test_outputs_that_differ_after_300_characters_get_different_keys() -> None:
    query = "Write a python function f(n) returning list(range(n)).\nassert f(200) == list(range(200))"
    right = fenced("def f(n):\n    return list(range(n))")
    wrong = fenced("def f(n):\n    return list(range(n - 1)) + [0]")
    keys, passes = behaviour_keys(query, [right, wrong], timeout_s=60.0)
    assert passes == [1.0, 0.0]
    assert keys[0] is not None and keys[0] != keys[1]


def test_a_long_output_is_whole_up_to_the_cap_then_its_start_and_a_digest() -> None:
    source = "def f(n, last):\n    return 'x' * (n - 1) + last"
    whole = _only_output(source, (1000, "x"))
    assert whole == repr("x" * 1000)
    long_a, long_b = (
        _only_output(source, (3 * OUTPUT_CHARS, "a")),
        _only_output(source, (3 * OUTPUT_CHARS, "b")),
    )
    assert long_a != long_b and long_a[:OUTPUT_CHARS] == long_b[:OUTPUT_CHARS]
    assert len(long_a) < OUTPUT_CHARS + 100


# ---- 5. forging a grade -----------------------------------------------------------------------------
TESTS = ["assert f() == 1", "assert f() == 2"]
FORGED = (
    'json.dumps({"results": [{"outputs": [], "passed": 2, "timed_out": [], "asserts": ["pass", "pass"]}]})'
)
FORGERS = {
    "writes a result and exits": f"import json, os\ndef f():\n    return 0\nos.write(3, {FORGED}.encode())\nos._exit(0)",
    "writes a result and goes on": f"import json, os\ndef f():\n    return 0\nos.write(3, {FORGED}.encode())",
    "reads __main__.job": (
        "import __main__, json, os\ndef f():\n    return 0\nn = len(__main__.job['asserts'])\n"
        "os.write(3, json.dumps({'results': [{'outputs': [], 'passed': n}]}).encode())\nos._exit(0)"
    ),
    "rebinds exec": "import builtins\ndef f():\n    return 0\nbuiltins.exec = lambda *args, **kwargs: None",
    "rebinds the timer": "import __main__\ndef f():\n    return 0\n__main__.guarded = lambda fn, seconds: None",
    "patches json": f"import json\ndef f():\n    return 0\n_real = json.dumps\njson.dumps = lambda *a, **k: _real({FORGED[11:-1]})",
    "is equal to everything": "class Yes:\n    def __eq__(self, other):\n        return True\ndef f():\n    return Yes()",
    "is an int equal to everything": "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef f():\n    return Yes(7)",
}


@pytest.mark.parametrize("answer", FORGERS.values(), ids=FORGERS.keys())
def test_an_answer_cannot_forge_its_grade(answer: str) -> None:
    assert grade_code(fenced(answer), TESTS, timeout_s=60.0, per_call_s=20.0).score == 0.0


def test_containers_of_objects_equal_to_everything_fail() -> None:
    answer = "class Yes:\n    def __eq__(self, other):\n        return True\ndef f():\n    return [Yes(), {'k': Yes()}]"
    assert grade_code(fenced(answer), ["assert f() == [1, {'k': 2}]"], timeout_s=60.0).score == 0.0


RIGHT_BY_PYTHONS_EQUALITY = {
    "Counter for a dict": (
        "from collections import Counter\ndef f():\n    return Counter('aab')",
        "{'a': 2, 'b': 1}",
    ),
    "OrderedDict": (
        "from collections import OrderedDict\ndef f():\n    return OrderedDict(b=1, a=2)",
        "{'a': 2, 'b': 1}",
    ),
    "defaultdict": (
        "from collections import defaultdict\ndef f():\n    d = defaultdict(list)\n    d[1].append(2)\n    return d",
        "{1: [2]}",
    ),
    "namedtuple for a tuple": (
        "from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
        "(1, 2)",
    ),
    "float for an int": ("def f():\n    return 5.0", "5"),
    "bool for an int": ("def f():\n    return True", "1"),
    "IntEnum": ("from enum import IntEnum\nclass C(IntEnum):\n    A = 3\ndef f():\n    return C.A", "3"),
    "str subclass": ("class S(str):\n    pass\ndef f():\n    return S('ab')", "'ab'"),
    "set for a set": ("def f():\n    return {3, 1}", "{1, 3}"),
    "frozenset of tuples": ("def f():\n    return frozenset({(1, 2)})", "{(1, 2)}"),
    "nested": (
        "def f():\n    return [(1, 'a'), {'k': [None, 2.5, b'x']}]",
        "[(1, 'a'), {'k': [None, 2.5, b'x']}]",
    ),
}


@pytest.mark.parametrize(
    "source, expected", RIGHT_BY_PYTHONS_EQUALITY.values(), ids=RIGHT_BY_PYTHONS_EQUALITY.keys()
)
def test_results_equal_by_builtin_equality_still_pass(source: str, expected: str) -> None:
    tests = [f"assert f() == {expected}", f"assert {expected} == f()", f"assert f() == {expected}, 'message'"]
    assert grade_code(fenced(source), tests, timeout_s=60.0, per_call_s=20.0).score == 1.0


# ---- 6. the process limit ---------------------------------------------------------------------------
BOUNDED_FORKS = """import os
def forks():
    made = 0
    for _ in range(20):  # bounded: even where the limit did not hold, 20 short-lived processes at most
        try:
            pid = os.fork()
        except OSError as exc:
            return (made, type(exc).__name__)
        if pid == 0:
            os._exit(0)
        made += 1
        os.waitpid(pid, 0)
    return (made, None)
"""


def test_the_process_limit_holds_for_the_answers() -> None:
    """As root the limit is ignored by the kernel; the answers run as nobody, where it applies."""
    assert _only_output(BOUNDED_FORKS) == "(0, 'BlockingIOError')"
