"""Paired bootstrap intervals of AIQ differences (router/offline/intervals.py)."""

from __future__ import annotations

import numpy as np
import pytest

from router.offline.intervals import PerQuery, curve_aiq, differences, interval, resampled_aiq


def _flat(scores: np.ndarray, lambdas: int = 3) -> PerQuery:
    """A router that returns these scores at no cost at every λ: its AIQ is its mean score."""
    score = np.tile(np.asarray(scores, float), (lambdas, 1))
    return PerQuery(score, np.zeros_like(score))


def test_the_same_router_twice_differs_by_exactly_nothing():
    scores = np.random.default_rng(0).integers(0, 2, 200)
    samples = resampled_aiq({"a": _flat(scores), "b": _flat(scores)}, 1.0, draws=50)
    out = differences(samples, [("a", "b")], lambda name: float(scores.mean()))
    assert out["a - b"] == {"difference": 0.0, "interval": [0.0, 0.0], "share_ahead": 0.0}


def test_a_router_right_wherever_the_other_is_wrong_is_ahead_on_every_resample():
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2, 300).astype(float)
    a = np.maximum(b, rng.integers(0, 2, 300))  # never worse, often better
    samples = resampled_aiq({"a": _flat(a), "b": _flat(b)}, 1.0, draws=200)
    out = differences(samples, [("a", "b")], lambda name: float({"a": a, "b": b}[name].mean()))["a - b"]
    assert out["interval"][0] > 0 and out["share_ahead"] == 1.0
    assert out["interval"][0] <= out["difference"] <= out["interval"][1]


def test_the_interval_covers_the_true_difference_at_about_its_level():
    """Two routers sharing hard queries (both right less often there): the 95% interval of their AIQ
    difference covers the true difference in about 95% of independent test sets."""
    rng = np.random.default_rng(2)
    n, trials, covered = 250, 120, 0
    p_hard, a_easy, a_hard, b_keeps = 0.3, 0.8, 0.3, 0.85  # b is right where a is, 85% of the time
    true = (p_hard * a_hard + (1 - p_hard) * a_easy) * (1 - b_keeps)  # E[a] − E[b]
    for t in range(trials):
        hard = rng.random(n) < p_hard
        a = (rng.random(n) < np.where(hard, a_hard, a_easy)).astype(float)
        b = a * (rng.random(n) < b_keeps)
        samples = resampled_aiq({"a": _flat(a), "b": _flat(b)}, 1.0, draws=300, seed=t)
        low, high = interval(samples["a"] - samples["b"])
        covered += low <= true <= high
    assert 0.88 <= covered / trials <= 0.99


def test_a_curve_is_scored_like_the_report_dearer_points_left_out():
    score = np.array([[0.5, 0.7], [0.9, 0.9]])  # λ rows, query columns
    cost = np.array([[0.0, 0.0], [4.0, 4.0]])  # the second λ costs more than the axis
    r = PerQuery(score, cost)
    samples = resampled_aiq({"r": r}, 2.0, draws=30, seed=3)
    # whatever the resample, only the free point counts: AIQ = its mean score
    assert np.all((samples["r"] >= 0.5) & (samples["r"] <= 0.7))
    assert curve_aiq(score.mean(axis=1), cost.mean(axis=1), 2.0) == pytest.approx(0.6)


def test_from_choices_reads_the_chosen_workers_label_and_cost():
    labels = np.array([[1.0, 0.0], [0.0, 1.0]])
    costs = np.array([[0.1, 0.2], [0.3, 0.4]])
    r = PerQuery.from_choices(np.array([[0, 0], [1, 1]]), labels, costs)
    assert r.score.tolist() == [[1.0, 0.0], [0.0, 1.0]] and r.cost.tolist() == [[0.1, 0.3], [0.2, 0.4]]


def test_routers_scored_on_different_queries_are_refused():
    with pytest.raises(ValueError, match="different query sets"):
        resampled_aiq({"a": _flat(np.ones(10)), "b": _flat(np.ones(11))}, 1.0, draws=5)
    with pytest.raises(ValueError, match=r"\[λ, n\]"):
        PerQuery(np.ones((2, 3)), np.ones((3, 2)))


def test_an_undefined_ratio_is_left_out_of_its_interval():
    assert interval(np.array([np.nan, 1.0, 2.0, 3.0, np.inf])) == pytest.approx([1.05, 2.95])
    assert all(np.isnan(interval(np.array([np.nan, np.nan]))))
