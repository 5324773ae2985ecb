"""The LLMRouter format (ulab-uiuc/LLMRouter): scores per model, tasks by query, prices per model.

* score files: a JSON list (or JSONL) of ``{question, scores: {model: 0..1}, cluster_id}``;
* optional query files: JSONL of ``{task_name, query, metric, ...}`` naming each query's task (joined on
  the query text);
* a price file (``default_llm.json``: USD per 1M input/output tokens per model).

The data has no token counts, so a query's cost is estimated (:func:`router.offline.dataset.estimate_costs`):
prompt tokens = characters / 4, output tokens by the task's answer type (:data:`LLMROUTER_OUTPUT_TOKENS`),
times the model's prices.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from router.features import TEXT_WHOLE
from router.offline.dataset import (
    RoutingDataset,
    estimate_costs,
    json_items,
    number_cell,
    read_text,
    single_turn,
)

PRICE_FILE = "default_llm.json"
# Expected output tokens per LLMRouter metric (the answer type of the task): a letter, a short span,
# a worked solution, a function, a sentence. Same for every model: the data says nothing per model.
LLMROUTER_OUTPUT_TOKENS: dict[str, float] = {
    "em_mc": 16.0,
    "f1_score": 32.0,
    "GSM8K": 256.0,
    "MATH": 384.0,
    "code_eval": 256.0,
    "commongen_coverage": 48.0,
}
LLMROUTER_DEFAULT_OUTPUT_TOKENS = 128.0  # task unknown (no query file given)


def load_prices(path: str | Path) -> dict[str, tuple[float, float]]:
    """Model -> (input, output) USD per 1M tokens from an LLMRouter ``default_llm.json``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"price file not found: {path} (give --prices FILE)")
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}:1: expected an object of model -> {{input_price, output_price}}")
    prices = {}
    for model, entry in data.items():
        try:
            prices[model] = (float(entry["input_price"]), float(entry["output_price"]))
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: model {model!r} lacks numeric input_price/output_price") from None
    return prices


def file_kind(path: Path) -> str:
    """'scores' (question + scores) or 'queries' (task_name + query), from the first item."""
    for line, item in json_items(path):
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{line}: expected a JSON object, got {type(item).__name__}")
        if "scores" in item:
            return "scores"
        if "task_name" in item and "query" in item:
            return "queries"
        raise ValueError(
            f"{path}:{line}: not an LLMRouter file: an item needs 'question' and 'scores', "
            f"or 'task_name' and 'query'; found keys {sorted(item)[:8]}"
        )
    raise ValueError(f"{path}:1: empty file")


def load_llmrouter(files: Sequence[str | Path], prices: str | Path | None = None) -> RoutingDataset:
    """LLMRouter score files (+ optional query files naming tasks) as one dataset with estimated costs.

    ``prices`` defaults to ``default_llm.json`` beside the first score file.
    """
    paths = [Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"llmrouter file not found: {path}")
    kinds = {path: file_kind(path) for path in paths}
    score_files = [p for p in paths if kinds[p] == "scores"]
    if not score_files:
        raise ValueError(f"no LLMRouter score file (question + scores) among {[str(p) for p in paths]}")
    price_path = Path(prices) if prices else score_files[0].parent / PRICE_FILE
    price_table = load_prices(price_path)

    tasks: dict[str, tuple[str, str]] = {}  # query text -> (task_name, metric)
    for path in (p for p in paths if kinds[p] == "queries"):
        for line, item in json_items(path):
            if not isinstance(item, dict) or not isinstance(item.get("query"), str):
                raise ValueError(f"{path}:{line}: query item needs a string 'query'")
            tasks.setdefault(item["query"], (str(item.get("task_name", "")), str(item.get("metric", ""))))

    workers: list[str] | None = None
    texts: list[str] = []
    groups: list[str] = []
    metrics: list[str] = []
    labels: list[list[float]] = []
    blank: Counter[str] = Counter()
    for path in score_files:
        for line, item in json_items(path):
            where = f"{path}:{line}"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
            question, scores = item.get("question"), item.get("scores")
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: item needs a non-empty string 'question'")
            if not isinstance(scores, dict) or not scores:
                raise ValueError(f"{where}: item needs an object 'scores' of model -> score")
            if workers is None:
                workers = sorted(scores)
                unpriced = [w for w in workers if w not in price_table]
                if unpriced:
                    raise ValueError(f"{where}: no price for {unpriced} in {price_path}")
            unknown = sorted(set(scores) - set(workers))
            if unknown:
                raise ValueError(f"{where}: models {unknown} are not in the first item's {workers}")
            row = []
            for model in workers:
                value = scores.get(model)
                if value is None or value == "":
                    score = math.nan
                elif isinstance(value, bool) or not isinstance(value, int | float | str):
                    raise ValueError(
                        f"{where}: score of {model} is {type(value).__name__}, expected a number"
                    )
                else:
                    score = number_cell(str(value), where, f"score of {model}", 1.0)
                if math.isnan(score):
                    blank[model] += 1
                row.append(score)
            task, metric = tasks.get(question, ("", ""))
            cluster = item.get("cluster_id")
            texts.append(question)
            groups.append(task or (f"cluster_{cluster}" if cluster is not None else "unknown"))
            metrics.append(metric)
            labels.append(row)
    if workers is None:
        raise ValueError(f"{score_files[0]}:1: no items")

    out_tokens = np.array([LLMROUTER_OUTPUT_TOKENS.get(m, LLMROUTER_DEFAULT_OUTPUT_TOKENS) for m in metrics])
    costs = np.column_stack([estimate_costs(texts, *price_table[w], out_tokens) for w in workers])
    return single_turn(
        "llmrouter",
        texts,
        workers,
        labels,
        groups,
        [hashlib.sha1(t.encode("utf-8", "surrogatepass")).hexdigest()[:12] for t in texts],
        costs,
        {
            "format": "llmrouter",
            "files": [str(p) for p in paths],
            "prices_file": str(price_path),
            "prices_per_m_tokens": {w: price_table[w] for w in workers},
            "blank_score_cells": dict(blank),
            "queries_with_task": int(sum(1 for m in metrics if m)),
            "output_tokens_by_metric": LLMROUTER_OUTPUT_TOKENS,
            "cost_model": "USD = (chars/4 * input price + output tokens(metric) * output price) / 1e6",
        },
        # the whole query: 7% of the training queries have several paragraphs, all of them the question
        text_rule=TEXT_WHOLE,
    )
