"""The RouteLLM format: Mixtral-8x7B vs GPT-4-1106-preview on MMLU, GSM8K and MT-Bench.

Two loaders over the same folder (see `/work/shared/data/routellm/SOURCE.md`):

* :func:`load_routellm` — per-question correctness of both models on every part, as one
  :class:`RoutingDataset` (what the single-strategy evaluation and `router train --dataset routellm` use);
* :func:`load_gsm8k_answers` — GSM8K with both models' recorded *answers*, which the cascade replay
  needs to score the cheap answer before deciding to escalate.

Costs: RouteLLM records none, so they are estimated from the published list prices (:data:`PRICES_PER_M`)
with :func:`router.offline.dataset.estimate_costs` — the recorded answer's length where the data has one
(GSM8K), else a per-benchmark output length.

Rules the loader follows, because a silently wrong label is worse than a loud failure:

- a blank or unparsable label cell becomes NaN and is counted in `meta`; it is never counted as wrong;
- a structurally broken file (bad quoting, wrong field count, invalid JSON, missing columns) raises
  `ValueError` naming the file and the line, instead of being half-loaded;
- raw model names are mapped to short stable worker names; the raw names are kept in `meta`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from router.features import TEXT_WHOLE
from router.offline.dataset import (
    CHARS_PER_TOKEN,
    RoutingDataset,
    csv_rows,
    estimate_costs,
    json_objects,
)

# Raw model name (CSV column / judgement "model") -> short worker name. Order = column order of labels.
WORKER_ALIASES: dict[str, str] = {
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "gpt-4-1106-preview": "gpt-4-1106-preview",
}
WORKERS: tuple[str, ...] = tuple(dict.fromkeys(WORKER_ALIASES.values()))
WEAK, STRONG = tuple(WORKER_ALIASES)  # raw model names, the cheap one first
PARTS: tuple[str, ...] = ("mmlu", "gsm8k", "mt_bench")
DEFAULT_ROOT = "../shared/data/routellm"
REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_FILE = REPO_ROOT.parent / "shared" / "data" / "routellm" / "gsm8k" / "gsm8k_responses.csv"
RESPONSE_SUFFIX = "_response"
MAX_EXAMPLES = 20  # how many unparsable cells / skipped rows are quoted verbatim in meta

# Published list prices per 1M tokens (input, output) at the time of the data (see SOURCE.md).
PRICES_PER_M: dict[str, tuple[float, float]] = {
    "mixtral-8x7b": (0.24, 0.24),
    "gpt-4-1106-preview": (10.0, 30.0),
}
# Output tokens per turn when no recorded response is available: MMLU answers are a letter plus a few
# words, GSM8K answers are worked solutions, MT-Bench answers are essays/code.
DEFAULT_OUTPUT_TOKENS: dict[str, float] = {"mmlu": 5.0, "gsm8k": 200.0, "mt_bench": 400.0}
FALLBACK_OUTPUT_TOKENS = 200.0  # for a benchmark not listed above

_TRUE = {"true", "1", "1.0", "yes"}
_FALSE = {"false", "0", "0.0", "no"}


# ----------------------------------------------------------------------------------------------- parsing


class _Stats:
    """Counts what the loader could not use, per part, so the report can say how much data is missing."""

    def __init__(self) -> None:
        self.blank: Counter[str] = Counter()  # "part/worker" -> blank label cells
        self.unparsable: Counter[str] = Counter()
        self.missing: Counter[str] = Counter()  # no label at all (column or judgement absent)
        self.examples: list[dict[str, Any]] = []
        self.skipped_rows: Counter[str] = Counter()  # "part: reason" -> rows dropped entirely
        self.skipped_examples: list[dict[str, Any]] = []
        self.ignored_columns: dict[str, list[str]] = {}

    def cell(self, kind: str, part: str, worker: str, where: dict[str, Any]) -> None:
        getattr(self, kind)[f"{part}/{worker}"] += 1
        if kind == "unparsable" and len(self.examples) < MAX_EXAMPLES:
            self.examples.append(where)

    def skip(self, part: str, reason: str, where: dict[str, Any]) -> None:
        self.skipped_rows[f"{part}: {reason}"] += 1
        if len(self.skipped_examples) < MAX_EXAMPLES:
            self.skipped_examples.append({**where, "reason": reason})


def _parse_bool(value: str) -> float | None:
    """1.0/0.0 for a correctness cell, NaN for blank, None for unparsable."""
    v = value.strip().lower()
    if not v:
        return math.nan
    if v in _TRUE:
        return 1.0
    if v in _FALSE:
        return 0.0
    return None


def _load_correctness_csv(
    path: Path, part: str, group: str, stats: _Stats
) -> tuple[list[str], list[str], np.ndarray, np.ndarray, dict[str, str]]:
    """(texts, ids, labels [n, k], response chars [n, k], short->raw column) of one correctness CSV."""
    header, rows = csv_rows(path)
    prompt_col = header.index("prompt")
    label_cols = {WORKER_ALIASES[h]: i for i, h in enumerate(header) if h in WORKER_ALIASES}
    response_cols = {
        WORKER_ALIASES[h[: -len(RESPONSE_SUFFIX)]]: i
        for i, h in enumerate(header)
        if h.endswith(RESPONSE_SUFFIX) and h[: -len(RESPONSE_SUFFIX)] in WORKER_ALIASES
    }
    if not label_cols:
        raise ValueError(f"{path}:1: no known model column in header {header}; known: {list(WORKER_ALIASES)}")
    used = {prompt_col, *label_cols.values(), *response_cols.values()}
    ignored = [h for i, h in enumerate(header) if i not in used]
    if ignored:
        stats.ignored_columns[str(path)] = ignored
    raw = {short: header[i] for short, i in label_cols.items()}

    texts: list[str] = []
    ids: list[str] = []
    labels = np.full((len(rows), len(WORKERS)), np.nan)
    chars = np.full((len(rows), len(WORKERS)), np.nan)
    kept = 0
    for ordinal, (line, record) in enumerate(rows):
        text = record[prompt_col]
        if not text.strip():
            stats.skip(part, "blank prompt", {"file": str(path), "line": line})
            continue
        for j, worker in enumerate(WORKERS):
            col = label_cols.get(worker)
            if col is None:
                stats.cell("missing", part, worker, {})
                continue
            value = _parse_bool(record[col])
            where = {"file": str(path), "line": line, "column": header[col], "value": record[col][:80]}
            if value is None:
                stats.cell("unparsable", part, worker, where)
            elif math.isnan(value):
                stats.cell("blank", part, worker, where)
            else:
                labels[kept, j] = value
            if worker in response_cols and record[response_cols[worker]].strip():
                chars[kept, j] = len(record[response_cols[worker]])
        texts.append(text)
        ids.append(f"{group}:{ordinal}")
        kept += 1
    return texts, ids, labels[:kept], chars[:kept], raw


def _score(value: Any) -> float | None:
    """A judge score in [1, 10], or None for missing / -1 (judge failed to parse) / anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        score = float(value)
    except ValueError:
        return None
    return score if 1.0 <= score <= 10.0 else None


