"""Train/serve parity of the learned router: what `router train --strategy cascade` stores is what the
gateway decides with, so the live router decides as `router eval` measured.

A tiny RouterBench-format data set (few-shot prompts, every worker's recorded answer and cost) is
written here, a router is trained on it with the real code, and the gateway (against the test
upstream) is checked against the offline side:

1. the operating λ the harness validates is stored in the card and is the gateway's default λ, below a
   request's, a tenant's and the operator's; GET /admin/router and the route reason say which is in force;
2. the live router reads the part of the query the model was trained on (RouterBench: the question after
   the few-shot examples; the whole message for the other formats and every older card);
3. live costs price each worker's recorded answer length, as for single routing;
4. a plan trained comparing code answers by behaviour says so in its card, and a gateway that compares
   them by source (code execution off) warns at load and in GET /admin/router;
5. a worker the model never saw does not rescale the prices of the workers it knows, in fast mode and in
   the plan alike.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import pickle
from pathlib import Path

import httpx
import numpy as np
import pytest

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway

WORKERS = ("cheap", "mid", "pricey")
SHOTS = (
    "Answer with the letter of the right option.\n\n"
    "Example: Which of these is a colour?\nA) seven\nB) red\nC) table\nD) run\nAnswer: B\n\n"
    "Example: Which of these is a number?\nA) seven\nB) red\nC) table\nD) run\nAnswer: A\n\n"
)
CODE_SHOTS = (
    "You are an expert Python programmer, and here is an example task.\n\n"
    "Example: Write a function double(x) that returns twice x.\n"
    "def double(x):\n    return 2 * x\n\n"
)
# P(right) per worker, by kind of question: easy choices, hard choices, code
ACCURACY = {"easy": (0.85, 0.9, 0.95), "hard": (0.2, 0.5, 0.9), "code": (0.3, 0.6, 0.9)}
USD_PER_CHAR = (2e-8, 1e-7, 1e-6)  # the recorded cost of an answer, per character, per worker
OPUS = """
  - name: opus
    model: openai/opus-model
    api_base: {url}/v1
    api_key_env: POLYROUTE_TEST_UPSTREAM_KEY
    context_window: 8192
    input_price_per_m: 15.00
    output_price_per_m: 75.00
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
"""


def _choice(i: int, hard: bool) -> tuple[str, str]:
    """(question, right letter) of a four-option question."""
    rng = np.random.default_rng(1000 + i)
    if hard:
        options = [str(n) for n in rng.choice(np.arange(20, 99), 4, replace=False)]
        primes = [o for o in options if all(int(o) % d for d in range(2, int(o)))]
        right = "ABCD"[options.index(primes[0])] if primes else "A"
        stem = f"Which of these numbers is prime (question {i})?"
    else:
        options = list(rng.permutation(["red", "seven", "table", "run"]))
        right = "ABCD"[options.index("red")]
        stem = f"Which of these words names a colour (question {i})?"
    return stem + "".join(f"\n{letter}) {o}" for letter, o in zip("ABCD", options, strict=True)), right


def rows(first: int, n_choice: int, n_code: int, seed: int) -> list[dict]:
    """Recorded rows: the whole message a client sends, the kind, and per worker answer, label, cost."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(first, first + n_choice + n_code):
        kind = "code" if i - first >= n_choice else ("hard" if i % 2 else "easy")
        if kind == "code":
            message = (
                CODE_SHOTS + f"Write a python function add_{i}(a, b) that returns a + b + {i}.\n"
                f"assert add_{i}(1, 2) == {3 + i}"
            )
        else:
            question, right = _choice(i, kind == "hard")
            message = SHOTS + question
        answers, labels, costs = [], [], []
        for j, accuracy in enumerate(ACCURACY[kind]):
            good = bool(rng.random() < accuracy)
            if kind == "code":
                body = f"return a + b + {i}" if good else "return a - b"
                doc = '    """Add the numbers and the offset, as the task asks."""\n' * (4 + j)
                answer = f"def add_{i}(a, b):\n{doc}    {body}"
            else:
                letter = right if good else next(x for x in "DCBA" if x != right)
                answer = (letter, f"The answer is {letter}.", f"Reading every option in turn: {letter}.")[j]
                answer = answer + " Checked once more, option by option." * j
            answers.append(answer)
            labels.append(float(good))
            costs.append(len(message) * 1e-8 + len(answer) * USD_PER_CHAR[j])
        out.append(
            {"id": i, "message": message, "kind": kind, "answers": answers, "labels": labels, "costs": costs}
        )
    return out


