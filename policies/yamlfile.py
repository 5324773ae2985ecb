"""Operator YAML files (catalog, policy): parse, validate with pydantic, name every problem."""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)

# Each round drops the entries that failed and validates the rest again; a file with errors at more
# levels than this is reported with what the rounds found.
MAX_ROUNDS = 6


def parse_yaml_model(text: str, source: str, model: type[Model], what: str, error: type[Exception]) -> Model:
    """One parse for every operator file, so each reports errors the same way: file, field, message.

    Every problem is reported at once: pydantic stops before the file's cross-reference checks (unknown
    data classes, jurisdictions, duplicate ids) when any field is malformed, so the entries that failed
    are set aside and the rest is validated again until no new problem turns up.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{source}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{source}: expected a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = every_problem(model, data, exc)
        raise error(f"{source}: invalid {what}: {'; '.join(problems)}") from exc


def every_problem(model: type[BaseModel], data: dict, first: ValidationError) -> list[str]:
    """The first error's problems, then those found once the failing entries are set aside.

    An entry is a list item (a rule, a worker) or, outside lists, a top-level field's entry (a tenant,
    a detection table): dropping it whole keeps one bad field from making its entry look empty.
    Locations are reported in the file's own terms: list indexes are those before any drop.
    """
    problems: list[str] = []
    pruned: set[tuple[Any, ...]] = set()
    data = copy.deepcopy(data)
    positions: dict[tuple[Any, ...], list[int]] = {}  # list path -> original index of each item left
    exc = first
    for _ in range(MAX_ROUNDS):
        errors = [(_original(tuple(e["loc"]), positions), e["msg"]) for e in exc.errors()]
        fresh = [(loc, msg) for loc, msg in errors if not any(loc[: len(p)] == p for p in pruned)]
        for loc, msg in fresh:
            line = f"{'.'.join(str(p) for p in loc) or '(top level)'}: {msg}"
            if line not in problems:
                problems.append(line)
        entries = {_entry(tuple(e["loc"])) for e in exc.errors()}
        if not fresh or () in entries or not _drop_all(data, entries, positions):
            break  # a whole-file problem, or nothing left to set aside: report what we have
        pruned |= {_original(entry, positions) for entry in entries}
        try:
            model.model_validate(data)
            break
        except ValidationError as again:
            exc = again
    return problems


def _entry(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    for i, key in enumerate(loc):
        if isinstance(key, int):
            return loc[: i + 1]
    return loc[:2]


def _original(loc: tuple[Any, ...], positions: dict[tuple[Any, ...], list[int]]) -> tuple[Any, ...]:
    out: list[Any] = []
    for i, key in enumerate(loc):
        index_map = positions.get(loc[:i])
        out.append(index_map[key] if isinstance(key, int) and index_map and key < len(index_map) else key)
    return tuple(out)


def _drop_all(data: dict, entries: set[tuple[Any, ...]], positions: dict[tuple[Any, ...], list[int]]) -> bool:
    """Remove each entry (list items from the highest index down); False when none could be removed."""
    dropped = False
    for loc in sorted(
        entries, key=lambda e: [str(k) if not isinstance(k, int) else f"{k:09d}" for k in e], reverse=True
    ):
        parent: Any = data
        for key in loc[:-1]:
            try:
                parent = parent[key]
            except (KeyError, IndexError, TypeError):
                parent = None
                break
        last = loc[-1]
        if isinstance(parent, dict) and last in parent:
            del parent[last]
            dropped = True
        elif isinstance(parent, list) and isinstance(last, int) and 0 <= last < len(parent):
            index_map = positions.setdefault(loc[:-1], list(range(len(parent))))
            del parent[last]
            del index_map[last]
            dropped = True
    return dropped
