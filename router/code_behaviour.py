"""Code answers compared by what they do, not by how they are written.

Workers rarely write the same code: other names, a loop instead of a comprehension, a helper. Comparing
text (even the canonical AST of `answers.code_key`) then splits answers that agree. So every answer's
main function is run on the same inputs, harvested from the calls the prompt's asserts and the answers'
own examples and tests make, and answers whose outputs are identical share a key. The prompt's own
asserts (MBPP's "Your code should pass these tests") are run too: a pass share per answer.

The sandbox: one child interpreter for all answers (`python -P -s -S -B`: stdlib only, no site, no user
paths, no current directory on sys.path, no inherited environment: PATH and PYTHONHASHSEED=0 only, so
set reprs are reproducible from run to run — `-I` would ignore PYTHONHASHSEED) in a fresh temporary
directory; limits on memory (1 GiB address space), CPU, open files, file size and
processes (the last is ignored when running as root), set by the child itself before any answer runs
(a `preexec_fn` is unsafe in a threaded parent such as the gateway); a timer per top-level statement
and per call (an answer that timed out twice is not called again); the whole process group is killed
at `timeout_s`, and when the child is done. The answers' prints go to a discarding sink and the result
to a private copy of stdout, so nothing an answer writes can corrupt it. Whatever an answer
does (syntax errors, loops, `sys.exit()`, recursion or memory bombs) ends as its own "!Exc" outputs;
if the child dies as a whole (say `os._exit`, a segfault), every answer gets None and callers fall back
to `code_key`.

Offline (router/offline/code_runs.py) each answer is instead run alone by `run_outcomes`, every call
made and the calls made twice in opposite orders; :meth:`Outcomes.behaviour` then applies the give-up
rule to any subset of the inputs, so a replay needs no child per plan state.

What it does NOT guarantee: this is not a security boundary against a malicious answer. The network and
the filesystem are reachable, answers share one interpreter and may tamper with each other. The gateway
runs it only when the operator enables it.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import copy
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from router.answers import code_key, python_source

MAX_ARG_CHARS = 2000
GIVE_UP_AFTER = 2  # an answer that timed out this often is not called again (the rest count as timeouts)
_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TESTS = re.compile(r"\[TESTS\](.*?)(?:\[/TESTS\]|$)", re.DOTALL)
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True, slots=True)
class Behaviour:
    """One answer's observed behaviour: `repr` of its main function's result per input ("!Exc" when it
    raised), and the share of the prompt's asserts it passed (None when the prompt has none)."""

    outputs: tuple[str, ...]
    assert_pass: float | None


