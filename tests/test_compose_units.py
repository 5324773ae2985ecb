"""The pieces of composition that need no worker: the predicted gain, the acceptance model and
its threshold, final-answer extraction."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest

from router.compose import (
    AcceptanceModel,
    acceptance_threshold,
    final_answer,
    predict_cascade,
    requested_workflow,
    should_cascade,
)
from router.decide import Estimate


def test_cascade_gain_formula():
    cheap, strong = Estimate("cheap", 0.6, Decimal("0.001")), Estimate("strong", 1.0, Decimal("0.010"))
    p = predict_cascade([cheap, strong], cost_weight=0.5, verifier_accuracy=0.75)
    assert p.quality == pytest.approx(0.6 * 1.0 + 0.4 * 0.75)  # = 0.9
    assert float(p.cost_usd) == pytest.approx(0.001 + (0.6 * 0.25 + 0.4 * 0.75) * 0.010)
    assert p.utility == pytest.approx(0.9 - 0.5 * float(p.cost_usd) / 0.010)
    assert should_cascade(p) and p.fast_worker == "cheap"
    # a cheap worker that is always right: nothing to gain
    assert not should_cascade(predict_cascade([Estimate("cheap", 1.0, Decimal("0.001")), strong], 0.5, 0.75))
    # quality first (λ = 0): the strong worker alone wins over an imperfect verifier
    assert not should_cascade(predict_cascade([cheap, strong], 0.0, 0.75))
    assert predict_cascade([strong], 0.5, 0.75) is None


def test_a_cascade_is_predicted_only_from_a_worker_cheaper_than_the_strongest():
    """The cascade runs cheaper workers before the strongest (cascade.chain drops dearer ones). When
    the strongest is also the cheapest there is no cascade: a prediction for "dearer -> strongest"
    made auto run a one-level chain of the strongest alone, and one failure of it was a 502 where
    fast mode falls back to the next worker."""
    strong = Estimate("strong", 0.9, Decimal("0.001"))
    weaker_dearer = [Estimate("mid", 0.5, Decimal("0.004")), Estimate("big", 0.6, Decimal("0.010"))]
    assert predict_cascade([strong, *weaker_dearer], 0.5, 0.75) is None
    cheaper = Estimate("tiny", 0.4, Decimal("0.0002"))
    p = predict_cascade([*weaker_dearer, strong, cheaper], 0.5, 0.75)
    assert (p.cheap, p.strong) == ("tiny", "strong")


def test_threshold_follows_the_cost_weight():
    assert acceptance_threshold(0.5) == pytest.approx(0.5)
    assert acceptance_threshold(0.0) > acceptance_threshold(0.5) > acceptance_threshold(1.0)
    assert 0.1 <= acceptance_threshold(100) and acceptance_threshold(-5) <= 0.9


def test_requested_workflow_names():
    assert requested_workflow("compose:debate") == "debate" and requested_workflow("auto") is None
    with pytest.raises(ValueError, match="compose:cascade"):
        requested_workflow("compose:chaos")


def test_final_answer_extraction():
    assert final_answer("so 6 * 7 = 42\n#### 42") == "42"
    assert final_answer("The answer is 1,234.") == "1234"
    assert final_answer("We get 3 then 5") == "5"
    assert final_answer("The answer is yes") == "yes"


def test_acceptance_model_learns_that_wrong_arithmetic_is_wrong():
    right = [
        (f"What is {a} times {b}?", f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}\n#### {a * b}")
        for a in range(2, 30)
        for b in (3, 4)
    ]
    wrong = [
        (f"What is {a} times {b}?", f"{a} * {b} = <<{a}*{b}={a * b + 1}>>{a * b + 1}\n#### {a * b + 1}")
        for a in range(2, 30)
        for b in (3, 4)
    ]
    queries = [q for q, _ in right + wrong]
    answers = [a for _, a in right + wrong]
    labels = [True] * len(right) + [False] * len(wrong)
    model = AcceptanceModel().fit(queries, answers, labels)
    p = model.predict_proba(
        ["What is 31 times 5?", "What is 31 times 5?"],
        ["31*5 = <<31*5=155>>155\n#### 155", "31*5 = <<31*5=150>>150\n#### 150"],
    )
    assert p[0] > 0.8 > 0.2 > p[1]
    again = AcceptanceModel().fit(queries, answers, labels).predict_proba(queries[:5], answers[:5])
    assert np.allclose(again, model.predict_proba(queries[:5], answers[:5]))  # deterministic
    with pytest.raises(ValueError, match="both right and wrong"):
        AcceptanceModel().fit(queries[:3], answers[:3], [True] * 3)


def _worker(name: str, input_price: str, output_price: str):
    from policies import Worker

    return Worker.model_validate(
        {
            "name": name,
            "model": f"openai/{name}",
            "api_base": "http://127.0.0.1:9/v1",
            "input_price_per_m": input_price,
            "output_price_per_m": output_price,
            "tier": "specialist",
            "license": "MIT",
            "provider": "fake",
            "jurisdiction": "FR",
            "context_window": 8192,
        }
    )


def test_the_cascade_chain_is_ordered_by_predicted_cost():
    from router.compose.cascade import chain

    strongest = _worker("strong", "5", "15")
    # a long prompt and a short answer: input price decides; list order (output first) would not
    long_input = _worker("long-input", "2", "0.1")
    cheap_input = _worker("cheap-input", "0.1", "1")
    cost = {"strong": Decimal(10), "long-input": Decimal(2), "cheap-input": Decimal("0.2")}
    pool = (strongest, long_input, cheap_input)
    assert [w.name for w in chain(pool, 3, lambda w: cost[w.name])] == ["cheap-input", "long-input", "strong"]
    assert [w.name for w in chain(pool, 2, lambda w: cost[w.name])] == ["cheap-input", "strong"]
    # the best-ranked worker is also the cheapest: nobody pricier and weaker answers before it
    free, paid = _worker("free", "0", "0"), _worker("paid-copy", "0.1", "0.1")
    assert [w.name for w in chain((free, paid), 2, lambda w: w.input_price_per_m)] == ["free"]
    assert [w.name for w in chain((free, paid), 2)] == ["free"]
    assert [w.name for w in chain((paid, free), 2)] == ["free", "paid-copy"]


def test_a_step_is_predicted_from_the_rate_a_long_prompt_was_billed_not_a_short_ones():
    """Run.prompt_tokens: characters at four a token (a non-ASCII one a token) until a step reports
    usage; then the run's billed rate, but only from prompts long enough to teach one — a short
    prompt's tokens are mostly the chat template's ("Hi": 2 characters, 9 tokens), and its rate would
    predict a later 2,000-character step at 9,000 tokens and stop the workflow for nothing."""
    from router.compose import Run

    worker = _worker("w", "1", "1")
    run = Run(messages=[], pool=(worker,), ask=None, ceiling_usd=Decimal(1))  # type: ignore[arg-type]
    text = [{"role": "user", "content": "x" * 2000}]
    assert run.prompt_tokens(worker, text) == 500
    assert run.prompt_tokens(worker, [{"role": "user", "content": "数" * 100}]) == 100
    run._observe(worker, [{"role": "user", "content": "Hi"}], 9)
    assert run.prompt_tokens(worker, text) == 500  # a short prompt teaches nothing
    run._observe(worker, [{"role": "user", "content": "y" * 800}], 400)  # billed 2 characters a token
    assert run.prompt_tokens(worker, text) == 1000
    run._observe(_worker("v", "1", "1"), [{"role": "user", "content": "z" * 800}], 100)  # cheaper rate
    assert run.prompt_tokens(worker, text) == 1000  # the worker's own rate first
