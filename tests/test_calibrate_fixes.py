"""`polyroute router calibrate`: the defects an audit reproduced, each pinned end to end.

The CLI runs as a user runs it (a subprocess) against the test upstream (tests/fakes, a real HTTP
server on loopback; a subclass of it below answers 200 with odd bodies), the ledger and the router
store are read back from disk, signals are real signals to the real process. Nothing here waits on
a clock: runs that must stop are stopped by a signal once the upstream has seen what the test waits
for, with generous deadlines.

1. the cost cap: holds scaled by what a worker was billed, one unmeasured call in flight per run,
   and a run that passes its cap anyway says so;
2. numbers: `**Answer**: 7` is the marked answer, `1\\,234` one number;
3. Ctrl-C while a code answer is graded: the paid call is recorded, the exit does not wait the test
   run's timeout;
4. SIGTERM stops the run as Ctrl-C does, with the same records;
5. a hanging worker does not stall the others;
6. "gave up after five failures in a row" is five, whatever the concurrency;
7. a 200 without answer text is a failed call; one without usage is booked at its hold;
8. a rerun updates a calibrated worker's output-token figure;
9. the dry run's estimate is the holds' prediction, and the policy's exclusions are planned out;
10. a closing option line and code split over fenced blocks are graded as written;
11. a rerun with nothing new keeps the version in force (so `router rollback` undoes calibration).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from starlette.responses import JSONResponse

from gateway.store import to_micros
from policies import DEFAULT_POLICY_PATH, parse_catalog, predicted_cost
from policies.cost import token_chars
from polyroute.calibrate import estimate, graded_pairs, make_plan
from router.answers import choice_key, python_source
from router.grading import grade
from router.probes import Probe, load_probes
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for
from tests.fakes.server import serve_in_thread
from tests.fakes.upstream import FakeUpstream
from tests.test_calibrate import (
    PROBES,
    RIGHT,
    ROOT,
    calibrate,
    calibrate_command,
    ledger,
)

DEADLINE_S = 120.0  # for what a loaded 2-core machine does in a few seconds


@pytest.fixture
def setup(tmp_path: Path, upstream) -> dict:
    """tests/test_calibrate.py's: a data dir, the test upstream's catalog (cheap FR, mid CN, pricey
    US, nokey without its key) and a probe file (that module's eight probes, unless a test writes
    its own)."""
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(catalog_yaml_for(upstream.url))
    probe_file = tmp_path / "probes.jsonl"
    probe_file.write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    return {"data_dir": tmp_path / "data", "workers_file": workers_file, "probe_file": probe_file}


def write_probes(setup: dict, probes: list[dict]) -> None:
    setup["probe_file"].write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in probes))


def spent_micros(setup: dict, worker: str | None = None) -> int:
    return sum(
        r.get("cost_micros") or 0
        for r in ledger(setup)
        if r["type"] == "request" and (worker is None or r["model"] == worker)
    )


def said(done: subprocess.CompletedProcess[str] | str) -> str:
    text = done if isinstance(done, str) else done.stderr
    return " ".join(text.split())


def start(setup: dict, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command, environment = calibrate_command(setup, *args, env=env)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT
    )


def wait_for(condition, proc: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S:g} s"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def choice_probes(n: int, prefix: str = "c", max_tokens: int = 16) -> list[dict]:
    """`n` choice probes whose prompts are all as long (each marked "[cNN]")."""
    return [
        {
            "id": f"{prefix}{i:02d}",
            "task": "t-choice",
            "type": "choice",
            "source": "test",
            "prompt": f"[{prefix}{i:02d}] Which one is right?\nA) this one\nB) that one\n\nAnswer with a letter.",
            "gold": "B",
            "max_tokens": max_tokens,
        }
        for i in range(n)
    ]


# ---- 1. the cost cap ------------------------------------------------------------------------------
def test_a_workers_holds_scale_with_what_its_answers_were_billed(setup, upstream):
    """The prediction counts four characters a token; this worker bills two ("a a a …" is a token a
    word). Its first answer shows it, so the second call, a long prompt, is held at what it will
    cost and does not start: it used to be held at max(prediction, the first call's cost), an
    amount and not a rate, and the run spent $0.10 under a $0.08 cap."""
    short = "a " * 100 + "\nA) x\nB) y\nAnswer with the letter."
    long = "a " * 20000 + "\nWhat is 1+1?"
    write_probes(
        setup,
        [
            {
                "id": "c-short",
                "task": "t1",
                "type": "choice",
                "source": "test",
                "prompt": short,
                "gold": "A",
                "max_tokens": 1,
            },
            {
                "id": "n-long",
                "task": "t2",
                "type": "number",
                "source": "test",
                "prompt": long,
                "gold": "2",
                "max_tokens": 1,
            },
        ],
    )
    upstream.behave("pricey-model", text="A")  # usage: the prompt's words, one output token
    done = calibrate(
        setup, "--workers", "pricey", "--probes", "2", "--max-cost-usd", "0.08", "--concurrency", "1"
    )
    assert done.returncode == 0, done.stderr
    assert len(upstream.requests_for("pricey-model")) == 1
    assert 0 < spent_micros(setup) <= 80_000
    assert "stopped at the cost cap" in said(done) and "raise --max-cost-usd to go on" in said(done)


def test_one_unmeasured_call_in_flight_per_run_keeps_the_cap(setup, upstream):
    """Three workers that each bill 2,000 prompt tokens for a ~25-token prompt (80 times the
    prediction). One call of a worker that has not answered yet runs at a time in the whole run, and
    a worker that has not answered is held at the rate the run's answers were billed: the cap holds.
    With one such call per worker, the first calls of all three ran at once and spent four times a
    $0.003 cap."""
    write_probes(setup, choice_probes(8))
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, text="B", prompt_tokens=2000, completion_tokens=1, latency_s=0.3)
    done = calibrate(
        setup,
        "--workers",
        "cheap,mid,pricey",
        "--probes",
        "8",
        "--max-cost-usd",
        "0.003",
        "--concurrency",
        "4",
    )
    assert done.returncode == 0, done.stderr
    assert "stopped at the cost cap" in said(done)
    assert 0 < spent_micros(setup) <= 3000
    assert upstream.requests_for("pricey-model") == []  # $0.01 a call: held at that, it never fit
    assert "more than its cap" not in said(done)


def test_a_run_that_passes_its_cap_says_so(setup, upstream):
    """A worker's first answer is the one the cap cannot see coming (nothing measured it yet): when it
    takes the spend over the cap, the progress bar and the last lines say so."""
    write_probes(setup, choice_probes(4))
    upstream.behave("pricey-model", text="B", prompt_tokens=2000, completion_tokens=1)
    done = calibrate(
        setup, "--workers", "pricey", "--probes", "4", "--max-cost-usd", "0.003", "--concurrency", "1"
    )
    assert done.returncode == 0, done.stderr
    assert spent_micros(setup) == 10_015  # one call: 2,000 tokens in, 1 out
    assert len(upstream.requests_for("pricey-model")) == 1
    assert "(over the cap)" in said(done)
    assert "warning: this run spent $0.0100, more than its cap of $0.0030" in said(done)


# ---- 2 and 10. grading as workers write ---------------------------------------------------------------
NUMBER = Probe(id="n", task="t", type="number", source="s", prompt="?", gold="7", max_tokens=256)
BIG = Probe(id="n2", task="t", type="number", source="s", prompt="?", gold="1234", max_tokens=256)
PLANET = Probe(
    id="c",
    task="t",
    type="choice",
    source="s",
    prompt="Which planet is largest?\nA) Mars\nB) Venus\nC) Jupiter\nD) Mercury",
    gold="C",
    max_tokens=64,
)
ADD = Probe(
    id="k",
    task="t",
    type="code",
    source="s",
    prompt="add",
    tests=["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
    max_tokens=256,
)


@pytest.mark.parametrize(
    ("probe", "answer", "score", "read"),
    [
        (NUMBER, "3 + 4 = 7.\n\n**Answer**: 7 apples (3 + 4)", 1.0, "7"),
        (NUMBER, "__Answer__: 7 (3 + 4)", 1.0, "7"),
        (NUMBER, "**Final Answer**: 7 apples, since 3 + 4 = 7 and I checked with 2 + 5.", 1.0, "7"),
        (NUMBER, "**Answer**: 6 (not 7)", 0.0, "6"),  # a wrong marked answer is wrong
        (NUMBER, "Answer — 7 apples (3 + 4)", 1.0, "7"),
        (BIG, "1000 + 234 = $1\\,234$.\n\nAnswer: $1\\,234$", 1.0, "1234"),
        (BIG, "The total is 1\u202f234 apples.", 1.0, "1234"),
        (BIG, "\\boxed{1\\,234}", 1.0, "1234"),
        (PLANET, "The largest planet is Jupiter.\n\n**C) Jupiter**", 1.0, "C"),
        (PLANET, "Mars is small and Venus too.\n\n(C) Jupiter", 1.0, "C"),
        (PLANET, "Let me compare them.\n\nA) Mars\nB) Venus\nC) Jupiter", 0.0, None),  # a listing
        (PLANET, "(A) or (C)", 0.0, None),
    ],
)
def test_numbers_and_options_are_read_as_workers_write_them(probe, answer, score, read):
    graded = grade(probe, answer)
    assert (graded.score, graded.extracted) == (score, read)


@pytest.mark.parametrize(
    "answer",
    [
        "First a helper:\n```python\ndef _is_int(x):\n    return isinstance(x, int)\n```\n"
        "Then the function:\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\nimport operator\n```\n```python\ndef add(a, b):\n    return operator.add(a, b)\n```",
        "```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```python\nprint(add(int(input()), 2))\n```",
    ],
)
def test_code_split_over_fenced_blocks_is_graded_whole(answer):
    assert grade(ADD, answer).score == 1.0


def test_the_planners_readers_are_unchanged():
    """The grading-side readers sit on top of router/answers.py, whose readers the live planner and
    the offline evaluation use (their figures and code-run cache depend on them as they are)."""
    assert choice_key("The largest planet is Jupiter.\n\nC) Jupiter", "ABCD") is None
    split = "```python\nimport operator\n```\n```python\ndef add(a, b):\n    return operator.add(a, b)\n```"
    assert python_source(split) == "def add(a, b):\n    return operator.add(a, b)"


def test_odd_but_right_answers_are_graded_right_through_the_cli(setup, upstream):
    """The answers above, from a worker through the CLI into the ledger: right ones score 1 (they
    scored 0: the bold marker was missed and the last number read, 1\\,234 read as 1, the closing
    option line and the split code not read) and a wrong marked answer 0 (it scored 1)."""
    write_probes(
        setup,
        [
            {
                "id": "n-apples",
                "task": "tn",
                "type": "number",
                "source": "test",
                "prompt": "[q1] Tom has 3 apples and buys 4. How many?",
                "gold": "7",
                "max_tokens": 256,
            },
            {
                "id": "n-big",
                "task": "tn",
                "type": "number",
                "source": "test",
                "prompt": "[q2] What is 1000 + 234?",
                "gold": "1234",
                "max_tokens": 256,
            },
            {
                "id": "c-planet",
                "task": "tc",
                "type": "choice",
                "source": "test",
                "prompt": "[q3] " + PLANET.prompt,
                "gold": "C",
                "max_tokens": 64,
            },
            {
                "id": "k-add",
                "task": "tk",
                "type": "code",
                "source": "test",
                "prompt": "[q4] Write add(a, b).",
                "tests": list(ADD.tests),
                "max_tokens": 256,
            },
        ],
    )
    upstream.behave(
        "cheap-model",
        text="?",
        replies={
            "[q1]": "3 + 4 = 7.\n\n**Answer**: 7 apples (3 + 4)",
            "[q2]": "1000 + 234 = $1\\,234$.\n\nAnswer: $1\\,234$",
            "[q3]": "The largest planet in the solar system is Jupiter.\n\n**C) Jupiter**",
            "[q4]": "A helper first:\n```python\ndef _is_num(x):\n    return isinstance(x, (int, float))\n```\n"
            "And the function:\n```python\ndef add(a, b):\n    return a + b\n```",
        },
    )
    upstream.behave("mid-model", text="?", replies={"[q1]": "**Answer**: 6 (not 7)"})
    done = calibrate(setup, "--workers", "cheap,mid", "--probes", "4")
    assert done.returncode == 0, done.stderr
    grades = {key: g.score for key, g in graded_pairs(ledger(setup)).items()}
    assert grades == {
        ("cheap", "n-apples"): 1.0,
        ("cheap", "n-big"): 1.0,
        ("cheap", "c-planet"): 1.0,
        ("cheap", "k-add"): 1.0,
        ("mid", "n-apples"): 0.0,
        ("mid", "n-big"): 0.0,
        ("mid", "c-planet"): 0.0,
        ("mid", "k-add"): 0.0,
    }


# ---- 3 and 4. stopped by a signal ---------------------------------------------------------------------
_SANDBOX_FLAGS = ["-P", "-s", "-S", "-B"]  # how router/code_behaviour.py starts its sandbox children


def sandbox_children(pid: int) -> list[int]:
    """The code sandbox interpreters `pid` started (router/code_behaviour.py), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid and argv[1:5] == _SANDBOX_FLAGS:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the sandbox child in /proc")
def test_ctrl_c_while_a_code_answer_is_graded_records_the_paid_call_and_does_not_wait(setup, upstream):
    """The answer is in and its tests run in the sandbox (they would take an hour): Ctrl-C records
    the paid call (status 200, its cost, no grade: a rerun asks again), stops the test run and
    exits. It used to record nothing and wait for the test run's whole timeout."""
    write_probes(
        setup,
        [
            {
                "id": "k-slow",
                "task": "tk",
                "type": "code",
                "source": "test",
                "prompt": "[k1] Write add(a, b).",
                "tests": ["assert add(1, 2) == 3"],
                "grader": {"timeout_s": 3600, "per_call_s": 3600},
                "max_tokens": 256,
            }
        ],
    )
    upstream.behave(
        "cheap-model",
        text="```python\nimport time\n\ndef add(a, b):\n    time.sleep(3600)\n    return a + b\n```",
    )
    proc = start(setup, "--workers", "cheap", "--probes", "1")
    children: list[int] = []
    try:
        wait_for(
            lambda: children.extend(sandbox_children(proc.pid)) or children, proc, "test run of the answer"
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=DEADLINE_S)  # the test run alone would take an hour
        assert proc.returncode == 130, err
        assert "stopped by Ctrl-C" in said(err)
        deadline = time.monotonic() + DEADLINE_S
        while any(alive(child) for child in children):  # stopped with the run, not at its timeout
            assert time.monotonic() < deadline, "the sandbox child outlived the run"
            time.sleep(0.05)
    finally:
        stop(proc)
        for child in children:
            if alive(child):
                os.killpg(child, signal.SIGKILL)
    records = ledger(setup)
    (request,) = [r for r in records if r["type"] == "request"]
    assert request["worker"] == "cheap" and request["status"] == 200
    assert request["cost_micros"] > 0 and request["completion_tokens"] > 0
    assert "stopped while its answer was graded" in request["trace"]["calibration"]["error"]
    assert not [r for r in records if r["type"] == "feedback"] and graded_pairs(records) == {}


def test_sigterm_stops_the_run_as_ctrl_c_does(setup, upstream):
    """SIGTERM (timeout(1), systemd, Kubernetes) cancels the run: the call in flight is recorded as
    stopped, with the most it may cost, and the exit says so (143). It used to end the process at
    once (-15): sent calls, perhaps billed, left no trace."""
    upstream.behave("cheap-model", replies=RIGHT, text="?", latency_s=600)
    proc = start(setup, "--workers", "cheap", "--probes", "8", "--concurrency", "2")
    try:
        wait_for(lambda: upstream.requests_for("cheap-model"), proc, "call")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        stop(proc)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in said(err)
    stopped = [r for r in ledger(setup) if r["type"] == "request"]
    assert [r["status"] for r in stopped] == [499] * len(upstream.requests_for("cheap-model"))
    assert all(r["fallbacks"] == ["cheap"] for r in stopped)
    assert all("may cost up to $" in r["trace"]["calibration"]["error"] for r in stopped)


# ---- 5 and 6. a worker that hangs or fails ------------------------------------------------------------
def test_a_hanging_worker_does_not_stall_the_others(setup, upstream):
    """mid never answers; cheap answers at once. Every cheap probe is answered while mid's first
    call hangs: no lane waits behind mid. A lane used to wait on mid's gate while holding its place,
    and with both lanes there cheap stopped at its second probe."""
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    upstream.behave("mid-model", replies=RIGHT, text="?", latency_s=600)
    proc = start(setup, "--workers", "cheap,mid", "--probes", "8", "--concurrency", "2")
    try:
        wait_for(lambda: len(upstream.requests_for("cheap-model")) == 8, proc, "answer to every cheap probe")
        graded = lambda: len([r for r in ledger(setup) if r["type"] == "feedback" and r["worker"] == "cheap"])  # noqa: E731
        wait_for(lambda: graded() == 8, proc, "grades")
        assert len(upstream.requests_for("mid-model")) == 1  # still hanging
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=DEADLINE_S)
    finally:
        stop(proc)
    assert {p for w, p in graded_pairs(ledger(setup)) if w == "cheap"} == {p["id"] for p in PROBES}
    assert [r["status"] for r in ledger(setup) if r["type"] == "request" and r["model"] == "mid"] == [499]