@dataclass(frozen=True, slots=True)
class Outcomes:
    """One answer run alone on `inputs` and the prompt's asserts with every call made (no give-up
    rule), and found to give the same results whichever order the calls came in. That makes each
    (input, result) pair a fact about the answer alone, so :meth:`behaviour` can tell what the live
    child reports for it on any list of these inputs: the offline replay's table (router/offline/code_runs.py)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # per input, as in Behaviour
    timed_out: tuple[bool, ...]  # per input: the call hit the per-call timer
    asserts: tuple[str, ...]  # per prompt assert, in order: "pass", "fail" or "timeout"

    def behaviour(self, inputs: Sequence[str]) -> Behaviour | None:
        """The answer's Behaviour in a live run on `inputs` (in that order) and the same asserts: the
        child's give-up rule applied to this list, exactly as the child applies it. None when an input
        is not in the table."""
        at = {inp: n for n, inp in enumerate(self.inputs)}
        if any(inp not in at for inp in inputs):
            return None
        outputs: list[str] = []
        timeouts = 0
        for inp in inputs:
            if timeouts >= GIVE_UP_AFTER:
                outputs.append("!Timeout")
            else:
                outputs.append(self.outputs[at[inp]])
                timeouts += self.timed_out[at[inp]]
        passed = 0
        for verdict in self.asserts:
            if timeouts >= GIVE_UP_AFTER:
                break
            passed += verdict == "pass"
            timeouts += verdict == "timeout"
        return Behaviour(tuple(outputs), passed / len(self.asserts) if self.asserts else None)


# ---- harvesting ------------------------------------------------------------------------------------
def _statements(text: str) -> list[ast.stmt]:
    """Statements of `text`; line by line when the whole does not parse (truncated [TESTS] blocks)."""
    with contextlib.suppress(Exception):
        return ast.parse(text).body
    found: list[ast.stmt] = []
    for line in text.splitlines():
        with contextlib.suppress(Exception):
            found.extend(ast.parse(line.strip()).body)
    return found


def _main_name(source: str | None, preferred: Sequence[str] = ()) -> str | None:
    """The answer's main function: the top-level def the prompt's asserts call if it has one (a helper
    may come first), else its first top-level def."""
    defs = [s.name for s in _statements(source or "") if isinstance(s, ast.FunctionDef)]
    return next((d for d in defs if d in preferred), defs[0] if defs else None)


def _called_name(assertion: str) -> str | None:
    """The function an assert tests: its first call of a non-builtin name (`set(f(x)) == …` → f)."""
    try:
        tree = ast.parse(assertion)
    except Exception:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in _BUILTINS:
            return node.func.id
    return None


def prompt_asserts(query: str) -> list[str]:
    """The query's single-line `assert …` statements that parse, deduplicated, in order."""
    found: list[str] = []
    for line in query.splitlines():
        line = line.strip()
        if line.startswith("assert ") and line not in found:
            with contextlib.suppress(Exception):
                ast.parse(line)
                found.append(line)
    return found


class _Resolve(ast.NodeTransformer):
    """Replaces names bound by earlier `name = literal` statements with their literal."""

    def __init__(self, env: dict[str, ast.expr]) -> None:
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return copy.deepcopy(self.env[node.id]) if node.id in self.env else node


def _literal_source(node: ast.expr, max_chars: int | None = MAX_ARG_CHARS) -> str | None:
    """`node` as source when `ast.literal_eval` accepts it and it is not too long, else None."""
    source = ast.unparse(node)
    if max_chars is not None and len(source) > max_chars:
        return None
    try:
        ast.literal_eval(source)
    except Exception:
        return None
    return source


def _calls(statements: Sequence[ast.stmt], names: frozenset[str]) -> Iterator[str]:
    """Literal argument tuples of calls to `names`, top-level `if` bodies included (`__main__` guards)."""
    env: dict[str, ast.expr] = {}
    pending = list(statements)
    while pending:
        stmt = pending.pop(0)
        if isinstance(stmt, ast.If):
            pending[:0] = [*stmt.body, *stmt.orelse]
            continue
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
                continue
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                continue  # keyword or starred calls: which parameter gets what is not known
            args = [_Resolve(env).visit(copy.deepcopy(a)) for a in node.args]
            if all(len(ast.unparse(a)) <= MAX_ARG_CHARS for a in args):
                source = _literal_source(ast.Tuple(elts=args, ctx=ast.Load()), max_chars=None)
                if source is not None:
                    yield source
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    value = _Resolve(env).visit(copy.deepcopy(stmt.value))
                    if len(targets) == 1 and _literal_source(value) is not None:
                        env[target.id] = value
                    else:
                        env.pop(target.id, None)


def harvest_inputs(query: str, answers: Sequence[str], limit: int = 12) -> list[str]:
    """Argument tuples (as literal source, e.g. "([1, 2, 3], [2])") of the calls that the prompt's
    asserts and the answers' code, examples and [TESTS] make to any answer's main function or to the
    function the prompt's asserts call. The prompt's come first: they are the task's own cases."""
    asserts = prompt_asserts(query)
    names = {n for a in asserts if (n := _called_name(a))}
    sources = [python_source(a) for a in answers]
    names |= {n for s in sources if (n := _main_name(s))}
    blocks = ["\n".join(asserts)]
    for answer, source in zip(answers, sources, strict=True):
        if source is not None:  # a JavaScript answer's calls are not Python calls
            blocks += [source, *_FENCE.findall(answer), *_TESTS.findall(answer)]
    found: list[str] = []
    for block in blocks:
        for args in _calls(_statements(block), frozenset(names)):
            if args not in found:
                found.append(args)
                if len(found) >= limit:
                    return found
    return found


