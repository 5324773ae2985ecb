"""Onboarding a worker from a few labelled probes: a small per-worker vector on a frozen query representation.

A router model knows the workers it was trained on. A new worker (the operator's own gpt-4.1, a local
model) has no public labels, and a few dozen graded probes are far too few to fit a model on the
query's embedding. They are enough to place the newcomer among the workers the model already knows:

* the shared representation of a query ``x`` is ``z(x)``, the log-odds the fitted quality model gives
  each known worker for it (queries hard for everyone have low ``z``; code queries, high ``z`` for the
  code models...);
* the newcomer's quality is ``P(success | x) = sigmoid(β · z(x) + δ)``: its vector ``β`` (one number
  per known worker) and its offset ``δ`` are all it fits, in the manner of item-response theory;
* with 25–200 labels a free ``β`` overfits, so it is pulled (an L2 penalty ``alpha``) towards a prior
  ``β₀``: a mixture of the known workers, weighted by how well "that worker, shifted by an offset"
  explains the probes. A newcomer that behaves like Mixtral starts as Mixtral; the data move it away
  as far as they can support.

The probes must not be training queries of the base model: its predictions for them would be
in-sample, sharper than on new queries, and ``β`` would come out too small. The shipped prior leaves
the probe set out of its training data for this reason (router/offline/prior.py), and the offline
evaluation (router/offline/onboard_eval.py) predicts the probes from a model fitted without them.

Everything here is offline work except :meth:`OnboardedQuality.predict`, a matmul on the request path.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from router.artifacts import RouterArtifact
from router.features import query_text, text_rule_of
from router.quality import PROB_EPS, _as_features, _logit, _sigmoid

# Chosen on our validation splits of the RouterBench and LLMRouter training files (README, "Onboarding").
DEFAULT_ALPHA = 10.0
PRIOR_TEMPERATURE = 1.0  # softmax temperature over the known workers' probe log-likelihoods
OFFSET_PENALTY = 0.1  # a weak pull of δ towards 0 so a probe set answered all right stays finite
MIN_PROBES = 5


def _bce(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, PROB_EPS, 1.0 - PROB_EPS)
    return float(-np.sum(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def _shifted_loss(z: np.ndarray, y: np.ndarray) -> float:
    """How well y is explained as sigmoid(z + d) at the best offset d (penalised like δ)."""
    from scipy.optimize import minimize_scalar

    def loss(d: float) -> float:
        return _bce(_sigmoid(z + d), y) + 0.5 * d * d

    return float(minimize_scalar(loss, bounds=(-8.0, 8.0), method="bounded").fun)


def prior_vector(
    Z: np.ndarray, y: np.ndarray, temperature: float = PRIOR_TEMPERATURE, components: np.ndarray | None = None
) -> np.ndarray:
    """β₀: weights over the known workers, softmax of how well each one (shifted) explains the probes.

    ``components`` [m, k] mixes other candidate vectors the same way (each scored as ``Z @ c``); the
    default is the known workers themselves, the identity. The offline evaluation compares another
    set of candidates with it (router/offline/onboard_curve.py)."""
    candidates = Z.T if components is None else (Z @ np.asarray(components).T).T  # one row per candidate
    losses = np.array([_shifted_loss(z, y) for z in candidates])
    weights = np.exp(-(losses - losses.min()) / temperature)
    weights /= weights.sum()
    return weights if components is None else weights @ components


def fit_vector(
    Z: Any,
    y: Any,
    alpha: float = DEFAULT_ALPHA,
    temperature: float = PRIOR_TEMPERATURE,
    prior: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """(β, δ) for one worker from its probes: ``Z`` [n, k] the known workers' log-odds, ``y`` [n] in [0, 1].

    ``prior`` is β₀, the vector the penalty pulls towards; by default :func:`prior_vector` of the probes.
    (The offline evaluation passes other priors to compare them: router/offline/onboard_curve.py.)"""
    from scipy.optimize import minimize

    Z = np.asarray(Z, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if Z.ndim != 2 or y.shape != (Z.shape[0],):
        raise ValueError(f"Z must be [n, k] and y [n]; got {Z.shape} and {y.shape}")
    if len(y) < MIN_PROBES:
        raise ValueError(f"{len(y)} labelled probes; a worker's vector needs at least {MIN_PROBES}")
    if np.any(~np.isfinite(y)) or y.min() < 0 or y.max() > 1:
        raise ValueError("probe labels must lie in [0, 1]")
    k = Z.shape[1]
    beta0 = prior_vector(Z, y, temperature) if prior is None else np.asarray(prior, dtype=np.float64)
    if beta0.shape != (k,):
        raise ValueError(f"the prior must be a vector over the {k} known workers, got shape {beta0.shape}")

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        beta, delta = theta[:k], theta[k]
        p = np.clip(_sigmoid(Z @ beta + delta), PROB_EPS, 1.0 - PROB_EPS)
        residual = p - y  # d BCE / d logit
        value = _bce(p, y) + 0.5 * alpha * np.sum((beta - beta0) ** 2) + 0.5 * OFFSET_PENALTY * delta**2
        grad = np.r_[Z.T @ residual + alpha * (beta - beta0), residual.sum() + OFFSET_PENALTY * delta]
        return value, grad

    found = minimize(loss, np.r_[beta0, 0.0], jac=True, method="L-BFGS-B")
    return found.x[:k].copy(), float(found.x[k])


class OnboardedQuality:
    """A fitted quality model plus onboarded workers: ``predict(X)`` gives the base model's columns, then
    one column per onboarded worker (an onboarded worker the base model also knows replaces its column).

    Same contract as router/quality.py's models (``predict(X) -> [n, k]`` probabilities), so a
    LearnedRouter and the model card treat it like any other.
    """

    def __init__(self, base: Any, base_workers: Sequence[str]) -> None:
        self.base = base
        self.base_workers = list(base_workers)
        self.names: list[str] = []  # onboarded workers, in coef_ row order
        self.coef_ = np.zeros((0, len(self.base_workers)))
        self.intercept_ = np.zeros(0)
        self.probes_: dict[str, int] = {}

    @property
    def workers(self) -> list[str]:
        """Column names of predict(X)."""
        return self.base_workers + [n for n in self.names if n not in self.base_workers]

    @property
    def n_features_in_(self) -> int:
        return int(self.base.n_features_in_)

    def set_worker(self, name: str, beta: np.ndarray, delta: float, probes: int) -> None:
        if beta.shape != (len(self.base_workers),):
            raise ValueError(f"a vector over {len(self.base_workers)} known workers, got shape {beta.shape}")
        if name in self.names:
            i = self.names.index(name)
            self.coef_[i], self.intercept_[i] = beta, delta
        else:
            self.names.append(name)
            self.coef_ = np.vstack([self.coef_, beta[None, :]])
            self.intercept_ = np.r_[self.intercept_, delta]
        self.probes_[name] = int(probes)

    def representation(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """(base predictions [n, k], their log-odds z [n, k])."""
        base = np.asarray(self.base.predict(_as_features(X, self.n_features_in_)), dtype=np.float64)
        return base, _logit(base)

    def predict(self, X: Any) -> np.ndarray:
        base, z = self.representation(X)
        if not self.names:
            return base
        onboarded = np.clip(_sigmoid(z @ self.coef_.T + self.intercept_), PROB_EPS, 1.0 - PROB_EPS)
        extra = [onboarded[:, i] for i, n in enumerate(self.names) if n not in self.base_workers]
        out = np.column_stack([base, *extra]) if extra else base.copy()
        for i, name in enumerate(self.names):
            if name in self.base_workers:
                out[:, self.base_workers.index(name)] = onboarded[:, i]
        return out


# What a base version's card says of how *it* was built; an onboarded version was not built so.
_BUILD_FIELDS = ("kind", "created_at", "train_seconds")


def _onboarded_card(artifact: RouterArtifact, onboarding: dict, alpha: float) -> dict:
    """The new version's own card: the base's description of its data and model (what the shared
    representation was trained on, the public tiers) kept, its build stamp replaced by this one's."""
    card = {k: v for k, v in artifact.card.items() if k not in _BUILD_FIELDS}
    return {
        **card,
        "kind": "onboarded",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "based_on": {
            field: artifact.card[field] for field in ("kind", "created_at") if field in artifact.card
        }
        | {"version": artifact.version},
        "onboarding": onboarding,
        "onboarding_alpha": alpha,
    }


