"""Every way the harness holds data out: file splits, row splits, validation splits and cross-fit folds.

One rule runs through all of them: a query never sits on both sides. Identical prompts stay together,
and train rows whose text also appears in the test side are dropped (MMLU repeats some questions
across subjects; RouterBench and LLMRouter files may share queries).

* :func:`write_split` — `router split`: a deterministic train/test split of data *files*, written in the
  same format, so our numbers come from the very command anyone runs on their own held-out files. By
  query (RouterBench ``sample_id``; LLMRouter question text), stratified by task, in the hash order of
  ``seed:id`` (:func:`split_ids`): the same files and seed give the same split, and adding rows does
  not reshuffle the existing ones. The same :func:`split_ids` picks the validation rows of a training set.
* :func:`align` — a train/test pair of files made honest: columns in one worker order, shared queries
  dropped from train, test rows with a blank score or cost skipped (counted, never read as wrong).
* :func:`routellm_splits` — the four RouteLLM row splits (random, held-out subjects, MMLU → GSM8K,
  MT-Bench test only) from :func:`split_random`, :func:`split_by_group`, :func:`split_train_test_parts`.
* :func:`cross_fit` (over :func:`folds`) — every row scored by a model fitted without its fold.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from router.offline.dataset import RoutingDataset, csv_rows, json_items
from router.offline.formats import FORMATS
from router.offline.llmrouter import file_kind


def _outside(texts: Sequence[str], held: Iterable[str]) -> np.ndarray:
    """Boolean mask of the texts that do not occur in ``held``."""
    held = set(held)
    return np.array([t not in held for t in texts], dtype=bool)


# ------------------------------------------------------------------------------------------ file splits


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
    parsed = [(path, *csv_rows(path)) for path in files]
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
    kinds = {path: file_kind(path) for path in files}
    items = {path: [item for _, item in json_items(path)] for path in files}
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


_WRITERS = {"routerbench": _write_routerbench, "llmrouter": _write_llmrouter}


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
    return _WRITERS[fmt](paths, Path(out_dir), test_fraction, seed)


def align(train: RoutingDataset, test: RoutingDataset) -> tuple[RoutingDataset, RoutingDataset, dict]:
    """Test columns in train's worker order; train rows sharing a query text with test dropped; test rows
    with any blank label or cost skipped. Returns (train, test, counts for the report)."""
    if sorted(test.workers) != sorted(train.workers):
        raise ValueError(
            f"test files have models {sorted(test.workers)}, train files {sorted(train.workers)}"
        )
    assert test.costs is not None and train.costs is not None
    test = test.in_worker_order(train.workers)
    assert test.costs is not None
    keep = _outside(train.texts, test.texts)
    complete = ~(np.isnan(test.labels).any(axis=1) | np.isnan(test.costs).any(axis=1))
    counts = {
        "n_train_files_rows": len(train),
        "n_train_dropped_overlap": int((~keep).sum()),
        "n_test_files_rows": len(test),
        "n_test_skipped_blank": int((~complete).sum()),
    }
    train = train.subset(keep)
    labelled = ~np.isnan(train.labels).all(axis=1)
    counts["n_train_skipped_unlabelled"] = int((~labelled).sum())
    return train.subset(labelled), test.subset(complete), counts


# ------------------------------------------------------------------------------------- RouteLLM row splits


def _drop_text_overlap(ds: RoutingDataset, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Train rows whose prompt also appears in test removed: MMLU repeats some questions across subjects."""
    train = np.asarray(train, dtype=int)
    return train[_outside([ds.texts[i] for i in train], (ds.texts[i] for i in test))]


