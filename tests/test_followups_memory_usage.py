"""Memory answers (several rounds to the worker, merged into one) keep the `estimated` marker a round
carries when its worker reported no usage: the ledger's trace says `usage: "estimated"`, as it does
for a one-call answer (tests/test_worker_faults_gateway.py) and for a stream without memory."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.conftest import Gateway, ledger_record, start_gateway
from tests.fakes.server import serve_in_thread
from tests.fakes.upstream import Behaviour
from tests.test_memory import HANDBOOK, MAX_EXPANSIONS, ScriptedUpstream, _memory_catalog, _memory_replies

DIRECTIVE = "MEMORY_EXPAND m1 2"  # the text protocol of a worker without tools (`plain`)


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedUpstream]:
    fake = ScriptedUpstream()
    running = serve_in_thread(fake.app)
    fake.url = running.url  # type: ignore[attr-defined]
    yield fake
    running.stop()


@pytest.fixture(autouse=True)
def _reset(scripted):
    scripted.reset()


@pytest.fixture(scope="module")
def mgw(scripted, tmp_path_factory) -> Iterator[Gateway]:
    gw = start_gateway(
        _memory_catalog(scripted),
        tmp_path_factory.mktemp("memory-usage"),
        retrieval_embedder="minilm-static",
        memory_max_expansions=MAX_EXPANSIONS,
        memory_index_size=3,
        memory_snippets=1,
    )
    documents = {"documents": HANDBOOK}
    added = httpx.post(
        gw.v1 + "/collections/handbook/documents", headers=gw.auth(), json=documents, timeout=60
    )
    assert added.status_code == 200, added.text
    yield gw
    gw.server.stop()


def without_usage(content: str) -> str:
    """A completion whose worker reports no usage (as some local servers answer)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    body = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "plain-model"}
    return orjson.dumps({**body, "choices": [choice]}).decode()


def ask(gw: Gateway, **extra) -> dict:
    return {
        "model": "plain",
        "messages": [{"role": "user", "content": "How many vacation days?"}],
        "metadata": {"collections": ["handbook"]},
        **extra,
    }


def test_a_memory_answer_over_rounds_without_usage_is_marked_estimated(mgw, scripted):
    scripted.scripts["plain-model"] = lambda body: Behaviour(
        raw_body=without_usage("27 days." if _memory_replies(body) else DIRECTIVE)
    )
    answer = httpx.post(mgw.v1 + "/chat/completions", headers=mgw.auth(), json=ask(mgw), timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(scripted.requests_for("plain-model")) == 2  # merged from two rounds
    assert answer.headers["x-polyroute-memory"].endswith("expansions=1")
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0  # counted here
    record = ledger_record(mgw, answer.headers["x-polyroute-request-id"])
    assert record["trace"]["usage"] == "estimated"
    assert record["cost_micros"] > 0


def test_a_streamed_memory_answer_without_usage_is_marked_estimated(mgw, scripted):
    """The expansion round is consumed, the answer round streams: neither reports usage (as
    llama.cpp's server never does), so the usage chunk and the ledger say estimated."""
    scripted.scripts["plain-model"] = lambda body: Behaviour(
        text="27 days." if _memory_replies(body) else DIRECTIVE, stream_usage=False
    )
    body = ask(mgw, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", mgw.v1 + "/chat/completions", headers=mgw.auth(), json=body, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-polyroute-request-id"]
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(scripted.requests_for("plain-model")) == 2
    last = [e for e in events if e.get("usage")][-1]
    assert last["polyroute"]["usage"] == "estimated"
    record = ledger_record(mgw, request_id)
    assert record["status"] == 200 and record["trace"]["usage"] == "estimated"


def test_memory_rounds_keep_every_rounds_calls_given_up():
    """A memory answer is one Completion made of its rounds (`_merge`): the calls a round's worker gave
    up before answering (a timeout that may be billed) stay on it, so the ledger's trace names them."""
    from decimal import Decimal

    from gateway.memory import _merge
    from gateway.upstream import Attempt, Completion
    from policies import parse_catalog
    from tests.conftest import catalog_yaml_for

    worker = parse_catalog(catalog_yaml_for("http://127.0.0.1:9/v1")).get("cheap")
    timed_out = Attempt("cheap", "timeout", None, True)
    refused = Attempt("cheap", "http_503", 503, False)
    rounds = [
        Completion(worker, {"choices": []}, 10, 2, Decimal("0.1"), attempts=(timed_out,)),
        Completion(worker, {"choices": []}, 12, 3, Decimal("0.2"), attempts=(refused,)),
    ]
    assert _merge(rounds).attempts == (timed_out, refused)