def write_routerbench(path: Path, recorded: list[dict]) -> Path:
    header = ["", "sample_id", "prompt", "eval_name", *WORKERS]
    header += [f"{w}|model_response" for w in WORKERS] + [f"{w}|total_cost" for w in WORKERS]
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(header)
        for n, row in enumerate(recorded):
            out.writerow(
                [
                    n,
                    f"parity.{row['id']}",
                    repr([row["message"]]),
                    row["kind"],
                    *row["labels"],
                    *row["answers"],
                ]
                + [f"{c:.10f}" for c in row["costs"]]
            )
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity-data")
    train, test = rows(0, 90, 10, seed=1), rows(500, 24, 4, seed=2)
    return {
        "train": write_routerbench(root / "train.csv", train),
        "test": write_routerbench(root / "test.csv", test),
        "train_rows": train,
        "test_rows": test,
    }


@pytest.fixture(scope="module")
def trained(data):
    """The cascade router `router train --strategy cascade --format routerbench` makes of the train file."""
    from router.offline.pool_cascade import train_cascade
    from router.offline.routerbench import load_routerbench

    return train_cascade(load_routerbench([data["train"]]), backend="static", model="ensemble", seed=0)


def catalog(url: str):
    """The test catalog (cheap, mid, pricey: the data's workers) and opus, a dear worker the model never saw."""
    return parse_catalog(catalog_yaml_for(url) + OPUS.format(url=url))


@pytest.fixture(scope="module")
def gw(upstream, trained, tmp_path_factory):
    """A gateway serving the trained router in fast mode (no plan, no auto cascade), POLYROUTE_COST_WEIGHT
    unset and code execution off (the defaults)."""
    from router import save_artifact

    data_dir = tmp_path_factory.mktemp("parity-gw") / "data"
    save_artifact(data_dir / "router", pickle.loads(pickle.dumps(trained)))
    gateway = start_gateway(
        catalog(upstream.url), data_dir, compose_plan=False, compose_auto=False, retries=0
    )
    assert gateway.state.router.current.name == "learned"
    yield gateway
    gateway.server.stop()


def ask(gw, message: str, **headers) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": message}], "max_tokens": 20}
    response = httpx.post(
        gw.v1 + "/chat/completions", headers={**gw.auth(), **headers}, json=body, timeout=60
    )
    assert response.status_code == 200, response.text
    return response