# ---- the sandbox ---------------------------------------------------------------------------------
_CHILD = r"""
import ast, copy, functools, io, json, os, resource, signal, sys

class Timeout(BaseException):  # not an Exception: an answer's `except Exception` must not swallow it
    pass

def alarm(signum, frame):
    raise Timeout

class Sink(io.TextIOBase):  # the answers' prints: discarded, not kept in memory
    def writable(self): return True
    def write(self, text): return len(text)

def guarded(fn, seconds):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def run(source, main, inputs, asserts, per_call, give_up):
    signal.signal(signal.SIGALRM, alarm)  # undo what an earlier answer may have changed
    sys.setrecursionlimit(1000)
    sys.stdout = sys.stderr = Sink()
    sys.stdin = io.StringIO()
    ns, failure = {"__name__": "__answer__"}, None
    for stmt in ast.parse(source).body:  # statement by statement: a failing example hides no function
        try:
            guarded(functools.partial(exec, compile(ast.Module([stmt], []), "<answer>", "exec"), ns), per_call)
        except BaseException as exc:
            failure = failure or type(exc).__name__
    fn = ns.get(main) if main else None
    if not callable(fn):
        return {"outputs": ["!exec:" + (failure or "NoFunction")] * len(inputs), "passed": 0,
                "timed_out": [False] * len(inputs), "asserts": ["fail"] * len(asserts)}
    outputs, timed_out, verdicts, timeouts, passed = [], [], [], 0, 0
    for args in inputs:
        try:
            if give_up is not None and timeouts >= give_up:  # a looping answer is not given every call's time
                raise Timeout
            outputs.append(guarded(lambda: repr(fn(*copy.deepcopy(args)))[:300], per_call))
            timed_out.append(False)
        except BaseException as exc:
            timeouts += isinstance(exc, Timeout)
            outputs.append("!" + type(exc).__name__)
            timed_out.append(isinstance(exc, Timeout))
    for name, code in asserts:
        try:
            if give_up is not None and timeouts >= give_up:
                raise Timeout
            ns[name or "_"] = fn
            guarded(functools.partial(exec, code, ns), per_call)  # compiled here: a bad one just fails
            passed += 1
            verdicts.append("pass")
        except BaseException as exc:
            timeouts += isinstance(exc, Timeout)
            verdicts.append("timeout" if isinstance(exc, Timeout) else "fail")
    return {"outputs": outputs, "passed": passed, "timed_out": timed_out, "asserts": verdicts}

def run_both(source, main, inputs, asserts, per_call, give_up, reverse):
    result = run(source, main, inputs, asserts, per_call, give_up)
    if reverse:  # again in a fresh namespace, the calls in the opposite order
        result["reverse"] = run(source, main, inputs[::-1], asserts[::-1], per_call, give_up)
    return result

job = json.loads(sys.stdin.buffer.read())
result_fd = os.dup(1)  # non-inheritable: nothing an answer spawns can write to it
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
for name, soft, hard in [("AS", 1 << 30, 1 << 30), ("CPU", job["cpu_s"], job["cpu_s"] + 1), ("NOFILE", 32, 32),
                         ("FSIZE", 1 << 20, 1 << 20), ("NPROC", 0, 0)]:
    try:
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
    except (AttributeError, ValueError, OSError):
        pass
inputs, results = [ast.literal_eval(i) for i in job["inputs"]], []
for source, main in zip(job["sources"], job["mains"]):
    try:
        results.append(None if source is None else run_both(source, main, inputs, job["asserts"], job["per_call_s"],
                                                            job["give_up"], job["reverse"]))
    except BaseException:
        results.append(None)
with open(result_fd, "w", encoding="utf-8") as out:
    out.write(json.dumps({"results": results}))
try:
    os.killpg(0, signal.SIGKILL)  # with whatever an answer spawned (its own process group)
finally:
    os._exit(0)  # no atexit handler or thread an answer left behind runs
"""
# -I without -E: the environment is ours (_ENV), and PYTHONHASHSEED in it must be honoured.
_COMMAND = (sys.executable, "-P", "-s", "-S", "-B", "-c", _CHILD)
# Its own session (killpg ends what it spawned too), no inherited environment, stderr discarded.
_SPAWN: dict[str, Any] = {
    "stdin": subprocess.PIPE,
    "stdout": subprocess.PIPE,
    "stderr": subprocess.DEVNULL,
    "env": _ENV,
    "start_new_session": True,
}