def test_giving_up_on_a_failing_worker_takes_five_failures_at_any_concurrency(setup, upstream):
    """Calls that waited for the worker's first answer went out after it was given up: with eight
    lanes, eight failed calls where five are the limit."""
    write_probes(setup, choice_probes(20))
    upstream.behave("mid-model", status=500)
    done = calibrate(setup, "--workers", "mid", "--probes", "20", "--concurrency", "8")
    assert done.returncode == 1, done.stderr
    failed = [r for r in ledger(setup) if r["type"] == "request"]
    assert [r["status"] for r in failed] == [500] * 5
    assert "gave up on mid after 5 failed calls in a row" in said(done)
    assert "15 calls left for a rerun" in said(done)


# ---- 7. odd 200s --------------------------------------------------------------------------------------
ODD_BODIES = {
    "odd-nochoices": {"id": "x", "object": "chat.completion", "created": 1, "model": "m"},
    "odd-emptychoices": {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": []},
    "odd-nullcontent": {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 16, "total_tokens": 66},
    },
    "odd-nousage": {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "B"}, "finish_reason": "stop"}],
    },
}


class OddUpstream(FakeUpstream):
    """The test upstream, where models named odd-* answer 200 with the bodies above while `odd` is
    on, and as the unchanged test upstream after."""

    odd = True

    async def _answer(self, body, model):
        if self.odd and model in ODD_BODIES:
            self._behaviour(model).calls += 1
            return JSONResponse(ODD_BODIES[model])
        return await super()._answer(body, model)