def admin_router(gw) -> dict:
    response = httpx.get(gw.url + "/admin/router", headers=gw.auth(gw.admin_key), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def live_request(message: str, **fields):
    """The RouteRequest the gateway builds for a one-message request (gateway/completions.py)."""
    from gateway.schemas import ChatCompletionRequest
    from router import RouteRequest

    chat = ChatCompletionRequest.model_validate(
        {"model": "auto", "messages": [{"role": "user", "content": message}], "max_tokens": 20}
    )
    return RouteRequest(chat.prompt_chars(), chat.output_budget(), text=chat.last_user_text(), **fields)


def learned(artifact, **kwargs):
    from router import LearnedRouter, feature_builder_for

    return LearnedRouter(artifact, feature_builder_for(artifact.features), **kwargs)


# ---- 1. the operating λ ------------------------------------------------------------------------------
def test_train_stores_the_operating_cost_weight_the_harness_validates(data, trained):
    from router.offline.pool_cascade import evaluate_cascade
    from router.offline.routerbench import load_routerbench
    from router.training import feature_builder

    report = evaluate_cascade(
        load_routerbench([data["train"]]),
        load_routerbench([data["test"]]),
        feature_builder("static"),
        model="ensemble",
        seed=0,
    )
    ours = report["routers"]["ours"]
    assert ours["chosen"] == trained.card["cascade"]["strategy"]
    # the same rule on the same cross-fitted replay of the training files (the test files are not read)
    assert trained.card["operating_cost_weight"] == ours["operating_point"]["lambda"]
    assert trained.card["operating_cost_weight_reason"].startswith(ours["operating_point"]["how"])


def test_the_cost_weight_in_force_follows_request_tenant_operator_card_then_default(trained):
    from router.learned import CostWeight

    operating = trained.card["operating_cost_weight"]
    router = learned(trained)  # POLYROUTE_COST_WEIGHT unset
    message = "Which of these words names a colour?\nA) red\nB) seven"
    assert router.cost_weight(live_request(message)) == CostWeight(operating, "model card")
    assert router.cost_weight(live_request(message, tenant_cost_weight=0.7)) == CostWeight(0.7, "tenant")
    both = live_request(message, cost_weight=0.1, tenant_cost_weight=0.7)
    assert router.cost_weight(both) == CostWeight(0.1, "request")
    operator = learned(trained, default_cost_weight=0.2)
    assert operator.cost_weight(live_request(message)) == CostWeight(0.2, "setting")
    assert operator.cost_weight(live_request(message, tenant_cost_weight=0.7)) == CostWeight(0.7, "tenant")
    older = pickle.loads(pickle.dumps(trained))  # a card from before the operating λ was stored
    del older.card["operating_cost_weight"]
    assert learned(older).cost_weight() == CostWeight(0.5, "default")
    # the fast decision is the one at that λ
    request = live_request(message)
    at = live_request(message, cost_weight=operating)
    assert router.route(request, tuple(_pool())).workers == router.route(at, tuple(_pool())).workers


def test_the_gateway_decides_at_the_operating_cost_weight_and_says_so(gw, trained, data):
    operating = trained.card["operating_cost_weight"]
    status = admin_router(gw)
    assert status["cost_weight"]["value"] == operating and status["cost_weight"]["source"] == "model card"
    assert status["cost_weight"]["reason"] == trained.card["operating_cost_weight_reason"]
    message = data["test_rows"][0]["message"]
    answer = ask(gw, message)
    reason = answer.headers["x-polyroute-route-reason"]
    assert reason.endswith(f"cost weight {operating:g} from the model card (operating_cost_weight)")
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["route"]["cost_weight"] == operating
    asked = ask(gw, message, **{"x-polyroute-cost-weight": "0.3"})
    assert "cost weight 0.3 from the request" in asked.headers["x-polyroute-route-reason"]
    assert ledger_record(gw, asked.headers["x-polyroute-request-id"])["route"]["cost_weight"] == 0.3
    # a plan reports the same λ and source
    body = {"model": "compose:plan", "messages": [{"role": "user", "content": message}], "max_tokens": 20}
    plan = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60)
    assert plan.status_code == 200, plan.text
    assert f"cost weight {operating:g} from the model card" in plan.headers["x-polyroute-route-reason"]


# ---- 2. the query text --------------------------------------------------------------------------------
def test_the_live_router_reads_the_question_a_routerbench_model_was_trained_on(trained, data, gw):
    from router.offline.routerbench import load_routerbench

    test = load_routerbench([data["test"]])
    messages = [row["message"] for row in data["test_rows"]]
    assert all(text != message for text, message in zip(test.texts, messages, strict=True))
    router = learned(trained)
    # offline (training, the harness): the model scores the dataset's texts; live, the whole message
    offline = np.asarray(trained.model.predict(router.features.transform(test.texts, test.turns)))
    live = np.array([[router.predict_quality(m)[w] for w in trained.workers] for m in messages])
    np.testing.assert_allclose(live, offline, rtol=1e-5, atol=1e-6)
    assert test.text_rule == "last_paragraph" and trained.features["text_rule"] == "last_paragraph"
    # the gateway's choice for the whole message is the router's for the question alone
    for message, text in list(zip(messages, test.texts, strict=True))[:6]:
        request = live_request(message, cost_weight=0.3)
        question = dataclasses.replace(request, text=text)
        expected = router.route(question, tuple(_pool())).workers[0].name
        assert (
            ask(gw, message, **{"x-polyroute-cost-weight": "0.3"}).headers["x-polyroute-worker"] == expected
        )
        assert router.route(request, tuple(_pool())).workers[0].name == expected


