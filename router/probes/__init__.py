"""The calibration probe set: public questions with gold answers, and a stable way to pick from it.

`polyroute router calibrate` sends probes to workers, grades their answers (router/grading.py) and
fits the workers' quality vectors on the grades. The set shipped here (`probes.jsonl`, built by
`python -m router.probes.build`, sources and licenses in README.md) has four answer types, so a
worker is measured on what the router has to tell apart: multiple choice, a number, a short answer
(normalised match) and code run against its tests.

Picking is deterministic and stratified: `ProbeSet.ordered(seed)` interleaves the types, and within
a type its tasks, each task's probes in a seeded order; `select(n)` is the first n of that order. So
200 probes hold about 50 of each type, and a larger `n` extends a smaller one (a rerun with more
probes only adds probes, the ones already graded are kept).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ProbeType = Literal["choice", "number", "match", "code"]
TYPES: tuple[ProbeType, ...] = ("choice", "number", "match", "code")


class ProbeError(ValueError):
    """A probe file that cannot be used; the message names the file, the line and the probe id."""


class Probe(BaseModel):
    """One labelled question: the prompt sent as a single user message, and how to grade the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    task: str = Field(min_length=1)
    type: ProbeType
    source: str = Field(min_length=1, description="a key of README.md's source table")
    prompt: str = Field(min_length=1)
    gold: str | list[str] | None = None  # choice: a letter; number: "12", "-0.5", "3/4"; match: aliases
    grader: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int = Field(ge=1, le=32_768)
    tests: list[str] = Field(default_factory=list)  # code: single-line asserts
    setup: str | None = None  # code: run before the answer (a stub's imports and helpers)

    @model_validator(mode="after")
    def _gradable(self) -> Probe:
        """Refuse at load time what router/grading.py could not grade: `calibrate` would pay for the
        call first and then fail (or score every answer 0) on the probe's own mistake."""
        _check_grader(self.type, self.grader)
        if self.type == "choice":
            letters = str(self.grader.get("letters", "ABCD"))
            if not isinstance(self.gold, str) or self.gold not in letters or len(self.gold) != 1:
                raise ValueError(f"a choice probe's gold must be one of its letters {letters!r}")
        elif self.type == "number":
            from router.grading import parse_number  # the grader's own reading of a number

            if not isinstance(self.gold, str) or parse_number(self.gold) is None:
                raise ValueError(f"a number probe's gold must be a number, got {self.gold!r}")
        elif self.type == "match":
            if not isinstance(self.gold, list) or not any(str(g).strip() for g in self.gold):
                raise ValueError("a match probe's gold must be a non-empty list of accepted answers")
            from router.answers import span_key  # the grader's own normalisation

            empty = [g for g in self.gold if span_key(str(g)) is None]
            if empty:
                raise ValueError(
                    f"a match probe's accepted answer {empty[0]!r} is empty once normalised "
                    "(case, punctuation and articles are dropped): nothing could match it"
                )
        else:
            _check_code(self.tests, self.setup)
        return self


# The parameters each grader reads (router/grading.py's `grade`); anything else is a typo that would
# silently fall back to a default.
_GRADER_KEYS: dict[str, tuple[str, ...]] = {
    "choice": ("letters",),
    "number": ("rel_tol",),
    "match": ("partial",),
    "code": ("entry_point", "timeout_s", "per_call_s"),
}


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_grader(kind: str, grader: dict[str, Any]) -> None:
    unknown = sorted(set(grader) - set(_GRADER_KEYS[kind]))
    if unknown:
        raise ValueError(
            f"a {kind} probe's grader does not take {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(map(repr, _GRADER_KEYS[kind]))})"
        )
    if "letters" in grader:
        letters = grader["letters"]
        if (
            not isinstance(letters, str)
            or len(letters) < 2
            or len(set(letters)) != len(letters)
            or any(c not in "ABCDEFGHIJ" for c in letters)
        ):
            raise ValueError(f"grader letters must be two or more distinct letters of A-J, got {letters!r}")
    if "rel_tol" in grader and not (_real(grader["rel_tol"]) and grader["rel_tol"] >= 0):
        raise ValueError(f"grader rel_tol must be a number >= 0, got {grader['rel_tol']!r}")
    if "partial" in grader and grader["partial"] not in ("f1", None):
        raise ValueError(f'grader partial must be "f1" or null, got {grader["partial"]!r}')
    for key in ("timeout_s", "per_call_s"):
        if key in grader and not (_real(grader[key]) and grader[key] > 0):
            raise ValueError(f"grader {key} must be a number of seconds > 0, got {grader[key]!r}")
    if "entry_point" in grader and not (
        isinstance(grader["entry_point"], str) and grader["entry_point"].isidentifier()
    ):
        raise ValueError(f"grader entry_point must be a Python name, got {grader['entry_point']!r}")


