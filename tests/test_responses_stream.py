"""gateway/responses_stream.py writes the Responses API's stream events from the pipeline's chunks.

Checked against litellm's `LiteLLMCompletionStreamingIterator` (what the endpoint used before) on the
streams where both follow OpenAI's order: the same events, item for item (ids and the clock aside),
and the same output items in the final response. Where litellm departs from OpenAI (it closes a
message item after a function call that followed it), the order OpenAI streams is required instead.
The real `openai` SDK reads these streams in tests/test_stream_tools_sdk.py and test_responses_api.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litellm.responses.litellm_completion_transformation.streaming_iterator import (
    LiteLLMCompletionStreamingIterator,
)

from gateway.responses import ResponsesRequest, ResponsesWire, bridge_params, input_items
from gateway.responses_stream import response_events
from tests.test_stream_sequences import ARGS, STREAMS, litellm_alone

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
# litellm also departs where OpenAI leaves it free: it splits one chunk's arguments into several
# deltas, and a cut answer's message is "completed" in output_item.done ("incomplete" in the final
# response); those streams are checked on their own below.
ORDERED_LIKE_OPENAI = [
    "text",
    "text in the first chunk",
    "empty chunks among the text",
    "tool call, arguments in pieces",
]


def wire() -> ResponsesWire:
    out = ResponsesWire()
    out.body = ResponsesRequest(model="auto", input="weather?", tools=[TOOL], stream=True)
    out.items = input_items(out.body)
    out.params = bridge_params(out.body)
    return out


async def ours(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async def replay():
        for chunk in chunks:
            yield {k: v for k, v in chunk.items() if k != "polyroute"}

    w = wire()
    events = response_events(replay(), lambda: w.envelope("in_progress", [], None, "w"), w.response_object)
    return [event async for batch in events for event in batch]


async def litellms(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    source = litellm_alone(chunks)

    class Wrapped:  # the CustomStreamWrapper shape the iterator reads
        logging_obj = None

        async def __anext__(self):
            return await anext(source)

    w = wire()
    iterator = LiteLLMCompletionStreamingIterator(
        model="w",
        litellm_custom_stream_wrapper=Wrapped(),  # type: ignore[arg-type]
        request_input=w.items,  # type: ignore[arg-type]
        responses_api_request=w.params,  # type: ignore[arg-type]
    )
    return [event.model_dump(mode="json", exclude_none=True) async for event in iterator]


def normal(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events with random ids numbered by first appearance; the created/in-progress envelopes (the
    wire's own, not litellm's) left out; the final response reduced to its status and output."""
    ids: dict[str, str] = {}

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items() if k != "sequence_number"}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if key in ("id", "item_id") and isinstance(value, str):
            return ids.setdefault(value, f"id-{len(ids)}")
        return value

    out = []
    for event in events:
        event = dict(event)
        if event["type"] in ("response.output_text.delta", "response.output_text.done"):
            event.setdefault("logprobs", [])
        if event["type"] == "response.function_call_arguments.done":
            # litellm's event has no `name`, which the SDK's model requires (the wire writes it;
            # tests/test_responses_fixes.py checks it)
            event.pop("name", None)
        if "item" in event:  # the wire writes output_text parts with logprobs, as OpenAI does
            item = dict(event["item"])
            parts = [{k: v for k, v in p.items() if k != "logprobs"} for p in item.get("content") or ()]
            event["item"] = {**item, "content": parts} if "content" in item else item
        if event["type"] in ("response.created", "response.in_progress"):
            event.pop("response")
        if event["type"] in ("response.completed", "response.incomplete"):
            response = event.pop("response")
            event["status"] = response["status"]
            event["output"] = [{**item, "content": item.get("content")} for item in response["output"]]
            for item in event["output"]:  # litellm's iterator leaves out the message's logprobs
                for part in item["content"] or ():
                    part.pop("logprobs", None)
                if item["content"] is None:
                    del item["content"]
        out.append(walk(event))
    return out


@pytest.mark.parametrize("name", ORDERED_LIKE_OPENAI)
def test_events_equal_litellms_where_it_follows_openai(name):
    expected = normal(asyncio.run(litellms(STREAMS[name])))
    got = normal(asyncio.run(ours(STREAMS[name])))
    assert got == expected


def kinds(events: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    return [(e["type"].removeprefix("response."), e.get("output_index")) for e in events]


def test_text_then_a_tool_call_closes_the_message_first():
    events = asyncio.run(ours(STREAMS["text then a tool call"]))
    text_deltas = [("output_text.delta", 0)] * 5
    argument_deltas = [("function_call_arguments.delta", 1)] * 8
    assert kinds(events) == [
        ("created", None),
        ("in_progress", None),
        ("output_item.added", 0),
        ("content_part.added", 0),
        *text_deltas,
        ("output_text.done", 0),
        ("content_part.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1),
        *argument_deltas,
        ("function_call_arguments.done", 1),
        ("output_item.done", 1),
        ("completed", None),
    ]
    response = events[-1]["response"]
    message, call = response["output"]
    assert (
        message["id"] == events[2]["item"]["id"]
        and message["content"][0]["text"] == "Let me check the weather. "
    )
    assert (
        call["id"] == events[-2]["item"]["id"] and call["arguments"] == ARGS and call["call_id"] == "call_1"
    )
    assert response["usage"]["output_tokens"] == 9 and response["status"] == "completed"


def test_parallel_calls_are_two_items_in_stream_order():
    events = asyncio.run(ours(STREAMS["parallel tool calls after text"]))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i.get("call_id")) for i in added] == [
        ("message", None),
        ("function_call", "call_1"),
        ("function_call", "call_2"),
    ]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [ARGS, '{"city": "Rome"}']
    output = events[-1]["response"]["output"]
    assert [o["id"] for o in output] == [a["id"] for a in added]


def test_arguments_in_one_chunk_are_one_delta():
    events = asyncio.run(ours(STREAMS["tool call in one chunk"]))
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == [ARGS]
    assert events[-1]["response"]["output"][0]["arguments"] == ARGS


def test_a_cut_answer_is_incomplete():
    events = asyncio.run(ours(STREAMS["text, no usage chunk"]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    [done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete"
