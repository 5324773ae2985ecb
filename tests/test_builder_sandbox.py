"""The builder's test run (router/compose/builder.run_tests) against what a worker's draft could do to
the gateway that runs it. The draft is worker-written code run as a program, so it gets the code
sandbox's child (router/code_behaviour.run_script), and each test checks one thing that promises:

1. the draft cannot see the gateway's secrets: not in its own environment, not in its parent's;
2. as root, the draft runs as nobody;
3. nothing the draft forks outlives the run;
4. passing and failing tests still report as they did: "all tests passed", or the last line of the
   traceback (the timeout is tests/test_compose_gateway.py's).

Every run here is real: the drafts run in the sandbox child, nothing stands in for it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from router.code_behaviour import SANDBOX_UID
from router.compose import run_tests
from router.compose.builder import extract_code
from tests.test_sandbox_hardening import _ended, _running

AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="the draft runs as nobody only when this process is root")
TIMEOUT_S = 60.0  # generous: the machine may be busy; none of these drafts comes near it


def _run(code: str, tests: str) -> tuple[bool, str]:
    return asyncio.run(run_tests(code, tests, timeout_s=TIMEOUT_S))


# ---- 1. the gateway's secrets ----------------------------------------------------------------------
def test_a_draft_cannot_see_a_secret_in_the_gateways_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's API key in this process's environment (this process is the draft's parent, as the
    gateway is): the draft finds it neither in os.environ nor in /proc/<its parent>/environ, which it
    may not read at all (as root it is nobody; else this process is non-dumpable)."""
    secret = "sk-fake-" + os.urandom(8).hex()
    monkeypatch.setenv("POLYROUTE_FAKE_WORKER_KEY", secret)
    tests = (
        f"assert os.getppid() == {os.getpid()}, 'not run by this process: the test proves nothing'\n"
        f"assert {secret!r} not in repr(dict(os.environ)), 'the secret is in the environment'\n"
        "try:\n"
        "    parent = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
        "except PermissionError:\n"
        "    parent = None\n"
        f"assert parent is None or {secret.encode()!r} not in parent, 'the secret is in the parent environ'\n"
        "assert parent is None, 'the parent environ is readable'\n"
    )
    passed, report = _run("import os", tests)
    assert passed, report
    assert secret not in report


# ---- 2. who runs the draft -------------------------------------------------------------------------
@needs_root
def test_as_root_the_draft_runs_as_nobody_without_groups() -> None:
    nobody = (SANDBOX_UID,) * 3
    tests = f"assert (os.getresuid(), os.getresgid(), os.getgroups()) == ({nobody!r}, {nobody!r}, []), os.getresuid()"
    passed, report = _run("import os", tests)
    assert (passed, report) == (True, "all tests passed")


# ---- 3. nothing outlives the run -------------------------------------------------------------------
FORKS_A_SLEEPER = """
import os, time
try:
    pid = os.fork()
except OSError:  # the sandbox's process limit: nothing to leave behind
    pid = None
if pid == 0:  # the sleeper lets go of the run's pipes, so nothing but a kill ends it early
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    time.sleep(120)
    os._exit(0)
"""


def test_a_sleeper_the_draft_forks_does_not_outlive_the_run() -> None:
    """The draft forks a sleeper and exits, reporting its pid: once run_tests returns, no such process
    runs (here the process limit refuses the fork; the process-group kill would end it otherwise)."""
    passed, report = _run(FORKS_A_SLEEPER, "raise SystemExit(f'forked {pid}')")
    assert not passed and report.startswith("forked "), report
    pid = report.removeprefix("forked ")
    if pid == "None":
        return  # refused: nothing was forked
    try:
        assert _ended(int(pid)), f"process {pid}, forked by the draft, outlived the run"
    finally:
        if _running(int(pid)):
            os.kill(int(pid), signal.SIGKILL)


# ---- 4. the report -----------------------------------------------------------------------------------
ADD = "def add(a, b):\n    return a + b"
UNITTEST = (
    "import unittest\n\nclass Add(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(add(2, 2), 5)\n\nunittest.main()"
)
TYPED = (
    "from collections.abc import Iterable\nfrom dataclasses import dataclass\n\n@dataclass\nclass Box:\n"
    "    items: list[int]\n\ndef total(box: Box) -> int:\n    return sum(box.items)"
)


@pytest.mark.parametrize(
    ("code", "tests", "expected"),
    [
        (ADD, "assert add(2, 3) == 5", (True, "all tests passed")),
        (ADD, "assert add(2, 3) == 6", (False, "AssertionError")),
        (ADD, "assert minus(3, 2) == 1", (False, "NameError: name 'minus' is not defined")),
        (ADD, "assert add(2, 3) == 5 +", (False, "SyntaxError: invalid syntax")),
        (ADD, UNITTEST, (False, "FAILED (failures=1)")),  # unittest's summary is its last stderr line
        (ADD, "import sys\nsys.stderr.write('\\n')\nsys.exit(1)", (False, "tests failed")),  # blank stderr
        (TYPED, "assert total(Box([1, 2])) == 3", (True, "all tests passed")),  # stdlib packages import
    ],
)
def test_passing_and_failing_tests_report_as_before(
    code: str, tests: str, expected: tuple[bool, str]
) -> None:
    assert _run(code, tests) == expected


@pytest.mark.parametrize(
    "draft",
    [
        "Here it is:\n```python3\ndef add(a, b):\n    return a + b\n```\nDone.",
        "Here it is:\r\n```Python\r\ndef add(a, b):\r\n    return a + b\r\n```\r\n",
        "Two parts:\n```py\ndef half(a):\n    return a / 2\n```\nand\n```\ndef add(a, b):\n    return a + b\n```",
    ],
)
def test_the_code_of_a_fenced_draft_is_what_runs(draft: str) -> None:
    """The builder runs the draft's fenced code, read as every answer reader reads a fence (a
    `python3` tag, a capital, CRLF lines). Its own pattern missed the first two and ran the prose."""
    assert _run(extract_code(draft), "assert add(2, 3) == 5") == (True, "all tests passed")