def _job(
    sources: Sequence[str | None],
    inputs: Sequence[str],
    asserts: Sequence[str],
    timeout_s: float,
    per_call_s: float,
    *,
    give_up: int | None = GIVE_UP_AFTER,
    reverse: bool = False,
) -> bytes | None:
    """The child's stdin; None when there is nothing to run (no Python, or neither inputs nor asserts).
    `give_up`: timeouts after which an answer is not called again (None: every call is made);
    `reverse`: run each answer a second time, fresh, with the calls in the opposite order."""
    if all(s is None for s in sources) or not (inputs or asserts):
        return None
    targets = [n for a in asserts if (n := _called_name(a))]
    return json.dumps(
        {
            "sources": list(sources),
            "mains": [_main_name(s, targets) for s in sources],
            "inputs": list(inputs),
            "asserts": [[_called_name(a), a] for a in asserts],
            "per_call_s": per_call_s,
            "cpu_s": int(timeout_s) + 1,
            "give_up": give_up,
            "reverse": reverse,
        }
    ).encode()


def _parse(
    stdout: bytes | None, sources: Sequence[str | None], inputs: Sequence[str], asserts: Sequence[str]
) -> list[Behaviour | None]:
    """The child's answer as one Behaviour per source; all None if it is missing or malformed."""
    behaviours: list[Behaviour | None] = []
    try:
        results = json.loads(stdout or b"")["results"]
        for result in results:
            outputs = None if result is None else tuple(str(o) for o in result["outputs"])
            if outputs is not None and len(outputs) != len(inputs):
                raise ValueError("an output per input")
            share = int(result["passed"]) / len(asserts) if outputs is not None and asserts else None
            behaviours.append(None if outputs is None else Behaviour(outputs, share))
    except Exception:
        behaviours = []
    return behaviours if len(behaviours) == len(sources) else [None] * len(sources)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)  # the child leads its own process group


