"""How fast probes teach the router a worker: the onboarded quality column's log loss by probe count,
measured on training files alone.

``gain_recovered`` (onboard_eval.py) scores a whole router by AIQ on validation queries. When a
worker's routing value is 0.005–0.01 of AIQ (LLMRouter), that ratio depends more on which queries
were drawn than on the onboarding. This module measures the onboarded column itself, where the noise
is far smaller, and splits its shortfall in two:

* **the representation**: how well the known workers' log-odds can describe the worker at all. This is
  the *ceiling*, a vector fitted on a whole half of the training queries;
* **the probes**: how much of that a vector fitted on N probes reaches.

For one worker W:

* ``Z`` holds the cross-fitted log-odds of a quality model of the other workers. Each query's row comes
  from a model fitted without its fold, so probes and scored queries are both out of sample, as in
  the product.
* ``full`` is W's cross-fitted column from the model trained with every worker's labels.
* The queries where W has a label are split in half: a probe pool and a scoring half. Per probe count
  N and draw, N probes are drawn from the pool, a vector is fitted on them (router/onboard.py), and it
  is scored by log loss on the scoring half.
* ``recovered`` = (base − ours) / (base − full). ``base`` is W's mean label on the pool: a worker known
  only by its average. ``recovered`` is the share of the log-loss reduction that full labels give,
  reached from N probes.

Two priors for the vector are compared:

* ``shifted``: the product's. It is a mixture of the known workers, each shifted by an offset.
* ``known_vectors``: an empirical-Bayes prior. It is a mixture over the shifted workers *and* the
  vectors the known workers themselves get when each is expressed in the others. These show how a
  worker that is not in the representation relates to it, which is what a newcomer is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from router.onboard import DEFAULT_ALPHA, _bce, fit_vector, prior_vector
from router.quality import _sigmoid

DEFAULT_PROBE_COUNTS = (25, 50, 100, 200, 400)
DEFAULT_DRAWS = 20


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    """Mean binary cross-entropy; soft labels allowed."""
    return _bce(p, y) / len(y)


def share_recovered(base: float, full: float, loss: float) -> float | None:
    """(base − loss) / (base − full): the share of full labels' log-loss gain over the mean label that
    ``loss`` reaches; None when full labels gain nothing."""
    span = base - full
    return None if span <= 0 else (base - loss) / span


def _standard_error(values: Sequence[float]) -> float | None:
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None


def known_worker_vectors(Z: np.ndarray, Y_known: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """[k, k]: row j is known worker j's vector over the *other* known workers' log-odds, with 0 in its
    own place. It is fitted on every label of j with a light L2 penalty ``alpha``."""
    n, k = Z.shape
    if Y_known.shape != (n, k):
        raise ValueError(f"Y_known must be {n} × {k}, got {Y_known.shape}")
    vectors = np.zeros((k, k))
    for j in range(k):
        rows = ~np.isnan(Y_known[:, j])
        keep = np.r_[0:j, j + 1 : k]
        beta, _ = fit_vector(Z[rows][:, keep], Y_known[rows, j], alpha, prior=np.zeros(k - 1))
        vectors[j, keep] = beta
    return vectors


def probe_curve(
    Z: np.ndarray,
    y: np.ndarray,
    full: np.ndarray,
    known_vectors: np.ndarray | None = None,
    *,
    probe_counts: Sequence[int] = DEFAULT_PROBE_COUNTS,
    draws: int = DEFAULT_DRAWS,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The curve for one worker. ``Z`` [n, k] are the cross-fitted log-odds of the known workers, ``y`` [n]
    the worker's labels (NaN where it has none), ``full`` [n] its cross-fitted column from the model
    with every label. ``known_vectors`` (:func:`known_worker_vectors`) adds the ``known_vectors`` prior."""
    Z = np.asarray(Z, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    full = np.asarray(full, dtype=np.float64)
    if Z.ndim != 2 or y.shape != (len(Z),) or full.shape != (len(Z),):
        raise ValueError(f"Z must be [n, k], y and full [n]; got {Z.shape}, {y.shape}, {full.shape}")
    if draws < 1:
        raise ValueError("draws must be >= 1")
    rng = np.random.default_rng(seed)
    labelled = rng.permutation(np.flatnonzero(~np.isnan(y)))
    pool, scored = np.sort(labelled[: len(labelled) // 2]), np.sort(labelled[len(labelled) // 2 :])
    if not probe_counts or min(probe_counts) < 5 or max(probe_counts) > len(pool):
        raise ValueError(
            f"probe counts {list(probe_counts)}: each must be between 5 and the pool's {len(pool)} queries"
        )
    k = Z.shape[1]
    # None: prior_vector's default candidates, the known workers themselves
    components: dict[str, np.ndarray | None] = {"shifted": None}
    if known_vectors is not None:
        components["known_vectors"] = np.vstack([np.eye(k), known_vectors])
    y_scored = y[scored]

    def scored_loss(beta: np.ndarray, delta: float) -> float:
        return log_loss(_sigmoid(Z[scored] @ beta + delta), y_scored)

    base = log_loss(np.full(len(scored), y[pool].mean()), y_scored)
    reference = {
        "base": base,
        "full": log_loss(full[scored], y_scored),
        "ceiling": scored_loss(*fit_vector(Z[pool], y[pool], alpha)),
    }

    def recovered(loss: float) -> float | None:
        return share_recovered(base, reference["full"], loss)

    rows = []
    for n in probe_counts:
        losses: dict[str, list[float]] = {name: [] for name in components}
        for _ in range(draws):
            probes = rng.choice(pool, size=n, replace=False)
            Zp, yp = Z[probes], y[probes]
            for name, C in components.items():
                beta0 = prior_vector(Zp, yp, components=C)
                losses[name].append(scored_loss(*fit_vector(Zp, yp, alpha, prior=beta0)))
        row: dict[str, Any] = {"probes": n}
        for name, values in losses.items():
            mean = float(np.mean(values))
            row[name] = {
                "log_loss": mean,
                "log_loss_se": _standard_error(values),
                "recovered": recovered(mean),
            }
        if "known_vectors" in losses:
            diff = np.subtract(losses["known_vectors"], losses["shifted"])
            row["known_vectors_minus_shifted"] = {"mean": float(diff.mean()), "se": _standard_error(diff)}
        rows.append(row)
        if progress:
            progress(f"{n} probes: log loss {row['shifted']['log_loss']:.4f} (shifted prior)")
    return {
        "n_pool": int(len(pool)),
        "n_scored": int(len(scored)),
        "draws": draws,
        "alpha": alpha,
        **{f"{name}_log_loss": value for name, value in reference.items()},
        "ceiling_recovered": recovered(reference["ceiling"]),
        "curve": rows,
    }
