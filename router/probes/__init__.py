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

import hashlib
import json
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
    """A probe file that cannot be used; the message names the file and line."""


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
        elif not self.tests:
            raise ValueError("a code probe needs tests (single-line asserts)")
        return self


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
            probe = Probe.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as exc:
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise ProbeError(f"{path}:{number}: not a valid probe: {detail}") from None
        if probe.id in seen:
            raise ProbeError(f"{path}:{number}: probe id {probe.id!r} appears twice")
        seen.add(probe.id)
        probes.append(probe)
    if not probes:
        raise ProbeError(f"{path}: holds no probe")
    version = "probes-" + hashlib.sha256(raw).hexdigest()[:12]
    return ProbeSet(tuple(probes), version, str(path))


__all__ = ["TYPES", "Probe", "ProbeError", "ProbeSet", "ProbeType", "default_path", "load_probes"]
