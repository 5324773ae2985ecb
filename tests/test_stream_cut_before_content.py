"""A worker's stream cut before any of the answer arrived: a failed call, fallen back from.

The pipeline opened a stream (sent its headers and started writing) at the worker's first chunk with
a choice, which carries no answer: an OpenAI-wire server's `{"role": "assistant", "content": ""}`, or,
for an Anthropic worker through litellm, the "stop" litellm makes up when the provider closes the
stream after `message_start` with no content. A cut right after it was therefore a mid-stream error
(a 200, then `message_start` and an `error` event on /v1/messages), never a fallback, although the
client had been sent nothing of the answer. Now the stream opens at the first chunk that carries some
of the answer (gateway/upstream.py `_past_prelude`), so such a cut is retried and `auto` falls back as
for a worker that failed before its first chunk, and the client sees one clean stream.

Real parts only: gateways on uvicorn in front of the loopback test upstream, which speaks the OpenAI
wire and Anthropic's Messages wire and cuts streams on demand.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import ATTEMPTS_HEADER, WorkerClient
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.fakes.upstream import FakeUpstream

MESSAGES = [{"role": "user", "content": "hello there friend"}]
TEXT = "one two three four five"
FALLBACK_TEXT = "cheap took over"
RETRIES = 1
# An Anthropic worker priced below the test catalog's cheapest, so `auto` tries it first.
FIRST_CLAUDE = """
  - name: claude
    model: anthropic/claude-fake
    api_base: {url}
    api_key_env: {key_env}
    context_window: 200000
    input_price_per_m: 0.01
    output_price_per_m: 0.02
    tier: frontier
    license: proprietary
    provider: anthropic
    jurisdiction: US
    capabilities: [general, tools]