def onboard_artifact(
    artifact: RouterArtifact,
    features: Any,
    texts: Sequence[str],
    turns: Sequence[int],
    labels: Any,
    workers: Sequence[str],
    output_tokens: dict[str, float] | None = None,
    *,
    alpha: float = DEFAULT_ALPHA,
) -> RouterArtifact:
    """A new artifact (not saved) with ``workers``' vectors fitted on their probes, on top of ``artifact``.

    ``labels`` is [len(texts), len(workers)] in [0, 1] with NaN where a worker was not graded on a text.
    Workers onboarded earlier and not in ``workers`` keep their vectors; the base model is not refitted.
    """
    labels = np.asarray(labels, dtype=np.float64)
    if labels.shape != (len(texts), len(workers)):
        raise ValueError(f"labels must be {len(texts)} × {len(workers)}, got {labels.shape}")
    if len(set(workers)) != len(workers):
        raise ValueError("a worker is named twice")
    previous = artifact.model
    if isinstance(previous, OnboardedQuality):
        model = OnboardedQuality(previous.base, previous.base_workers)
        for i, name in enumerate(previous.names):
            model.set_worker(name, previous.coef_[i], float(previous.intercept_[i]), previous.probes_[name])
    else:
        model = OnboardedQuality(previous, artifact.workers)
    # the probes are read as the router reads a query live: under the card's text rule
    rule = text_rule_of(artifact.features or {})
    X = features.transform([query_text(t, rule) for t in texts], list(turns))
    _, Z = model.representation(X)
    for j, name in enumerate(workers):
        rows = ~np.isnan(labels[:, j])
        beta, delta = fit_vector(Z[rows], labels[rows, j], alpha)
        model.set_worker(name, beta, delta, int(rows.sum()))
    observed = dict(artifact.observed)
    observed.update({name: model.probes_[name] for name in workers})
    onboarding = {
        **artifact.card.get("onboarding", {}),
        **{
            name: {"probes": model.probes_[name], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            for name in workers
        },
    }
    return dataclasses.replace(
        artifact,
        workers=model.workers,
        model=model,
        output_tokens={**artifact.output_tokens, **(output_tokens or {})},
        observed=observed,
        card=_onboarded_card(artifact, onboarding, alpha),
        version="",
    )
