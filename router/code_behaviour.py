"""Code answers compared by what they do, not by how they are written.

Workers rarely write the same code: other names, a loop instead of a comprehension, a helper. Comparing
text (even the canonical AST of `answers.code_key`) then splits answers that agree. So every answer's
main function is run on the same inputs, harvested from the calls the prompt's asserts and the answers'
own examples and tests make, and answers whose outputs are identical share a key. The prompt's own
asserts (MBPP's "Your code should pass these tests") are run too: a pass share per answer.

The sandbox: one child interpreter for all answers (`python -P -s -S -B`: stdlib only, no site, no user
paths, no current directory on sys.path, no inherited environment: PATH and PYTHONHASHSEED=0 only, so
set reprs are reproducible from run to run — `-I` would ignore PYTHONHASHSEED) in a fresh temporary
directory of its own.

Who runs the answers. The child's environment is clean, but a process of the same uid can read this
process's /proc/<pid>/environ, where the workers' API keys are, and send them out (the network is
reachable). So when this process is root, the child becomes nobody/nogroup (SANDBOX_UID, no
supplementary groups) before any answer runs. It switches itself, after it has started, rather than
being started so (Popen's `user=`): the interpreter may sit where nobody cannot reach it (a pyenv under
/root, mode 0700); the directories of its import path nobody cannot read stay reachable through
descriptors it opened before switching. If it cannot switch (a user namespace without uid 65534, no
CAP_SETUID), no answer runs and the log says why. When this process is not root, the child has its uid,
and this process makes itself non-dumpable (prctl PR_SET_DUMPABLE 0, once, on its first run; Linux only,
best effort): a same-uid child can then not read its /proc/<pid>/environ. What that costs: no debugger
or py-spy can attach to this process, it writes no core dump, and tools of the same user can no longer
read its /proc/<pid>/ files (environ, fd, maps). Other processes of that user (the shell or supervisor
that started it, with the same keys in their environment) stay readable: to keep keys from answers,
run as root or as a user of its own.

Limits on memory (1 GiB address space), CPU, open files, file size and processes (none: an answer can
neither fork nor start a thread; the kernel ignores this limit for root, one more reason the child does
not stay root), set by the child itself before any answer runs (a `preexec_fn` is unsafe in a threaded
parent such as the gateway); a timer per top-level statement and per call (an answer that timed out
twice is not called again); the whole process group is killed at `timeout_s`, and whenever the child is
done however it ended (a process that left the group with setsid would escape it, but none can be
made). The parent waits for the child's exit, not for the end of its output, which a process it forked
could hold open.

The answers' prints go to a discarding sink and the result to a private copy of stdout, behind a nonce
the parent sends on stdin and the harness keeps out of the answers' reach (not in `__main__`, not on
stdin once read): anything else written there, say a result an answer made up, makes the run count as
died. The harness judges with builtins and functions it bound before any answer ran, so an answer that
rebinds `exec` or patches `json` changes nothing. Each output is the `repr` of the result, whole up to
OUTPUT_CHARS characters, else its start and the sha256 of all of it: outputs that differ anywhere give
different keys. An assert `assert <expression> == <literal>` is judged on builtin data: the result is
read through the builtin types' own methods (a Counter as the dict it holds, a namedtuple as its tuple)
and compared with builtin equality, so an object whose `__eq__` always says yes fails; a result of any
other type (a Fraction, a Decimal) fails such an assert even where Python's `==` would say equal. Other
asserts run as written. Whatever an answer does (syntax errors, loops, `sys.exit()`, recursion or memory
bombs) ends as its own "!Exc" outputs; if the child dies as a whole (say `os._exit`, a segfault), every
answer gets None and callers fall back to `code_key`.

Harvesting the inputs runs in this process (the gateway's worker thread, the offline evaluator), not in
the child, so its work is bounded whatever the answers hold: a literal is measured before it is built
(at most MAX_ARG_CHARS of source, MAX_DEPTH deep, MAX_SUBSTITUTIONS names put in), each answer's harvest
visits or builds at most HARVEST_NODES AST nodes, what does not fit is skipped, and it never raises.

Offline (router/offline/code_runs.py) each answer is instead run alone by `run_outcomes`, every call
made and the calls made twice in opposite orders; :meth:`Outcomes.behaviour` then applies the give-up
rule to any subset of the inputs, so a replay needs no child per plan state.

Whole programs run in the same child too, by `run_script`: the builder's tests (a worker's draft and
the request's asserts, router/compose/builder.py) as `__main__`, with the same flags, environment,
uid, limits and group kill; its exit status and last stderr line are what the caller gets.

What it does NOT guarantee: this is not a security boundary against a malicious answer. The network and
the world-readable filesystem are reachable; answers share one interpreter and may tamper with each
other; the answers of concurrent runs share a uid (nobody, or this process's) and can signal each
other's children; an answer that inspects the harness's frames or memory (sys._getframe, gc, ctypes)
can still find the nonce and forge its result. The gateway runs it only when the operator enables it.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.answers import FENCE, code_key, python_source

MAX_ARG_CHARS = 2000  # a harvested argument tuple's source, at most
MAX_DEPTH = 50  # a harvested literal's nesting, at most (deeper ones would recurse deep in ast)
MAX_SUBSTITUTIONS = 100  # uses of `name = literal` names put into one harvested literal, at most
HARVEST_NODES = 50_000  # AST nodes the harvest may visit or build per answer: its work whatever it holds
OUTPUT_CHARS = 4000  # an output's repr kept whole up to this; longer: its start and a sha256 of all of it
MAX_RESULT_BYTES = 32 << 20  # what the child may send; more and the run counts as failed
GIVE_UP_AFTER = 2  # an answer that timed out this often is not called again (the rest count as timeouts)
SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup: who runs the answers when this process is root
_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
_PR_SET_DUMPABLE = 4  # linux/prctl.h
_POLL_S = 0.05  # how often the child's exit is polled where there is no pidfd
_REAP_S = 10.0  # waiting for a killed child, at most
_log = logging.getLogger(__name__)
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
    _at: dict[str, int] = field(init=False, repr=False, compare=False)  # input -> its index, built once

    def __post_init__(self) -> None:
        object.__setattr__(self, "_at", {inp: n for n, inp in enumerate(self.inputs)})

    def behaviour(self, inputs: Sequence[str]) -> Behaviour | None:
        """The answer's Behaviour in a live run on `inputs` (in that order) and the same asserts: the
        child's give-up rule applied to this list, exactly as the child applies it. None when an input
        is not in the table."""
        at = self._at
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


@dataclass(slots=True)
class _Budget:
    """AST nodes the harvest may still visit or build for one answer (or the prompt). The harvest runs
    in the caller (the gateway's worker thread, the offline evaluator), not in the sandbox: its work
    must be bounded by this, not by the size an answer's literals would take once substituted."""

    left: int = HARVEST_NODES

    def spend(self, nodes: int) -> bool:
        self.left -= nodes
        return self.left >= 0


@dataclass(frozen=True, slots=True)
class _Literal:
    """A literal harvested from an answer (a call's arguments, or a name's value): its source and its
    nesting depth."""

    source: str
    depth: int


class _Resolve(ast.NodeTransformer):
    """Replaces names bound by earlier `name = literal` statements with their literal."""

    def __init__(self, env: dict[str, _Literal]) -> None:
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.parse(self.env[node.id].source, mode="eval").body if node.id in self.env else node


def _measure(
    nodes: Sequence[ast.expr], env: dict[str, _Literal], budget: _Budget
) -> tuple[int, int, int] | None:
    """The source length (a lower bound: one character per expression node, plus each substituted
    literal's source), depth and number of substitutions `nodes` will have once `env`'s literals
    stand in for their names; None, before anything is built, when they would exceed MAX_ARG_CHARS,
    MAX_DEPTH or MAX_SUBSTITUTIONS, or the budget is spent. An argument that names a 2,000-character
    list 1,600 times is refused at its second name, not built."""
    chars = substitutions = deepest = 0
    stack = [(node, 1) for node in nodes]
    while stack:
        node, depth = stack.pop()
        if not budget.spend(1):
            return None
        if isinstance(node, ast.Name) and node.id in env:
            literal = env[node.id]
            chars, substitutions, depth = (
                chars + len(literal.source),
                substitutions + 1,
                depth + literal.depth - 1,
            )
        else:
            chars += isinstance(node, ast.expr)
            stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
        deepest = max(deepest, depth)
        if chars > MAX_ARG_CHARS or deepest > MAX_DEPTH or substitutions > MAX_SUBSTITUTIONS:
            return None
    return chars, deepest, substitutions


def _resolved(
    nodes: Sequence[ast.expr], env: dict[str, _Literal], budget: _Budget, *, as_tuple: bool
) -> _Literal | None:
    """`nodes` with `env`'s literals substituted, as one literal (`as_tuple`: the tuple of them, a
    call's arguments) within the bounds of :func:`_measure`; None when it is not one. Never raises:
    an input that cannot be harvested is skipped."""
    try:
        measured = _measure(nodes, env, budget)
        if measured is None or not budget.spend(measured[0]):  # building it costs about its size
            return None
        chars, depth, substitutions = measured
        if substitutions:  # on a copy (the answer's tree is still being walked)
            nodes = [_Resolve(env).visit(ast.parse(ast.unparse(node), mode="eval").body) for node in nodes]
        node = ast.Tuple(elts=list(nodes), ctx=ast.Load()) if as_tuple else nodes[0]
        source = ast.unparse(node)
        if len(source) > MAX_ARG_CHARS:
            return None
        ast.literal_eval(source)  # raises when it is not a literal
    except Exception:  # RecursionError, MemoryError, ValueError: not a literal we can use
        return None
    return _Literal(source, depth)


def _calls(statements: Sequence[ast.stmt], names: frozenset[str], budget: _Budget) -> Iterator[str]:
    """Literal argument tuples of calls to `names`, top-level `if` bodies included (`__main__` guards),
    as far as `budget` goes."""
    env: dict[str, _Literal] = {}
    pending = deque(statements)
    while pending and budget.left > 0:
        stmt = pending.popleft()
        if isinstance(stmt, ast.If):
            pending.extendleft(reversed([*stmt.body, *stmt.orelse]))
            continue
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
                continue
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                continue  # keyword or starred calls: which parameter gets what is not known
            args = _resolved(node.args, env, budget, as_tuple=True)
            if args is not None:
                yield args.source
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    value = (
                        _resolved([stmt.value], env, budget, as_tuple=False) if len(targets) == 1 else None
                    )
                    if value is not None:
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
    blocks = [("\n".join(asserts), _Budget())]
    for answer, source in zip(answers, sources, strict=True):
        if source is not None:  # a JavaScript answer's calls are not Python calls
            budget = _Budget()  # one per answer, shared by its blocks: however many fences it has
            blocks += [(block, budget) for block in [source, *FENCE.findall(answer), *_TESTS.findall(answer)]]
    found: list[str] = []
    called = frozenset(names)
    for block, budget in blocks:
        with contextlib.suppress(Exception):  # never raises: what a block cannot give is skipped
            for args in _calls(_statements(block), called, budget):
                if args not in found:
                    found.append(args)
                    if len(found) >= limit:
                        return found
    return found


# ---- the sandbox ---------------------------------------------------------------------------------
# The harness runs in the child with a private copy of the builtins as its globals' `__builtins__`, and
# binds the module functions it calls after an answer ran before any answer runs: an answer that
# rebinds a builtin or a module's attribute (exec, json, signal, `__main__`) changes nothing here.
_HARNESS = r"""
import ast, builtins, copy, functools, hashlib, io, json, os, resource, signal, sys

answer_builtins = builtins  # the real module: what the answers see and may change
parse, Module, Expression, Assert, Compare, Eq = ast.parse, ast.Module, ast.Expression, ast.Assert, ast.Compare, ast.Eq
literal_eval, deepcopy, partial, sha256 = ast.literal_eval, copy.deepcopy, functools.partial, hashlib.sha256
setitimer, ITIMER_REAL, set_handler, SIGALRM, SIGKILL = (signal.setitimer, signal.ITIMER_REAL, signal.signal,
                                                         signal.SIGALRM, signal.SIGKILL)
encode_str, write, exit_now, killpg = json.encoder.encode_basestring_ascii, os.write, os._exit, os.killpg
setrecursionlimit, StringIO = sys.setrecursionlimit, io.StringIO

class Timeout(BaseException):  # not an Exception: an answer's `except Exception` must not swallow it
    pass

def alarm(signum, frame):
    raise Timeout

class Sink(io.TextIOBase):  # the answers' prints: discarded, not kept in memory
    def writable(self): return True
    def write(self, text): return len(text)

def guarded(fn, seconds):
    setitimer(ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        setitimer(ITIMER_REAL, 0)

def shown(value, limit):  # the repr, whole up to `limit` characters, else its start and a digest of all
    text = str.__str__(repr(value))  # an exact str, whatever __repr__ returned
    if len(text) <= limit:
        return text
    return text[:limit] + "...sha256:" + sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

SCALARS = (bool, int, float, complex, str, bytes, type(None))

def plain(value):  # builtin data, read through the builtin types' own methods; TypeError for any other
    kind = type(value)
    for scalar in SCALARS:
        if kind is scalar:
            return value
    if issubclass(kind, int):
        return int.__index__(value)
    if issubclass(kind, float):
        return float.__float__(value)
    if issubclass(kind, complex):
        return complex(complex.real.__get__(value), complex.imag.__get__(value))
    if issubclass(kind, str):
        return str.__str__(value)
    if issubclass(kind, bytes):
        return bytes.__getitem__(value, slice(None))
    if issubclass(kind, list):
        return [plain(item) for item in list.__iter__(value)]
    if issubclass(kind, tuple):
        return tuple([plain(item) for item in tuple.__iter__(value)])
    if issubclass(kind, dict):  # Counter, OrderedDict, defaultdict: compared as the dict they hold
        return {plain(key): plain(item) for key, item in dict.items(value)}
    if issubclass(kind, frozenset):
        return frozenset([plain(item) for item in frozenset.__iter__(value)])
    if issubclass(kind, set):
        return {plain(item) for item in set.__iter__(value)}
    raise TypeError("not builtin data")

def split(code):  # `assert <expression> == <literal>` (either side): the expression compiled, the value
    try:
        (stmt,) = parse(code).body
    except Exception:
        return None
    test = getattr(stmt, "test", None)
    if type(stmt) is not Assert or type(test) is not Compare or len(test.ops) != 1 or type(test.ops[0]) is not Eq:
        return None
    for actual, expected in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
        try:
            return compile(Expression(actual), "<assert>", "eval"), literal_eval(expected)
        except Exception:
            continue
    return None

def check(expression, expected, ns):  # builtin equality: an object whose __eq__ says yes does not pass
    if not plain(eval(expression, ns)) == expected:
        raise AssertionError

def run(source, main, inputs, asserts, per_call, give_up, output_chars):
    set_handler(SIGALRM, alarm)  # undo what an earlier answer may have changed
    setrecursionlimit(1000)
    sys.stdout = sys.stderr = Sink()
    sys.stdin = StringIO()
    ns, failure = {"__name__": "__answer__", "__builtins__": answer_builtins}, None
    for stmt in parse(source).body:  # statement by statement: a failing example hides no function
        try:
            guarded(partial(exec, compile(Module([stmt], []), "<answer>", "exec"), ns), per_call)
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
            outputs.append(guarded(lambda: shown(fn(*deepcopy(args)), output_chars), per_call))
            timed_out.append(False)
        except BaseException as exc:
            timeouts += isinstance(exc, Timeout)
            outputs.append("!" + type(exc).__name__)
            timed_out.append(isinstance(exc, Timeout))
    for name, code, typed in asserts:
        try:
            if give_up is not None and timeouts >= give_up:
                raise Timeout
            ns[name or "_"] = fn
            if typed is None:
                guarded(partial(exec, code, ns), per_call)  # compiled here: a bad one just fails
            else:
                guarded(partial(check, typed[0], typed[1], ns), per_call)
            passed += 1
            verdicts.append("pass")
        except BaseException as exc:
            timeouts += isinstance(exc, Timeout)
            verdicts.append("timeout" if isinstance(exc, Timeout) else "fail")
    return {"outputs": outputs, "passed": passed, "timed_out": timed_out, "asserts": verdicts}

def run_both(source, main, inputs, asserts, per_call, give_up, output_chars, reverse):
    result = run(source, main, inputs, asserts, per_call, give_up, output_chars)
    if reverse:  # again in a fresh namespace, the calls in the opposite order
        result["reverse"] = run(source, main, inputs[::-1], asserts[::-1], per_call, give_up, output_chars)
    return result

def drop(uid, gid):  # become uid/gid for good, no supplementary groups; a reason when that fails
    held = {}  # the import path, reachable through descriptors opened now when uid may not read it
    for path in sys.path:
        try:
            held.setdefault(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY))
        except OSError:
            pass
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError as exc:
        return f"cannot switch to uid {uid} / gid {gid}: {exc}"
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        return f"still holds other ids after switching to uid {uid} / gid {gid}"
    paths = []
    for path in sys.path:
        fd = held.pop(path, None)
        if fd is not None and not os.access(path, os.R_OK | os.X_OK):
            paths.append(f"/proc/self/fd/{fd}")
        else:
            paths.append(path)
            if fd is not None:
                os.close(fd)
    for fd in held.values():
        os.close(fd)
    # Packages imported before the switch (collections, encodings) keep their own search paths: point
    # those the new uid cannot read at the same descriptors, or `import collections.abc` fails.
    moved = [(old, new) for old, new in zip(sys.path, paths) if old != new]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if type(search) is list:
            search[:] = [next((new + entry[len(old):] for old, new in moved
                               if entry == old or entry.startswith(old + "/")), entry) for entry in search]
    sys.path[:] = paths
    sys.path_importer_cache.clear()
    return None

def dump(value):  # JSON of the harness's own result, by exact type, without json's patchable encoder
    kind = type(value)
    if kind is str:
        return encode_str(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return int.__repr__(value)
    if value is None:
        return "null"
    if kind is list:
        return "[" + ",".join([dump(item) for item in value]) + "]"
    if kind is dict:
        return "{" + ",".join([encode_str(key) + ":" + dump(item) for key, item in value.items()]) + "}"
    raise TypeError("not part of a result")

def send(fd, nonce, message):  # the nonce first: without it the parent takes nothing
    data = memoryview(nonce + b"\n" + dump(message).encode("ascii"))
    while data:
        data = data[write(fd, data):]

def confine(job, result_fd, nonce):  # who the child is and what it may use, before untrusted code runs
    if job["drop_to"] is not None:
        refused = drop(*job["drop_to"])
        if refused is not None:
            send(result_fd, nonce, {"error": refused})
            exit_now(0)
    for name, soft, hard in [("AS", 1 << 30, 1 << 30), ("CPU", job["cpu_s"], job["cpu_s"] + 1),
                             ("NOFILE", 32, 32), ("FSIZE", 1 << 20, 1 << 20), ("NPROC", 0, 0)]:
        try:
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        except (AttributeError, ValueError, OSError):
            pass

def start():  # the job and nonce from stdin, stdout kept aside and silenced, then confined
    nonce, _, job = sys.stdin.buffer.read().partition(b"\n")  # the nonce lives in callers' frames only
    job = json.loads(job)
    kept = os.dup(1)  # non-inheritable: nothing an answer spawns can write to it
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # untrusted prints: discarded
    confine(job, kept, nonce)
    return nonce, job, kept

def main():
    nonce, job, result_fd = start()
    asserts = [(name, code, split(code)) for name, code in job["asserts"]]
    inputs = [literal_eval(i) for i in job["inputs"]]
    settings = (job["per_call_s"], job["give_up"], job["output_chars"], job["reverse"])
    answers = list(zip(job["sources"], job["mains"]))
    del job
    results = []
    for source, name in answers:
        try:
            results.append(None if source is None else run_both(source, name, inputs, asserts, *settings))
        except BaseException:
            results.append(None)
    send(result_fd, nonce, {"results": results})
    try:
        killpg(0, SIGKILL)  # with whatever an answer spawned (its own process group)
    finally:
        exit_now(0)  # no atexit handler or thread an answer left behind runs

def run_script():  # a whole script as __main__ (run_script below): its stderr is what the parent reads
    nonce, job, out = start()  # `out` becomes the script's stderr
    text = job["script"]
    del nonce, job
    os.dup2(out, 2)
    os.close(out)
    code = compile(text, "check.py", "exec")  # a syntax error is the script's own traceback
    module = type(sys)("__main__")
    module.__builtins__ = answer_builtins
    sys.modules["__main__"] = module
    sys.argv[:] = ["check.py"]
    exec(code, vars(module))  # what it raises ends this interpreter as it would end `python check.py`
"""


def _boot(entry: str) -> str:
    """The child's `-c` code: the harness in a namespace of its own, then its function `entry`."""
    return (
        "import builtins\n"
        f"exec(compile({_HARNESS + entry + '()' + chr(10)!r}, '<harness>', 'exec'), "
        "{'__builtins__': dict(vars(builtins)), '__name__': '__harness__'})"
    )


_BOOT = _boot("main")
# -I without -E: the environment is ours (_ENV), and PYTHONHASHSEED in it must be honoured.
_COMMAND = (sys.executable, "-P", "-s", "-S", "-B", "-c", _BOOT)
_SCRIPT_COMMAND = (*_COMMAND[:-1], _boot("run_script"))
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
) -> dict[str, Any] | None:
    """The child's job; None when there is nothing to run (no Python, or neither inputs nor asserts).
    `give_up`: timeouts after which an answer is not called again (None: every call is made);
    `reverse`: run each answer a second time, fresh, with the calls in the opposite order."""
    if all(s is None for s in sources) or not (inputs or asserts):
        return None
    targets = [n for a in asserts if (n := _called_name(a))]
    return {
        "sources": list(sources),
        "mains": [_main_name(s, targets) for s in sources],
        "inputs": list(inputs),
        "asserts": [[_called_name(a), a] for a in asserts],
        "per_call_s": per_call_s,
        "cpu_s": int(timeout_s) + 1,
        "give_up": give_up,
        "reverse": reverse,
        "output_chars": OUTPUT_CHARS,
    }