@pytest.fixture
def odd(tmp_path: Path):
    fake = OddUpstream()
    running = serve_in_thread(fake.app)
    fake.url = running.url  # type: ignore[attr-defined]
    extra = "".join(
        f"""
  - name: {name.removeprefix("odd-")}
    model: openai/{name}
    api_base: {running.url}/v1
    api_key_env: {FAKE_KEY_ENV}
    context_window: 8192
    input_price_per_m: 5.0
    output_price_per_m: 15.0
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
"""
        for name in ODD_BODIES
    )
    (tmp_path / "workers.yaml").write_text(catalog_yaml_for(running.url) + extra)
    probe_file = tmp_path / "probes.jsonl"
    probe_file.write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    try:
        yield (
            fake,
            {
                "data_dir": tmp_path / "data",
                "workers_file": tmp_path / "workers.yaml",
                "probe_file": probe_file,
            },
        )
    finally:
        running.stop()


def test_a_200_without_answer_text_is_a_failed_call_that_a_rerun_asks_again(odd):
    """No choices, empty choices, null content: nothing to grade, so no grade (they were graded 0
    and fitted), the call is recorded as failed with what it cost, and a rerun asks again."""
    fake, setup = odd
    done = calibrate(
        setup, "--workers", "nochoices,emptychoices,nullcontent", "--probes", "8", "--concurrency", "1"
    )
    assert done.returncode == 1, done.stderr
    assert "200 with no choices" in said(done) and "200 without answer text (finish_reason length" in said(
        done
    )
    records = ledger(setup)
    assert graded_pairs(records) == {} and not [r for r in records if r["type"] == "feedback"]
    failed = [r for r in records if r["type"] == "request"]
    assert len(failed) == 15 and {r["status"] for r in failed} == {502}  # five each, then given up
    null = [r for r in failed if r["model"] == "nullcontent"]
    assert all(r["completion_tokens"] == 16 and r["cost_micros"] > 0 for r in null)  # paid: booked
    assert "fitted" not in said(done)

    fake.odd = False  # the workers answer again
    for name in ("nochoices", "emptychoices", "nullcontent"):
        fake.behave(f"odd-{name}", replies=RIGHT, text="?")
    again = calibrate(setup, "--workers", "nochoices,emptychoices,nullcontent", "--probes", "8")
    assert again.returncode == 0, again.stderr
    grades = graded_pairs(ledger(setup))
    assert len(grades) == 24 and {g.score for g in grades.values()} == {1.0}


