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
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from router.offline.dataset import RoutingDataset
from router.offline.ips import effective_sample_size, importance_weights, ips, on_policy, snips
from router.routelog import logging_propensity, replay_request

NOT_ROUTED = "not chosen by the router (pinned, cached, composed, or logged before propensities)"
LEFT_CATALOG = "a worker of its pool is not in the catalog any more"


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

    def estimates(values: list[float]) -> dict:
        return {
            "snips": snips(values, agrees, logged, confidence).as_dict(),
            "ips": ips(values, agrees, logged, confidence).as_dict(),
            "logging_policy": on_policy(values, confidence).as_dict(),
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