def _parse(
    results: list[Any] | None, sources: Sequence[str | None], inputs: Sequence[str], asserts: Sequence[str]
) -> list[Behaviour | None]:
    """The child's results as one Behaviour per source; all None if they are missing or malformed."""
    behaviours: list[Behaviour | None] = []
    try:
        for result in results or []:
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


# The children running now (their pids, each leading its own process group): kill_running's.
_RUNNING: set[int] = set()
_RUNNING_LOCK = threading.Lock()


def kill_running() -> int:
    """Kill every sandbox child of this process running now, with what it spawned; how many. For a
    caller that stops while a thread still waits on a child (calibrate's Ctrl-C during a code grade):
    the wait then ends at once instead of at the child's timeout."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for pid in running:
        _kill(pid)
    return len(running)


@functools.cache
def _undumpable() -> bool:
    """Makes this process non-dumpable (prctl PR_SET_DUMPABLE 0), once: its /proc/<pid>/environ, where
    a worker's API keys are, can then not be read by a child of the same uid. Linux only, best effort;
    the cost (no debugger or py-spy attaches, no core dump) is in the module docstring."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        done = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        done = False
    if not done:
        _log.warning(
            "code sandbox: could not make this process non-dumpable; a code answer may read its environment"
        )
    return done


@functools.cache
def _warn_once(message: str) -> None:
    _log.warning("code sandbox: %s; no code answer is run", message)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _drain(fd: int, into: bytearray) -> bool:
    """Reads what non-blocking `fd` holds now into `into` (stopping past MAX_RESULT_BYTES); False at
    end of file."""
    while len(into) <= MAX_RESULT_BYTES:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        into += chunk
    return True


