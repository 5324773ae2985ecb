"""The one in-memory shape of routing data, and the file-reading rules every loader shares.

Every data format (RouteLLM, RouterBench, LLMRouter, the ledger) becomes a :class:`RoutingDataset`:
questions × workers with a label per cell, so splits, metrics and strategies never see a CSV quirk.
The readers here are shared so that all loaders fail the same way: a structurally broken file raises
``ValueError`` naming the file and the line, because a silently half-loaded file is worse than a loud
failure; a blank cell is NaN, never read as wrong.

:func:`estimate_costs` is the one "characters / 4 tokens at list prices" estimate, for the formats
that record no per-query cost (RouteLLM, LLMRouter).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from router.features import TEXT_RULES, TEXT_WHOLE

CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class RoutingDataset:
    """Questions x workers: `labels[i, j]` is how well worker j did on question i (1 = correct).

    `response_chars[i, j]` is the length of worker j's recorded answer where the source has it (GSM8K,
    and any dataset with `responses`, from which it is taken when not given), NaN elsewhere; the evaluation
    uses it for per-query output-token costs, training for each worker's expected answer length
    (:meth:`output_tokens`). `ids` are stable row ids ("mmlu/anatomy:3" = 4th question of that file,
    "mt_bench:81" = question_id 81) for tracing. `text_rule` says which part of each query `texts`
    holds (router/features.py TEXT_RULES: "whole" message, or its "last_paragraph"), so that a model
    trained on them reads the same part of a live query.
    """

    name: str
    texts: list[str]
    workers: list[str]
    labels: np.ndarray
    groups: list[str]
    turns: list[int]
    meta: dict = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    response_chars: np.ndarray | None = None
    # USD per (question, worker) where the source records it (RouterBench) or prices it (LLMRouter);
    # None when the dataset carries no costs (RouteLLM: the evaluation estimates them from tokens).
    costs: np.ndarray | None = None
    # Each worker's recorded answer per question (RouterBench, GSM8K), for replaying answer-aware plans;
    # None when the source records only scores.
    responses: list[list[str]] | None = None
    text_rule: str = TEXT_WHOLE

    def __post_init__(self) -> None:
        n, k = len(self.texts), len(self.workers)
        labels = np.asarray(self.labels, dtype=float)
        if labels.shape != (n, k):
            raise ValueError(f"labels has shape {labels.shape}, expected ({n}, {k})")
        if len(self.groups) != n or len(self.turns) != n:
            raise ValueError(f"groups ({len(self.groups)}) and turns ({len(self.turns)}) must have {n} rows")
        object.__setattr__(self, "labels", labels)
        if not self.ids:
            object.__setattr__(self, "ids", [f"{self.name}:{i}" for i in range(n)])
        elif len(self.ids) != n:
            raise ValueError(f"ids has {len(self.ids)} rows, expected {n}")
        chars = self.response_chars
        if chars is None and self.responses is not None and [len(r) for r in self.responses] == [k] * n:
            chars = [[float(len(answer)) for answer in row] for row in self.responses]
        chars = np.full((n, k), np.nan) if chars is None else np.asarray(chars, dtype=float)
        if chars.shape != (n, k):
            raise ValueError(f"response_chars has shape {chars.shape}, expected ({n}, {k})")
        object.__setattr__(self, "response_chars", chars)
        if self.costs is not None:
            costs = np.asarray(self.costs, dtype=float)
            if costs.shape != (n, k):
                raise ValueError(f"costs has shape {costs.shape}, expected ({n}, {k})")
            object.__setattr__(self, "costs", costs)
        if self.responses is not None and (
            len(self.responses) != n or any(len(r) != k for r in self.responses)
        ):
            raise ValueError(f"responses must be {n} rows of {k} answers")
        if self.text_rule not in TEXT_RULES:
            raise ValueError(f"unknown text rule {self.text_rule!r}; known: {', '.join(TEXT_RULES)}")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def parts(self) -> list[str]:
        """The source benchmark of each row ("mmlu", "gsm8k", "mt_bench"): the group up to the first '/'."""
        return [g.split("/", 1)[0] for g in self.groups]

    def output_tokens(self) -> dict[str, float]:
        """Each worker's median recorded answer length in tokens (characters / 4), for the workers whose
        answers the data records: what a trained router expects a worker to write (its live cost)."""
        assert self.response_chars is not None  # set in __post_init__
        out: dict[str, float] = {}
        for j, worker in enumerate(self.workers):
            chars = self.response_chars[:, j]
            chars = chars[np.isfinite(chars)]
            if chars.size:
                out[worker] = float(np.median(chars) / CHARS_PER_TOKEN)
        return out

    def worker_index(self, worker: str) -> int:
        try:
            return self.workers.index(worker)
        except ValueError:
            raise KeyError(f"unknown worker {worker!r}; dataset has {self.workers}") from None

    def subset(self, idx: Sequence[int] | np.ndarray) -> RoutingDataset:
        """Rows `idx` (integer indices or a boolean mask), in that order; meta is shared plus the parent size."""
        index = np.asarray(idx)
        if index.dtype == bool:
            if index.shape != (len(self),):
                raise ValueError(f"boolean mask has shape {index.shape}, expected ({len(self)},)")
            index = np.flatnonzero(index)
        index = index.astype(int, copy=False)
        rows = index.tolist()
        assert self.response_chars is not None  # set in __post_init__
        return RoutingDataset(
            name=self.name,
            texts=[self.texts[i] for i in rows],
            workers=list(self.workers),
            labels=self.labels[index],
            groups=[self.groups[i] for i in rows],
            turns=[self.turns[i] for i in rows],
            meta={**self.meta, "subset_of_rows": len(self)},
            ids=[self.ids[i] for i in rows],
            response_chars=self.response_chars[index],
            costs=None if self.costs is None else self.costs[index],
            responses=None if self.responses is None else [self.responses[i] for i in rows],
            text_rule=self.text_rule,
        )

    def in_worker_order(self, workers: Sequence[str]) -> RoutingDataset:
        """The same rows with label and cost columns in the order of ``workers`` (the same set)."""
        order = [self.workers.index(w) for w in workers]
        assert self.response_chars is not None
        return RoutingDataset(
            name=self.name,
            texts=self.texts,
            workers=list(workers),
            labels=self.labels[:, order],
            groups=self.groups,
            turns=self.turns,
            meta=self.meta,
            ids=self.ids,
            response_chars=self.response_chars[:, order],
            costs=None if self.costs is None else self.costs[:, order],
            responses=None if self.responses is None else [[r[j] for j in order] for r in self.responses],
            text_rule=self.text_rule,
        )


def single_turn(
    name: str,
    texts: list[str],
    workers: Sequence[str],
    labels: list[list[float]],
    groups: list[str],
    ids: list[str],
    costs: np.ndarray,
    meta: dict[str, Any],
    responses: list[list[str]] | None = None,
    text_rule: str = TEXT_WHOLE,
) -> RoutingDataset:
    """One single-turn dataset from parsed rows (labels: a list of per-row score lists)."""
    return RoutingDataset(
        name=name,
        texts=texts,
        workers=list(workers),
        labels=np.array(labels, dtype=float).reshape(len(texts), len(workers)),
        groups=groups,
        turns=[1] * len(texts),
        ids=ids,
        costs=costs,
        meta=meta,
        responses=responses,
        text_rule=text_rule,
    )


# ------------------------------------------------------------------------------------------------- costs


def estimate_costs(
    texts: Sequence[str],
    price_in_per_m: float,
    price_out_per_m: float,
    output_tokens: np.ndarray | float,
    turns: np.ndarray | int = 1,
) -> np.ndarray:
    """Estimated USD per query: prompt tokens ~ chars / 4, `output_tokens` per turn (scalar or per query).

    For a T-turn conversation of which only the first prompt is known, every later turn resends the history,
    approximated as T prompts plus T - 1 earlier answers of input, and T answers of output.
    """
    n = len(texts)
    prompt = np.array([len(t) for t in texts], dtype=float) / CHARS_PER_TOKEN
    out = np.broadcast_to(np.asarray(output_tokens, dtype=float), (n,))
    t = np.broadcast_to(np.asarray(turns, dtype=float), (n,))
    tokens_in = t * prompt + (t - 1.0) * out
    tokens_out = t * out
    return (tokens_in * price_in_per_m + tokens_out * price_out_per_m) / 1e6


# ----------------------------------------------------------------------------------------------- readers


def read_text(path: Path) -> str:
    """UTF-8 text of `path`; a decoding error becomes a ValueError with the line number."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({exc.reason})") from None