def test_an_answer_without_usage_is_booked_at_its_hold(odd):
    """A priced worker that reports no usage cost $0 by litellm's count, so the cap never saw it:
    each answer is booked at its hold (the prediction, the most it could cost), said in the trace and
    the summary, and the cap stops the run on it."""
    fake, setup = odd
    done = calibrate(
        setup, "--workers", "nousage", "--probes", "8", "--max-cost-usd", "0.002", "--concurrency", "1"
    )
    assert done.returncode == 0, done.stderr
    nousage = parse_catalog(setup["workers_file"].read_text()).get("nousage")
    requests = [r for r in ledger(setup) if r["type"] == "request"]
    assert len(requests) == len(fake.requests_for("odd-nousage")) < 8
    first = requests[0]
    probe = next(p for p in PROBES if p["id"] == first["trace"]["calibration"]["probe"])
    hold = predicted_cost(nousage, token_chars([probe["prompt"]]), probe["max_tokens"])
    assert first["cost_micros"] == to_micros(hold) > 0
    assert first["trace"]["calibration"]["usage"] == "missing: booked at the hold"
    assert 0 < spent_micros(setup) <= 2000
    assert "stopped at the cost cap" in said(done) and "reported no token usage" in said(done)


# ---- 8. a rerun updates output tokens -------------------------------------------------------------
def test_a_rerun_updates_a_calibrated_workers_output_tokens(setup, upstream):
    """The first run grades five probes (three one-token choices: a median of 1 output token), the
    rerun all sixteen (eight 305-token worked answers): the fit after it uses the median of all
    sixteen, as one uninterrupted run does. A rerun used to keep the first run's figure."""
    from router import load_current

    probes = choice_probes(8) + [
        {
            "id": f"n{i}",
            "task": "tn",
            "type": "number",
            "source": "test",
            "prompt": f"[n{i}] What is 3+4?",
            "gold": "7",
            "max_tokens": 512,
        }
        for i in range(8)
    ]
    write_probes(setup, probes)
    replies = {f"[c{i:02d}]": "B" for i in range(8)} | {
        f"[n{i}]": "Let me think " + "step " * 300 + "Answer: 7" for i in range(8)
    }
    upstream.behave("cheap-model", replies=replies, text="?")
    first = calibrate(setup, "--workers", "cheap", "--probes", "5")
    assert first.returncode == 0 and "fitted on 5 probes" in said(first), first.stderr
    assert load_current(setup["data_dir"] / "router").output_tokens["cheap"] == 1.0
    again = calibrate(setup, "--workers", "cheap", "--probes", "16")
    assert again.returncode == 0 and "fitted on 16 probes" in said(again), again.stderr
    tokens = [r["completion_tokens"] for r in ledger(setup) if r["type"] == "request"]
    assert len(tokens) == 16 and statistics.median(tokens) == 153.0
    assert load_current(setup["data_dir"] / "router").output_tokens["cheap"] == 153.0