def _exchange(proc: subprocess.Popen[bytes], message: bytes, timeout_s: float) -> bytes | None:
    """Sends `message` to the child's stdin and returns what it wrote to stdout by the time it exited;
    None when it did not exit within `timeout_s` or wrote more than MAX_RESULT_BYTES. The end is the
    child's exit, not the end of its stdout: a process it forked may hold that pipe open for as long
    as it lives."""
    assert proc.stdin is not None and proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    pending, received = memoryview(message), bytearray()
    stdin, stdout = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(stdin, False)
    os.set_blocking(stdout, False)
    exits = _pidfd(proc.pid)
    with selectors.DefaultSelector() as selector:
        selector.register(stdin, selectors.EVENT_WRITE)
        selector.register(stdout, selectors.EVENT_READ)
        if exits is not None:
            selector.register(exits, selectors.EVENT_READ)
        try:
            while (left := deadline - time.monotonic()) > 0:
                ready = {
                    key.fd for key, _ in selector.select(left if exits is not None else min(left, _POLL_S))
                }
                if stdin in ready:
                    try:
                        pending = pending[os.write(stdin, pending) :]
                    except BlockingIOError:
                        pass
                    except OSError:  # it stopped reading (it exited): what is left is not needed
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(stdin)
                        proc.stdin.close()
                if stdout in ready and not _drain(stdout, received):
                    selector.unregister(stdout)  # end of file: the exit is still what ends the wait
                if len(received) > MAX_RESULT_BYTES:
                    return None
                if (exits in ready) if exits is not None else proc.poll() is not None:
                    _drain(stdout, received)  # all it wrote before it exited is in the pipe
                    return bytes(received) if len(received) <= MAX_RESULT_BYTES else None
            return None
        finally:
            if exits is not None:
                os.close(exits)


