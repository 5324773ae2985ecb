"""A plan table live in the gateway, against the test upstream: a router whose cascade is a plan
table (the strategy `router train --strategy cascade` picks when it replays better) asks a plan's
voters in one round, returns their answer when they agree, asks the fallback when they do not,
and never calls a worker outside the pool."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import Gateway
from tests.test_planner_gateway import (
    LAMBDAS,
    QUESTION,
    WORKERS,
    answered,
    ask,
    behave_all,
    header_steps,
    multiple_choice,
    planned_gateway,
    trace_of,
    trained,  # noqa: F401  (the session fixture: the query-only artifact that carries the table)
    with_planner,
)

COSTS = np.array([1.0, 2.0, 20.0]) / 1000  # recorded USD per question: cheap, mid, pricey


@pytest.fixture(scope="module")
def table():
    from router.offline.book import AnswerBook
    from router.offline.plan_table_fit import fit_plan_table

    queries, texts, labels = multiple_choice(300, seed=4)
    return fit_plan_table(AnswerBook(queries, texts), labels, np.tile(COSTS, (300, 1)), list(WORKERS))


@pytest.fixture(scope="module")
def gw(upstream, trained, table, tmp_path_factory):  # noqa: F811
    _, artifact = trained
    gateway = planned_gateway(upstream, tmp_path_factory.mktemp("plan-table"), with_planner(artifact, table))
    assert gateway.state.router.current.planner is not None
    yield gateway
    gateway.server.stop()


def walk(gw: Gateway, texts: dict[str, str], cost_weight: float, question: str = QUESTION) -> list[list[str]]:
    """The plan the table makes for ``question`` from the priors and predicted costs the gateway uses,
    placing its workers by name as the gateway does: the oracle the live plan must match (free text
    compared without meaning keys: only its first round is an oracle)."""
    from gateway.schemas import ChatCompletionRequest
    from router import RouteRequest
    from router.evidence import logit, read_answers
    from router.planner import State

    router = gw.state.router.current
    chat = ChatCompletionRequest.model_validate(
        {"model": "auto", "messages": [{"role": "user", "content": question}], "max_tokens": 20}
    )
    route = RouteRequest(chat.prompt_chars(), chat.output_budget(), text=question, cost_weight=cost_weight)
    pool = list(router.route(route, tuple(gw.state.catalog.get(w) for w in WORKERS)).workers)
    names = [w.name for w in pool]
    estimates = router.estimates(route, pool)
    log_odds, costs = [logit(e.quality) for e in estimates], [float(e.cost_usd) for e in estimates]
    called: list[int] = []
    rounds: list[list[str]] = []
    while True:
        read = read_answers(question, [texts[names[k]] for k in called]) if called else None
        decision = router.planner.decide(
            State.of(question, called, read), log_odds, costs, cost_weight, names=names
        )
        if not decision.call:
            return rounds
        rounds.append([names[k] for k in decision.call])
        called.extend(decision.call)


def pick(gw: Gateway, texts: dict[str, str], wanted, question: str = QUESTION) -> tuple[float, list]:
    for cost_weight in LAMBDAS:
        rounds = walk(gw, texts, cost_weight, question)
        if wanted(rounds):
            return cost_weight, rounds
    pytest.fail(f"the table makes no such plan at any λ of {LAMBDAS}")


def two_voters(rounds) -> bool:
    return len(rounds) >= 1 and len(rounds[0]) == 2


def run_plan(gw: Gateway, upstream, texts: dict[str, str]):
    """Ask at the first λ where the table asks two voters; (the answer, its rounds, the oracle's)."""
    cost_weight, expected = pick(gw, texts, two_voters)
    behave_all(upstream, texts)
    answer = ask(gw, cost_weight=cost_weight)
    assert answer.status_code == 200, answer.text
    return answer, header_steps(answer), expected


def test_voters_are_asked_together_and_the_fallback_settles_a_disagreement(gw, upstream):
    texts = {"cheap": "A", "mid": "B", "pricey": "C"}
    answer, rounds, expected = run_plan(gw, upstream, texts)
    assert rounds == expected and len(rounds) == 2 and len(rounds[0]) == 2
    fallback = rounds[1][0]
    assert answer.headers["x-polyroute-worker"] == fallback
    assert answer.json()["choices"][0]["message"]["content"] == texts[fallback]
    assert answered(upstream) == {w: 1 for r in rounds for w in r}
    steps = trace_of(answer)["steps"]
    assert [s["worker"] for s in steps] == [w for r in rounds for w in r]


def test_agreeing_voters_end_the_plan_in_one_round(gw, upstream):
    answer, rounds, expected = run_plan(gw, upstream, dict.fromkeys(WORKERS, "B"))
    assert rounds == expected and len(rounds) == 1 and len(rounds[0]) == 2
    assert answer.headers["x-polyroute-worker"] in rounds[0]
    assert answer.json()["choices"][0]["message"]["content"] == "B"
    assert sum(answered(upstream).values()) == 2


def test_a_failing_voter_is_dropped_and_the_plan_still_answers(gw, upstream):
    texts = {"cheap": "A", "mid": "B", "pricey": "C"}
    cost_weight, expected = pick(gw, texts, two_voters)
    behave_all(upstream, texts)
    failing = expected[0][0]
    upstream.behave(f"{failing}-model", status=500)
    answer = ask(gw, cost_weight=cost_weight)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] != failing
    assert answered(upstream)[failing] == 1  # asked once, then out of the plan