def _check_code(tests: list[str], setup: str | None) -> None:
    """Each test must be Python holding an assert, and the setup must be Python: otherwise every
    answer fails (or trivially passes) the probe whatever it says."""
    from router.answers import parse_python

    if not tests:
        raise ValueError("a code probe needs tests (single-line asserts)")
    for test in tests:
        tree = parse_python(test)
        if tree is None:
            raise ValueError(f"a code probe's test is not Python: {test[:80]!r}")
        if not any(isinstance(node, ast.Assert) for node in tree.body):
            raise ValueError(f"a code probe's test holds no assert: {test[:80]!r}")
    if setup is not None and parse_python(setup) is None:
        raise ValueError("a code probe's setup is not Python")


@dataclass(frozen=True)
class ProbeSet:
    probes: tuple[Probe, ...]
    version: str  # "probes-<sha256 of the file, 12 hex>": which file a ledger record was graded on
    path: str

    def __len__(self) -> int:
        return len(self.probes)

    def get(self, probe_id: str) -> Probe | None:
        return self._by_id.get(probe_id)

    @cached_property
    def _by_id(self) -> dict[str, Probe]:
        return {p.id: p for p in self.probes}

    def composition(self) -> dict[str, dict[str, int]]:
        """type -> task -> count."""
        out: dict[str, dict[str, int]] = {}
        for (kind, task), count in sorted(Counter((p.type, p.task) for p in self.probes).items()):
            out.setdefault(kind, {})[task] = count
        return out

    def ordered(self, seed: int = 0) -> list[Probe]:
        """Every probe, stratified: types take turns, within a type its tasks take turns."""
        streams = []
        for kind in TYPES:
            tasks = sorted({p.task for p in self.probes if p.type == kind})
            queues = []
            for task in tasks:
                members = sorted(
                    (p for p in self.probes if p.task == task and p.type == kind), key=lambda p: p.id
                )
                random.Random(f"{seed}:{task}").shuffle(members)
                queues.append(members)
            streams.append(list(_round_robin(queues)))
        return list(_round_robin(streams))

    def select(self, n: int, seed: int = 0) -> list[Probe]:
        if n < 1:
            raise ProbeError(f"the number of probes must be at least 1, got {n}")
        if n > len(self.probes):
            raise ProbeError(f"{self.path} holds {len(self.probes)} probes; {n} were asked for")
        return self.ordered(seed)[:n]


def _round_robin(queues: list[list[Probe]]) -> Iterator[Probe]:
    at = 0
    while any(at < len(q) for q in queues):
        for queue in queues:
            if at < len(queue):
                yield queue[at]
        at += 1


def default_path() -> Path:
    return Path(str(resources.files(__package__).joinpath("probes.jsonl")))


def load_probes(path: str | Path | None = None) -> ProbeSet:
    """Read and check a probe file (JSON lines); the shipped set when `path` is None."""
    path = Path(path) if path is not None else default_path()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read the probe file: {exc.strerror or exc}") from None
    probes: list[Probe] = []
    seen: set[str] = set()
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ProbeError(f"{path}:{number}: not a valid probe: {exc}") from None
        try:
            probe = Probe.model_validate(fields)
        except ValidationError as exc:
            named = fields.get("id") if isinstance(fields, dict) else None
            which = f" {named!r}" if isinstance(named, str) and named else ""
            raise ProbeError(f"{path}:{number}: not a valid probe{which}: {exc.errors()[0]['msg']}") from None
        if probe.id in seen:
            raise ProbeError(f"{path}:{number}: probe id {probe.id!r} appears twice")
        seen.add(probe.id)
        probes.append(probe)
    if not probes:
        raise ProbeError(f"{path}: holds no probe")
    version = "probes-" + hashlib.sha256(raw).hexdigest()[:12]
    return ProbeSet(tuple(probes), version, str(path))


__all__ = ["TYPES", "Probe", "ProbeError", "ProbeSet", "ProbeType", "default_path", "load_probes"]