# ------------------------------------------------------------------------------------------------- parts


@dataclass
class _Part:
    texts: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    chars: list[np.ndarray] = field(default_factory=list)
    raw_columns: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(
        self,
        texts: list[str],
        ids: list[str],
        group: str,
        labels: np.ndarray,
        chars: np.ndarray,
        turns: int = 1,
    ) -> None:
        self.texts += texts
        self.ids += ids
        self.groups += [group] * len(texts)
        self.turns += [turns] * len(texts)
        self.labels.append(labels)
        self.chars.append(chars)


def _load_mmlu(root: Path, stats: _Stats) -> _Part:
    folder = root / "mmlu" / "responses"
    files = sorted(folder.glob("mmlu_*.csv"))
    if not files:
        raise FileNotFoundError(f"no mmlu_<subject>.csv files in {folder}")
    part = _Part(sources=[str(folder)])
    for path in files:
        subject = path.stem[len("mmlu_") :]
        group = f"mmlu/{subject}"
        texts, ids, labels, chars, raw = _load_correctness_csv(path, "mmlu", group, stats)
        part.add(texts, ids, group, labels, chars)
        part.raw_columns.update(raw)
    part.extra["subjects"] = len(files)
    return part


def _load_gsm8k(root: Path, stats: _Stats) -> _Part:
    path = root / "gsm8k" / "gsm8k_responses.csv"
    if not path.is_file():
        raise FileNotFoundError(path)
    part = _Part(sources=[str(path)])
    texts, ids, labels, chars, raw = _load_correctness_csv(path, "gsm8k", "gsm8k", stats)
    part.add(texts, ids, "gsm8k", labels, chars)
    part.raw_columns.update(raw)
    return part


