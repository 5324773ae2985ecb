"""Composition through every API (chat completions, /v1/messages, /v1/responses), against the test
upstream: `auto` never fails on the workflow ceiling where fast mode answers, and the plan names the
workers the ceiling leaves out; a client that hangs up stops the workflow and is booked 499; the step
that writes the answer keeps the client's system prompt; a tool_choice a workflow cannot honour is
served as a request with tools is; count_tokens knows which workflows exist."""

from __future__ import annotations

import json
import select
import socket
import time
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
import yaml

from policies import parse_catalog
from router.compose.base import Run
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_planner_gateway import (  # noqa: F401  (trained: a session fixture)
    QUESTION,
    WORKERS,
    behave_all,
    pick,
    planned_gateway,
    trained,
    walk,
    with_planner,
)

SYSTEM = "SYSTEM-RULE: always answer in French."
MESSAGES_Q = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def pgw(upstream, trained, tmp_path_factory):  # noqa: F811
    """A gateway whose learned router has a trained planner (auto runs the plan), and a daily budget
    for the test key's tenant, so that what a request holds and settles shows in its spend."""
    planner, artifact = trained
    tmp = tmp_path_factory.mktemp("compose-apis")
    policy = tmp / "policy.yaml"
    policy.write_text(yaml.safe_dump({"version": "b", "tenants": {"acme": {"budget": {"daily_usd": "50"}}}}))
    gw = planned_gateway(upstream, tmp, with_planner(artifact, planner), policy_file=policy)
    assert gw.state.router.current.planner is not None
    yield gw
    gw.server.stop()


def post(gw, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.v1 + path, headers={**gw.auth(), "x-polyroute-trace": "1", **headers}, json=body, timeout=60
    )