def csv_rows(path: Path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """Header and (first line number, fields) of every record; multi-line quoted fields are fine.

    `strict=True` makes the csv module reject stray quotes and unterminated fields instead of guessing.
    """
    reader = csv.reader(io.StringIO(read_text(path), newline=""), strict=True)
    rows: list[tuple[int, list[str]]] = []
    header: list[str] | None = None
    start = 1
    try:
        for record in reader:
            if header is None:
                header = [h.strip() for h in record]
            elif record and any(cell.strip() for cell in record):
                if len(record) != len(header):
                    raise ValueError(
                        f"{path}:{start}: expected {len(header)} fields as in the header, got {len(record)}"
                    )
                rows.append((start, record))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}:{start}: malformed CSV ({exc})") from None
    if header is None:
        raise ValueError(f"{path}:1: empty file, expected a header row")
    if "prompt" not in header:
        raise ValueError(f"{path}:1: header has no 'prompt' column: {header}")
    return header, rows


class _LineCounter:
    """Line number of a position in a text, counting forward from the last query (positions ascend)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.line = text, 0, 1

    def __call__(self, pos: int) -> int:
        if pos < self.pos:
            self.pos, self.line = 0, 1
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


def json_items(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, item) for each element of a JSON array file, or each non-blank line of a JSONL file."""
    text = read_text(path)
    stripped = text.lstrip()
    decoder = json.JSONDecoder()
    if not stripped.startswith("["):
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and other Unicode line breaks.
        for line_no, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
        return
    pos = len(text) - len(stripped) + 1
    line_of = _LineCounter(text)
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            raise ValueError(f"{path}:{line_of(pos)}: JSON array is not closed")
        if text[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_of(exc.pos)}: invalid JSON ({exc.msg})") from None
        yield line_of(pos), item
        pos = end


def json_objects(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, object) per item of :func:`json_items`; an item that is not an object raises with its line."""
    out: list[tuple[int, dict[str, Any]]] = []
    for line, item in json_items(path):
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{line}: expected a JSON object, got {type(item).__name__}")
        out.append((line, item))
    return out


def number_cell(raw: str, where: str, what: str, upper: float | None) -> float:
    """A float cell: NaN when blank; ValueError naming the place when unparsable or out of range."""
    text = raw.strip()
    if not text:
        return math.nan
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {what} {raw[:40]!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (upper is not None and value > upper):
        bound = f"[0, {upper:g}]" if upper is not None else ">= 0"
        raise ValueError(f"{where}: {what} {value!r} is outside {bound}")
    return value
