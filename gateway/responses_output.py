"""A chat completion as the Responses API's output items, status and usage.

Written here rather than through litellm's bridge
(`transform_chat_completion_response_to_responses_api_response`, used until issue 17's overhead
benchmark): the bridge builds a `ModelResponse` and a pydantic `ResponsesAPIResponse` that the
gateway dumped again and rewrote under its own envelope, ~95 µs a response, which kept plain
/v1/responses requests over the 20% target against chat completions. The mapping is the bridge's
(tests/test_responses_output.py compares the two): the message's text as one `output_text` part,
each tool call as a `function_call` item (id `fc_<call id>`), a refusal left out as the bridge
leaves it out, `length` and `content_filter` finishes as an incomplete response, and the usage in
the Responses API's names. Requests are still translated by litellm's bridge.

Where the bridge's mapping is not what the `openai` SDK's models require, this module follows the
SDK (tests/test_responses_fixes.py parses answers with them): a tool call the worker sent without
an id gets one made up (`call_id` is a required string, and the client must echo it in its
`function_call_output`); `input_tokens_details.cache_write_tokens` is always written; and an empty
text next to tool calls is no message item (the stream writes none for it either).
"""

from __future__ import annotations

import uuid
from typing import Any

# A chat finish reason that leaves the response incomplete -> incomplete_details.reason
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_call_id() -> str:
    """An id for a tool call the worker sent without one, in OpenAI's `call_<hex>` form. The plain
    answer and the stream both use it: the client needs a string to send back as the
    function_call_output's `call_id`, and the stored conversation must keep the same one."""
    return "call_" + uuid.uuid4().hex[:24]


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat completions' usage in the Responses API's names (None stays None). Plain answers and
    streams (their usage chunk) both come here, so the two report the same details: OpenAI's
    `prompt_tokens_details.cached_tokens` / `cache_creation_tokens` (litellm's name for tokens
    written to a cache) and `completion_tokens_details.reasoning_tokens`, 0 when not reported; every
    field the SDK's `ResponseUsage` requires is written."""
    if usage is None:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(prompt_details.get("cached_tokens") or 0),
            "cache_write_tokens": int(prompt_details.get("cache_creation_tokens") or 0),
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(completion_details.get("reasoning_tokens") or 0)},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def output_of(completion: dict[str, Any]) -> tuple[str, dict | None, list[dict], dict | None]:
    """(status, incomplete_details, output items, usage) of a chat completion's first choice."""
    choices = completion.get("choices") or [{}]
    message = choices[0].get("message") or {}
    reason = INCOMPLETE.get(choices[0].get("finish_reason") or "")
    status = "incomplete" if reason else "completed"
    output: list[dict[str, Any]] = []
    tool_calls = message.get("tool_calls") or ()
    text = message.get("content")
    if isinstance(text, str) and (text or not tool_calls):  # "" beside tool calls is no message
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item_id = "msg_" + uuid.uuid4().hex
        output.append(
            {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}
        )
    for call in tool_calls:
        function = call.get("function") or {}
        call_id = call.get("id") or new_call_id()
        output.append(
            {
                "arguments": function.get("arguments") or "",
                "call_id": call_id,
                "name": function.get("name") or "",
                "type": "function_call",
                "id": f"fc_{call_id}",
                "status": "completed",
            }
        )
    details = {"reason": reason} if reason else None
    return status, details, output, responses_usage(completion.get("usage"))