def _communicate(job: bytes, timeout_s: float) -> bytes | None:
    """The child's stdout for `job`; None if it could not start or did not finish within `timeout_s`."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as cwd:
        try:
            proc = subprocess.Popen(_COMMAND, cwd=cwd, **_SPAWN)
        except OSError:
            return None
        stdout: bytes | None = None
        try:
            stdout, _ = proc.communicate(job, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stdout = None
        finally:
            if proc.poll() is None:  # timed out or interrupted: the child must not outlive the call
                _kill(proc.pid)
                proc.communicate()
    return stdout


def run_behaviour(
    sources: Sequence[str | None],
    inputs: Sequence[str],
    asserts: Sequence[str] = (),
    *,
    timeout_s: float = 5.0,
    per_call_s: float = 0.5,
) -> list[Behaviour | None]:
    """Each source's behaviour on `inputs` (argument tuples as literal source) and `asserts`, all in one
    sandboxed child (see the module docstring); None for a source that is None, all None if the child
    times out or dies."""
    job = _job(sources, inputs, asserts, timeout_s, per_call_s)
    if job is None:
        return [None] * len(sources)
    return _parse(_communicate(job, timeout_s), sources, inputs, asserts)


def run_outcomes(
    source: str,
    inputs: Sequence[str],
    asserts: Sequence[str] = (),
    *,
    per_call_s: float = 0.5,
    timeout_s: float | None = None,
) -> Outcomes | None:
    """`source` alone in its own sandboxed child on every input and assert, none skipped after
    timeouts, then again in a fresh namespace with the calls reversed. None when that cannot stand
    for the answer's behaviour on a subset of the inputs: the child died or ran out of time (say an
    `os._exit` on one input), or the two orders disagree (it keeps state between calls, or is random).
    The default `timeout_s` gives every statement and call of both passes its timer and 10 s more."""
    if timeout_s is None:
        timeout_s = 10.0 + 2 * per_call_s * (len(_statements(source)) + len(inputs) + len(asserts))
    job = _job([source], inputs, asserts, timeout_s, per_call_s, give_up=None, reverse=True)
    if job is None:  # neither inputs nor asserts: nothing to observe
        return Outcomes(tuple(inputs), (), (), ())
    try:
        (result,) = json.loads(_communicate(job, timeout_s) or b"")["results"]
        forward, backward = result, result["reverse"]
        outputs = tuple(str(o) for o in forward["outputs"])
        timed_out = tuple(bool(t) for t in forward["timed_out"])
        verdicts = tuple(str(v) for v in forward["asserts"])
        if not (len(outputs) == len(timed_out) == len(inputs) and len(verdicts) == len(asserts)):
            return None
        if (
            tuple(str(o) for o in backward["outputs"])[::-1] != outputs
            or tuple(bool(t) for t in backward["timed_out"])[::-1] != timed_out
            or tuple(str(v) for v in backward["asserts"])[::-1] != verdicts
        ):
            return None
    except Exception:  # missing or malformed: the child died
        return None
    return Outcomes(tuple(inputs), outputs, timed_out, verdicts)


async def run_behaviour_async(
    sources: Sequence[str | None],
    inputs: Sequence[str],
    asserts: Sequence[str] = (),
    *,
    timeout_s: float = 5.0,
    per_call_s: float = 0.5,
) -> list[Behaviour | None]:
    """`run_behaviour` off the event loop (the gateway). A cancelled caller does not wait for it; the
    child still ends by its own timeout."""
    return await asyncio.to_thread(
        run_behaviour, sources, inputs, asserts, timeout_s=timeout_s, per_call_s=per_call_s
    )


# ---- keys ------------------------------------------------------------------------------------------
def _plan(query: str, answers: Sequence[str]) -> tuple[list[str | None], list[str], list[str]]:
    return [python_source(a) for a in answers], harvest_inputs(query, answers), prompt_asserts(query)


def keys_from(
    answers: Sequence[str],
    sources: Sequence[str | None],
    inputs: Sequence[str],
    behaviours: Sequence[Behaviour | None],
) -> tuple[list[str | None], list[float | None]]:
    """Behaviour keys when inputs were run; `code_key` when there were none or the child failed."""
    ran = any(b is not None for b in behaviours)
    shares = [b.assert_pass if b is not None else None for b in behaviours]
    if not inputs or not ran:
        return [code_key(a) for a in answers], shares
    keys: list[str | None] = []
    for source, behaviour in zip(sources, behaviours, strict=True):
        if source is None or behaviour is None or all(o.startswith("!") for o in behaviour.outputs):
            keys.append(None)  # no Python, or it failed on every input: it agrees with nobody
        else:
            keys.append(hashlib.sha1(json.dumps(behaviour.outputs).encode()).hexdigest()[:16])
    return keys, shares


def behaviour_keys(
    query: str, answers: Sequence[str], *, timeout_s: float = 5.0
) -> tuple[list[str | None], list[float | None]]:
    """Per answer: a key shared by answers that behave alike (None: no Python, or it fails on every
    input), and the share of the prompt's asserts it passes (None: no asserts or no Python)."""
    sources, inputs, asserts = _plan(query, answers)
    behaviours = run_behaviour(sources, inputs, asserts, timeout_s=timeout_s)
    return keys_from(answers, sources, inputs, behaviours)


async def behaviour_keys_async(
    query: str, answers: Sequence[str], *, timeout_s: float = 5.0
) -> tuple[list[str | None], list[float | None]]:
    """`behaviour_keys` off the event loop: parsing the answers and running them both block."""
    return await asyncio.to_thread(behaviour_keys, query, answers, timeout_s=timeout_s)