def ledger_lines(gw) -> list[dict]:
    path = Path(gw.data_dir) / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def record_of(gw, request_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        for record in ledger_lines(gw):
            if record.get("id") == request_id:
                return record
        assert time.monotonic() < deadline, f"no ledger record for {request_id}"
        time.sleep(0.05)


def wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def spent_today(gw) -> Decimal:
    """The tenant's spend as the budget counts it: settled amounts plus any hold still open."""
    books = httpx.get(f"{gw.url}/admin/spend/acme", headers=gw.auth(gw.admin_key), timeout=30).json()
    return Decimal(str(books["daily_usd"]))


# ---- 1. the workflow ceiling under auto ------------------------------------------------------------
def test_auto_answers_in_fast_mode_when_no_worker_fits_the_workflow_ceiling(upstream, trained, tmp_path):  # noqa: F811
    """The gateway's ceiling is below every worker's first step: auto (a trained planner in force)
    answers as fast mode does, degraded and saying why, on chat completions and /v1/messages alike;
    a ceiling the client set itself is the client's bound and stays a 502 that calls nobody."""
    planner, artifact = trained
    gw = planned_gateway(upstream, tmp_path, with_planner(artifact, planner), compose_max_cost_usd=0.000001)
    try:
        behave_all(upstream, dict.fromkeys(WORKERS, "A"))
        for path, body in (
            ("/chat/completions", {"model": "auto", "max_tokens": 20, "messages": MESSAGES_Q}),
            ("/messages", {"model": "auto", "max_tokens": 20, "messages": MESSAGES_Q}),
        ):
            answer = post(gw, path, body)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-polyroute-strategy"] == "fast"
            note = answer.headers["x-polyroute-compose"]
            assert note.startswith("degraded: no worker fits the plan workflow's cost ceiling $0.000001")
            assert "at max_tokens 20" in note
            trace = record_of(gw, answer.headers["x-polyroute-request-id"])["trace"]
            assert trace["degraded"] is True and trace["workflow"] == "plan" and trace["note"] == note
            assert trace["final_worker"] == answer.headers["x-polyroute-worker"]
        upstream.reset()
        capped = post(
            gw,
            "/chat/completions",
            {"model": "auto", "max_tokens": 20, "messages": MESSAGES_Q, "metadata": {"max_cost_usd": 1e-7}},
        )
        assert capped.status_code == 502 and "no worker fits" in capped.json()["error"]["message"]
        assert not upstream.requests
    finally:
        gw.server.stop()


def test_auto_does_not_choose_a_cascade_that_cannot_start(upstream, tmp_path):
    """A learned router without a planner predicts that a cascade pays for this estimate (as in
    tests/test_compose_gateway.py); below the gateway's ceiling no worker's step fits: fast mode."""
    import numpy as np

    from router import save_artifact, train_artifact

    things = ("cars", "trees", "dogs", "bikes", "shops", "schools", "parks", "bridges", "buses", "cats")
    estimates = [f"Estimate the number of {thing} in a typical city, roughly." for thing in things] * 6
    greetings = [f"Say hello to my friend number {i} in a warm and friendly tone." for i in range(60)]
    cheap_right = [float(i // 10 in (0, 1, 2, 5)) for i in range(len(estimates))]
    labels = np.array([[c, 1.0] for c in cheap_right] + [[1.0, 1.0]] * len(greetings))
    artifact = train_artifact(
        estimates + greetings, [1] * 120, labels, ["cheap", "pricey"], backend="static", model="logreg"
    )
    save_artifact(tmp_path / "data" / "router", artifact)
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data", compose_max_cost_usd=0.000001
    )
    try:
        behave_all(upstream, dict.fromkeys(WORKERS, "about 40000"))
        body = {"model": "auto", "messages": [{"role": "user", "content": estimates[0]}]}
        answer = post(gw, "/chat/completions", body, **{"x-polyroute-cost-weight": "0.3"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-polyroute-strategy"] == "fast"
        note = answer.headers["x-polyroute-compose"]
        assert note.startswith("degraded: no worker fits the cascade workflow's cost ceiling $0.000001")
        assert answer.json()["polyroute"]["trace"]["workflow"] == "cascade"
    finally:
        gw.server.stop()


def test_the_plan_names_the_worker_the_ceiling_leaves_out(pgw, upstream):
    """max_tokens 8000 prices pricey ($15 per million output tokens) over the $0.10 ceiling, not the
    others: the plan runs over cheap and mid, and its note and trace say pricey was left out."""
    behave_all(upstream, dict.fromkeys(WORKERS, "A"))
    answer = post(pgw, "/messages", {"model": "auto", "max_tokens": 8000, "messages": MESSAGES_Q})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-strategy"] == "compose:plan"
    note = answer.headers["x-polyroute-compose"]
    assert "left out, over the cost ceiling $0.1: pricey (predicted $0.12" in note
    trace = answer.json()["polyroute"]["trace"]
    assert list(trace["detail"]["over_ceiling"]) == ["pricey"]
    assert Decimal(trace["detail"]["over_ceiling"]["pricey"]) > Decimal("0.1")
    assert "pricey-model" not in {r["model"] for r in upstream.requests}


# ---- 2. a client that hangs up while the workflow runs ---------------------------------------------
LATENCY_S = 4.0  # each worker's answer: the client hangs up while round 1 waits on it

HANG_UPS = {
    "chat-stream": (
        "/chat/completions",
        {"model": "auto", "max_tokens": 20, "stream": True, "messages": MESSAGES_Q},
    ),
    "chat-json": ("/chat/completions", {"model": "auto", "max_tokens": 20, "messages": MESSAGES_Q}),
    "messages-stream": (
        "/messages",
        {"model": "auto", "max_tokens": 20, "stream": True, "messages": MESSAGES_Q},
    ),
    "responses-stream": (
        "/responses",
        {"model": "auto", "max_output_tokens": 20, "stream": True, "input": QUESTION},
    ),
}


def send_and_hang_up(gw, upstream, path: str, body: dict, cost_weight: float) -> None:
    """Send the request on a raw connection, wait until a worker has been asked (round 1 is in
    flight: no byte of the answer can have been sent), and close the connection."""
    url = urlsplit(gw.url)
    payload = orjson.dumps(body)
    head = (
        f"POST /v1{path} HTTP/1.1\r\nhost: {url.netloc}\r\nauthorization: Bearer {gw.api_key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        f"x-polyroute-cost-weight: {cost_weight}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        wait_for(lambda: len(upstream.requests) >= 1, "round 1 to reach a worker")
        assert not select.select([sock], [], [], 0)[0], "the gateway answered before the plan ended"


@pytest.mark.parametrize("case", list(HANG_UPS))
def test_a_client_that_hangs_up_stops_the_plan_and_is_booked_499(pgw, upstream, case):
    """The planner would make a second round; the client hangs up during the first. No later round
    starts, the round in flight is billed (the budget's hold settled to it, none left open), and the
    ledger says 499, as for a fast-mode stream the client leaves."""
    path, body = HANG_UPS[case]
    texts = {"cheap": "A", "mid": "B", "pricey": "C"}
    cost_weight, rounds = pick(pgw, texts, lambda r: len(r) >= 2)
    behave_all(upstream, texts, latency_s=LATENCY_S)
    before, spent_before = len(ledger_lines(pgw)), spent_today(pgw)
    send_and_hang_up(pgw, upstream, path, body, cost_weight)
    record = wait_for(lambda: ledger_lines(pgw)[before:], "the request's ledger record")[0]
    # the workflow has returned (its record is written): any round it started has reached the upstream
    assert sorted(r["model"].removesuffix("-model") for r in upstream.requests) == sorted(rounds[0])
    assert record["status"] == 499 and record["strategy"] == "compose:plan"
    trace = record["trace"]
    assert trace["ended"] == "client_disconnected"
    assert trace.get("stream") == ("client_disconnected" if body.get("stream") else None)
    assert "the client disconnected after 1 round" in trace["note"]
    answered = [s for s in trace["steps"] if "cost_usd" in s and Decimal(s["cost_usd"]) > 0]
    assert sorted(s["worker"] for s in answered) == sorted(rounds[0])
    assert record["cost_micros"] > 0
    assert spent_today(pgw) - spent_before == Decimal(record["cost_micros"]) / 10**6


# ---- 3. the client's system prompt reaches the step that writes the answer --------------------------
CONVERSATION = [
    {"role": "user", "content": "I am asking about arithmetic."},
    {"role": "assistant", "content": "Go ahead."},
    {"role": "user", "content": "What is six times seven?"},
]


def _sent_with(upstream, marker: str) -> list[dict]:
    return [r for w in WORKERS for r in upstream.requests_for(f"{w}-model") if marker in str(r["messages"])]


def _keeps_the_conversation(request: dict, marker: str) -> None:
    messages = request["messages"]
    assert messages[0] == {"role": "system", "content": SYSTEM}, messages
    assert [m["content"] for m in messages[1:3]] == ["I am asking about arithmetic.", "Go ahead."]
    assert messages[-1]["role"] == "user" and marker in messages[-1]["content"]
    assert "What is six times seven?" in messages[-1]["content"]


def test_the_fuser_gets_the_system_prompt_and_the_conversation(gateway, upstream):
    fused = {"Several assistants answered": "Quarante-deux (fused)."}
    for worker, text in zip(WORKERS, ("quarante-deux", "42", "forty-two"), strict=True):
        upstream.behave(f"{worker}-model", text=text, replies=fused)
    answer = post(
        gateway,
        "/messages",
        {"model": "compose:ensemble", "max_tokens": 50, "system": SYSTEM, "messages": CONVERSATION},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "Quarante-deux (fused)."
    (fuse,) = _sent_with(upstream, "Several assistants answered")
    _keeps_the_conversation(fuse, "Several assistants answered")
    upstream.reset()
    for worker, text in zip(WORKERS, ("quarante-deux", "42", "forty-two"), strict=True):
        upstream.behave(f"{worker}-model", text=text, replies=fused)
    answer = post(
        gateway, "/responses", {"model": "compose:ensemble", "instructions": SYSTEM, "input": QUESTION}
    )
    assert answer.status_code == 200, answer.text
    (fuse,) = _sent_with(upstream, "Several assistants answered")
    assert [m["content"] for m in fuse["messages"][:-1]] == [SYSTEM]  # instructions, then the instruction


def test_rebuttals_and_revisions_get_the_system_prompt(gateway, upstream):
    behave_all(upstream, dict.fromkeys(WORKERS, "42"))
    chat = {"max_tokens": 50, "messages": [{"role": "system", "content": SYSTEM}, *CONVERSATION]}
    answer = post(gateway, "/chat/completions", {"model": "compose:debate", **chat})
    assert answer.status_code == 200, answer.text
    rebuttals = _sent_with(upstream, "Point out any errors")
    assert len(rebuttals) >= 2
    for rebuttal in rebuttals:
        _keeps_the_conversation(rebuttal, "Point out any errors")
    upstream.reset()
    reviews = {"Check this answer": "The answer lacks the working.", "A reviewer found": "Quarante-deux."}
    for worker in WORKERS:
        upstream.behave(f"{worker}-model", text="42", replies=reviews)
    answer = post(gateway, "/chat/completions", {"model": "compose:builder", **chat})
    assert answer.status_code == 200, answer.text
    revisions = _sent_with(upstream, "A reviewer found these problems")
    assert revisions, "the builder revised"
    for revision in revisions:
        _keeps_the_conversation(revision, "A reviewer found these problems")
    # a reviewer reads the instruction alone: the client's system prompt is not its to follow
    (review, *_) = _sent_with(upstream, "Check this answer")
    assert [m["role"] for m in review["messages"]] == ["user"]


def test_the_conversation_keeps_the_replaced_turns_images():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    run = Run(
        messages=[
            {"role": "developer", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]},
        ],
        pool=(),
        ask=None,  # type: ignore[arg-type]  (no step is run)
        ceiling_usd=Decimal(1),
    )
    assert run.conversation("Fuse these.") == [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "Fuse these."}, image]},
    ]


# ---- 4. a tool_choice a workflow cannot honour ------------------------------------------------------
def test_a_tool_choice_that_asks_for_a_call_without_tools_is_refused_on_every_api(pgw, gateway, upstream):
    """A tool_choice that asks for a tool call with no tools to call is a 400 in each API's own shape,
    as OpenAI answers it (litellm would drop it, and the client would get text it did not ask for);
    no worker is called. `auto` and `none` ask for nothing: the workflow runs."""
    behave_all(upstream, dict.fromkeys(WORKERS, "A"))
    upstream.requests.clear()
    messages = post(
        pgw,
        "/messages",
        {"model": "compose:plan", "max_tokens": 20, "tool_choice": {"type": "any"}, "messages": MESSAGES_Q},
    )
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert "asks for a tool call" in messages.json()["error"]["message"]
    responses = post(
        pgw,
        "/responses",
        {"model": "auto", "max_output_tokens": 20, "tool_choice": "required", "input": QUESTION},
    )
    assert responses.status_code == 400, responses.text
    assert "asks for a tool call" in responses.json()["error"]["message"]
    function = {"type": "function", "function": {"name": "lookup"}}
    for model in ("compose:ensemble", "auto"):
        chat = post(
            gateway, "/chat/completions", {"model": model, "messages": MESSAGES_Q, "tool_choice": function}
        )
        assert chat.status_code == 400, chat.text
        assert chat.json()["error"]["type"] == "invalid_request_error"
    assert list(upstream.requests) == []
    plain = post(
        pgw,
        "/chat/completions",
        {"model": "compose:plan", "max_tokens": 20, "messages": MESSAGES_Q, "tool_choice": "none"},
    )
    assert plain.status_code == 200 and plain.headers["x-polyroute-strategy"] == "compose:plan"


# ---- 5. count_tokens and workflow names -------------------------------------------------------------
def test_count_tokens_refuses_an_unknown_workflow_as_messages_does(gateway):
    body = {"model": "compose:tournament", "messages": [{"role": "user", "content": "hi"}]}
    sent = post(gateway, "/messages", {**body, "max_tokens": 5})
    counted = post(gateway, "/messages/count_tokens", body)
    assert sent.status_code == counted.status_code == 404
    assert counted.json()["error"]["type"] == "not_found_error"
    assert counted.json()["polyroute"]["code"] == "model_not_found"
    assert counted.json()["error"]["message"] == sent.json()["error"]["message"]
    known = post(gateway, "/messages/count_tokens", {**body, "model": "compose:plan"})
    assert known.status_code == 200 and known.json()["input_tokens"] > 0


# ---- 5. one output bound per step -------------------------------------------------------------------
@pytest.mark.parametrize(
    "workflow", ["compose:ensemble", "compose:cascade", "compose:debate", "compose:plan"]
)
def test_each_step_gets_one_output_bound_in_the_field_the_client_used(pgw, upstream, workflow):
    """Current OpenAI SDKs send max_completion_tokens, and OpenAI refuses it beside max_tokens: every
    step, judges included (their own bound, 4 tokens, wins), sends one bound in the client's field."""
    behave_all(upstream, dict.fromkeys(WORKERS, "Paris. Score: 9"))
    upstream.requests.clear()
    body = {"model": workflow, "max_completion_tokens": 50, "messages": MESSAGES_Q}
    if workflow == "compose:cascade":
        body["metadata"] = {"verifier": "judge"}
    answer = post(pgw, "/chat/completions", body)
    assert answer.status_code == 200, answer.text
    sent = [r for r in upstream.requests if r.get("model") in {f"{w}-model" for w in WORKERS}]
    assert sent
    assert not [r for r in sent if "max_tokens" in r], [r.get("model") for r in sent]
    assert {r["max_completion_tokens"] for r in sent} <= {50, 4}
    if workflow in ("compose:cascade", "compose:debate"):
        assert 4 in {r["max_completion_tokens"] for r in sent}  # a judge asked for its score alone
    upstream.requests.clear()
    classic = post(pgw, "/chat/completions", {**body, "max_completion_tokens": None, "max_tokens": 50})
    assert classic.status_code == 200, classic.text
    sent = [r for r in upstream.requests if r.get("model") in {f"{w}-model" for w in WORKERS}]
    assert sent and not [r for r in sent if "max_completion_tokens" in r]
    assert {r["max_tokens"] for r in sent} <= {50, 4}


# ---- 6. the client's own ceiling when a workflow answers in fast mode ---------------------------------
LOOKUP = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def test_a_workflow_answered_in_fast_mode_keeps_the_clients_own_ceiling(pgw, upstream):
    """compose:<workflow> with tools answers in fast mode; a ceiling the client set itself
    (metadata.max_cost_usd) stays its bound there, as the workflow would have kept it: workers predicted
    over it are not called (not even as fallbacks), and when every one is, nobody is (502, in each
    API's shape). At max_tokens 4000 cheap is predicted $0.0008, mid $0.008, pricey $0.06."""
    behave_all(upstream, dict.fromkeys(WORKERS, "Paris."))
    body = {"model": "compose:ensemble", "max_tokens": 4000, "messages": MESSAGES_Q, "tools": LOOKUP}
    upstream.requests.clear()
    none_fits = post(pgw, "/chat/completions", {**body, "metadata": {"max_cost_usd": "0.00001"}})
    assert none_fits.status_code == 502, none_fits.text
    error = none_fits.json()["error"]
    assert error["code"] == "workflow_failed" and "nobody was called" in error["message"]
    assert "the cheapest admissible worker, cheap, is predicted $0.0008" in error["message"]
    messages = post(
        pgw,
        "/messages",
        {
            "model": "compose:ensemble",
            "max_tokens": 4000,
            "messages": MESSAGES_Q,
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            "metadata": {"max_cost_usd": "0.00001"},
        },
    )
    assert messages.status_code == 502 and messages.json()["type"] == "error", messages.text
    assert not upstream.requests
    # cheap fits and fails: fast mode would fall back to mid and pricey, both over the client's bound
    upstream.behave("cheap-model", status=500)
    answer = post(pgw, "/chat/completions", {**body, "metadata": {"max_cost_usd": "0.001"}})
    assert answer.status_code == 502, answer.text
    assert {r["model"] for r in upstream.requests} == {"cheap-model"}
    assert (
        "not called, predicted over your cost ceiling $0.001: mid, pricey"
        in answer.headers["x-polyroute-compose"]
    )
    # without a ceiling of its own, the client gets fast mode's fallback as before
    upstream.requests.clear()
    fallback = post(pgw, "/chat/completions", body)
    assert fallback.status_code == 200, fallback.text
    assert "mid-model" in {r["model"] for r in upstream.requests}
    upstream.reset()


# ---- 7. logprobs in a streamed workflow answer --------------------------------------------------------
def test_a_streamed_workflow_answer_carries_the_logprobs_the_json_answer_has(pgw, upstream):
    """logprobs=true: each streamed chunk carries its own tokens' logprobs, as OpenAI streams them, and
    together they are the JSON answer's (every chunk said null)."""
    answer_text = "Paris is the capital of France and has been for a very long time indeed."
    behave_all(upstream, dict.fromkeys(WORKERS, answer_text))
    body = {"model": "compose:ensemble", "max_tokens": 40, "logprobs": True, "messages": MESSAGES_Q}
    plain = post(pgw, "/chat/completions", body)
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    expected = choice["logprobs"]["content"]
    assert len(expected) == len(choice["message"]["content"].split(" ")) > 8  # more than one chunk's worth
    with httpx.stream(
        "POST", pgw.v1 + "/chat/completions", headers=pgw.auth(), json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [orjson.loads(e) for e in events if e != "[DONE]"]
    content = [
        c["choices"][0] for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")
    ]
    assert len(content) >= 2
    streamed = [entry for c in content for entry in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in expected]
    assert "".join(c["delta"]["content"] for c in content) == choice["message"]["content"]
    for c in content:  # a chunk's text is its own tokens
        assert c["delta"]["content"] == "".join(e["token"] for e in c["logprobs"]["content"])
    upstream.reset()
