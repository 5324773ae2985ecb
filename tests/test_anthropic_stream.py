"""gateway/anthropic_stream.py writes Anthropic's event stream itself (litellm's AnthropicStreamWrapper
wrote it before). These tests feed the same chat-chunk sequences to litellm's wrapper and to ours and
require the same events wherever litellm follows Anthropic's API: text, tool calls (arguments whole
and in pieces), parallel tool calls, text then a tool call and back, blank and role-only chunks, the
finish reasons stop / length / tool_calls / content_filter, refusals, usage chunks (and none), long
tool names mapped back, odd tool-call ids.

The one difference on those sequences is deliberate: our `message_delta.delta` always carries
`stop_sequence` (null unless one ended the answer), as Anthropic's does; litellm leaves the key out.
(`message_delta.polyroute`, the cost, is polyroute's own, added to litellm's events before too.)
Where litellm's events leave Anthropic's format (a blank chunk after a tool call, several tool calls
in one chunk, text after the finish, usage before the finish, no finish at all), ours are checked
against Anthropic's documented stream instead (`assert_anthropic_format`) and with the `anthropic`
SDK's own accumulator, and the difference from litellm's is shown.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from litellm.llms.anthropic.pass_through.adapters.streaming_iterator import AnthropicStreamWrapper

from gateway.anthropic_stream import AnthropicStream, event_batches, tool_use_id, usage_delta
from tests.test_stream_sequences import (
    ARGS,
    ROLE,
    STREAMS,
    arguments,
    call,
    chunk,
    litellm_alone,
    replay,
    tool_call,
    usage,
    words,
)

LONG = "get_the_weather_for_a_city_" + "x" * 60  # over OpenAI's 64 characters: truncated for the worker
SHORT = LONG[:55] + "_trunc"
MAPPING = {SHORT: LONG}

MORE = {
    "stop with usage": [ROLE, *words("all done"), chunk({}, "stop"), usage(11, 2)],
    "length with usage": [ROLE, *words("cut at max tokens"), chunk({}, "length"), usage()],
    "content filter": [ROLE, *words("some text"), chunk({}, "content_filter"), usage()],
    "content filter, no text": [ROLE, chunk({}, "content_filter"), usage()],
    "a refusal cut by length": [ROLE, chunk({"refusal": "I can't"}), chunk({}, "length"), usage()],
    "an unknown finish reason": [ROLE, *words("x y"), chunk({}, "function_call"), usage()],
    "an empty answer": [ROLE, chunk({}, "stop"), usage(5, 0)],
    "blank chunks first": [
        ROLE,
        chunk({}),
        chunk({"content": ""}),
        *words("late text"),
        chunk({}, "stop"),
        usage(),
    ],
    "text and the finish in one chunk": [
        chunk({"role": "assistant", "content": "all of it"}, "stop"),
        usage(),
    ],
    "usage on the finish chunk": [
        ROLE,
        *words("a b"),
        {**chunk({}, "stop"), "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}},
    ],
    "cached prompt tokens": [
        ROLE,
        *words("a"),
        chunk({}, "stop"),
        {
            **usage(20, 3),
            "usage": {
                "prompt_tokens": 20,
                "completion_tokens": 3,
                "total_tokens": 23,
                "prompt_tokens_details": {"cached_tokens": 12},
            },
        },
    ],
    "text and a tool call in one chunk": [
        ROLE,
        chunk({"content": "Checking.", "tool_calls": [tool_call(0, "call_1", "f", ARGS)]}),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "a long tool name mapped back": [
        ROLE,
        call(0, "call_1", SHORT),
        *arguments(0, ARGS),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "tool-call ids Anthropic does not allow": [
        ROLE,
        call(0, "call:1/a.b", "f", "{}"),
        call(1, "call_2__thought__c2lnbmF0dXJl", "g", "{}"),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "three parallel calls, no text": [
        ROLE,
        call(0, "call_1", "f"),
        *arguments(0, ARGS),
        call(1, "call_2", "g", "{}"),
        call(2, "call_3", "h"),
        *arguments(2, '{"q": "r"}', 3),
        chunk({}, "tool_calls"),
        usage(),
    ],
}
SAME = {**STREAMS, **MORE}


async def litellms(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    wrapper = AnthropicStreamWrapper(litellm_alone(chunks), model="w", tool_name_mapping=MAPPING)
    wrapper._message_id = "msg_1"
    return [event async for event in wrapper]


async def ours_batched(chunks: list[dict[str, Any]], stop: str | None = None) -> list[list[dict[str, Any]]]:
    stream = AnthropicStream("msg_1", "w", MAPPING, lambda: stop)
    return [batch async for batch in event_batches(replay(chunks), stream)]


def ours(chunks: list[dict[str, Any]], stop: str | None = None) -> list[dict[str, Any]]:
    return [event for batch in asyncio.run(ours_batched(chunks, stop)) for event in batch]


def without_null_stop_sequence(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our events with message_delta's `"stop_sequence": null` left out, as litellm writes them, and
    without polyroute's own entry (the cost: the wire added it to litellm's events too)."""
    out = []
    for event in events:
        if event["type"] == "message_delta":
            event = {k: v for k, v in event.items() if k != "polyroute"}
            if event["delta"].get("stop_sequence", "") is None:
                event["delta"] = {k: v for k, v in event["delta"].items() if k != "stop_sequence"}
        out.append(event)
    return out