# ---- 9. the dry run ---------------------------------------------------------------------------------
def test_the_estimate_is_the_holds_prediction(setup, upstream, monkeypatch):
    """Non-ASCII prompts count a token a character (policies.cost.token_chars), as the holds count
    them: the estimate counted four characters a token and came out at a quarter. The expected cost
    never assumes more output than max_tokens (it came out above the worst case)."""
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")
    cjk = "水" * 1000
    write_probes(
        setup,
        [
            {
                "id": f"z{i}",
                "task": "t",
                "type": "number",
                "source": "test",
                "prompt": f"[z{i}] {cjk}？",
                "gold": "1",
                "max_tokens": 16,
            }
            for i in range(4)
        ],
    )
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    plan = make_plan(catalog, load_probes(setup["probe_file"]), 4, 0, ["pricey"], [])
    (row,) = estimate(plan)
    pricey = catalog.get("pricey")
    held = sum(predicted_cost(pricey, token_chars([p.prompt]), p.max_tokens) for p in plan.probes)
    assert (
        row.worst_usd == held > sum(predicted_cost(pricey, len(p.prompt), p.max_tokens) for p in plan.probes)
    )
    assert row.expected_usd == row.worst_usd  # a number answer is ~250 tokens; these may write 16
    # a real run is billed about what the dry run said (a provider bills a token per CJK character)
    upstream.behave("pricey-model", text="1", prompt_tokens=1000, completion_tokens=16)
    done = calibrate(setup, "--workers", "pricey", "--probes", "4")
    assert done.returncode == 0, done.stderr
    assert Decimal(spent_micros(setup)) / 1_000_000 <= row.worst_usd


