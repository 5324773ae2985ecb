"""Code answers run once per query, so that a replay can key any state's answers by behaviour.

Live, the gateway runs the answers of the workers it called on the inputs harvested from the
prompt and from those answers (router/code_behaviour.py). A replay asks that for thousands of states
per query, so each query's recorded answers are run once, on every input any subset of them could
harvest, and :meth:`CodeRuns.keys` then looks the state's outputs up: the inputs are harvested from
the state's answers only, exactly as live. Results are cached on disk (running 300 MBPP queries'
11 answers takes a minute or two), keyed by the query and its answers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from router.answers import Kind, detect_kind, python_source
from router.code_behaviour import Behaviour, harvest_inputs, keys_from, prompt_asserts, run_behaviour

EVERY_INPUT = 10_000  # no limit when harvesting for the table: each state applies its own


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "polyroute" / "code-runs"


@dataclass
class CodeRuns:
    """One query's code answers and their outputs on every harvestable input."""

    query: str
    answers: Sequence[str]
    inputs: list[str]
    outputs: list[list[str] | None]  # per answer, per input; None: it could not be run
    passes: list[float | None]
    _keys: dict[tuple[int, ...], tuple[list[str | None], list[float | None]]] = field(default_factory=dict)

    def keys(self, members: Sequence[int]) -> tuple[list[str | None], list[float | None]]:
        """Behaviour keys and assert pass shares of the answers ``members``, as the gateway would
        compute them holding only those answers."""
        cached = self._keys.get(tuple(members))
        if cached is not None:
            return cached
        texts = [self.answers[j] for j in members]
        inputs = harvest_inputs(self.query, texts)
        at = {inp: n for n, inp in enumerate(self.inputs)}
        behaviours: list[Behaviour | None] = []
        for j in members:
            outputs = self.outputs[j]
            if outputs is None or any(inp not in at for inp in inputs):
                behaviours.append(None)
            else:
                behaviours.append(Behaviour(tuple(outputs[at[inp]] for inp in inputs), self.passes[j]))
        result = keys_from(texts, [python_source(t) for t in texts], inputs, behaviours)
        self._keys[tuple(members)] = result
        return result


def _run_one(query: str, answers: Sequence[str], directory: Path) -> CodeRuns:
    digest = hashlib.sha256(json.dumps([query, list(answers)]).encode()).hexdigest()[:32]
    path = directory / f"{digest}.json"
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            return CodeRuns(query, answers, saved["inputs"], saved["outputs"], saved["passes"])
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is recomputed
    inputs = harvest_inputs(query, answers, limit=EVERY_INPUT)
    sources = [python_source(a) for a in answers]
    behaviours = run_behaviour(sources, inputs, prompt_asserts(query), timeout_s=30.0)
    outputs = [list(b.outputs) if b is not None else None for b in behaviours]
    passes = [b.assert_pass if b is not None else None for b in behaviours]
    runs = CodeRuns(query, answers, inputs, outputs, passes)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"inputs": inputs, "outputs": outputs, "passes": passes}))
    os.replace(tmp, path)
    return runs


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
