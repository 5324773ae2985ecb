"""The ledger as data: training rows for `router train --from-ledger`, logged choices for `router eval`.

Training: the rows that carry both a stored query and a counted score (gateway.ledger.training_rows,
which weighs the score sources) become a RoutingDataset like any other format's. A (query, worker)
cell seen several times — the same question asked again, or scored by several sources — gets the
weighted mean of its scores, each row weighing as much as its sources' weights add up to. So the
source weights arbitrate where sources meet on one cell (weight 0 leaves a source out entirely);
a cell only one source scored keeps that score whatever its weight, since the quality models take
no per-cell weights.

Evaluation: the routed requests among those rows (their `route` record, router/routelog.py) are
replayed through a candidate router, and its value estimated by inverse propensity scoring
(router/offline/ips.py) — before it is ever put in force.

Reading: a ledger can be far larger than memory allows (every request's query and route record), and
only the scored requests make rows. So a reader goes over it twice, streaming: once to check every
record and note which requests a counted source scored (:func:`counted_score`), once more to keep
only what training and the replay read (:func:`compact_records`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Iterable, Mapping
from typing import Any

import numpy as np

from router.offline.dataset import RoutingDataset
from router.offline.ips import (
    OffPolicyEstimate,
    effective_sample_size,
    importance_weights,
    ips,
    on_policy,
    snips,
)
from router.routelog import logging_propensity, replay_request

NOT_ROUTED = "not chosen by the router (pinned, cached, composed, or logged before propensities)"
LEFT_CATALOG = "a worker of its pool is not in the catalog any more"


# What gateway.ledger.training_rows and `router train`'s output-token medians read of a record.
ROW_FIELDS = (
    "type",
    "id",
    "query",
    "query_tail",
    "query_chars",
    "turns",
    "worker",
    "route",
    "cost_micros",
    "status",
    "completion_tokens",
)
SCORE_FIELDS = ("type", "request_id", "score", "source", "at")  # `at`: the latest score counts


def counted_score(record: dict, weights: Mapping[str, float]) -> str | None:
    """The request a feedback record scores when its source counts (weight > 0), else None: the
    rule of gateway.ledger.training_rows, which makes a row only of a request with a counted score."""
    if record.get("type") != "feedback" or weights.get(record.get("source") or "user", 0.0) <= 0:
        return None
    return record["request_id"]


def compact_records(
    records: Iterable[dict], scored: Container[str], weights: Mapping[str, float]
) -> list[dict]:
    """Checked ledger records reduced to what `router train` and `router eval --from-ledger` read.

    Kept: each feedback of a counted source (its score fields), each request in `scored` with a
    stored query and a worker (the fields of a training row and its replay), and of any other
    request only its worker, status and output tokens, which `router train` takes a median of per
    worker — one shared dict per distinct (worker, tokens), so the many unscored requests cost a
    list slot each instead of their query and route record. The dicts are read-only. Order and
    scores' `at` are kept, so training_rows still lets the last duplicate of a request win, and of a
    source's scores the latest (by `at`, then order).
    """
    kept: list[dict] = []
    tokens: dict[tuple[str, Any], dict] = {}
    for record in records:
        if record["type"] == "feedback":
            if counted_score(record, weights) is not None:
                kept.append({name: record[name] for name in SCORE_FIELDS if name in record})
        elif record["type"] != "request":  # an intent (a call in flight): neither a row nor an answer
            continue
        elif record["id"] in scored and record.get("query") and record.get("worker"):
            kept.append({name: record[name] for name in ROW_FIELDS if name in record})
        elif (
            isinstance(worker := record.get("worker"), str)
            and record.get("status") == 200
            and (count := record.get("completion_tokens")) is not None
        ):
            shared = tokens.setdefault(
                (worker, count),
                {"type": "request", "worker": worker, "status": 200, "completion_tokens": count},
            )
            kept.append(shared)
    return kept


def ledger_dataset(rows: list[dict]) -> RoutingDataset:
    """Scored rows (query, turns, worker, score[, weight]) → one row per distinct query, NaN where unscored."""
    if not rows:
        raise ValueError("the ledger holds no request with both a stored query and a counted score")
    workers = sorted({r["worker"] for r in rows})
    column = {w: i for i, w in enumerate(workers)}
    index: dict[str, int] = {}
    texts: list[str] = []
    turns: list[int] = []
    for row in rows:
        if row["query"] not in index:
            index[row["query"]] = len(texts)
            texts.append(row["query"])
            turns.append(int(row.get("turns", 1)))
    weighted = np.zeros((len(texts), len(workers)))
    weights = np.zeros((len(texts), len(workers)))
    for row in rows:
        weight = float(row.get("weight", 1.0))
        cell = index[row["query"]], column[row["worker"]]
        weighted[cell] += weight * float(row["score"])
        weights[cell] += weight
    labels = np.full((len(texts), len(workers)), np.nan)
    scored = weights > 0
    labels[scored] = weighted[scored] / weights[scored]
    return RoutingDataset(
        name="ledger",
        texts=texts,
        workers=workers,
        labels=labels,
        groups=["ledger"] * len(texts),
        turns=turns,
    )


def _reported(estimate: OffPolicyEstimate, overlap: bool) -> dict:
    """An estimate as the report gives it; value, bounds and standard error None ("no estimate", null
    in JSON) when the log says nothing about the candidate. That is so when no logged choice is the
    candidate's: IPS is then 0 ± 0 — the mean of zero weights, a certain-looking number about a policy
    the log never saw — and SNIPS is NaN, which the JSON report could not even hold (RFC 8259)."""
    reported = estimate.as_dict()
    if not overlap or math.isnan(estimate.value):
        reported.update(value=None, low=None, high=None, stderr=None)
    return reported


def evaluate_candidate(router: Any, rows: list[dict], catalog: Any, confidence: float = 0.95) -> dict:
    """A candidate router's mean quality and cost on logged traffic, by IPS and self-normalised IPS.

    `router` is a LearnedRouter without exploration (its choice must be deterministic); `rows` come
    from gateway.ledger.training_rows (the score of a row is its outcome); `catalog` gives today's
    workers and prices, so the candidate decides as it would if put in force now. The logged action is
    the router's first choice: when a fallback answered, that is part of what choosing it led to.
    """
    if getattr(router, "exploration", 0.0):
        raise ValueError("replay the candidate without exploration: its choice must be deterministic")
    skipped: Counter[str] = Counter()
    outcomes: list[float] = []
    costs: list[float] = []
    logged: list[float] = []
    agrees: list[float] = []
    supported: list[bool] = []
    picks: Counter[str] = Counter()
    for row in rows:
        log = row.get("route")
        if not log:
            skipped[NOT_ROUTED] += 1
            continue
        pool = tuple(catalog.get(name) for name in log["pool"])
        if not pool or any(worker is None for worker in pool):
            skipped[LEFT_CATALOG] += 1
            continue
        pick = router.route(replay_request(log, row["query"], int(row.get("turns", 1))), pool).workers[0].name
        drawn = logging_propensity(log)
        picks[pick] += 1
        agrees.append(1.0 if pick == log["chosen"] else 0.0)
        logged.append(drawn.probability)
        supported.append(drawn.of(pick) > 0)
        outcomes.append(float(row["score"]))
        costs.append(int(row.get("cost_micros", 0)) / 1e6)
    if len(outcomes) < 2:
        raise ValueError(
            f"{len(outcomes)} logged request(s) can be replayed (routed, scored, query stored); "
            f"at least 2 are needed. Skipped: {dict(skipped) or 'none'}"
        )
    weights = importance_weights(agrees, logged)
    overlap = bool(np.any(weights > 0))

    def estimates(values: list[float]) -> dict:
        return {
            "snips": _reported(snips(values, agrees, logged, confidence), overlap),
            "ips": _reported(ips(values, agrees, logged, confidence), overlap),
            "logging_policy": _reported(on_policy(values, confidence), True),
        }

    return {
        "candidate": router.version,
        "requests": len(outcomes),
        "skipped": dict(skipped),
        "agreement": float(np.mean(agrees)),
        "support": float(np.mean(supported)),
        "effective_sample_size": effective_sample_size(weights),
        "randomised_share": float(np.mean([p < 1.0 for p in logged])),  # drawn with exploration on
        "quality": estimates(outcomes),
        "cost_usd": estimates(costs),
        "candidate_choices": dict(picks.most_common()),
        "confidence": confidence,
        "interval": "normal approximation (IPS: standard error of w·r; SNIPS: delta method)",
    }