def split_random(
    ds: RoutingDataset, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random (train, test) row indices, sorted; identical prompts always land on the same side.

    Splitting unique prompts rather than rows keeps duplicated MMLU questions from leaking into test, so the
    test share is `test_fraction` of unique prompts (of rows, up to the few duplicates).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError("test_fraction must be in (0, 1)")
    unique = list(dict.fromkeys(ds.texts))
    order = np.random.default_rng(seed).permutation(len(unique))
    n_test = max(1, int(round(test_fraction * len(unique))))
    is_test = ~_outside(ds.texts, (unique[i] for i in order[:n_test]))
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def split_by_group(
    ds: RoutingDataset,
    test_groups: Sequence[str] | None = None,
    test_fraction: float = 0.25,
    seed: int = 0,
    prefix: str = "mmlu/",
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(train, test, test groups) over the rows whose group starts with `prefix`: whole groups are held out.

    This measures whether the router generalizes to unseen subjects instead of memorizing per-subject
    priors. Without `test_groups`, round(test_fraction * groups) groups are drawn with `seed`. Train rows
    whose prompt also occurs in a test group are dropped.
    """
    in_scope = [g.startswith(prefix) for g in ds.groups]
    groups = sorted({g for g, keep in zip(ds.groups, in_scope, strict=True) if keep})
    if len(groups) < 2:
        raise ValueError(f"need at least two groups starting with {prefix!r}, found {groups}")
    if test_groups is None:
        n_test = min(len(groups) - 1, max(1, int(round(test_fraction * len(groups)))))
        pick = np.random.default_rng(seed).permutation(len(groups))[:n_test]
        chosen = sorted(groups[i] for i in pick)
    else:
        chosen = sorted(set(test_groups))
        unknown = [g for g in chosen if g not in groups]
        if unknown or not chosen or len(chosen) == len(groups):
            raise ValueError(f"test_groups must be a proper, non-empty subset of {groups}; bad: {unknown}")
    held = set(chosen)
    test = np.array([i for i, g in enumerate(ds.groups) if in_scope[i] and g in held], dtype=int)
    train = np.array([i for i, g in enumerate(ds.groups) if in_scope[i] and g not in held], dtype=int)
    return _drop_text_overlap(ds, train, test), test, chosen


def split_train_test_parts(
    ds: RoutingDataset,
    train_prefix: str | tuple[str, ...] = "mmlu/",
    test_prefix: str | tuple[str, ...] = "gsm8k",
) -> tuple[np.ndarray, np.ndarray]:
    """Train on one benchmark, test on another (distribution shift), by group prefix; overlap removed."""
    train = np.array([i for i, g in enumerate(ds.groups) if g.startswith(train_prefix)], dtype=int)
    test = np.array([i for i, g in enumerate(ds.groups) if g.startswith(test_prefix)], dtype=int)
    if train.size == 0 or test.size == 0:
        raise ValueError(
            f"empty split: {train.size} rows match {train_prefix!r}, {test.size} match {test_prefix!r}"
        )
    test = np.setdiff1d(test, train)
    return _drop_text_overlap(ds, train, test), test


@dataclass(frozen=True)
class Split:
    """One named train/test split of a dataset's rows, as reported."""

    name: str
    description: str
    test_only: bool  # the test benchmark is never trained on (a transfer test)
    train: np.ndarray
    test: np.ndarray
    extra: dict = field(default_factory=dict)


def routellm_splits(ds: RoutingDataset, seed: int) -> list[Split]:
    """The four RouteLLM splits: in distribution, held-out subjects, MMLU → GSM8K, MT-Bench test only."""
    core = np.flatnonzero([p in ("mmlu", "gsm8k") for p in ds.parts])
    tr, te = split_random(ds.subset(core), 0.2, seed)
    held_tr, held_te, held_groups = split_by_group(ds, None, 0.25, seed, "mmlu/")
    shift_tr, shift_te = split_train_test_parts(ds, "mmlu/", "gsm8k")
    mt_tr, mt_te = split_train_test_parts(ds, ("mmlu/", "gsm8k"), "mt_bench/")
    return [
        Split(
            "random",
            "random 80/20 over MMLU+GSM8K (identical prompts kept on one side)",
            False,
            core[tr],
            core[te],
        ),
        Split(
            "held_out_subjects",
            "25% of MMLU subjects held out whole; train on the other subjects",
            False,
            held_tr,
            held_te,
            {"test_groups": held_groups},
        ),
        Split(
            "mmlu_to_gsm8k",
            "train on all of MMLU, test on GSM8K (distribution shift)",
            False,
            shift_tr,
            shift_te,
        ),
        Split(
            "mt_bench",
            "TEST ONLY: train on MMLU+GSM8K, test on MT-Bench (soft labels = normalized judge scores, "
            "routed on the first turn)",
            True,
            mt_tr,
            mt_te,
        ),
    ]


# ---------------------------------------------------------------------------------------- cross-fitting


def folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    """k disjoint row-index folds covering range(n), in a seeded random order."""
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


def fold_assignment(n: int, k: int, seed: int) -> np.ndarray:
    """Each of ``n`` rows' fold (0..k-1), seeded (:func:`folds`): the one assignment every stacked
    model of a cross-fit shares."""
    fold_of = np.empty(n, dtype=int)
    for f, part in enumerate(folds(n, k, seed)):
        fold_of[part] = f
    return fold_of


def cross_fit_on(
    fold_of: np.ndarray, fit_score: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """One score per row (or row of scores), each from ``fit_score(train rows, fold rows)`` fitted on
    the rows of the other folds of ``fold_of``."""
    fold_of = np.asarray(fold_of)
    scores: np.ndarray | None = None
    for f in np.unique(fold_of):
        part = np.flatnonzero(fold_of == f)
        found = np.asarray(fit_score(np.flatnonzero(fold_of != f), part), dtype=float)
        if scores is None:
            scores = np.empty((len(fold_of), *found.shape[1:]))
        scores[part] = found
    if scores is None:
        raise ValueError("cross-fitting needs at least one row")
    return scores


def cross_fit(
    n: int, k: int, seed: int, fit_score: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """:func:`cross_fit_on` the seeded :func:`fold_assignment` of ``n`` rows into ``k`` folds."""
    return cross_fit_on(fold_assignment(n, k, seed), fit_score)