def assert_anthropic_format(events: list[dict[str, Any]]) -> None:
    """Anthropic's documented event stream (docs.anthropic.com, "Streaming Messages"): message_start;
    per content block, at indices 0, 1, 2..., content_block_start, deltas of its kind
    (text_delta for text, input_json_delta for tool_use), content_block_stop; one message_delta with
    stop_reason, stop_sequence and usage.output_tokens once every block is closed; message_stop."""
    assert events[0]["type"] == "message_start" and events[-1] == {"type": "message_stop"}
    message = events[0]["message"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["content"] == []
    assert {"input_tokens", "output_tokens"} <= set(message["usage"])
    open_block: dict[str, Any] | None = None
    expected_index = 0
    deltas = 0
    for event in events[1:-1]:
        kind = event["type"]
        assert deltas == 0, f"{kind} after message_delta"
        if kind == "content_block_start":
            assert open_block is None and event["index"] == expected_index
            open_block = event["content_block"]
            assert open_block["type"] in ("text", "tool_use")
            if open_block["type"] == "tool_use":
                assert open_block["name"] and open_block["id"] and open_block["input"] == {}
        elif kind == "content_block_delta":
            assert open_block is not None and event["index"] == expected_index
            want = {"text": "text_delta", "tool_use": "input_json_delta"}[open_block["type"]]
            assert event["delta"]["type"] == want
        elif kind == "content_block_stop":
            assert open_block is not None and event["index"] == expected_index
            open_block = None
            expected_index += 1
        elif kind == "message_delta":
            assert open_block is None
            assert "stop_reason" in event["delta"] and "stop_sequence" in event["delta"]
            assert isinstance(event["usage"]["output_tokens"], int)
            deltas += 1
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert deltas == 1


def sdk_message(events: list[dict[str, Any]]):
    """The final message the `anthropic` SDK's stream helper builds from these events."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


@pytest.mark.parametrize("name", list(SAME))
def test_events_equal_litellms_where_it_follows_anthropic(name):
    chunks = SAME[name]
    expected = asyncio.run(litellms(chunks))
    got = ours(chunks)
    assert without_null_stop_sequence(got) == expected
    assert_anthropic_format(got)
    [delta] = [e for e in got if e["type"] == "message_delta"]
    assert delta["delta"]["stop_sequence"] is None


@pytest.mark.parametrize("name", list(SAME))
def test_the_sdk_reads_the_answer(name):
    chunks = SAME[name]
    message = sdk_message(ours(chunks))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    got_text = "".join(block.text for block in message.content if block.type == "text")
    refusal = "".join(c["choices"][0]["delta"].get("refusal") or "" for c in chunks if c.get("choices"))
    assert got_text == text + refusal
    calls = [b for b in message.content if b.type == "tool_use"]
    for block in calls:
        assert isinstance(block.input, dict)
    assert message.id == "msg_1" and message.model == "w"


def test_finish_reasons_and_usage():
    def closing(name: str) -> dict[str, Any]:
        return next(e for e in ours(SAME[name]) if e["type"] == "message_delta")

    assert closing("stop with usage")["delta"]["stop_reason"] == "end_turn"
    assert closing("stop with usage")["usage"] == {"input_tokens": 11, "output_tokens": 2}
    assert closing("stop with usage")["polyroute"] == {"worker": "w", "cost_usd": "0.000001"}
    assert closing("length with usage")["delta"]["stop_reason"] == "max_tokens"
    assert closing("tool call in one chunk")["delta"]["stop_reason"] == "tool_use"
    assert closing("content filter")["delta"]["stop_reason"] == "refusal"
    assert closing("an unknown finish reason")["delta"]["stop_reason"] == "end_turn"
    refused = closing("a refusal")["delta"]
    assert (
        refused["stop_reason"] == "refusal"
        and refused["stop_details"]["explanation"] == "I can't help with that."
    )
    assert closing("a refusal cut by length")["delta"]["stop_reason"] == "max_tokens"
    # the provider sent no usage (the pipeline normally stands in with an estimate): zeros, as litellm
    assert closing("text, no usage chunk")["usage"] == {"input_tokens": 0, "output_tokens": 0}
    cached = closing("cached prompt tokens")["usage"]
    assert cached == {"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 12}


def test_tool_names_and_ids():
    starts = [
        e["content_block"]
        for e in ours(SAME["a long tool name mapped back"])
        if e["type"] == "content_block_start"
    ]
    assert starts[0]["name"] == LONG
    blocks = [
        e["content_block"]
        for e in ours(SAME["tool-call ids Anthropic does not allow"])
        if e["type"] == "content_block_start"
    ]
    assert blocks[0]["id"] == "call_1_a_b"
    assert blocks[1]["id"] == "call_2" and blocks[1]["provider_specific_fields"] == {
        "signature": "c2lnbmF0dXJl"
    }
    assert tool_use_id(None)[0].startswith("toolu_")
    assert usage_delta({"prompt_tokens": None, "completion_tokens": None}) == {
        "input_tokens": 0,
        "output_tokens": 0,
    }


def test_a_stop_sequence_is_named_in_message_delta():
    """StopScan (gateway/stop_sequences.py) cut the text and finished with "stop"; the wire's
    callback says which sequence did."""
    events = ours(STREAMS["text"], stop="four")
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "four"}
    assert_anthropic_format(events)


# ---- where litellm's wrapper leaves Anthropic's format: ours against the documented format ----------
DIFFERENT = {
    # OpenAI-wire servers may send an empty delta between tool-call chunks (or before the finish)
    "a blank chunk after a tool call": [
        ROLE,
        call(0, "call_1", "get_weather"),
        chunk({}),
        *arguments(0, ARGS),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "two tool calls in one chunk": [
        ROLE,
        chunk({"tool_calls": [tool_call(0, "call_1", "f", "{}"), tool_call(1, "call_2", "g", ARGS)]}),
        chunk({}, "tool_calls"),
        usage(),
    ],
    "text after the finish": [ROLE, *words("a b"), chunk({}, "stop"), *words("c"), usage()],
    "usage before the finish": [ROLE, *words("a b"), usage(6, 2), chunk({}, "stop")],
    "no finish": [ROLE, *words("a b"), usage(6, 2)],
    "no finish, no usage": [ROLE, *words("a b")],
    "a second finish": [ROLE, *words("a b"), chunk({}, "stop"), chunk({}, "stop"), usage()],
}


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_where_litellm_leaves_anthropics_format_ours_does_not(name):
    chunks = DIFFERENT[name]
    got = ours(chunks)
    assert_anthropic_format(got)
    message = sdk_message(got)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == {"text after the finish": "a b "}.get(name, text)  # nothing after the finish
    expected = asyncio.run(litellms(chunks))
    assert without_null_stop_sequence(got) != expected  # the difference this test documents
    theirs = [  # litellm's events with the stop_sequence key they lack: still not Anthropic's format...
        {**e, "delta": {"stop_sequence": None, **e["delta"]}} if e["type"] == "message_delta" else e
        for e in expected
    ]
    if name == "usage before the finish":  # ...or the format, with the usage dropped
        assert theirs[-2]["usage"] == {"input_tokens": 0, "output_tokens": 0}
    elif name == "two tool calls in one chunk":  # ...or the format, with both calls in one block
        starts = [e for e in theirs if e["type"] == "content_block_start"]
        assert [b["content_block"]["name"] for b in starts] == ["f"]
    else:
        with pytest.raises(AssertionError):
            assert_anthropic_format(theirs)


def test_the_differences_in_detail():
    calls = [b for b in sdk_message(ours(DIFFERENT["a blank chunk after a tool call"])).content]
    assert [b.type for b in calls] == ["tool_use"] and calls[0].input == {"city": "Paris", "unit": "celsius"}
    two = sdk_message(ours(DIFFERENT["two tool calls in one chunk"])).content
    assert [(b.name, b.input) for b in two] == [("f", {}), ("g", {"city": "Paris", "unit": "celsius"})]
    late = ours(DIFFERENT["usage before the finish"])
    assert late[-2]["usage"] == {"input_tokens": 6, "output_tokens": 2}
    unfinished = ours(DIFFERENT["no finish"])
    assert [e["type"] for e in unfinished[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert unfinished[-2]["delta"]["stop_reason"] == "end_turn"
