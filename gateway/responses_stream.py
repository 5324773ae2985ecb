"""The Responses API's typed stream events, written from the pipeline's chat chunks.

Why not litellm's `LiteLLMCompletionStreamingIterator` (used until issue 17's benchmark): for a short
answer its fixed cost was most of the endpoint's overhead (bench/overhead.py: streamed /v1/responses
added 1.8x chat completions' milliseconds, with text deltas already written past it), because it
rebuilds every chunk as pydantic objects, assembles the answer again at the end with litellm's
`stream_chunk_builder` (which also prices the worker's name: a failed lookup, and "Provider List"
printed to stdout, per stream), and builds a pydantic event per event; and the gateway then rewrote
most of what it produced (ids, sequence numbers, the envelope). It also closes a message item after
a function call that followed it, where OpenAI closes it first. The events are a small state machine
over three item kinds, so they are written here; the response object in `response.completed` is the
one the plain answer gets (`ResponsesWire.response_object`, litellm's bridge), from the chunks
assembled into a chat completion, with the item ids the events used.

Order, as OpenAI streams it: response.created, response.in_progress; per output item
output_item.added, then for a message content_part.added, output_text.delta..., output_text.done,
content_part.done, and for a function call function_call_arguments.delta..., .done; output_item.done
(an item is closed when the next one starts or the stream ends); response.completed (or
response.incomplete).

Events come in batches: those one chunk gives (or the stream's start, or its end), which the wire
writes at once. A 5-word answer is 13 events; written one by one they cost a send each, and the
start and end batches are 2 and 4 events with nothing to wait for between them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.responses_output import new_call_id


class _Item:
    """One output item being streamed: a message (text) or a function call."""

    def __init__(self, index: int, kind: str, item_id: str, call: dict[str, Any] | None = None) -> None:
        self.index = index
        self.kind = kind
        self.id = item_id
        self.call = call or {}  # call_id, name
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def added(self) -> list[dict[str, Any]]:
        if self.kind == "message":
            item = {
                "id": self.id,
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": []}
            return [
                {"type": "response.output_item.added", "output_index": self.index, "item": item},
                {**self._where(), "type": "response.content_part.added", "content_index": 0, "part": part},
            ]
        item = {"type": "function_call", "id": self.id, **self.call, "status": "in_progress", "arguments": ""}
        return [{"type": "response.output_item.added", "output_index": self.index, "item": item}]

    def delta(self, text: str) -> dict[str, Any]:
        self.parts.append(text)
        if self.kind == "message":
            return {**self._where(), "type": "response.output_text.delta", "content_index": 0} | {
                "delta": text,
                "logprobs": [],
            }
        return {**self._where(), "type": "response.function_call_arguments.delta", "delta": text}

    def done(self, final: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The item's closing events; `final` is its form in the response object (None mid-stream)."""
        text = self.text
        if self.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            item = final or {
                "id": self.id,
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{**part, "logprobs": []}],
            }
            return [
                {**self._where(), "type": "response.output_text.done", "content_index": 0, "text": text}
                | {"logprobs": []},
                {**self._where(), "type": "response.content_part.done", "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": self.index, "item": item},
            ]
        item = final or {"type": "function_call", "id": self.id, **self.call, "status": "completed"}
        item = {**item, "arguments": text}
        # `name` is required by the SDK's ResponseFunctionCallArgumentsDoneEvent: clients dispatch
        # the tool on this event
        done = {"type": "response.function_call_arguments.done", "name": self.call["name"], "arguments": text}
        return [
            {**self._where(), **done},
            {"type": "response.output_item.done", "output_index": self.index, "item": item},
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index}


async def response_events(
    chunks: AsyncIterator[dict],
    envelope: Callable[[], dict],
    response_object: Callable[[dict], dict],
) -> AsyncIterator[list[dict[str, Any]]]:
    """The events for `chunks` (the pipeline's chat chunks), in batches. `envelope()` is the
    in-progress response object; `response_object(completion)` the finished one, from a chat
    completion."""
    created = envelope()
    yield [
        {"type": "response.created", "response": created},
        {"type": "response.in_progress", "response": created},
    ]
    items: list[_Item] = []
    open_item: _Item | None = None
    calls: dict[int, _Item] = {}  # the tool call's index in the chunks -> its item
    first: dict[str, Any] = {}
    finish: str | None = None
    usage: dict[str, Any] | None = None

    def start(kind: str, item_id: str, call: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        nonlocal open_item
        events = open_item.done(None) if open_item is not None else []
        open_item = _Item(len(items), kind, item_id, call)
        items.append(open_item)
        return events + open_item.added()

    async for chunk in chunks:
        batch: list[dict[str, Any]] = []
        first = first or chunk
        if chunk.get("usage"):
            # kept whole (cached and reasoning token details included): response.completed's usage
            # is written by the plain answer's builder (responses_output.responses_usage)
            usage = chunk["usage"]
        for choice in (chunk.get("choices") or ())[:1]:
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                if open_item is None or open_item.kind != "message":
                    batch += start("message", "msg_" + uuid.uuid4().hex)
                batch.append(open_item.delta(text))  # type: ignore[union-attr]
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                index = call.get("index", 0)
                if index not in calls or (call.get("id") and call["id"] != calls[index].call["call_id"]):
                    call_id = call.get("id") or new_call_id()
                    named = {"call_id": call_id, "name": function.get("name") or ""}
                    batch += start("function_call", "fc_" + call_id, named)
                    calls[index] = open_item  # type: ignore[assignment]
                if arguments := function.get("arguments"):
                    item = calls[index]
                    if item is not open_item:  # arguments of an earlier call, interleaved: kept, not streamed
                        item.parts.append(arguments)
                    else:
                        batch.append(item.delta(arguments))
        if batch:
            yield batch

    response = response_object(_completion(first, items, finish, usage))
    finals = _with_stream_ids(response, items)
    last = open_item.done(finals.get(open_item.id)) if open_item is not None else []
    kind = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
    yield [*last, {"type": kind, "response": response}]


def _completion(
    first: dict[str, Any], items: list[_Item], finish: str | None, usage: dict[str, Any] | None
) -> dict[str, Any]:
    """The streamed answer as the chat completion a plain request would have got."""
    text = "".join(item.text for item in items if item.kind == "message")
    tool_calls = [
        {
            "id": item.call["call_id"],
            "type": "function",
            "function": {"name": item.call["name"], "arguments": item.text},
        }
        for item in items
        if item.kind == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    completion = {
        "id": first.get("id") or "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": first.get("created") or 0,
        "model": first.get("model") or "",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish or "stop"}],
    }
    if usage:
        completion["usage"] = usage
    return completion


def _with_stream_ids(response: dict[str, Any], items: list[_Item]) -> dict[str, dict[str, Any]]:
    """The response object's output in stream order with the streamed item ids (the bridge mints its
    own message id); returns the final form of each item by id."""
    output = response.get("output") or []
    messages = [o for o in output if o.get("type") == "message"]
    by_call = {o.get("call_id"): o for o in output if o.get("type") == "function_call"}
    ordered = []
    for item in items:
        if item.kind == "message" and messages:
            final = {**messages[0], "id": item.id}
            messages = messages[1:]  # the bridge writes one message; a second streamed one is merged in
        elif item.kind == "function_call" and item.call["call_id"] in by_call:
            final = {**by_call.pop(item.call["call_id"]), "id": item.id}
        else:
            continue
        ordered.append(final)
    ordered += messages + list(by_call.values())  # anything the stream did not name (none expected)
    response["output"] = ordered
    return {o["id"]: o for o in ordered if "id" in o}