def test_the_dry_run_leaves_out_what_the_policy_excludes_and_names_the_rule(setup, upstream):
    policy = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    policy["rules"].append(
        {
            "id": "no-cn-for-probes",
            "description": "calibration stays out of China",
            "when": {"tenants": ["calibration"]},
            "deny_jurisdictions": ["CN"],
        }
    )
    setup["data_dir"].mkdir(parents=True)
    (setup["data_dir"] / "policy.yaml").write_text(yaml.safe_dump(policy))
    dry = calibrate(setup, "--workers", "cheap,mid", "--probes", "4", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert (
        "excluded by the policy, not sent: mid: 4 pairs by rule no-cn-for-probes (jurisdiction CN is denied)"
        in said(dry)
    )
    assert re.search(r"│ mid\s+│ 0\s+│ \$0\.0000\s+│ \$0\.0000", dry.stderr)
    assert re.search(r"│ total\s+│ 4\s+│", dry.stderr)
    assert list(upstream.requests) == [] and ledger(setup) == []
    assert sorted(os.listdir(setup["data_dir"])) == ["policy.yaml"]  # a dry run writes nothing


def test_a_dry_run_on_a_fresh_data_dir_plans_with_the_shipped_policy_and_writes_nothing(setup, upstream):
    dry = calibrate(setup, "--workers", "cheap,mid", "--probes", "4", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "excluded by the policy" not in dry.stderr and re.search(r"│ total\s+│ 8\s+│", dry.stderr)
    assert not setup["data_dir"].exists() or os.listdir(setup["data_dir"]) == []


# ---- 11. nothing new, nothing fitted ------------------------------------------------------------------
def test_a_rerun_with_nothing_new_keeps_the_version_in_force(setup, upstream):
    """A rerun with nothing to send used to fit and activate a new, identical version each time, so
    `router rollback` went back to a copy of the calibration instead of undoing it."""
    from router import read_pointer
    from router.shipped import shipped_version

    upstream.behave("cheap-model", replies=RIGHT, text="?")
    first = calibrate(setup, "--workers", "cheap", "--probes", "8")
    assert first.returncode == 0, first.stderr
    root = setup["data_dir"] / "router"
    fitted = read_pointer(root)["version"]
    assert fitted != shipped_version() and read_pointer(root)["previous"] == shipped_version()
    versions = sorted(p.name for p in root.iterdir() if p.is_dir())
    for _ in range(2):
        again = calibrate(setup, "--workers", "cheap", "--probes", "8")
        assert again.returncode == 0, again.stderr
        assert f"nothing new: version {fitted} stays in force" in said(again)
    assert read_pointer(root)["version"] == fitted
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == versions
    _, environment = calibrate_command(setup)
    rollback = subprocess.run(
        [sys.executable, "-m", "polyroute.cli", "router", "rollback", "--data-dir", str(setup["data_dir"])],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=600,
    )
    assert rollback.returncode == 0, rollback.stderr
    assert read_pointer(root)["version"] == shipped_version()  # the calibration is undone

    # new grades are fitted: a version of their own
    more = calibrate(setup, "--workers", "cheap,mid", "--probes", "8")
    assert more.returncode == 0 and "fitted on 8 probes" in said(more), more.stderr
    assert read_pointer(root)["version"] not in versions


def test_an_empty_answer_the_worker_ended_itself_is_graded(odd):
    """An empty answer with finish_reason stop is the worker's answer (the local Gemma base model
    gives some), graded 0, not a failed call that every rerun would ask again."""
    fake, setup = odd
    fake.odd = False
    fake.behave("odd-nochoices", text="")
    done = calibrate(setup, "--workers", "nochoices", "--probes", "6", "--concurrency", "1")
    assert done.returncode == 0, done.stderr
    grades = graded_pairs(ledger(setup))
    assert len(grades) == 6 and {g.score for g in grades.values()} == {0.0}
    assert not [r for r in ledger(setup) if r["type"] == "request" and r["status"] != 200]


def test_a_long_probes_record_keeps_its_question_as_a_live_requests_does(setup, upstream):
    """A probe longer than the ledger keeps whole (a few-shot prompt) is recorded with its head and
    tail, as a live request is since the ledger kept tails: its question, in the last paragraph, is
    what a last-paragraph router fitted on these records must read. Calibration records kept the
    head alone, so the question was lost from them."""
    from gateway.ledger import MAX_QUERY_CHARS

    shots = "\n\n".join(f"Example {i}: which one is right?\nA) this\nB) that\nAnswer: B" for i in range(200))
    question = "[long] Which planet is the largest?\nA) Mars\nB) Jupiter\n\nAnswer with a letter."
    assert len(shots) > MAX_QUERY_CHARS
    probe = {
        "id": "long",
        "task": "t-choice",
        "type": "choice",
        "source": "test",
        "prompt": shots + "\n\n" + question,
        "gold": "B",
        "max_tokens": 16,
    }
    write_probes(setup, [probe])
    upstream.behave("cheap-model", text="B")
    done = calibrate(setup, "--workers", "cheap", "--probes", "1")
    assert done.returncode == 0, done.stderr
    (record,) = [r for r in ledger(setup) if r["type"] == "request"]
    assert record["query_chars"] == len(probe["prompt"])
    assert record["query_tail"].endswith(question)
    assert graded_pairs(ledger(setup))[("cheap", "long")].query.endswith(question)