def _load_mt_bench(root: Path, stats: _Stats) -> _Part:
    """One row per question; label = mean over turns of the per-turn mean judge score, mapped (s-1)/9.

    The router decides once per conversation, on the first turn (as RouteLLM does), so the text is the
    first turn; the second turn's quality still counts in the label through its judge score.
    """
    q_path = root / "mt_bench" / "question.jsonl"
    j_path = root / "mt_bench" / "judgements.jsonl"
    for p in (q_path, j_path):
        if not p.is_file():
            raise FileNotFoundError(p)

    questions: dict[Any, tuple[str, str, int]] = {}
    for line, obj in json_objects(q_path):
        missing = [key for key in ("question_id", "category", "turns") if key not in obj]
        if missing:
            raise ValueError(f"{q_path}:{line}: question lacks {missing}")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{q_path}:{line}: 'turns' must be a non-empty list of strings")
        if obj["question_id"] in questions:
            raise ValueError(f"{q_path}:{line}: duplicate question_id {obj['question_id']}")
        questions[obj["question_id"]] = (turns[0], str(obj["category"]), len(turns))

    scores: dict[tuple[Any, str, int], list[float]] = {}
    models: Counter[str] = Counter()
    judges: Counter[str] = Counter()
    raw_columns: dict[str, str] = {}
    for line, obj in json_objects(j_path):
        where = {"file": str(j_path), "line": line}
        model = obj.get("model")
        models[str(model)] += 1
        if model not in WORKER_ALIASES:
            continue
        qid, turn = obj.get("question_id"), obj.get("turn")
        if qid not in questions:
            stats.skip("mt_bench", "judgement for unknown question_id", {**where, "question_id": qid})
            continue
        if not isinstance(turn, int) or not 1 <= turn <= questions[qid][2]:
            stats.skip("mt_bench", "judgement with missing/invalid turn", {**where, "turn": turn})
            continue
        score = _score(obj.get("score"))
        if score is None:
            stats.skip(
                "mt_bench", "judgement with missing or invalid score", {**where, "score": obj.get("score")}
            )
            continue
        judges[json.dumps(obj.get("judge"))] += 1
        raw_columns[WORKER_ALIASES[model]] = model
        scores.setdefault((qid, WORKER_ALIASES[model], turn), []).append(score)

    part = _Part(sources=[str(q_path), str(j_path)], raw_columns=raw_columns)
    duplicates = sum(len(v) - 1 for v in scores.values())
    for qid, (text, category, n_turns) in questions.items():
        labels = np.full((1, len(WORKERS)), np.nan)
        for j, worker in enumerate(WORKERS):
            per_turn = [
                float(np.mean(scores[key]))
                for t in range(1, n_turns + 1)
                if (key := (qid, worker, t)) in scores
            ]
            if per_turn:
                labels[0, j] = (float(np.mean(per_turn)) - 1.0) / 9.0
            else:
                stats.cell("missing", "mt_bench", worker, {})
        group = f"mt_bench/{category}"
        part.add([text], [f"mt_bench:{qid}"], group, labels, np.full((1, len(WORKERS)), np.nan), n_turns)
    part.extra = {
        "models_found": dict(models),
        "models_ignored": sorted(m for m in models if m not in WORKER_ALIASES),
        "judges": dict(judges),
        "duplicate_judgements_averaged": duplicates,
        "label": "mean over turns of the judge score, normalized (score - 1) / 9",
    }
    return part


