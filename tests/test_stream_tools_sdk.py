"""Streamed tool calls through /v1/messages and /v1/responses, read by the real `anthropic` and `openai`
SDKs: a tool call alone, its arguments in pieces (OpenAI's way of streaming them), and a stream that
mixes text and a tool call (both written by our own translators: gateway/anthropic_stream.py and
gateway/responses_stream.py). The SDKs' own accumulators must rebuild the same message.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway

ARGS = '{"city": "Paris", "unit": "celsius"}'
PREAMBLE = "Let me look up the weather in Paris for you."
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tgw(upstream, tmp_path_factory):
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path_factory.mktemp("tools-gw"))
    yield gw
    gw.server.stop()


def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=120)


def oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("pieces", [None, 4], ids=["arguments in one chunk", "arguments in pieces"])
@pytest.mark.parametrize("preamble", [None, PREAMBLE], ids=["tool call alone", "text then tool call"])
def test_messages_stream_with_a_tool_call(tgw, upstream, pieces, preamble):
    tool = {"name": "get_weather", "arguments": ARGS}
    upstream.behave("cheap-model", tool_call=tool, preamble=preamble, arguments_chunk_chars=pieces)
    with claude(tgw).messages.stream(
        model="cheap", max_tokens=64, messages=[{"role": "user", "content": ASK}], tools=[ANTHROPIC_TOOL]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-polyroute-request-id"]
    expected_types = (["text"] if preamble else []) + ["tool_use"]
    assert [block.type for block in final.content] == expected_types
    if preamble:
        assert final.content[0].text == preamble
    use = final.content[-1]
    assert use.name == "get_weather" and use.input == json.loads(ARGS)
    assert final.stop_reason == "tool_use"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.index for e in starts] == list(range(len(expected_types)))
    if pieces:
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        partial = [d.partial_json for d in deltas if d.type == "input_json_delta"]
        assert len(partial) > 1 and "".join(partial) == ARGS
    assert ledger_record(tgw, request_id)["status"] == 200


@pytest.mark.parametrize("pieces", [None, 4], ids=["arguments in one chunk", "arguments in pieces"])
@pytest.mark.parametrize("preamble", [None, PREAMBLE], ids=["tool call alone", "text then tool call"])
def test_responses_stream_with_a_function_call(tgw, upstream, pieces, preamble):
    tool = {"name": "get_weather", "arguments": ARGS}
    upstream.behave("cheap-model", tool_call=tool, preamble=preamble, arguments_chunk_chars=pieces)
    with oai(tgw).responses.stream(model="cheap", input=ASK, tools=[RESPONSES_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    expected_types = (["message"] if preamble else []) + ["function_call"]
    assert [item.type for item in final.output] == expected_types
    if preamble:
        assert final.output_text == preamble
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == preamble
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == ARGS
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == ARGS
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(1, len(events) + 1))


def test_long_text_streams_are_whole_on_both_endpoints(tgw, upstream):
    """Many text chunks (nearly all on the fast path): the SDKs rebuild every word, in order."""
    text = " ".join(f"word{i}" for i in range(300))
    upstream.behave("cheap-model", text=text)
    with claude(tgw).messages.stream(
        model="cheap", max_tokens=512, messages=[{"role": "user", "content": ASK}]
    ) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().stop_reason == "end_turn"
    with oai(tgw).responses.stream(model="cheap", input=ASK) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == text
        assert stream.get_final_response().output_text == text
