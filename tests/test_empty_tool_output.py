"""A tool that printed nothing is an ordinary turn of an agent loop, on every client API.

OpenAI accepts an empty tool message (chat completions) and an empty `function_call_output`
(Responses); Anthropic makes a tool_result's content optional. Other providers refuse an empty text
block, so the gateway sends one placeholder, gateway.schemas.NO_OUTPUT, whichever API the client used.
Before, only /v1/messages did: chat completions and Responses answered 400 "a tool message has empty
content" and no worker was called.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.schemas import NO_OUTPUT

CALL = {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
RUN_TOOL = {
    "type": "function",
    "function": {"name": "run", "parameters": {"type": "object", "properties": {}}},
}


def tool_message(upstream) -> dict:
    messages = upstream.requests_for("cheap-model")[-1]["messages"]
    return next(m for m in messages if m["role"] == "tool")


def tool_text(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


@pytest.mark.parametrize("content", ["", "   ", [{"type": "text", "text": " "}], None])
def test_chat_completions_sends_a_placeholder_for_an_empty_tool_message(gateway, upstream, content):
    upstream.behave("cheap-model", text="Nothing was printed.")
    tool = {"role": "tool", "tool_call_id": "call_1"}
    if content is not None:
        tool["content"] = content
    body = {
        "model": "cheap",
        "tools": [RUN_TOOL],
        "messages": [
            {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            tool,
        ],
    }
    r = httpx.post(gateway.v1 + "/chat/completions", headers=gateway.auth(), json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Nothing was printed."
    sent = tool_message(upstream)
    assert sent["tool_call_id"] == "call_1"
    assert tool_text(sent) == NO_OUTPUT


@pytest.mark.parametrize("output", ["", "  "])
def test_responses_sends_a_placeholder_for_an_empty_function_output(gateway, upstream, output):
    upstream.behave("cheap-model", text="Nothing was printed.")
    body = {
        "model": "cheap",
        "store": False,
        "tools": [{"type": "function", "name": "run", "parameters": {"type": "object", "properties": {}}}],
        "input": [
            {"role": "user", "content": "Run it."},
            {"type": "function_call", "call_id": "call_1", "name": "run", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": output},
        ],
    }
    r = httpx.post(gateway.v1 + "/responses", headers=gateway.auth(), json=body, timeout=30)
    assert r.status_code == 200, r.text
    sent = tool_message(upstream)
    assert sent["tool_call_id"] == "call_1"
    assert tool_text(sent) == NO_OUTPUT


def test_an_empty_user_message_is_still_refused(gateway, upstream):
    """The placeholder is for tool results only: an empty user turn remains the client's error."""
    body = {"model": "cheap", "messages": [{"role": "user", "content": " "}]}
    r = httpx.post(gateway.v1 + "/chat/completions", headers=gateway.auth(), json=body, timeout=30)
    assert r.status_code == 400
    assert "empty content" in r.json()["error"]["message"]
    assert upstream.requests_for("cheap-model") == []