_LOADERS = {"mmlu": _load_mmlu, "gsm8k": _load_gsm8k, "mt_bench": _load_mt_bench}


def _resolve_root(root: str | Path) -> Path:
    """An absolute path as is; a relative one against the working directory, else against the repo root."""
    path = Path(root).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve()
    repo_relative = (REPO_ROOT / path).resolve()
    return repo_relative if repo_relative.exists() else path


def load_routellm(root: str | Path = DEFAULT_ROOT, parts: Sequence[str] = PARTS) -> RoutingDataset:
    """The RouteLLM evaluation data (Mixtral-8x7B vs GPT-4-1106-preview) as one dataset.

    Rows are ordered by part (in `parts` order), then MMLU subject (alphabetical), then file order.
    Labels: MMLU/GSM8K correctness 1.0/0.0; MT-Bench normalized judge scores in [0, 1].
    """
    unknown = [p for p in parts if p not in _LOADERS]
    if unknown or not parts:
        raise ValueError(f"unknown parts {unknown or list(parts)}; choose from {list(PARTS)}")
    base = _resolve_root(root)
    if not base.is_dir():
        raise FileNotFoundError(f"RouteLLM data folder not found: {base}")

    stats = _Stats()
    loaded = {name: _LOADERS[name](base, stats) for name in dict.fromkeys(parts)}
    texts = [t for p in loaded.values() for t in p.texts]
    k = len(WORKERS)
    labels = np.concatenate([a for p in loaded.values() for a in p.labels] or [np.empty((0, k))])
    chars = np.concatenate([a for p in loaded.values() for a in p.chars] or [np.empty((0, k))])

    raw_columns: dict[str, dict[str, str]] = {name: p.raw_columns for name, p in loaded.items()}
    meta: dict[str, Any] = {
        "source": str(base),
        "parts": list(loaded),
        "files": {name: p.sources for name, p in loaded.items()},
        "raw_columns": raw_columns,
        "worker_aliases": dict(WORKER_ALIASES),
        "counts": {name: len(p.texts) for name, p in loaded.items()},
        "label_nan": {
            name: {w: int(np.isnan(part_labels[:, j]).sum()) for j, w in enumerate(WORKERS)}
            for name, part_labels in (
                (n, np.concatenate(p.labels or [np.empty((0, k))])) for n, p in loaded.items()
            )
        },
        "blank_cells": dict(stats.blank),
        "unparsable_cells": dict(stats.unparsable),
        "missing_labels": dict(stats.missing),
        "unparsable_examples": stats.examples,
        "skipped_rows": dict(stats.skipped_rows),
        "skipped_examples": stats.skipped_examples,
        "ignored_columns": stats.ignored_columns,
    }
    for name, p in loaded.items():
        if p.extra:
            meta[name] = p.extra
    return RoutingDataset(
        name="routellm",
        texts=texts,
        workers=list(WORKERS),
        labels=labels,
        groups=[g for p in loaded.values() for g in p.groups],
        turns=[t for p in loaded.values() for t in p.turns],
        meta=meta,
        ids=[i for p in loaded.values() for i in p.ids],
        response_chars=chars,
        text_rule=TEXT_WHOLE,  # the whole prompt, as a client sends it
    )


# ------------------------------------------------------------------------------------------------- costs


