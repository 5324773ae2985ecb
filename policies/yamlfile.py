"""Operator YAML files (catalog, policy): parse, validate with pydantic, name every problem."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)
MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice. YAML loaders keep the last one silently, so a second
    `rules:` block would drop the first whole (and a repeated `allow_jurisdictions` widen a rule):
    an operator's file that says a thing twice is refused instead of half-applied."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(f"line {line}: duplicate key {key!r} (first at line {first_line})")


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping (merge keys `<<` may still be
    overridden: that is what they are for). Every operator YAML file is read with it."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it with its own message
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise DuplicateKeyError(key, line, seen)
                first[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse operator YAML: safe (no object construction) and strict (no repeated keys)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass


Loc = tuple[Any, ...]
# (where, message, places the message names): `{name}` in the message is replaced by the place
# refs[name], as the file numbers it (its indexes may differ in the data a validator saw).
Problem = tuple[Loc, str, dict[str, Loc]]


class PlacedProblems(ValueError):
    """Raised by a model validator whose checks span fields (cross references): each problem keeps
    its own place (a pydantic location), so the report says `rules.1.id`, not `(top level)`."""

    def __init__(self, problems: Sequence[tuple[Loc, str] | Problem]) -> None:
        self.problems: list[Problem] = [(p[0], p[1], p[2] if len(p) > 2 else {}) for p in problems]
        super().__init__("; ".join(f"{_where(loc)}: {_fill(msg, refs)}" for loc, msg, refs in self.problems))


def _fill(message: str, refs: dict[str, Loc], positions: dict[Loc, list[int]] | None = None) -> str:
    for name, loc in refs.items():
        message = message.replace("{" + name + "}", _where(_original(loc, positions or {})))
    return message


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


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
        data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise error(f"{source}: {exc}: a repeated key would silently replace the first") from exc
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
        errors = [(_original(loc, positions), _fill(msg, refs, positions)) for loc, msg, refs in _placed(exc)]
        fresh = [(loc, msg) for loc, msg in errors if not any(loc[: len(p)] == p for p in pruned)]
        for loc, msg in fresh:
            line = f"{_where(loc)}: {msg}"
            if line not in problems:
                problems.append(line)
        entries = {_entry(tuple(e["loc"])) for e in exc.errors()}
        originals = {_original(entry, positions) for entry in entries}  # before the drop shifts indexes
        if not fresh or () in entries or not _drop_all(data, entries, positions):
            break  # a whole-file problem, or nothing left to set aside: report what we have
        pruned |= originals
        try:
            model.model_validate(data)
            break
        except ValidationError as again:
            exc = again
    return problems


def _placed(exc: ValidationError) -> list[Problem]:
    """Each error's (location, message, places named); a PlacedProblems error expands to its problems,
    each at the validator's location plus its own (indexes as in the data validated: _original maps
    them back to the file's)."""
    out: list[Problem] = []
    for e in exc.errors():
        loc = tuple(e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, PlacedProblems):
            out += [
                (loc + where, msg, {k: loc + v for k, v in refs.items()})
                for where, msg, refs in cause.problems
            ]
        else:
            out.append((loc, e["msg"], {}))
    return out


def _entry(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    for i, key in enumerate(loc):
        if isinstance(key, int):
            return loc[: i + 1]
    return loc[:2]


def _original(loc: Loc, positions: dict[Loc, list[int]]) -> Loc:
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
