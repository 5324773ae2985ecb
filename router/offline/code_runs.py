"""Code answers run once per answer, so that a replay can key any plan state's answers by behaviour.

Live, the gateway runs the answers of the workers it called, together in one child, on the inputs
harvested from the prompt and from those answers (router/code_behaviour.py). A replay asks that for
thousands of states per query, so each recorded answer is run once, alone in its own child, on every
input any set of answers could harvest, with every call made (no give-up after timeouts) and made
again in the opposite order (:func:`run_outcomes`). Its result on an input is then a fact about that
answer alone, and :meth:`CodeRuns.keys` rebuilds what the live child would report for a state: the
inputs harvested from the state's answers only, the give-up rule applied to that list
(:meth:`Outcomes.behaviour`), and every answer None (text keys) when one of them kills the child.
No answer the plan did not pay for, nor an input only such an answer proposed, changes a state.

An answer whose table cannot stand for it (its child died or ran out of time, say an ``os._exit`` on
one input; or the two orders disagree: it keeps state between calls, or is random) is run per state
instead, alone on that state's inputs as live (memoised per input list, not cached on disk).

What is not replayed: the live child's wall-clock and CPU budget shared by the state's answers,
answers tampering with each other in the shared interpreter (router/code_behaviour.py does not
guarantee isolation there), and outputs that print a memory address (``<generator object … at
0x…>``), which differ from process to process live too. Results are cached on disk per query and its answers; ``VERSION`` is
part of the key, so entries written under another scheme are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from router.answers import Kind, detect_kind, python_source
from router.code_behaviour import (
    Behaviour,
    Outcomes,
    harvest_inputs,
    keys_from,
    prompt_asserts,
    run_behaviour,
    run_outcomes,
)

EVERY_INPUT = 10_000  # no limit when harvesting for the table: each state applies its own
VERSION = 4  # 1: all answers in one child, give-up rule applied on the union of inputs; 2: outputs cut to
# 300 characters, asserts judged by the answer's own ==; 3: as root, packages imported before the switch
# to nobody could not import their submodules (`from collections.abc import ...`, `typing`)
PER_STATE_TIMEOUT_S = 10.0  # an answer replayed per state: its own child's limit (live: 5 s for all)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "polyroute" / "code-runs"


@dataclass
class CodeRuns:
    """One query's code answers and, per answer, its :class:`Outcomes` on every harvestable input
    (None: no Python, or it must be run per state)."""

    query: str
    answers: Sequence[str]
    inputs: list[str]
    outcomes: list[Outcomes | None]
    _keys: dict[tuple[int, ...], tuple[list[str | None], list[float | None]]] = field(default_factory=dict)
    _per_state: dict[tuple[int, tuple[str, ...]], Behaviour | None] = field(default_factory=dict)

    def keys(self, members: Sequence[int]) -> tuple[list[str | None], list[float | None]]:
        """Behaviour keys and assert pass shares of the answers ``members`` (in the order called), as
        the gateway computes them holding only those answers (router/code_behaviour.behaviour_keys)."""
        cached = self._keys.get(tuple(members))
        if cached is not None:
            return cached
        texts = [self.answers[j] for j in members]
        sources = [python_source(t) for t in texts]
        inputs = harvest_inputs(self.query, texts)
        asserts = prompt_asserts(self.query)
        behaviours: list[Behaviour | None] = [None] * len(members)
        if any(s is not None for s in sources) and (inputs or asserts):  # live: else no child runs
            for n, (j, source) in enumerate(zip(members, sources, strict=True)):
                if source is None:
                    continue
                table = self.outcomes[j]
                found = table.behaviour(inputs) if table is not None else None
                if found is None:
                    found = self._run_alone(j, source, inputs, asserts)
                    if found is None:  # it kills the child: live, every answer in it is lost
                        behaviours = [None] * len(members)
                        break
                behaviours[n] = found
        result = keys_from(texts, sources, inputs, behaviours)
        self._keys[tuple(members)] = result
        return result

    def _run_alone(self, j: int, source: str, inputs: list[str], asserts: list[str]) -> Behaviour | None:
        """Answer j alone in a live child on ``inputs``; None when the child died or timed out."""
        memo = (j, tuple(inputs))
        if memo not in self._per_state:
            (found,) = run_behaviour([source], inputs, asserts, timeout_s=PER_STATE_TIMEOUT_S)
            self._per_state[memo] = found
        return self._per_state[memo]


def _entry_path(query: str, answers: Sequence[str], directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps([VERSION, query, list(answers)]).encode()).hexdigest()[:32]
    return directory / f"{digest}.json"


def _load(path: Path, query: str, answers: Sequence[str]) -> CodeRuns | None:
    """The cached runs at ``path``; None when missing or damaged (then they are recomputed)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        inputs = [str(i) for i in saved["inputs"]]
        outcomes = [
            None
            if o is None
            else Outcomes(
                tuple(inputs),
                tuple(str(x) for x in o["outputs"]),
                tuple(bool(t) for t in o["timed_out"]),
                tuple(str(v) for v in o["asserts"]),
            )
            for o in saved["outcomes"]
        ]
        if len(outcomes) != len(answers):
            return None
        return CodeRuns(query, answers, inputs, outcomes)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_one(query: str, answers: Sequence[str], directory: Path) -> CodeRuns:
    path = _entry_path(query, answers, directory)
    loaded = _load(path, query, answers)
    if loaded is not None:
        return loaded
    inputs = harvest_inputs(query, answers, limit=EVERY_INPUT)
    asserts = prompt_asserts(query)
    outcomes = [
        None if (source := python_source(a)) is None else run_outcomes(source, inputs, asserts)
        for a in answers
    ]
    directory.mkdir(parents=True, exist_ok=True)
    saved = [
        None if o is None else {"outputs": o.outputs, "timed_out": o.timed_out, "asserts": o.asserts}
        for o in outcomes
    ]
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps({"version": VERSION, "inputs": inputs, "outcomes": saved}))
    os.replace(tmp, path)
    return CodeRuns(query, answers, inputs, outcomes)


def code_runs_for(
    queries: Sequence[str],
    responses: Sequence[Sequence[str]],
    *,
    directory: Path | None = None,
    workers: int = 2,
    progress: Callable[[int], None] | None = None,
) -> dict[int, CodeRuns]:
    """:class:`CodeRuns` for every query that asks for code (query index → runs)."""
    directory = directory or cache_dir()
    wanted = [i for i, q in enumerate(queries) if detect_kind(q) is Kind.CODE]

    def one(i: int) -> tuple[int, CodeRuns]:
        runs = _run_one(queries[i], responses[i], directory)
        if progress is not None:
            progress(1)
        return i, runs

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(pool.map(one, wanted))