def _converse(
    job: dict[str, Any], timeout_s: float, command: Sequence[str]
) -> tuple[bytes, bytes | None, int | None] | None:
    """Runs `command` as the sandbox child on `job`, sent after a fresh nonce on its stdin: as root the
    child becomes SANDBOX_UID before any untrusted code runs (it is told to, in the job); else this
    process is made non-dumpable. The child's whole process group is killed when it is done, however
    it ended. Returns the nonce, what the child wrote to stdout by the time it exited (None when it did
    not exit within `timeout_s` or wrote more than MAX_RESULT_BYTES) and its exit status (None if it
    was not reaped); None when it could not start."""
    as_root = os.geteuid() == 0
    if not as_root:
        _undumpable()
    nonce = secrets.token_hex(16).encode()
    drop_to = [SANDBOX_UID, SANDBOX_GID] if as_root else None
    message = nonce + b"\n" + json.dumps({**job, "drop_to": drop_to}).encode()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as cwd:
        if as_root:
            try:
                os.chown(cwd, SANDBOX_UID, SANDBOX_GID)  # its working directory is its own
            except OSError as exc:
                _warn_once(f"cannot give uid {SANDBOX_UID} its working directory: {exc}")
                return None
        # started and registered under the lock: a kill_running that comes while the child is being
        # forked waits for its pid, instead of missing a child that exists but is not registered yet
        with _RUNNING_LOCK:
            try:
                proc = subprocess.Popen(command, cwd=cwd, **_SPAWN)
            except OSError:
                return None
            _RUNNING.add(proc.pid)
        try:
            sent = _exchange(proc, message, timeout_s)
        finally:
            _kill(proc.pid)  # always: what it spawned must not outlive it, even when it exited by itself
            with _RUNNING_LOCK:
                _RUNNING.discard(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_REAP_S)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
    return nonce, sent, proc.returncode


