"""gateway/stream_fast.py writes plain text deltas itself and hands every other chunk to litellm's
AnthropicStreamWrapper. These tests feed the same chunk sequences (in the pipeline's chunk form) to
the wrapper alone and to the fast path, and require the same events: for text, tool calls
(arguments in one chunk or in pieces), parallel tool calls, text then a tool call, a tool call then
text, empty and refusal chunks, streams with and without a usage chunk. They also check that the fast
path was taken (fewer chunks reached litellm), so a litellm upgrade that moves the state it reads shows
up here, not as wrong events on the wire.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litellm.llms.anthropic.pass_through.adapters.streaming_iterator import AnthropicStreamWrapper
from litellm.types.utils import ModelResponseStream

from gateway.stream_fast import FLUSH, Feed, anthropic_events, plain_text

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "w"}


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage(prompt: int = 7, completion: int = 9) -> dict[str, Any]:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {**BASE, "choices": [], "usage": counts, "polyroute": {"worker": "w", "cost_usd": "0.000001"}}


def words(text: str) -> list[dict[str, Any]]:
    return [chunk({"content": word + " "}) for word in text.split()]


def call(index: int, call_id: str, name: str, arguments: str = "") -> dict[str, Any]:
    named = {"index": index, "id": call_id, "type": "function"}
    return chunk({"tool_calls": [{**named, "function": {"name": name, "arguments": arguments}}]})


def arguments(index: int, text: str, size: int = 5) -> list[dict[str, Any]]:
    return [
        chunk({"tool_calls": [{"index": index, "function": {"arguments": text[i : i + size]}}]})
        for i in range(0, len(text), size)
    ]


ROLE = chunk({"role": "assistant", "content": ""})
ARGS = '{"city": "Paris", "unit": "celsius"}'
STREAMS = {
    "text": [ROLE, *words("one two three four five six"), chunk({}, "stop"), usage()],
    "text, no usage chunk": [ROLE, *words("cut short here"), chunk({}, "length")],
    "text in the first chunk": [
        chunk({"role": "assistant", "content": "Hello"}),
        *words("there you"),
        chunk({}, "stop"),
        usage(),
    ],
    "empty chunks among the text": [
        ROLE,
        *words("a b"),
        chunk({"content": ""}),
        chunk({}),
        *words("c d"),
        chunk({}, "stop"),
        usage(),
    ],
    "tool call, arguments in pieces": [
        ROLE,
        call(0, "call_1", "get_weather"),
        *arguments(0, ARGS),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "tool call in one chunk": [
        ROLE,
        call(0, "call_1", "get_weather", ARGS),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "text then a tool call": [
        ROLE,
        *words("Let me check the weather."),
        call(0, "call_1", "get_weather"),
        *arguments(0, ARGS),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "parallel tool calls after text": [
        ROLE,
        *words("Two cities."),
        call(0, "call_1", "get_weather"),
        *arguments(0, ARGS),
        call(1, "call_2", "get_weather"),
        *arguments(1, '{"city": "Rome"}'),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "a tool call then text": [
        ROLE,
        call(0, "call_1", "get_weather", ARGS),
        *words("and some words after it"),
        chunk({}, "stop"),
        usage(),
    ],
    "a refusal": [ROLE, chunk({"refusal": "I can't help with that."}), chunk({}, "stop"), usage()],
}


class CountingFeed(Feed):
    """A Feed that counts the chunks litellm read through it."""

    read = 0

    async def __anext__(self) -> ModelResponseStream:
        item = await super().__anext__()
        self.read += 1
        return item


async def replay(chunks: list[dict[str, Any]]):
    for item in chunks:
        yield dict(item)


async def litellm_alone(chunks: list[dict[str, Any]]):
    """What litellm's translators read without the fast path: every chunk as a ModelResponseStream."""
    for item in chunks:
        yield ModelResponseStream(**{k: v for k, v in item.items() if k != "polyroute"})


