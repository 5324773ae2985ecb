"""The RouterBench format (as re-published by RouterDC): a CSV per task, every model's score and cost.

Columns: ``sample_id``, ``prompt`` (a stringified Python list of messages), ``eval_name``, one score
column per model and a ``<model>|total_cost`` column (USD for that query); a column is a model when its
cost column exists. ``<model>|model_response`` holds each model's answer.

RouterBench prompts are few-shot: a shared block of solved examples, then the question. A router should
read the question, not the examples (MiniLM reads 128 tokens, which would be examples only), so the text
routed on is the last message's last paragraph (:func:`router.features.focus_text`); the dataset says so
(``text_rule="last_paragraph"``), a model trained on it records the rule in its card, and the live
router applies the same rule to each query. The full prompt's length is kept for costs
(``meta["prompt_chars"]``).
"""

from __future__ import annotations

import ast
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from router.features import MIN_FOCUS_CHARS, TEXT_LAST_PARAGRAPH, focus_text, query_text
from router.offline.dataset import RoutingDataset, csv_rows, number_cell, single_turn

__all__ = ["MIN_FOCUS_CHARS", "focus_text", "load_routerbench"]

COST_SUFFIX = "|total_cost"
RESPONSE_SUFFIX = "|model_response"


def _last_message(raw: str, where: str) -> str:
    """The last message of a RouterBench prompt cell (a Python list literal), or the cell itself."""
    text = raw.strip()
    if not text.startswith("["):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"{where}: prompt looks like a list but is not a valid Python literal") from None
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise ValueError(f"{where}: prompt must be a non-empty list of strings")
    return value[-1]


def _response(raw: str) -> str:
    """A recorded answer: the cell is a stringified one-element Python list; the text itself otherwise."""
    text = raw.strip()
    if text.startswith("["):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return raw
        if isinstance(value, list) and value and isinstance(value[-1], str):
            return value[-1]
    return raw


def load_routerbench(files: Sequence[str | Path]) -> RoutingDataset:
    """RouterBench CSVs (one or more, same models) as one dataset; rows in file order."""
    if not files:
        raise ValueError("no routerbench file given")
    workers: list[str] | None = None
    texts: list[str] = []
    ids: list[str] = []
    groups: list[str] = []
    prompt_chars: list[int] = []
    labels: list[list[float]] = []
    costs: list[list[float]] = []
    responses: list[list[str]] = []
    has_responses = True
    blank: Counter[str] = Counter()
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"routerbench file not found: {path}")
        header, rows = csv_rows(path)
        models = [h[: -len(COST_SUFFIX)] for h in header if h.endswith(COST_SUFFIX)]
        missing = [m for m in models if m not in header] + [c for c in ("eval_name",) if c not in header]
        if not models or missing:
            raise ValueError(
                f"{path}:1: not a RouterBench file: needs 'prompt', 'eval_name' and per model a score "
                f"column plus '<model>{COST_SUFFIX}'" + (f"; missing {missing}" if missing else "")
            )
        if workers is None:
            workers = models
        elif sorted(models) != sorted(workers):
            raise ValueError(
                f"{path}:1: models {sorted(models)} differ from the first file's {sorted(workers)}"
            )
        col = {h: i for i, h in enumerate(header)}
        has_responses = has_responses and all(m + RESPONSE_SUFFIX in col for m in workers)
        id_col = col.get("sample_id")
        for ordinal, (line, record) in enumerate(rows):
            where = f"{path}:{line}"
            message = _last_message(record[col["prompt"]], where)
            if not message.strip():
                raise ValueError(f"{where}: blank prompt")
            row_labels, row_costs = [], []
            for model in workers:
                score = number_cell(record[col[model]], where, f"score of {model}", 1.0)
                cost = number_cell(record[col[model + COST_SUFFIX]], where, f"cost of {model}", None)
                if math.isnan(score):
                    blank[model] += 1
                row_labels.append(score)
                row_costs.append(cost)
            texts.append(query_text(message, TEXT_LAST_PARAGRAPH))
            prompt_chars.append(len(message))
            groups.append(record[col["eval_name"]].strip() or path.stem)
            ids.append(record[id_col].strip() if id_col is not None else f"{path.stem}:{ordinal}")
            labels.append(row_labels)
            costs.append(row_costs)
            if has_responses:
                responses.append([_response(record[col[m + RESPONSE_SUFFIX]]) for m in workers])
    assert workers is not None
    return single_turn(
        "routerbench",
        texts,
        workers,
        labels,
        groups,
        ids,
        np.array(costs, dtype=float).reshape(len(texts), len(workers)),
        {
            "format": "routerbench",
            "files": [str(f) for f in files],
            "blank_score_cells": dict(blank),
            "prompt_chars": prompt_chars,
            "text": "last paragraph of the last message (few-shot examples dropped)",
            "responses": has_responses,
        },
        responses if has_responses else None,
        text_rule=TEXT_LAST_PARAGRAPH,
    )
