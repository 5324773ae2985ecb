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
"""

from __future__ import annotations

import uuid
from typing import Any

# A chat finish reason that leaves the response incomplete -> incomplete_details.reason
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat completions' usage in the Responses API's names (None stays None)."""
    if usage is None:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def output_of(completion: dict[str, Any]) -> tuple[str, dict | None, list[dict], dict | None]:
    """(status, incomplete_details, output items, usage) of a chat completion's first choice."""
    choices = completion.get("choices") or [{}]
    message = choices[0].get("message") or {}
    reason = INCOMPLETE.get(choices[0].get("finish_reason") or "")
    status = "incomplete" if reason else "completed"
    output: list[dict[str, Any]] = []
    if isinstance(text := message.get("content"), str):
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item_id = "msg_" + uuid.uuid4().hex
        output.append(
            {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}
        )
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            {
                "arguments": function.get("arguments") or "",
                "call_id": call.get("id"),
                "name": function.get("name"),
                "type": "function_call",
                "id": f"fc_{call.get('id')}",
                "status": "completed",
            }
        )
    details = {"reason": reason} if reason else None
    return status, details, output, responses_usage(completion.get("usage"))
