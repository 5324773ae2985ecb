"""gateway/responses_output.py writes a chat completion as the Responses API's output; it must say
what litellm's bridge (`transform_chat_completion_response_to_responses_api_response`, which the
endpoint used before) says, item for item: text, cut and filtered answers, tool calls with and
without text, parallel calls, refusals, empty content, cached and reasoning token counts."""

from __future__ import annotations

from typing import Any

import pytest
from litellm.responses.litellm_completion_transformation.transformation import (
    LiteLLMCompletionResponsesConfig as Bridge,
)
from litellm.types.utils import ModelResponse

from gateway.responses_output import output_of

USAGE = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = {
    "text": ({"content": "Hello."}, "stop", USAGE),
    "cut at max tokens": ({"content": "Hel"}, "length", USAGE),
    "content filter": ({"content": ""}, "content_filter", USAGE),
    "empty text": ({"content": ""}, "stop", USAGE),
    "no content": ({"content": None}, "stop", USAGE),
    "refusal": ({"content": None, "refusal": "I can't."}, "stop", USAGE),
    "tool call": ({"content": None, "tool_calls": [call("call_1", "f", '{"a": 1}')]}, "tool_calls", USAGE),
    "text and tool call": (
        {"content": "Checking.", "tool_calls": [call("call_1", "f", "{}")]},
        "tool_calls",
        USAGE,
    ),
    "parallel calls": (
        {"content": None, "tool_calls": [call("call_1", "f", "{}"), call("call_2", "g", '{"b": 2}')]},
        "tool_calls",
        USAGE,
    ),
    "cached and reasoning tokens": (
        {"content": "ok"},
        "stop",
        {
            **USAGE,
            "prompt_tokens_details": {"cached_tokens": 4, "cache_creation_tokens": 3},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    ),
}


def completion(message: dict[str, Any], finish: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "w",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": usage,
    }


def bridges(body: dict[str, Any]) -> tuple[str, Any, list[dict], dict]:
    """What the endpoint wrote through litellm's bridge (its model dumped, None fields left out,
    output_text parts with annotations and logprobs lists, as OpenAI writes them)."""
    answer = Bridge.transform_chat_completion_response_to_responses_api_response(
        request_input=[{"type": "message", "role": "user", "content": "hi"}],  # type: ignore[arg-type]
        responses_api_request={},  # type: ignore[arg-type]
        chat_completion_response=ModelResponse(**body),
    ).model_dump(mode="json")
    output = []
    for item in answer["output"]:
        item = {k: v for k, v in item.items() if v is not None}
        if item["type"] == "message":
            item["content"] = [
                {**p, "annotations": [], "logprobs": p.get("logprobs") or []} for p in item["content"]
            ]
        output.append(item)
    usage = answer["usage"]
    usage = {
        "input_tokens": usage["input_tokens"],
        "input_tokens_details": {
            "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0,
            # None in the bridge when the worker reports none; the SDK's ResponseUsage requires an int
            "cache_write_tokens": (usage.get("input_tokens_details") or {}).get("cache_write_tokens") or 0,
        },
        "output_tokens": usage["output_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("output_tokens_details") or {}).get("reasoning_tokens") or 0
        },
        "total_tokens": usage["total_tokens"],
    }
    return answer["status"], answer.get("incomplete_details"), output, usage


def without_message_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in o.items() if not (k == "id" and o["type"] == "message")} for o in output]


@pytest.mark.parametrize("name", list(CASES))
def test_output_is_the_bridges(name):
    body = completion(*CASES[name])
    status, details, output, usage = output_of(body)
    expected_status, expected_details, expected_output, expected_usage = bridges(body)
    assert (status, details, usage) == (expected_status, expected_details, expected_usage)
    assert without_message_ids(output) == without_message_ids(expected_output)
    assert all(o["id"].startswith("msg_") for o in output if o["type"] == "message")


def test_no_usage_is_none():
    body = completion({"content": "x"}, "stop", USAGE)
    del body["usage"]
    assert output_of(body)[3] is None