def test_probes_are_read_under_the_cards_text_rule_when_a_worker_is_onboarded(trained, data):
    """router/onboard.py featurises probes as the router reads a query live: a worker onboarded on
    the whole few-shot messages gets the vector it gets from their questions alone."""
    from router.offline.routerbench import load_routerbench
    from router.onboard import onboard_artifact

    test = load_routerbench([data["test"]])
    messages = [row["message"] for row in data["test_rows"]]
    labels = np.array([[float(i % 3 == 0)] for i in range(len(messages))])
    features = learned(trained).features
    turns = [1] * len(messages)
    whole = onboard_artifact(trained, features, messages, turns, labels, ["newcomer"])
    focused = onboard_artifact(trained, features, test.texts, turns, labels, ["newcomer"])
    for model in (whole.model, focused.model):
        assert "newcomer" in model.names
    np.testing.assert_allclose(
        whole.model.coef_[whole.model.names.index("newcomer")],
        focused.model.coef_[focused.model.names.index("newcomer")],
    )


def test_whole_text_models_and_older_cards_read_the_whole_message(tmp_path):
    from router import load_version, train_artifact
    from router.features import combined_text_rule
    from router.offline import load_format
    from router.offline.routellm import gsm8k_dataset, load_gsm8k_answers

    fixtures = Path(__file__).parent / "fixtures"
    llmrouter = load_format(
        "llmrouter", [fixtures / "multi" / "llmrouter_tiny.json"], fixtures / "multi" / "default_llm.json"
    )
    assert llmrouter.text_rule == "whole"
    assert gsm8k_dataset(load_gsm8k_answers(fixtures / "gsm8k_small.csv")).text_rule == "whole"
    assert combined_text_rule(["last_paragraph", "whole"]) == "whole"
    assert combined_text_rule(["last_paragraph", "last_paragraph"]) == "last_paragraph"
    # several paragraphs, all of them the question: a whole-text model reads all of them
    texts = ["Here is my situation, at length.\n\nNow: should I refactor the parser or rewrite it?"] * 40
    labels = np.tile([0.3, 0.8], (40, 1))
    artifact = train_artifact(texts, [1] * 40, labels, ["a", "b"], backend="static", model="logreg")
    assert artifact.features["text_rule"] == "whole"
    router = learned(artifact)
    whole = np.asarray(artifact.model.predict(router.features.transform(texts[:1], [1])))[0]
    assert [router.predict_quality(texts[0])[w] for w in ("a", "b")] == pytest.approx(whole.tolist())
    # the shipped prior's card has no rule: the whole message, as before
    prior = load_version(Path(__file__).parents[1] / "router", "prior")
    assert "text_rule" not in prior.features
    shipped = learned(prior)
    assert shipped.text_rule == "whole"
    expected = np.asarray(prior.model.predict(shipped.features.transform(texts[:1], [1])))[0]
    assert list(shipped.predict_quality(texts[0]).values()) == pytest.approx(expected.tolist())


# ---- 3. costs -----------------------------------------------------------------------------------------
def test_live_costs_price_each_workers_recorded_answer_length(trained, data, upstream):
    from policies import estimate_tokens
    from router.offline.routerbench import load_routerbench

    answers = np.array([[len(a) for a in row["answers"]] for row in data["train_rows"]], dtype=float)
    assert trained.output_tokens == pytest.approx(
        {w: float(np.median(answers[:, j]) / 4) for j, w in enumerate(WORKERS)}
    )
    router = learned(trained)
    workers = catalog(upstream.url)
    pool = [workers.get(w) for w in WORKERS]
    test = load_routerbench([data["test"]])
    # offline: the completion tokens the artifact's model of the recorded answers expects for the
    # dataset's text of each test query; live: the whole message, at the catalog's prices
    offline = np.asarray(trained.output_model.predict(router.features.transform(test.texts, test.turns)))
    tokens = {"code": [], "choice": []}
    for row, expected in zip(data["test_rows"], offline, strict=True):
        request = dataclasses.replace(live_request(row["message"]), max_output_tokens=None)
        prompt_tokens, _ = estimate_tokens(request.prompt_chars, None)
        for estimate, worker, predicted in zip(router.estimates(request, pool), pool, expected, strict=True):
            assert estimate.cost_usd == worker.cost_usd(prompt_tokens, int(round(predicted)))
        tokens["code" if row["kind"] == "code" else "choice"].append(expected)
    # the costs follow the answers' lengths per query: code answers are long, letters short
    code, choice = np.median(tokens["code"], axis=0), np.median(tokens["choice"], axis=0)
    assert np.all(code > 2 * choice), (code, choice)
    # capped by the request's max_tokens, as for single routing
    capped = live_request(data["test_rows"][-1]["message"])
    prompt_tokens, _ = estimate_tokens(capped.prompt_chars, capped.max_output_tokens)
    for estimate, worker, predicted in zip(router.estimates(capped, pool), pool, offline[-1], strict=True):
        tokens_capped = int(round(min(predicted, capped.max_output_tokens)))
        assert estimate.cost_usd == worker.cost_usd(prompt_tokens, tokens_capped)


