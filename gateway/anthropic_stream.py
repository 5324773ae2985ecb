"""Anthropic's Messages event stream, written from the pipeline's chat chunks.

Why not litellm's `AnthropicStreamWrapper` (used until issue 17's benchmark, with plain text deltas
written past it): it rebuilds every chunk as a pydantic `ModelResponseStream`, deep-copies and splits
it, and translates it through its adapter, about 115 µs a chunk under cProfile on the loaded 2-core
machine, against ~1 µs for chat completions' SSE. Even with text deltas skipping it, the chunks that
open and close the message (the first, the finish, the usage, the end) cost ~0.2 ms a stream, which
left streamed /v1/messages at the edge of the overhead target (docs/benchmarks.md). The events are a
small state machine over two block kinds (text, tool_use), so they are written here, in plain dicts.

The events are those litellm's wrapper writes wherever it follows Anthropic's API (tests/
test_anthropic_stream.py compares them chunk sequence by chunk sequence). Where it does not, this
module follows Anthropic's documented stream (docs.anthropic.com, "Streaming Messages"):

* `message_delta.delta` always carries `stop_sequence` (null unless a stop sequence ended the answer);
  litellm leaves the key out.
* A blank chunk (no text, no tool call) never opens a block; litellm opens an empty text block for
  one that follows a tool call (and a second tool block after it for later arguments).
* Several tool calls in one chunk are one tool_use block each; litellm merges their arguments into
  the first's block.
* Nothing is written after the finish but `message_delta` and `message_stop`: text after the finish
  chunk is dropped (litellm writes it into the closed block), and a second finish is ignored (litellm
  writes a second `message_delta`).
* The usage is taken whenever it comes, also before the finish (litellm drops it then, and reports 0
  tokens), and a stream that ends without a finish still gets `content_block_stop` and a
  `message_delta` (stop_reason `end_turn`) before `message_stop` (litellm writes `message_stop`
  alone).

`message_start` carries the usage litellm's does (all counts 0): the worker's counts only arrive with
its last chunk, and `message_delta.usage` then carries `input_tokens` and `output_tokens`, which the
`anthropic` SDK applies to the final message.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

# OpenAI's finish_reason -> Anthropic's stop_reason (litellm's adapter's mapping; anything else ends the turn).
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
    "refusal": "refusal",
}
# A Gemini thought signature rides on the tool call's id after this (litellm's separator); Anthropic's
# ids allow only [a-zA-Z0-9_-].
THOUGHT_SEPARATOR = "__thought__"
_NOT_IN_ID = re.compile(r"[^a-zA-Z0-9_-]")
ZERO_USAGE = {"input_tokens": 0, "output_tokens": 0}


def tool_use_id(raw: str | None) -> tuple[str, str | None]:
    """A tool call's id as Anthropic's `tool_use` id, and the thought signature it carried (if any)."""
    if not raw:
        return "toolu_" + uuid.uuid4().hex, None
    base, _, signature = raw.partition(THOUGHT_SEPARATOR)
    return _NOT_IN_ID.sub("_", base) or "tool_use_id", signature or None


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return 0
    return int(value) if float(value).is_integer() else 0


def usage_delta(usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage as `message_delta.usage` (litellm's translation): cached prompt tokens are not
    input tokens but `cache_read_input_tokens` / `cache_creation_input_tokens`."""
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    read = _count(usage.get("cache_read_input_tokens")) or _count(details.get("cached_tokens"))
    created = _count(usage.get("cache_creation_input_tokens")) or _count(
        details.get("cache_creation_tokens") or details.get("cache_write_tokens")
    )
    out: dict[str, Any] = {
        "input_tokens": max((usage.get("prompt_tokens") or 0) - read - created, 0),
        "output_tokens": usage.get("completion_tokens") or 0,
    }
    if created:
        out["cache_creation_input_tokens"] = created
    if read:
        out["cache_read_input_tokens"] = read
    return out


def _stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