# ---- Anthropic ----------------------------------------------------------------------------------------
def anthropic_wrapper(source) -> AnthropicStreamWrapper:
    wrapper = AnthropicStreamWrapper(source, model="w", tool_name_mapping={})
    wrapper._message_id = "msg_1"
    return wrapper


async def anthropic_both(chunks: list[dict[str, Any]]) -> tuple[list, list, int]:
    expected = [event async for event in anthropic_wrapper(litellm_alone(chunks))]
    feed = CountingFeed(replay(chunks))
    events = [event async for event in anthropic_events(anthropic_wrapper(feed), feed)]
    assert events[-1] is FLUSH  # the last events go out
    got = [event for event in events if event is not FLUSH]
    return expected, got, feed.read


@pytest.mark.parametrize("name", list(STREAMS))
def test_anthropic_events_equal_litellms_own(name):
    chunks = STREAMS[name]
    expected, got, read = asyncio.run(anthropic_both(chunks))
    assert got == expected
    plain = sum(plain_text(c) is not None for c in chunks)
    if plain >= 3:  # the first text chunk opens the block through litellm; the rest skip it
        assert read < len(chunks), (read, len(chunks))


def test_events_go_out_in_one_write_per_read_of_the_worker():
    """FLUSH marks each wait for the worker: message_start before the first chunk, the block's start
    with its first delta, then one batch per chunk read."""

    async def batches() -> list[list[str]]:
        feed = Feed(replay(STREAMS["text"]))
        out: list[list[str]] = [[]]
        async for event in anthropic_events(anthropic_wrapper(feed), feed):
            if event is FLUSH:
                out.append([])
            else:
                out[-1].append(event["type"])
        return [batch for batch in out if batch]

    got = asyncio.run(batches())
    assert got[0] == ["message_start"]
    assert got[1] == ["content_block_start", "content_block_delta"]
    assert got[2:7] == [["content_block_delta"]] * 5
    # each closing event waits for a read of the worker: the finish, the usage, the end
    assert got[7:] == [["content_block_stop"], ["message_delta"], ["message_stop"]]


def test_anthropic_text_then_tool_call_blocks():
    """The stream mixing text and a tool call: a text block, then a tool_use block whose arguments
    arrive as input_json_delta pieces, then the stop reason and the usage."""
    _, got, _ = asyncio.run(anthropic_both(STREAMS["text then a tool call"]))
    kinds = [(e["type"], e.get("index")) for e in got]
    assert kinds[:2] == [("message_start", None), ("content_block_start", 0)]
    starts = [e for e in got if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert starts[1]["index"] == 1 and starts[1]["content_block"]["name"] == "get_weather"
    text = "".join(e["delta"]["text"] for e in got if e["type"] == "content_block_delta" and e["index"] == 0)
    assert text == "Let me check the weather. "
    pieces = [e["delta"] for e in got if e["type"] == "content_block_delta" and e["index"] == 1]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    assert "".join(p["partial_json"] for p in pieces) == ARGS
    assert got[-2]["type"] == "message_delta" and got[-2]["delta"]["stop_reason"] == "tool_use"
    assert got[-2]["usage"]["output_tokens"] == 9 and got[-1] == {"type": "message_stop"}


def test_plain_text_is_only_the_hot_shape():
    assert plain_text(chunk({"content": "x"})) == "x"
    assert plain_text(chunk({"role": "assistant", "content": "x"})) == "x"
    assert plain_text(chunk({"content": ""})) == ""  # blank: no event while a text block is open
    assert plain_text(chunk({"role": "assistant"})) == ""
    assert plain_text(chunk({"content": "x"}, "stop")) is None
    assert plain_text(chunk({"content": "x", "refusal": "no"})) is None
    assert plain_text(call(0, "c", "f")) is None
    assert plain_text(usage()) is None
    two = {**BASE, "choices": [chunk({"content": "x"})["choices"][0]] * 2}
    assert plain_text(two) is None