# ---- 4. how code answers are compared -----------------------------------------------------------------
def test_a_plan_trained_on_code_behaviour_warns_when_the_gateway_compares_code_by_source(
    trained, gw, tmp_path, caplog
):
    from gateway.router_state import RouterHolder
    from router import save_artifact

    card = trained.card["cascade"]
    assert card["code_answers"] == "behaviour" and card["code_questions"] == 10
    router = learned(trained)
    assert router.warnings(code_exec=True) == []
    (warning,) = router.warnings(code_exec=False)
    assert "POLYROUTE_PLAN_CODE_EXEC" in warning and "behaviour" in warning
    assert admin_router(gw)["warnings"] == [warning]  # the gateway's default: code execution off
    save_artifact(tmp_path / "router", pickle.loads(pickle.dumps(trained)))
    with caplog.at_level(logging.WARNING, logger="polyroute.router"):
        RouterHolder(tmp_path / "router")
    logged = [r for r in caplog.records if "POLYROUTE_PLAN_CODE_EXEC" in r.getMessage()]
    assert len(logged) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyroute.router"):
        RouterHolder(tmp_path / "router", plan_code_exec=True)
    assert not [r for r in caplog.records if "POLYROUTE_PLAN_CODE_EXEC" in r.getMessage()]


# ---- 5. a worker the model never saw ------------------------------------------------------------------
LAMBDAS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


@pytest.fixture(scope="module")
def synthetic(upstream):
    """A router whose predictions are the workers' accuracies (one question, many labels) and whose plan
    is a plan table fitted on recorded multiple-choice answers: decisions that turn on prices."""
    from router import train_artifact
    from router.offline.book import AnswerBook
    from router.offline.plan_table_fit import fit_plan_table
    from tests.test_planner_gateway import ACCURACY, QUESTION, multiple_choice

    queries, texts, labels = multiple_choice(300, seed=5)
    recorded = np.tile(np.array([0.2, 1.0, 10.0]) / 1000, (300, 1))
    artifact = train_artifact(
        [QUESTION] * 300, [1] * 300, labels, list(WORKERS), backend="static", model="logreg"
    )
    artifact.cascade = fit_plan_table(AnswerBook(queries, texts), labels, recorded, list(WORKERS))
    assert ACCURACY == (0.6, 0.7, 0.95)
    return learned(artifact), QUESTION


def _pool(with_opus: bool = False, url: str = "http://127.0.0.1:9"):
    workers = catalog(url)
    return [workers.get(w) for w in (*WORKERS, *(("opus",) if with_opus else ()))]


def test_an_unseen_dear_worker_does_not_rescale_the_fast_choice(synthetic):
    router, question = synthetic
    choices = set()
    for cost_weight in LAMBDAS:
        request = live_request(question, cost_weight=cost_weight)
        known = [w.name for w in router.route(request, tuple(_pool())).workers]
        everyone = [w.name for w in router.route(request, tuple(_pool(with_opus=True))).workers]
        assert [name for name in everyone if name != "opus"] == known, cost_weight
        choices.add(known[0])
    assert len(choices) >= 2  # λ moves the choice: prices matter at these λ


