"""Training router models: from a labelled dataset or from the ledger's feedback, into an artifact.

The data itself comes from router/offline/ (one loader per format, the ledger's included); this module
stays at the top level because the gateway rebuilds a model's features with :func:`feature_builder_for`.
Heavy imports (sentence-transformers, LightGBM) happen inside the functions, so importing the
router package stays cheap for the gateway's start and the CLI's help.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from router.artifacts import RouterArtifact, RouterLoadError

MODEL_CHOICES = ("auto", "logreg", "lightgbm", "mf", "knn", "ensemble")
AUTO_CANDIDATES = ("logreg", "lightgbm")

_embedders: dict[tuple[str, int], Any] = {}
_embedders_lock = threading.Lock()


def shared_embedder(backend: str, max_seq_length: int = 128):
    """One embedder per process and configuration, so a hot-swapped model keeps the embedding cache."""
    from router.features import Embedder

    key = (backend, max_seq_length)
    with _embedders_lock:
        if key not in _embedders:
            _embedders[key] = Embedder(backend=backend, max_seq_length=max_seq_length)
        return _embedders[key]


def feature_builder(backend: str, max_seq_length: int = 128, lexical: bool = True, text_rule: str = "whole"):
    """Features over the shared embedder; ``text_rule``: the part of a live query the model reads
    (router/features.py TEXT_RULES), recorded in the model card's feature description."""
    from router.features import FeatureBuilder

    return FeatureBuilder(shared_embedder(backend, max_seq_length), use_lexical=lexical, text_rule=text_rule)


def feature_builder_for(description: dict[str, Any]):
    """Rebuild the features a model was trained on; refuse a model this gateway cannot feed. A card
    without a ``text_rule`` (written before the rule was recorded) reads the whole query."""
    from router.features import text_rule_of

    try:
        rule = text_rule_of(description)
        builder = feature_builder(
            description["backend"],
            int(description.get("max_seq_length", 128)),
            bool(description.get("lexical", True)),
            rule,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise RouterLoadError(f"model card has unusable features {description!r}: {exc}") from None
    if builder.describe() != {**description, "text_rule": rule}:
        raise RouterLoadError(
            f"feature mismatch: the model was trained on {description}, this gateway builds {builder.describe()}"
        )
    return builder


def fit_quality(
    X: np.ndarray,
    labels: np.ndarray,
    model: str = "auto",
    random_state: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
):
    from router.quality import select_quality_model

    if model not in MODEL_CHOICES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODEL_CHOICES)}")
    if model == "ensemble":  # no candidates to choose between: fit the members on all rows
        from router.quality import EnsembleQuality

        ensemble = EnsembleQuality(random_state=random_state)
        stage = f"fitting the ensemble ({', '.join(name for name, _ in ensemble.members)}) on all rows"
        total, done = len(ensemble.members), 0

        def member_done() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(stage, done, total)

        if progress is not None:
            progress(stage, 0, total)  # the bar (and its clock) from the start of the first member
        fitted = ensemble.fit(X, labels, on_fit=member_done)
        return fitted, {"chosen": "ensemble", "members": [list(m) for m in fitted.members]}
    candidates = AUTO_CANDIDATES if model == "auto" else (model,)
    return select_quality_model(
        X, labels, candidates=candidates, random_state=random_state, progress=progress
    )


@contextmanager
def fit_progress(enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich bar per fitting stage, with the fits done, elapsed time and an ETA; None when disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("fits"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ) as bar:

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield report


def train_artifact(
    texts: Sequence[str],
    turns: Sequence[int],
    labels: np.ndarray,
    workers: Sequence[str],
    *,
    backend: str = "static",
    model: str = "auto",
    output_tokens: dict[str, float] | None = None,
    tiers: dict[str, str] | None = None,
    sources: dict[str, Any] | None = None,
    progress: bool = False,
    random_state: int = 0,
    text_rule: str = "whole",
) -> RouterArtifact:
    """Fit a quality model on (texts × workers) labels and package it with its model card.

    ``text_rule``: which part of a query ``texts`` hold (the dataset's rule, router/features.py
    TEXT_RULES), stored in the card so that the live router reads the same part of its queries."""
    labels = np.asarray(labels, dtype=float)
    if labels.shape != (len(texts), len(workers)):
        raise ValueError(f"labels must be {len(texts)} × {len(workers)}, got {labels.shape}")
    # Checked here, where the workers have names: the quality models see only column numbers.
    repeated = sorted({w for w in workers if list(workers).count(w) > 1})
    if repeated:
        raise ValueError(f"worker(s) {repeated} name more than one label column: each worker needs its own")
    unlabelled = [w for i, w in enumerate(workers) if labels.size and np.isnan(labels[:, i]).all()]
    if unlabelled:
        raise ValueError(
            f"no labels for worker(s) {unlabelled}: every score of theirs is missing in the training data "
            "(drop them from the data, or give them scores)"
        )
    started = time.time()
    builder = feature_builder(backend, text_rule=text_rule)
    X = builder.transform(list(texts), list(turns), progress=progress)
    with fit_progress(progress) as on_fit:
        fitted, report = fit_quality(X, labels, model, random_state, progress=on_fit)
    observed = {w: int(np.sum(~np.isnan(labels[:, i]))) for i, w in enumerate(workers)}
    tier_prior: dict[str, float] = {}
    for tier in set((tiers or {}).values()):
        columns = [i for i, w in enumerate(workers) if (tiers or {}).get(w) == tier]
        values = labels[:, columns]
        if np.any(~np.isnan(values)):
            tier_prior[tier] = float(np.nanmean(values))
    card = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": sources or {},
        "rows": len(texts),
        "model": report.get("chosen", model),
        "selection": report,
        "train_seconds": round(time.time() - started, 1),
        "random_state": random_state,
    }
    return RouterArtifact(
        workers=list(workers),
        features=builder.describe(),
        model=fitted,
        output_tokens=dict(output_tokens or {}),
        observed=observed,
        tier_prior=tier_prior,
        card=card,
    )