def dataset_costs(
    ds: RoutingDataset,
    worker: str,
    prices: Mapping[str, tuple[float, float]] = PRICES_PER_M,
    default_output_tokens: Mapping[str, float] = DEFAULT_OUTPUT_TOKENS,
) -> np.ndarray:
    """Per-query cost of `worker` on `ds`: the recorded response length / 4 where the data has it (GSM8K),
    else the per-benchmark default output length."""
    if worker not in prices:
        raise KeyError(f"no price for worker {worker!r}; known: {sorted(prices)}")
    j = ds.worker_index(worker)
    assert ds.response_chars is not None
    recorded = ds.response_chars[:, j] / CHARS_PER_TOKEN
    default = np.array([default_output_tokens.get(p, FALLBACK_OUTPUT_TOKENS) for p in ds.parts], dtype=float)
    output = np.where(np.isfinite(recorded), recorded, default)
    price_in, price_out = prices[worker]
    return estimate_costs(ds.texts, price_in, price_out, output, np.asarray(ds.turns, dtype=float))


# -------------------------------------------------------------------------------------- GSM8K with answers


def load_gsm8k_answers(path: str | Path = GSM8K_FILE) -> dict[str, Any]:
    """RouteLLM's GSM8K with Mixtral's recorded answer, both models' correctness and costs, for replay.

    Stricter than :func:`load_routellm`: every correctness cell must be True/False (a replay cannot
    skip a row half-way), and the answer itself is kept, not just its length. Each model is charged for
    its own recorded answer: prompt chars/4 at the input price, answer chars/4 at the output price.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (RouteLLM's gsm8k_responses.csv)")
    header, records = csv_rows(path)
    needed = {"prompt", WEAK, STRONG, WEAK + RESPONSE_SUFFIX, STRONG + RESPONSE_SUFFIX}
    missing = needed - set(header)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    col = {h: i for i, h in enumerate(header)}
    rows = []
    for line, record in records:
        row = {name: record[col[name]] for name in needed}
        if row[WEAK] not in ("True", "False") or row[STRONG] not in ("True", "False"):
            raise ValueError(
                f"{path}:{line}: correctness must be True/False, got {row[WEAK]!r}/{row[STRONG]!r}"
            )
        rows.append(row)
    prompts = [r["prompt"] for r in rows]

    def cost(model: str) -> np.ndarray:
        answer_tokens = np.array([len(r[model + RESPONSE_SUFFIX]) for r in rows], dtype=float)
        return estimate_costs(prompts, *PRICES_PER_M[WORKER_ALIASES[model]], answer_tokens / CHARS_PER_TOKEN)

    return {
        "prompts": prompts,
        "weak_answers": [r[WEAK + RESPONSE_SUFFIX] for r in rows],
        "strong_answers": [r[STRONG + RESPONSE_SUFFIX] for r in rows],
        "y_weak": np.array([r[WEAK] == "True" for r in rows], dtype=float),
        "y_strong": np.array([r[STRONG] == "True" for r in rows], dtype=float),
        "cost_weak": cost(WEAK),
        "cost_strong": cost(STRONG),
    }


def gsm8k_dataset(data: dict[str, Any]) -> RoutingDataset:
    """:func:`load_gsm8k_answers`'s rows as a two-worker dataset (Mixtral, GPT-4) with both answers, for
    the planner: training it (`router train --strategy cascade --dataset routellm`) and replaying it.

    The workers carry the short names of :data:`WORKER_ALIASES`, as :func:`load_routellm` gives them,
    so one `--map mixtral-8x7b=...` renames the same worker whichever strategy is trained."""
    n = len(data["prompts"])
    return RoutingDataset(
        name="gsm8k",
        texts=list(data["prompts"]),
        workers=[WORKER_ALIASES[WEAK], WORKER_ALIASES[STRONG]],
        labels=np.column_stack([data["y_weak"], data["y_strong"]]),
        groups=["gsm8k"] * n,
        turns=[1] * n,
        costs=np.column_stack([data["cost_weak"], data["cost_strong"]]),
        responses=[[w, s] for w, s in zip(data["weak_answers"], data["strong_answers"], strict=True)],
        text_rule=TEXT_WHOLE,
    )
