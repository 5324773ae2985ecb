"""Off-policy evaluation by inverse propensity scoring: a candidate policy's value on logged traffic.

The logging policy (the router in force, exploring with probability ε) chose action a_i on context
x_i with a known probability p_i = π₀(a_i | x_i) and observed reward r_i. A candidate policy π₁ that
would have chosen a_i with probability t_i = π₁(a_i | x_i) (0 or 1 for a deterministic router) has
value V(π₁) = E[r] under π₁, estimated without running it by re-weighting the log with w_i = t_i / p_i:

* IPS, Σ w_i r_i / n — unbiased when π₀ gives every action π₁ takes a positive probability;
* self-normalised IPS, Σ w_i r_i / Σ w_i — slightly biased, much lower variance, and scale-invariant
  (a reward shifted by c moves it by exactly c), the estimate to read first.

Confidence intervals use the normal approximation: for IPS the sample standard error of w_i r_i,
for SNIPS its delta-method linearisation √Σ w_i² (r_i − V̂)² / Σ w_i. Both are asymptotic: read them
together with the effective sample size (Σw)² / Σw², the number of on-policy samples the log is
worth for this candidate; with an ESS of a few dozen the interval is optimistic. Plain arrays in,
plain numbers out, so the estimators are tested on synthetic logs whose true value is known.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

__all__ = [
    "OffPolicyEstimate",
    "effective_sample_size",
    "importance_weights",
    "ips",
    "on_policy",
    "snips",
]


@dataclass(frozen=True, slots=True)
class OffPolicyEstimate:
    """A value with its (two-sided, normal-approximation) confidence interval."""

    value: float
    low: float
    high: float
    stderr: float
    n: int  # logged samples used
    confidence: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1 (exclusive), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def _vector(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return array


def importance_weights(target_probs, logging_probs) -> np.ndarray:
    """w_i = π₁(a_i|x_i) / π₀(a_i|x_i), checked: probabilities in range, one per logged sample."""
    target = _vector(target_probs, "target_probs")
    logging = _vector(logging_probs, "logging_probs")
    if target.shape != logging.shape:
        raise ValueError(f"target_probs {target.shape} and logging_probs {logging.shape} differ in length")
    if target.size and (target.min() < 0 or target.max() > 1):
        raise ValueError("target_probs must lie in [0, 1]")
    if logging.size and (logging.min() <= 0 or logging.max() > 1):
        raise ValueError(
            "logging_probs must lie in (0, 1]: a logged action had a positive probability, else it "
            "would not have been taken"
        )
    return target / logging


def _checked(rewards, target_probs, logging_probs) -> tuple[np.ndarray, np.ndarray]:
    r = _vector(rewards, "rewards")
    w = importance_weights(target_probs, logging_probs)
    if r.shape != w.shape:
        raise ValueError(f"rewards {r.shape} and propensities {w.shape} differ in length")
    if r.size < 2:
        raise ValueError(f"need at least 2 logged samples, got {r.size}")
    return r, w


def effective_sample_size(weights) -> float:
    """(Σw)² / Σw²: how many on-policy samples the weighted log is worth (0 when no weight is positive)."""
    w = _vector(weights, "weights")
    square = float(np.sum(w * w))
    return float(np.sum(w)) ** 2 / square if square > 0 else 0.0


def _interval(value: float, stderr: float, n: int, confidence: float) -> OffPolicyEstimate:
    half = _z(confidence) * stderr
    return OffPolicyEstimate(value, value - half, value + half, stderr, n, confidence)


def ips(rewards, target_probs, logging_probs, confidence: float = 0.95) -> OffPolicyEstimate:
    """Inverse propensity scoring: mean of w_i r_i, with the sample standard error of that mean.

    When no weight is positive (no logged action is one the candidate takes) this is 0 ± 0: the
    unbiased estimator's value, but no evidence about the candidate. Check the weights before
    reporting it (router/offline/ledger.py reports "no estimate", as SNIPS's NaN says here)."""
    r, w = _checked(rewards, target_probs, logging_probs)
    terms = w * r
    return _interval(float(terms.mean()), float(terms.std(ddof=1) / np.sqrt(r.size)), r.size, confidence)


def snips(rewards, target_probs, logging_probs, confidence: float = 0.95) -> OffPolicyEstimate:
    """Self-normalised IPS: Σ w_i r_i / Σ w_i, delta-method standard error. NaN when no logged action
    is one the candidate would take (Σw = 0): the log then says nothing about the candidate."""
    r, w = _checked(rewards, target_probs, logging_probs)
    total = float(w.sum())
    if total <= 0:
        nan = float("nan")
        return OffPolicyEstimate(nan, nan, nan, nan, r.size, confidence)
    value = float(np.sum(w * r) / total)
    stderr = float(np.sqrt(np.sum(w * w * (r - value) ** 2)) / total)
    return _interval(value, stderr, r.size, confidence)


def on_policy(rewards, confidence: float = 0.95) -> OffPolicyEstimate:
    """The logging policy's own value: the plain mean of the logged rewards."""
    r = _vector(rewards, "rewards")
    if r.size < 2:
        raise ValueError(f"need at least 2 logged samples, got {r.size}")
    return _interval(float(r.mean()), float(r.std(ddof=1) / np.sqrt(r.size)), r.size, confidence)