class AnthropicStream:
    """The events of one answer: `start()`, then `chunk(c)` for each chat chunk, then `end()`.

    Chunks are the pipeline's (dicts: one choice whose delta holds content, refusal or tool_calls, a
    finish_reason; the usage chunk with no choices, carrying polyroute's cost under `polyroute`)."""

    def __init__(
        self,
        message_id: str,
        model: str,
        tool_names: dict[str, str] | None = None,
        stop_sequence: Callable[[], str | None] | None = None,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.tool_names = tool_names or {}  # truncated name (what the worker saw) -> the client's
        self.stop_sequence = stop_sequence  # the sequence that ended the answer, once one has
        self.index = -1  # the last block opened
        self.open: str | None = None  # the open block's type
        self.stop_reason: str | None = None  # set at the finish chunk
        self.usage: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}  # polyroute's entry (worker, cost_usd, usage kind)
        self.refusal = ""
        self.closed = False  # message_delta written: only message_stop may follow

    def start(self) -> dict[str, Any]:
        usage = {**ZERO_USAGE, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return {"type": "message_start", "message": message}

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk makes (none for a blank one)."""
        if self.closed:
            return []
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices")
        if choices and self.stop_reason is None:
            choice = choices[0]
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            refusal = delta.get("refusal") or ""
            if refusal:
                self.refusal += refusal
            if text or refusal:
                out += self._text(text + refusal)
            if calls := delta.get("tool_calls"):
                out += self._tools(calls)
            if finish := choice.get("finish_reason"):
                out += self._finish(finish)
        if usage := chunk.get("usage"):
            self.usage = usage
        if extra := chunk.get("polyroute"):
            self.extra.update(extra)
        if self.stop_reason is not None and self.usage is not None:
            out.append(self._message_delta())
        return out

    def end(self) -> list[dict[str, Any]]:
        """The closing events once the worker's stream has ended."""
        out: list[dict[str, Any]] = []
        if not self.closed:
            if self.open is not None:
                out.append(_stop(self.index))
                self.open = None
            out.append(self._message_delta())
        out.append({"type": "message_stop"})
        return out

    def _begin(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = [_stop(self.index)] if self.open is not None else []
        self.index += 1
        self.open = kind
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = self._begin("text", {"type": "text", "text": ""}) if self.open != "text" else []
        out.append(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "text_delta", "text": text},
            }
        )
        return out

    def _tools(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A tool call that names its function opens a tool_use block; arguments go to the open one."""
        out: list[dict[str, Any]] = []
        for call in calls:
            function = call.get("function") or {}
            name = function.get("name")
            if name or self.open != "tool_use":
                block_id, signature = tool_use_id(call.get("id"))
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": block_id,
                    "name": self.tool_names.get(name, name) if name else "",
                    "input": {},
                }
                if signature:  # litellm's adapter reads it back from the next request's tool_use block
                    block["provider_specific_fields"] = {"signature": signature}
                out += self._begin("tool_use", block)
            if arguments := function.get("arguments"):
                delta = {"type": "input_json_delta", "partial_json": arguments}
                out.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return out

    def _finish(self, finish: str) -> list[dict[str, Any]]:
        """The finish closes the open block (an answer with no content gets an empty text block, as
        litellm writes it); message_delta waits for the usage, which comes next."""
        self.stop_reason = STOP_REASONS.get(finish, "end_turn")
        out = self._begin("text", {"type": "text", "text": ""}) if self.index < 0 else []
        if self.open is not None:
            out.append(_stop(self.index))
            self.open = None
        return out

    def _message_delta(self) -> dict[str, Any]:
        self.closed = True
        reason = self.stop_reason or "end_turn"
        delta: dict[str, Any] = {"stop_reason": reason, "stop_sequence": None}
        matched = self.stop_sequence() if self.stop_sequence is not None else None
        if matched is not None:
            delta = {"stop_reason": "stop_sequence", "stop_sequence": matched}
        elif self.refusal and reason != "max_tokens":  # the worker refused in words (OpenAI's `refusal`)
            delta["stop_reason"] = "refusal"
            delta["stop_details"] = {"type": "refusal", "category": None, "explanation": self.refusal}
        event: dict[str, Any] = {
            "type": "message_delta",
            "delta": delta,
            "usage": usage_delta(self.usage) if self.usage else dict(ZERO_USAGE),
        }
        if self.extra:
            event["polyroute"] = dict(self.extra)
        return event


async def event_batches(
    chunks: AsyncIterator[dict[str, Any]], stream: AnthropicStream
) -> AsyncIterator[list[dict[str, Any]]]:
    """`stream`'s events for `chunks`, in batches that each go out in one write (a 5-word answer is
    10 events; written one by one they cost a send each).

    A read of the worker that made events sends what is ready. `message_start` waits for the first
    such read: the pipeline opens the stream once the worker's first chunk carrying some of the answer
    has arrived (gateway/upstream.py `_past_prelude`; a worker that fails before it is fallen back
    from, and its client sees nothing of it), so it costs no time to the client. After
    `message_delta` only the end can follow, so it waits for it and goes out with `message_stop`. If
    the worker fails or the deadline passes, what was ready goes out first and the error is raised on
    to the pipeline, which writes the `error` event and bills the stream.
    """
    ready = [stream.start()]
    try:
        async for chunk in chunks:
            events = stream.chunk(chunk)
            if events:
                ready += events
                if not stream.closed:
                    yield ready
                    ready = []
    except Exception:
        if ready:
            yield ready
        raise
    yield ready + stream.end()