def _results(job: dict[str, Any], timeout_s: float, command: Sequence[str] = _COMMAND) -> list[Any] | None:
    """The child's results for `job` (one per source); None if it could not start, did not exit within
    `timeout_s`, died, or what it wrote does not start with this run's nonce (an answer wrote to the
    result descriptor). `command` is the child (tests run other children through the same exchange).
    Who runs it and how it ends: :func:`_converse`."""
    child = _converse(job, timeout_s, command)
    if child is None:
        return None
    reply = _reply(*child[:2])
    if reply is None:
        return None
    if "error" in reply:
        _warn_once(str(reply["error"]))
        return None
    results = reply.get("results")
    return results if isinstance(results, list) else None


def _reply(nonce: bytes, sent: bytes | None) -> dict[str, Any] | None:
    """The harness's JSON object after this run's nonce; None when the child wrote none (an answer
    writing to the result descriptor cannot know the nonce)."""
    if sent is None or not sent.startswith(nonce + b"\n"):
        return None
    try:
        reply = json.loads(sent[len(nonce) + 1 :])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def run_script(text: str, timeout_s: float) -> tuple[int | None, str]:
    """`text` run whole as a Python script (`__main__`, stdlib only) in the answers' sandbox child:
    the same flags, environment, limits, uid and process-group kill (see the module docstring), for
    worker-written code run as a program rather than called function by function (the builder's
    tests, router/compose/builder.py). Returns its exit status and the last line it wrote to stderr
    (a traceback's last line; "" when none). The status is None when it did not run to its end, and
    the line then says why: "did not finish in N s", or "could not be run: ..."."""
    started = time.monotonic()
    child = _converse({"script": text, "cpu_s": int(timeout_s) + 1}, timeout_s, _SCRIPT_COMMAND)
    if child is None:
        return None, "could not be run: the sandbox child did not start"
    nonce, sent, status = child
    if sent is None:
        if time.monotonic() - started >= timeout_s:
            return None, f"did not finish in {timeout_s:g} s"
        return None, f"could not be run: it wrote more than {MAX_RESULT_BYTES >> 20} MiB to stderr"
    if sent.startswith(nonce + b"\n"):  # the child refused before the script ran (it could not switch)
        reply = _reply(nonce, sent)
        reason = (
            str(reply["error"]) if reply is not None and "error" in reply else "the sandbox child refused"
        )
        _warn_once(reason)
        return None, f"could not be run: {reason}"
    if status is None:
        return None, "could not be run: the sandbox child was not reaped"
    lines = sent.decode("utf-8", "replace").strip().splitlines()
    return status, lines[-1] if lines else ""


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
    return _parse(_results(job, timeout_s), sources, inputs, asserts)


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
    results = _results(job, timeout_s)
    if results is None:  # the child died, ran out of time, or refused to run
        return None
    try:
        (result,) = results
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
    except Exception:  # malformed
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