# ---- free text, compared by meaning ----------------------------------------------------------------
FREE_TEXT = "Explain in one or two sentences what the mitochondria does in a cell."
SAYS_ATP = "The mitochondria produces most of the cell's energy in the form of ATP."
SAYS_ATP_TOO = "Most of a cell's ATP, its energy currency, is made by the mitochondria."
SAYS_DNA = "The mitochondria stores the genetic information of the cell as DNA in its nucleus."


def free_text_plan(gw: Gateway, upstream, voters_say: tuple[str, str]):
    """Ask FREE_TEXT at the first λ where the table asks two voters, they answering ``voters_say``
    and the fallback SAYS_DNA; (the answer, its rounds)."""
    probe = dict.fromkeys(WORKERS, SAYS_DNA)
    cost_weight, expected = pick(gw, probe, two_voters, FREE_TEXT)
    texts = dict(probe)
    for voter, said in zip(expected[0], voters_say, strict=True):
        texts[voter] = said
    behave_all(upstream, texts)
    answer = ask(gw, cost_weight=cost_weight, content=FREE_TEXT, max_tokens=60)
    assert answer.status_code == 200, answer.text
    rounds = header_steps(answer)
    assert rounds[0] == expected[0]
    return answer, rounds


@pytest.mark.slow
def test_free_text_voters_that_say_the_same_in_other_words_agree(gw, upstream):
    """Loads MiniLM (the retrieval embedder) for the meaning keys."""
    answer, rounds = free_text_plan(gw, upstream, (SAYS_ATP, SAYS_ATP_TOO))
    assert len(rounds) == 1 and sum(answered(upstream).values()) == 2
    assert answer.json()["choices"][0]["message"]["content"] in (SAYS_ATP, SAYS_ATP_TOO)


@pytest.mark.slow
def test_free_text_voters_that_say_different_things_ask_the_fallback(gw, upstream):
    answer, rounds = free_text_plan(gw, upstream, (SAYS_ATP, SAYS_DNA))
    assert len(rounds) == 2 and answer.json()["choices"][0]["message"]["content"] == SAYS_DNA


def test_without_meaning_keys_free_text_agrees_with_nobody(upstream, trained, table, tmp_path):  # noqa: F811
    _, artifact = trained
    plain = planned_gateway(upstream, tmp_path, with_planner(artifact, table), plan_text_agreement=False)
    try:
        answer, rounds = free_text_plan(plain, upstream, (SAYS_ATP, SAYS_ATP))
        assert len(rounds) == 2  # even word-for-word the same free text: the fallback settles it
    finally:
        plain.server.stop()


def test_the_trace_lists_a_rounds_voters_in_the_plans_order_whoever_finishes_first(gw, upstream):
    """The first voter answers last: its step still comes first in the trace, as in the header."""
    texts = {"cheap": "A", "mid": "B", "pricey": "C"}
    cost_weight, expected = pick(gw, texts, two_voters)
    behave_all(upstream, texts)
    upstream.behave(f"{expected[0][0]}-model", text=texts[expected[0][0]], latency_s=0.5)
    answer = ask(gw, cost_weight=cost_weight)
    assert answer.status_code == 200, answer.text
    rounds = header_steps(answer)
    assert rounds == expected
    assert [s["worker"] for s in trace_of(answer)["steps"]] == [w for r in rounds for w in r]
