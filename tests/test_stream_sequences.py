"""The chat-chunk sequences the stream translators' tests share, and how the Anthropic stream is
written: the events one read of the worker makes go out in one write.

tests/test_anthropic_stream.py compares gateway/anthropic_stream.py's events with litellm's on these
sequences, and tests/test_responses_stream.py uses them too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litellm.types.utils import ModelResponseStream

from gateway.anthropic_stream import AnthropicStream, event_batches

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "w"}


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage(prompt: int = 7, completion: int = 9) -> dict[str, Any]:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {**BASE, "choices": [], "usage": counts, "polyroute": {"worker": "w", "cost_usd": "0.000001"}}


def words(text: str) -> list[dict[str, Any]]:
    return [chunk({"content": word + " "}) for word in text.split()]


def tool_call(index: int, call_id: str, name: str, arguments: str = "") -> dict[str, Any]:
    """One entry of a delta's `tool_calls`: the call's start (and maybe all of its arguments)."""
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call(index: int, call_id: str, name: str, arguments: str = "") -> dict[str, Any]:
    return chunk({"tool_calls": [tool_call(index, call_id, name, arguments)]})


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


async def replay(chunks: list[dict[str, Any]]):
    for item in chunks:
        yield dict(item)


async def litellm_alone(chunks: list[dict[str, Any]]):
    """What litellm's translators read: every chunk as a ModelResponseStream."""
    for item in chunks:
        yield ModelResponseStream(**{k: v for k, v in item.items() if k != "polyroute"})


def batches(chunks: list[dict[str, Any]]) -> list[list[str]]:
    """The event types of each write, as AnthropicWire.frames makes them."""

    async def run() -> list[list[str]]:
        stream = AnthropicStream("msg_1", "w")
        return [[event["type"] for event in batch] async for batch in event_batches(replay(chunks), stream)]

    return asyncio.run(run())


def test_events_go_out_in_one_write_per_read_of_the_worker():
    """message_start goes with the first chunk that makes events (the role-only chunk makes none), the
    block's start with its first delta, then one write per chunk; message_delta waits for the end of
    the worker's stream and goes out with message_stop."""
    got = batches(STREAMS["text"])
    assert got[0] == ["message_start", "content_block_start", "content_block_delta"]
    assert got[1:6] == [["content_block_delta"]] * 5
    # the finish closes the block at once (a stop sequence's cut goes out at the match); the usage
    # chunk makes message_delta, which waits for the end
    assert got[6:] == [["content_block_stop"], ["message_delta", "message_stop"]]
    assert sum(map(len, got)) == 11


def test_a_stream_with_no_usage_chunk_closes_at_the_end():
    got = batches(STREAMS["text, no usage chunk"])
    assert got[-2:] == [["content_block_stop"], ["message_delta", "message_stop"]]


def test_what_was_ready_goes_out_before_a_failure():
    """A worker that fails mid-stream: the events made so far are written, then the error reaches the
    pipeline (which writes Anthropic's error event and bills the stream)."""

    async def failing():
        yield dict(STREAMS["text"][0])
        yield dict(STREAMS["text"][1])
        raise RuntimeError("worker dropped")

    async def run() -> tuple[list[list[str]], BaseException | None]:
        out: list[list[str]] = []
        try:
            async for batch in event_batches(failing(), AnthropicStream("msg_1", "w")):
                out.append([event["type"] for event in batch])
        except RuntimeError as err:
            return out, err
        return out, None

    got, err = asyncio.run(run())
    assert isinstance(err, RuntimeError)
    assert got == [["message_start", "content_block_start", "content_block_delta"]]
