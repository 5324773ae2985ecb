"""Many-worker routing data in the two public formats, loaded from files anyone can hold.

`polyroute router eval --format routerbench|llmrouter --train FILE --test FILE` reads its files here, so
the same code serves our own split of the shared training files and someone else's held-out test files.
Both formats become a :class:`router.datasets.RoutingDataset` with per-query costs, so the evaluation
never sees a CSV quirk:

* **routerbench** (RouterBench as re-published by RouterDC): a CSV per task with ``sample_id``,
  ``prompt`` (a stringified Python list of messages), ``eval_name``, one score column per model and a
  ``<model>|total_cost`` column (USD for that query). A column is a model when its cost column exists.
* **llmrouter** (ulab-uiuc/LLMRouter): a JSON list (or JSONL) of ``{question, scores: {model: 0..1},
  cluster_id}``; optional JSONL files of ``{task_name, query, metric, ...}`` name each query's task (joined
  on the query text); a price file (``default_llm.json``: USD per 1M input/output tokens per model).
  The data has no token counts, so a query's cost is estimated: prompt tokens = characters / 4, output
  tokens by the task's answer type (:data:`LLMROUTER_OUTPUT_TOKENS`), times the model's prices.

The loader's rules are the RouteLLM loader's (router/datasets.py): a blank score cell is NaN and counted,
never read as wrong; a structurally broken file raises ``ValueError`` naming the file and the line.

RouterBench prompts are few-shot: a shared block of solved examples, then the question. A router should
read the question, not the examples (MiniLM reads 128 tokens, which would be examples only), so the text
routed on is the last message's last paragraph (:func:`focus_text`); the full prompt's length is kept
for costs (``meta["prompt_chars"]``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from router.datasets import RoutingDataset, _csv_rows, _read_text

FORMATS = ("routerbench", "llmrouter")
COST_SUFFIX = "|total_cost"
RESPONSE_SUFFIX = "|model_response"
PRICE_FILE = "default_llm.json"
CHARS_PER_TOKEN = 4.0
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
MIN_FOCUS_CHARS = 20


def focus_text(message: str) -> str:
    """The last paragraph of a message (the question after any few-shot examples); the whole message if
    that paragraph is too short to stand alone."""
    tail = message.strip().rsplit("\n\n", 1)[-1].strip()
    return tail if len(tail) >= MIN_FOCUS_CHARS else message.strip()


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


def _number(raw: str, where: str, what: str, upper: float | None) -> float:
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


def _dataset(name, texts, workers, labels, groups, ids, costs, meta) -> RoutingDataset:
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
    )


# --------------------------------------------------------------------------------------------- RouterBench


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
    blank: Counter[str] = Counter()
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"routerbench file not found: {path}")
        header, rows = _csv_rows(path)
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
        id_col = col.get("sample_id")
        for ordinal, (line, record) in enumerate(rows):
            where = f"{path}:{line}"
            message = _last_message(record[col["prompt"]], where)
            if not message.strip():
                raise ValueError(f"{where}: blank prompt")
            row_labels, row_costs = [], []
            for model in workers:
                score = _number(record[col[model]], where, f"score of {model}", 1.0)
                cost = _number(record[col[model + COST_SUFFIX]], where, f"cost of {model}", None)
                if math.isnan(score):
                    blank[model] += 1
                row_labels.append(score)
                row_costs.append(cost)
            texts.append(focus_text(message))
            prompt_chars.append(len(message))
            groups.append(record[col["eval_name"]].strip() or path.stem)
            ids.append(record[id_col].strip() if id_col is not None else f"{path.stem}:{ordinal}")
            labels.append(row_labels)
            costs.append(row_costs)
    assert workers is not None
    return _dataset(
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
        },
    )


# ----------------------------------------------------------------------------------------------- LLMRouter


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


def _json_items(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, item) for each element of a JSON array file, or each line of a JSONL file."""
    text = _read_text(path)
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


def load_prices(path: str | Path) -> dict[str, tuple[float, float]]:
    """Model -> (input, output) USD per 1M tokens from an LLMRouter ``default_llm.json``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"price file not found: {path} (give --prices FILE)")
    try:
        data = json.loads(_read_text(path))
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


def _classify(path: Path) -> str:
    """'scores' (question + scores) or 'queries' (task_name + query), from the first item."""
    for line, item in _json_items(path):
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
    kinds = {path: _classify(path) for path in paths}
    score_files = [p for p in paths if kinds[p] == "scores"]
    if not score_files:
        raise ValueError(f"no LLMRouter score file (question + scores) among {[str(p) for p in paths]}")
    price_path = Path(prices) if prices else score_files[0].parent / PRICE_FILE
    price_table = load_prices(price_path)

    tasks: dict[str, tuple[str, str]] = {}  # query text -> (task_name, metric)
    for path in (p for p in paths if kinds[p] == "queries"):
        for line, item in _json_items(path):
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
        for line, item in _json_items(path):
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
                    score = _number(str(value), where, f"score of {model}", 1.0)
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
    in_tokens = np.array([len(t) for t in texts], dtype=float) / CHARS_PER_TOKEN
    price_in = np.array([price_table[w][0] for w in workers])
    price_out = np.array([price_table[w][1] for w in workers])
    costs = (in_tokens[:, None] * price_in + out_tokens[:, None] * price_out) / 1e6
    return _dataset(
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
    )


def load_format(fmt: str, files: Sequence[str | Path], prices: str | Path | None = None) -> RoutingDataset:
    if fmt == "routerbench":
        if prices:
            raise ValueError("--prices applies to --format llmrouter only (RouterBench records costs)")
        return load_routerbench(files)
    if fmt == "llmrouter":
        return load_llmrouter(files, prices)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
