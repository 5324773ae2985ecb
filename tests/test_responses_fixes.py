"""POST /v1/responses answers as the `openai` SDK's own models require them, and requests the docs
promise to take (or to refuse with a clear 400).

The answers are parsed with the SDK's pydantic models in strict mode (`Response`, and each stream
event by its own model): an answer the SDK's client builds leniently can still hold a null where
the model says `str`, or lack a required field, and strict parsing is what shows it. The worker
is the test upstream (tests/fakes); what it received shows the translation of a request.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import httpx
import openai
import openai.types.responses as sdk_types
import pytest
from pydantic import BaseModel

from gateway.responses_output import output_of, responses_usage

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# each stream event type -> the SDK's model of it
EVENT_MODELS: dict[str, type[BaseModel]] = {
    typing.get_args(model.model_fields["type"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(sdk_types.ResponseStreamEvent)[0])
}


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0)


def post(gw, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.v1 + "/responses", headers=gw.auth(), json=body, timeout=30)


def events_of(text: str) -> list[dict[str, Any]]:
    """The `data:` payloads of an SSE body, in order."""
    out = []
    for block in text.strip().split("\n\n"):
        data = [line[len("data: ") :] for line in block.splitlines() if line.startswith("data: ")]
        if data:
            out.append(json.loads(data[0]))
    return out


def strict_events(text: str) -> list[dict[str, Any]]:
    """The stream's events, each parsed strictly by the SDK's model of its type (raises if one fails)."""
    events = events_of(text)
    for event in events:
        EVENT_MODELS[event["type"]].model_validate(event, strict=True)
    return events


def strict_response(data: dict[str, Any]) -> sdk_types.Response:
    return sdk_types.Response.model_validate(data, strict=True)


# ---- 10: every answer parses strictly with the SDK's models (usage's cache_write_tokens) ------------
ANSWERS = {
    "text": ({"text": "hello there"}, {}),
    "tool call": (
        {"tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"tools": [WEATHER]},
    ),
    "text then a tool call in pieces": (
        {
            "preamble": "Let me look.",
            "tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            "arguments_chunk_chars": 4,
        },
        {"tools": [WEATHER]},
    ),
    "cut at max_output_tokens": ({"text": "one two three four five"}, {"max_output_tokens": 2}),
}


@pytest.mark.parametrize("name", list(ANSWERS))
def test_plain_streamed_and_retrieved_answers_parse_strictly_with_the_sdk_models(gateway, upstream, name):
    behaviour, extra = ANSWERS[name]
    upstream.behave("cheap-model", **behaviour)
    body = {"model": "cheap", "input": "Weather in Paris?", **extra}

    plain = post(gateway, body)
    assert plain.status_code == 200, plain.text
    parsed = strict_response(plain.json())
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cache_write_tokens == 0
    retrieved = httpx.get(gateway.v1 + "/responses/" + parsed.id, headers=gateway.auth(), timeout=30)
    strict_response(retrieved.json())

    streamed = post(gateway, {**body, "stream": True})
    events = strict_events(streamed.text)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_cache_write_tokens_come_from_the_workers_cache_creation_tokens():
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 3,
        "total_tokens": 103,
        "prompt_tokens_details": {"cached_tokens": 40, "cache_creation_tokens": 25},
    }
    written = responses_usage(usage)
    sdk_types.ResponseUsage.model_validate(written, strict=True)
    assert written is not None and written["input_tokens_details"] == {
        "cached_tokens": 40,
        "cache_write_tokens": 25,
    }


# ---- 4: a tool call the worker sent without an id ---------------------------------------------------
def test_tool_call_without_id_gets_a_call_id_the_client_can_answer(gateway, upstream):
    upstream.behave(
        "cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}', "id": None}
    )
    first = client(gateway).responses.create(model="cheap", input="Weather in Paris?", tools=[WEATHER])
    strict_response(first.model_dump(mode="json"))
    call = next(item for item in first.output if item.type == "function_call")
    assert isinstance(call.call_id, str) and call.call_id.startswith("call_")
    assert call.id == "fc_" + call.call_id

    # the client answers the call by its id; the stored conversation carries the same id to the worker
    upstream.behave("cheap-model", text="Sunny.")
    follow_up = client(gateway).responses.create(
        model="cheap",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert follow_up.output_text == "Sunny."
    messages = upstream.requests_for("cheap-model")[-1]["messages"]
    assistant = next(m for m in messages if m.get("tool_calls"))
    tool = next(m for m in messages if m["role"] == "tool")
    assert assistant["tool_calls"][0]["id"] == tool["tool_call_id"] == call.call_id


def test_output_builder_makes_up_a_distinct_id_for_each_call_without_one():
    """The builder itself, on a chat completion with two id-less calls (parallel tool calls)."""
    completion = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"type": "function", "function": {"name": "g", "arguments": "{}"}},
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    _, _, output, _ = output_of(completion)
    ids = [item["call_id"] for item in output]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert [item["id"] for item in output] == ["fc_" + i for i in ids]
    for item in output:
        sdk_types.ResponseFunctionToolCall.model_validate(item, strict=True)


# ---- 7: response.function_call_arguments.done names the function ------------------------------------
@pytest.mark.parametrize("call_id", ["call_from_worker", None])
def test_function_call_arguments_done_event_names_the_function(gateway, upstream, call_id):
    upstream.behave(
        "cheap-model",
        tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}', "id": call_id},
        arguments_chunk_chars=5,
    )
    raw = post(gateway, {"model": "cheap", "input": "Weather?", "tools": [WEATHER], "stream": True})
    events = strict_events(raw.text)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1
    assert done[0]["name"] == "get_weather" and done[0]["arguments"] == '{"city": "Paris"}'
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert done[0]["item_id"] == added["item"]["id"]


# ---- 8: a refusal part in the history ----------------------------------------------------------------
def test_assistant_turn_that_is_a_refusal_reaches_the_worker_as_its_text(gateway, upstream):
    upstream.behave("cheap-model", text="Sure.")
    r = post(
        gateway,
        {
            "model": "cheap",
            "store": False,
            "input": [
                {"role": "user", "content": "something borderline"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "refusal", "refusal": "I can't."}],
                },
                {"role": "user", "content": "something else then"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assistant = upstream.requests_for("cheap-model")[-1]["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"] == [{"type": "text", "text": "I can't."}]


def test_refusal_beside_text_is_sent_not_dropped(gateway, upstream):
    upstream.behave("cheap-model", text="Sure.")
    content = [{"type": "output_text", "text": "Part one."}, {"type": "refusal", "refusal": "Not the rest."}]
    r = post(
        gateway,
        {
            "model": "cheap",
            "input": [
                {"role": "user", "content": "both parts please"},
                {"type": "message", "role": "assistant", "content": content},
                {"role": "user", "content": "fine"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assistant = upstream.requests_for("cheap-model")[-1]["messages"][1]
    assert [part["text"] for part in assistant["content"]] == ["Part one.", "Not the rest."]
    # the stored conversation keeps the refusal, and a follow-up sends it again
    upstream.behave("cheap-model", text="Done.")
    follow_up = post(gateway, {"model": "cheap", "previous_response_id": r.json()["id"], "input": "and?"})
    assert follow_up.status_code == 200, follow_up.text
    assistant = upstream.requests_for("cheap-model")[-1]["messages"][1]
    assert [part["text"] for part in assistant["content"]] == ["Part one.", "Not the rest."]


def test_message_with_an_empty_content_list_is_a_400_in_plain_english(gateway, upstream):
    before = len(upstream.requests)
    r = post(
        gateway,
        {
            "model": "cheap",
            "input": [{"role": "assistant", "content": []}, {"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input.0" and "empty content list" in error["message"]
    assert "a assistant" not in error["message"]
    assert len(upstream.requests) == before


# ---- 9: an input_image by file_id --------------------------------------------------------------------
@pytest.mark.parametrize(
    "image, named",
    [
        ({"type": "input_image", "file_id": "file-abc123", "detail": "auto"}, "file_id"),
        ({"type": "input_image", "image_url": "", "detail": "auto"}, "image_url"),
    ],
)
def test_input_image_without_image_url_is_a_400_naming_the_field(gateway, upstream, image, named):
    before = len(upstream.requests)
    content = [{"type": "input_text", "text": "What is this?"}, image]
    r = post(gateway, {"model": "cheap", "input": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "input.0.content.1"
    assert "image_url" in error["message"] and named in error["message"]
    assert len(upstream.requests) == before


def test_image_by_url_still_reaches_the_worker(gateway, upstream):
    upstream.behave("cheap-model", text="A cat.")
    image = {"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"}
    r = post(gateway, {"model": "cheap", "input": [{"role": "user", "content": [image]}]})
    assert r.status_code == 200, r.text
    part = upstream.requests_for("cheap-model")[-1]["messages"][0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"] == "https://example.com/cat.png"


# ---- 11: response.failed's error.code is one the SDK allows -----------------------------------------
def test_response_failed_event_parses_strictly_and_keeps_polyroutes_code(gateway, upstream):
    upstream.behave("cheap-model", text="a b c d e f g h", drop_after_chunks=3)
    raw = post(gateway, {"model": "cheap", "input": "hi", "stream": True})
    events = strict_events(raw.text)
    error, failed = events[-2], events[-1]
    assert error["type"] == "error" and error["code"] == "upstream_stream_error"
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["error"]["message"] == error["message"]
    assert failed["response"]["polyroute"]["error_code"] == "upstream_stream_error"


# ---- 6 (the Responses half): streamed usage details equal the plain answer's -------------------------
def test_streamed_usage_keeps_cached_and_reasoning_tokens_like_the_plain_answer(gateway, upstream):
    """Needs gateway/upstream.py's clean_chunk to keep OpenAI's usage details on the stream's usage
    chunk (and the test upstream to report them); the Responses stream builds its usage with the
    plain answer's builder."""
    upstream.behave("cheap-model", text="hi", prompt_tokens=100, cached_tokens=40, reasoning_tokens=2)
    plain = client(gateway).responses.create(model="cheap", input="x")
    with client(gateway).responses.stream(model="cheap", input="x") as stream:
        final = stream.get_final_response()
    assert plain.usage is not None and final.usage is not None
    assert plain.usage.input_tokens_details.cached_tokens == 40
    assert plain.usage.output_tokens_details.reasoning_tokens == 2
    assert final.usage.model_dump() == plain.usage.model_dump()


# ---- minor: no empty message item before a tool call ------------------------------------------------
def test_empty_text_beside_a_tool_call_is_no_message_item(gateway, upstream):
    upstream.behave(
        "cheap-model", preamble="", tool_call={"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    )
    body = {"model": "cheap", "input": "Weather in Oslo?", "tools": [WEATHER]}
    plain = post(gateway, body).json()
    streamed = next(
        e["response"]
        for e in events_of(post(gateway, {**body, "stream": True}).text)
        if e["type"] == "response.completed"
    )
    assert [item["type"] for item in plain["output"]] == ["function_call"]
    assert [item["type"] for item in streamed["output"]] == ["function_call"]


def test_empty_answer_without_tool_calls_is_still_a_message():
    """An empty answer is still an answer (a message with empty text), as the bridge wrote it."""
    completion = {"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}
    _, _, output, _ = output_of(completion)
    assert [(item["type"], item["content"][0]["text"]) for item in output] == [("message", "")]
