"""The ledger's feedback as training data: the gateway's own record of who answered what, and how well.

`polyroute router train --from-ledger` reads the rows that carry both a stored query and a feedback
score (gateway.ledger.training_rows) and trains on them like on any other format.
"""

from __future__ import annotations

import numpy as np

from router.offline.dataset import RoutingDataset


def ledger_dataset(rows: list[dict]) -> RoutingDataset:
    """Feedback rows (query, turns, worker, score) → one row per distinct query, NaN where unscored."""
    if not rows:
        raise ValueError("the ledger holds no request with both a stored query and feedback")
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
    labels = np.full((len(texts), len(workers)), np.nan)
    for row in rows:
        labels[index[row["query"]], column[row["worker"]]] = float(row["score"])
    return RoutingDataset(
        name="ledger",
        texts=texts,
        workers=workers,
        labels=labels,
        groups=["ledger"] * len(texts),
        turns=turns,
    )