"""
# Cuts right after the message's opening (Anthropic's message_start and content_block_start; the
# OpenAI wire's role chunk), before the first text: the body closed cleanly, or the connection reset.
CUTS = pytest.mark.parametrize(
    "cut", [{"end_after_chunks": 0}, {"drop_after_chunks": 0}], ids=["closed-cleanly", "connection-reset"]
)

pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


@pytest.fixture(scope="module")
def gw(fake: FakeUpstream, tmp_path_factory) -> Iterator[Gateway]:
    catalog = catalog_yaml_for(fake.url) + FIRST_CLAUDE.format(url=fake.url, key_env=FAKE_KEY_ENV)
    gateway = start_gateway(
        parse_catalog(catalog, "stream cut before content"),
        tmp_path_factory.mktemp("stream-cut-before-content"),
        retries=RETRIES,
    )
    yield gateway
    gateway.server.stop()


def _messages_events(gw: Gateway, model: str) -> tuple[int, dict[str, str], list[dict]]:
    """A streamed /v1/messages call, raw: status, headers and the events (the body, if not a stream)."""
    body = {"model": model, "max_tokens": 64, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/messages", headers=gw.auth(), json=body, timeout=60) as response:
        if response.status_code != 200:
            return response.status_code, dict(response.headers), [orjson.loads(response.read())]
        events = [orjson.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
        return response.status_code, dict(response.headers), events


def _chat_lines(gw: Gateway, model: str) -> tuple[int, dict[str, str], list[str]]:
    body = {"model": model, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60
    ) as response:
        if response.status_code != 200:
            return response.status_code, dict(response.headers), [response.read().decode()]
        return (
            200,
            dict(response.headers),
            [line for line in response.iter_lines() if line.startswith("data:")],
        )


def _text(events: list[dict]) -> str:
    return "".join(
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )


def _fell_back(
    gw: Gateway, fake: FakeUpstream, headers: dict[str, str], failed: str, upstream_model: str
) -> None:
    """The answer came from `cheap` after `failed` was retried and given up, as for any failed call."""
    assert headers["x-polyroute-worker"] == "cheap"
    assert headers["x-polyroute-fallbacks"] == failed
    attempts = headers[ATTEMPTS_HEADER].split(",")
    assert len(attempts) == 1 + RETRIES and all(a.startswith(failed + ":") for a in attempts)
    assert len(fake.requests_for(upstream_model)) == 1 + RETRIES  # retried, then fallen back from
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["worker"] == "cheap" and record["fallbacks"] == [failed]
    assert [a["worker"] for a in record["trace"]["attempts"]] == [failed] * (1 + RETRIES)
    assert all(a["may_be_billed"] for a in record["trace"]["attempts"])  # the calls reached the worker
    # a cut stream is a lost connection on both paths (litellm's StreamCut, the fast path's disconnect)
    assert {a["outcome"] for a in record["trace"]["attempts"]} == {"connection_lost"}
    assert "stream" not in record["trace"]  # not a stream cut mid-way


# ---- the Messages API, an Anthropic worker -------------------------------------------------------
@CUTS
def test_an_anthropic_workers_stream_cut_before_content_falls_back_on_messages(gw, fake, cut):
    """Closed cleanly after message_start, it was a 200 with message_start then an error event."""
    fake.behave("claude-fake", text=TEXT, **cut)
    fake.behave("cheap-model", text=FALLBACK_TEXT)
    status, headers, events = _messages_events(gw, "auto")
    assert status == 200
    types = [e["type"] for e in events]
    assert "error" not in types
    assert types[0] == "message_start" and types.count("message_start") == 1 and types[-1] == "message_stop"
    assert events[0]["message"]["model"] == "cheap"
    assert _text(events) == FALLBACK_TEXT
    _fell_back(gw, fake, headers, "claude", "claude-fake")


def test_the_anthropic_sdk_sees_one_clean_stream_from_the_worker_that_answered(gw, fake):
    fake.behave("claude-fake", text=TEXT, end_after_chunks=0)
    fake.behave("cheap-model", text=FALLBACK_TEXT)
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=60)
    with client.messages.stream(model="auto", max_tokens=64, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == FALLBACK_TEXT and final.stop_reason == "end_turn" and final.model == "cheap"


def test_a_pinned_anthropic_worker_cut_before_content_is_a_plain_502(gw, fake):
    """No fallback for a pinned worker, but nothing was streamed: an HTTP error in Anthropic's
    format, not a 200 whose stream holds message_start and an error event."""
    fake.behave("claude-fake", text=TEXT, end_after_chunks=0)
    status, headers, body = _messages_events(gw, "claude")
    assert status == 502
    assert body[0]["type"] == "error" and body[0]["error"]["type"] == "api_error"
    assert "ended before the answer did" in body[0]["error"]["message"]
    assert len(fake.requests_for("claude-fake")) == 1 + RETRIES
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 502 and "stream" not in (record["trace"] or {})


def test_a_responses_client_sees_the_fallbacks_stream_alone(gw, fake):
    """The Responses API's events come from the same pipeline: no error, the fallback's text."""
    fake.behave("claude-fake", text=TEXT, end_after_chunks=0)
    fake.behave("cheap-model", text=FALLBACK_TEXT)
    client = openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=60)
    raw = client.responses.with_raw_response.create(model="auto", input="hello", stream=True)
    assert raw.headers["x-polyroute-worker"] == "cheap" and raw.headers["x-polyroute-fallbacks"] == "claude"
    events = list(raw.parse())
    assert [e.type for e in events][-1] == "response.completed"
    assert "error" not in [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == FALLBACK_TEXT


# ---- an OpenAI-wire worker: the same cut after its role chunk, on both dialects ---------------------
@CUTS
def test_an_openai_wire_stream_cut_after_its_role_chunk_falls_back_on_chat(gw, fake, cut):
    fake.behave("claude-fake", status=503)  # out of the way: the chain is then cheap, mid
    fake.behave("cheap-model", text=TEXT, **cut)
    fake.behave("mid-model", text="mid took over")
    status, headers, lines = _chat_lines(gw, "auto")
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)
    chunks = [orjson.loads(line[5:]) for line in lines[:-1]]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == "mid took over"
    )
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"  # the role chunk still leads
    assert headers["x-polyroute-worker"] == "mid"
    assert headers["x-polyroute-fallbacks"] == "claude,cheap"
    assert len(fake.requests_for("cheap-model")) == 1 + RETRIES
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["fallbacks"] == ["claude", "cheap"]


@CUTS
def test_an_openai_wire_stream_cut_after_its_role_chunk_falls_back_on_messages(gw, fake, cut):
    fake.behave("claude-fake", status=503)
    fake.behave("cheap-model", text=TEXT, **cut)
    fake.behave("mid-model", text="mid took over")
    status, headers, events = _messages_events(gw, "auto")
    assert status == 200 and "error" not in [e["type"] for e in events]
    assert _text(events) == "mid took over" and headers["x-polyroute-worker"] == "mid"


# ---- no buffering past the first content, and cuts after it are still mid-stream ----------------------
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_the_first_content_goes_out_while_the_worker_still_streams(gw, fake, path):
    """The worker stalls for good after its first word: the client has that word (and the headers)
    all the same, so nothing is held past the first content. The client then hangs up."""
    fake.behave("claude-fake", status=503)
    fake.behave("cheap-model", text=TEXT, stall_after_chunks=1)
    body = {"model": "auto", "messages": MESSAGES, "stream": True, "max_tokens": 64}
    if path == "/v1/chat/completions":
        body.pop("max_tokens")
    with httpx.stream("POST", gw.url + path, headers=gw.auth(), json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["x-polyroute-worker"] == "cheap"
        for line in response.iter_lines():
            if line.startswith("data:") and '"one ' in line:
                break  # the first word arrived while the worker stalls: hang up
        else:
            pytest.fail("the first word never arrived")


def test_an_anthropic_workers_stream_cut_after_content_is_still_a_mid_stream_error(gw, fake):
    """Once some of the answer has gone out, a cut is what it was: an error event, a billed 502."""
    fake.behave("claude-fake", text=TEXT, end_after_chunks=1)
    status, headers, events = _messages_events(gw, "auto")
    assert status == 200 and headers["x-polyroute-worker"] == "claude"
    assert events[-1]["type"] == "error" and _text(events) == "one "
    assert len(fake.requests_for("claude-fake")) == 1 and not fake.requests_for("cheap-model")
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 502 and record["trace"]["stream"] == "mid_stream_error"


# ---- what opens a stream: the first chunk with some of the answer, whatever its kind ----------------
def _sse(*chunks: dict) -> str:
    """An OpenAI-wire stream body: each chunk as an event, then [DONE]."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "cheap-model"}
    return "".join(f"data: {orjson.dumps({**base, **c}).decode()}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _delta(finish: str | None = None, **delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


ROLE = _delta(role="assistant", content="")
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
TOOL_CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
OPENINGS = {  # the worker's chunks, and the finish reason the client gets
    # empty-string deltas before the text: held back with the role chunk, then passed on in order
    "empty-deltas-first": (
        [ROLE, _delta(content=""), _delta(content=""), _delta(content="hi"), _delta("stop")],
        "stop",
    ),
    # a tool call in the opening chunk itself (content null): that chunk starts the answer
    "tool-call": (
        [_delta(role="assistant", content=None, tool_calls=[TOOL_CALL]), _delta("tool_calls")],
        "tool_calls",
    ),
    # an empty answer: a finish alone (and the usage after it) is a whole answer, not a cut
    "finish-only": ([ROLE, _delta("stop")], "stop"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("fast_path", [True, False], ids=["wire", "litellm"])
@pytest.mark.parametrize("opening", list(OPENINGS))
async def test_a_stream_opens_at_its_first_chunk_with_some_of_the_answer(
    fake, monkeypatch, fast_path, opening
):
    """Role chunks, empty deltas and usage-only chunks are no answer; text, a tool call or a finish
    is: the stream opens there on its first call (nothing retried, nothing fallen back from) and every
    chunk reaches the client, in order, with the provider's usage at the end."""
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")
    chunks, finish = OPENINGS[opening]
    fake.behave("cheap-model", raw_body=_sse(*chunks, USAGE))
    worker = parse_catalog(catalog_yaml_for(fake.url)).get("cheap")
    client = WorkerClient(Metrics(), retries=RETRIES, backoff_s=0.01, fast_path=fast_path)
    chat = ChatCompletionRequest(model="cheap", messages=MESSAGES, stream=True)
    try:
        stream = await client.open_stream(worker, worker.api_base, chat)
        out = [chunk async for chunk in stream]
    finally:
        await client.aclose()
    assert len(fake.requests_for("cheap-model")) == 1
    deltas = [c["choices"][0]["delta"] for c in out if c["choices"]]
    assert deltas[0].get("role") == "assistant"  # the opening still leads
    assert "".join(d.get("content") or "" for d in deltas) == (
        "hi" if opening == "empty-deltas-first" else ""
    )
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls")] == (
        ["f"] if opening == "tool-call" else []
    )
    assert stream.finish_reasons == [finish]
    assert out[-1]["usage"]["completion_tokens"] == 2
