"""The routing decision: quality − λ·cost, targets, ties, unknown workers."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import Estimate, choose


def est(name: str, q: float, cost: str, active: float | None = None, known: bool = True) -> Estimate:
    return Estimate(name, q, Decimal(cost), active, known)


POOL = [est("cheap", 0.60, "0.0001"), est("mid", 0.75, "0.001"), est("frontier", 0.90, "0.01")]


def test_lambda_zero_picks_best_quality_and_high_lambda_the_cheapest():
    assert choose(POOL, 0.0).ranked[0].worker == "frontier"
    assert choose(POOL, 5.0).ranked[0].worker == "cheap"


def test_lambda_trades_quality_against_normalised_cost():
    # utilities at λ=0.2: cheap 0.60-0.002=0.598, mid 0.75-0.02=0.73, frontier 0.90-0.2=0.70
    choice = choose(POOL, 0.2)
    assert [e.worker for e in choice.ranked] == ["mid", "frontier", "cheap"]
    assert "0.2*cost" in choice.reason


def test_min_quality_target_picks_cheapest_reaching_it():
    assert choose(POOL, 0.0, min_quality=0.7).ranked[0].worker == "mid"
    assert choose(POOL, 0.0, min_quality=0.5).ranked[0].worker == "cheap"
    unreachable = choose(POOL, 0.0, min_quality=0.95)
    assert unreachable.ranked[0].worker == "frontier" and "none predicted to reach" in unreachable.reason


def test_ties_go_to_cheaper_then_fewer_active_params_then_name():
    tie = [est("b", 0.8, "0.001", 10), est("a", 0.8, "0.001", 10), est("c", 0.8, "0.001", 5)]
    assert [e.worker for e in choose(tie, 0.0).ranked] == ["c", "a", "b"]
    free = [est("x", 0.5, "0"), est("y", 0.5, "0")]
    assert [e.worker for e in choose(free, 1.0).ranked] == ["x", "y"]  # all free: no division by zero


def test_unknown_worker_is_said_in_the_reason():
    choice = choose([est("new", 0.99, "0", known=False), est("old", 0.5, "0")], 0.5)
    assert choice.ranked[0].worker == "new" and "prior used" in choice.reason


def test_bad_arguments():
    with pytest.raises(ValueError, match="no worker"):
        choose([], 0.5)
    with pytest.raises(ValueError, match="cost_weight"):
        choose(POOL, -1)


estimates = st.lists(
    st.tuples(st.floats(0, 1), st.integers(0, 10_000)), min_size=1, max_size=8, unique_by=lambda t: t
).map(lambda items: [est(f"w{i}", q, str(Decimal(c) / 1_000_000)) for i, (q, c) in enumerate(items)])


@settings(max_examples=400, deadline=None)
@given(pool=estimates, low=st.floats(0, 3), extra=st.floats(0.001, 3))
def test_higher_lambda_never_picks_a_more_expensive_worse_worker(pool, low, extra):
    at_low = choose(pool, low).ranked[0]
    at_high = choose(pool, low + extra).ranked[0]
    assert not (at_high.cost_usd > at_low.cost_usd and at_high.quality < at_low.quality)
    assert at_high.cost_usd <= at_low.cost_usd  # the chosen cost never rises with λ


def test_the_policy_preference_for_fewer_active_params_weighs_in_the_price():
    big, small = est("big", 0.80, "0.001", active=400), est("small", 0.70, "0.001", active=3)
    assert choose([big, small], 0.5).ranked[0].worker == "big"  # same price: quality decides
    # w = 1: size alone is the price, so 0.5 × (1 − 3/400) outweighs the 0.1 quality gap
    assert choose([big, small], 0.5, active_weight=1.0).ranked[0].worker == "small"
    assert "active params" in choose([big, small], 0.5, active_weight=1.0).reason
    assert choose([big, small], 0.0, active_weight=1.0).ranked[0].worker == "big"  # quality first
    unknown = est("unknown", 0.80, "0.001")  # unknown size counts as the largest known (400)
    assert choose([unknown, big, small], 0.5, active_weight=1.0).ranked[0].worker == "small"
    with pytest.raises(ValueError, match="active_weight"):
        choose([big, small], 0.5, active_weight=1.5)
