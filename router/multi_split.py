"""A deterministic train/test split of routing data files, written as files of the same format.

Only training files are public, so the held-out evaluation needs a split we make ourselves; writing it
as files in the original format means our numbers come from the very command anyone runs on their own
test files (`polyroute router eval --train ... --test ...`), with no special path for our split.

The split is by query (RouterBench ``sample_id``; LLMRouter question text), so duplicated rows of one
query land on the same side, and stratified by task, so every task has its share of test queries. The
order within a task is a hash of ``seed:id``: the same files and seed always give the same split, and
adding rows does not reshuffle the existing ones.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from router.datasets import _csv_rows
from router.multi_datasets import FORMATS, _classify, _json_items


def split_ids(
    ids: Sequence[str], groups: Sequence[str], test_fraction: float = 0.2, seed: int = 0
) -> set[str]:
    """The ids held out for test: round(test_fraction × distinct ids) per group, by hash order."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    by_group: dict[str, set[str]] = defaultdict(set)
    for key, group in zip(ids, groups, strict=True):
        by_group[group].add(key)
    test: set[str] = set()
    for members in by_group.values():
        ordered = sorted(members, key=lambda k: hashlib.sha1(f"{seed}:{k}".encode()).hexdigest())
        test.update(ordered[: int(round(test_fraction * len(ordered)))])
    return test


def _write_routerbench(files: Sequence[Path], out_dir: Path, fraction: float, seed: int) -> dict:
    parsed = [(path, *_csv_rows(path)) for path in files]
    for path, header, _ in parsed:
        if "sample_id" not in header:
            raise ValueError(f"{path}:1: no 'sample_id' column to split by")
    keys, groups = [], []
    for path, header, rows in parsed:
        sid, task = header.index("sample_id"), header.index("eval_name") if "eval_name" in header else None
        for _, record in rows:
            keys.append(record[sid])
            groups.append(record[task] if task is not None else path.stem)
    test = split_ids(keys, groups, fraction, seed)
    counts = {}
    for path, header, rows in parsed:
        sid = header.index("sample_id")
        for side in ("train", "test"):
            chosen = [r for _, r in rows if (r[sid] in test) == (side == "test")]
            target = out_dir / side / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(header)
                writer.writerows(chosen)
            counts[str(target)] = len(chosen)
    return counts


def _write_llmrouter(files: Sequence[Path], out_dir: Path, fraction: float, seed: int) -> dict:
    kinds = {path: _classify(path) for path in files}
    items = {path: [item for _, item in _json_items(path)] for path in files}
    task_of = {
        item["query"]: str(item.get("task_name"))
        for path in files
        if kinds[path] == "queries"
        for item in items[path]
    }
    scored = [item for path in files if kinds[path] == "scores" for item in items[path]]
    questions = [item["question"] for item in scored]
    groups = [
        task_of.get(q, f"cluster_{item.get('cluster_id')}") for q, item in zip(questions, scored, strict=True)
    ]
    test = split_ids(questions, groups, fraction, seed)
    counts = {}
    for path in files:
        key = "question" if kinds[path] == "scores" else "query"
        for side in ("train", "test"):
            chosen = [item for item in items[path] if (item[key] in test) == (side == "test")]
            target = out_dir / side / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".jsonl":
                text = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in chosen)
            else:
                text = json.dumps(chosen, indent=2, ensure_ascii=False) + "\n"
            target.write_text(text, encoding="utf-8")
            counts[str(target)] = len(chosen)
    return counts


def write_split(
    fmt: str, files: Sequence[str | Path], out_dir: str | Path, test_fraction: float = 0.2, seed: int = 0
) -> dict[str, int]:
    """Write ``out_dir/train/<name>`` and ``out_dir/test/<name>`` for each input file; rows per file written."""
    paths = [Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{fmt} file not found: {path}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    writer = _write_routerbench if fmt == "routerbench" else _write_llmrouter
    return writer(paths, Path(out_dir), test_fraction, seed)