def test_an_unseen_dear_worker_does_not_rescale_the_plan(synthetic):
    from router.evidence import logit
    from router.planner import State

    router, question = synthetic
    request = live_request(question)
    plans = set()
    for cost_weight in LAMBDAS:
        decided = []
        for pool in (_pool(), _pool(with_opus=True)):
            names = [w.name for w in pool]
            estimates = router.estimates(request, pool)
            decision = router.planner.decide(
                State.of(question),
                [logit(e.quality) for e in estimates],
                [float(e.cost_usd) for e in estimates],
                cost_weight,
                names=names,
            )
            decided.append(sorted(names[k] for k in decision.call))
        assert decided[0] == decided[1], cost_weight
        plans.add(tuple(decided[0]))
    assert len(plans) >= 2


def test_the_gateway_prices_an_unseen_worker_on_the_models_scale(gw, trained, data):
    router = learned(trained)
    for row in data["test_rows"][:6]:
        for cost_weight in (0.3, 1.0):
            known = router.route(live_request(row["message"], cost_weight=cost_weight), tuple(_pool()))
            answer = ask(gw, row["message"], **{"x-polyroute-cost-weight": str(cost_weight)})
            assert answer.headers["x-polyroute-worker"] == known.workers[0].name


# ---- 6. the question the plan reads -------------------------------------------------------------------
# few-shot multiple-choice examples before a question that is not one: only the last paragraph says so
OPEN_ROWS = (
    (SHOTS + "Name the colour of a clear daytime sky, in one word.", ("Blue", "blue.", "Blue")),
    (SHOTS + "How many legs do 3 spiders have in total?", ("24", "The answer is 24.", "3 x 8 = 24")),
    (SHOTS + "Which planet is the largest one in our solar system?", ("Jupiter", "Saturn", "Jupiter.")),
)


def test_the_plan_reads_the_question_a_routerbench_plan_was_trained_on(gw, trained, data, upstream):
    """A RouterBench plan was fitted on the question after the few-shot examples: live, its answer
    readers (the kind of answer, the option letters, the asserts) read that question too, so with each
    worker answering as recorded the gateway's plans are the replay's. Read whole, the few-shot
    examples' options make an open question look like a multiple-choice one, and some plans differ."""
    from router.evidence import logit
    from router.features import focus_text
    from router.offline.book import AnswerBook
    from router.offline.replay import play

    recorded = [(row["message"], tuple(row["answers"])) for row in data["test_rows"][::3]] + list(OPEN_ROWS)
    assert all(focus_text(m) != m for m, _ in recorded)  # every message is few-shot
    answers = [list(a) for _, a in recorded]
    book = AnswerBook([focus_text(m) for m, _ in recorded], answers)
    whole = AnswerBook([m for m, _ in recorded], answers)
    router, pool = learned(trained), _pool()
    differ = 0
    for cost_weight in (0.02, 3.0):
        for i, (message, texts) in enumerate(recorded):
            # room for every recorded answer (the test upstream cuts an answer at max_tokens words)
            request = dataclasses.replace(
                live_request(message, cost_weight=cost_weight), max_output_tokens=400
            )
            estimates = router.estimates(request, pool)
            priors = np.array([logit(e.quality) for e in estimates])
            costs = np.array([float(e.cost_usd) for e in estimates])
            called, _, rounds = play(router.planner, book, i, priors, costs, cost_weight)
            differ += play(router.planner, whole, i, priors, costs, cost_weight)[0] != called
            for worker, text in zip(WORKERS, texts, strict=True):
                upstream.behave(f"{worker}-model", text=text)
            body = {
                "model": "compose:plan",
                "messages": [{"role": "user", "content": message}],
                "max_tokens": 400,
            }
            headers = {**gw.auth(), "x-polyroute-cost-weight": str(cost_weight)}
            response = httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=60)
            assert response.status_code == 200, response.text
            steps = response.headers["x-polyroute-plan"].split("steps=")[1]
            live = [name for step in steps.split(",") for name in step.split("+")]
            expected = (sorted(WORKERS[k] for k in called), rounds)
            assert (sorted(live), steps.count(",") + 1) == expected, (cost_weight, message)
    assert differ >= 1  # the rule matters for these questions: read whole, a plan differs
    upstream.reset()
