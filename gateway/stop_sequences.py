"""Anthropic stop sequences applied by the gateway: the answer ends before the first one the worker
writes, and says which (stop_reason "stop_sequence", stop_sequence the string), as Anthropic does.

Two modes (`POLYROUTE_MESSAGES_STOP_SEQUENCES`, docs/anthropic.md):

* ``forward`` (default): the sequences go to the worker as OpenAI's `stop`, so it stops there and
  nothing past them is generated or billed (what an agent that stops on "Observation:" needs). A
  worker that honours `stop` ends with finish_reason "stop" and leaves the sequence out, exactly as
  when it simply finishes, so that answer reads end_turn: OpenAI's wire cannot say which sequence
  stopped it, and litellm drops the ones vLLM and Anthropic send. The cut here still applies, for a
  worker that ignores `stop`: then the answer names the sequence.
* ``gateway``: the sequences are kept here; the worker writes on to its own end (billed, within the
  request's max_tokens, as reserved) and the gateway cuts the text and names the sequence: Anthropic's
  semantics exactly, at that cost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any


def first_stop(text: str, sequences: list[str]) -> tuple[int, str] | None:
    """Where the text must end (the start of the first stop sequence to complete) and which one."""
    found = []
    for sequence in sequences:
        start = text.find(sequence)
        if sequence and start >= 0:
            found.append((start + len(sequence), start, sequence))
    if not found:
        return None
    _, start, sequence = min(found)
    return start, sequence


def held_back(text: str, sequences: list[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop sequence (kept until the
    next chunk says whether they are)."""
    longest = 0
    for sequence in sequences:
        for size in range(min(len(sequence) - 1, len(text)), longest, -1):
            if text.endswith(sequence[:size]):
                longest = size
                break
    return longest


def cut_completion(body: dict[str, Any], sequences: list[str]) -> tuple[dict[str, Any], str | None]:
    """A chat completion cut at the first stop sequence in its text (its tool calls, written after it,
    dropped), and the sequence; (body, None) when the text holds none. `body` is not changed (the
    pipeline may still cache or judge the worker's whole answer)."""
    choices = body.get("choices") or []
    message = (choices[0].get("message") or {}) if choices else {}
    text = message.get("content")
    if not isinstance(text, str) or (found := first_stop(text, sequences)) is None:
        return body, None
    start, sequence = found
    cut = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text[:start]}
    first = {**choices[0], "message": cut, "finish_reason": "stop"}
    return {**body, "choices": [first, *choices[1:]]}, sequence


def _with_text(chunk: dict[str, Any], text: str) -> dict[str, Any]:
    choice = chunk["choices"][0]
    delta = {k: v for k, v in choice["delta"].items() if k in ("role",)}
    delta["content"] = text
    return {**chunk, "choices": [{**choice, "delta": delta, "finish_reason": None}]}


class StopScan:
    """Applies stop sequences to a stream of chat chunks: text that could begin a sequence is held
    back until the next chunk decides; at a match, the text before it is sent, then a finish chunk
    ("stop"); after that only the usage chunk passes (the worker's later chunks are read, so the stream
    is billed from the worker's own usage, and dropped). `matched` says which sequence ended it."""

    def __init__(self, sequences: list[str]) -> None:
        self.sequences = [s for s in sequences if s]
        self.matched: str | None = None

    async def scan(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        held = ""
        last: dict[str, Any] | None = None  # the chunk the held text came in, to send it in its shape
        async for chunk in chunks:
            choices = chunk.get("choices") or []
            if self.matched is not None:
                if not choices:  # the usage chunk: what the answer cost
                    yield chunk
                continue
            if len(choices) != 1:
                yield chunk
                continue
            delta = choices[0].get("delta") or {}
            text = delta.get("content")
            if not isinstance(text, str) or not text:
                if held and (delta.get("tool_calls") or choices[0].get("finish_reason")):
                    yield _with_text(last or chunk, held)  # the text before a tool call or the end
                    held = ""
                yield chunk
                continue
            held += text
            last = chunk
            if (found := first_stop(held, self.sequences)) is not None:
                start, self.matched = found
                if start:
                    yield _with_text(chunk, held[:start])
                yield {**chunk, "choices": [{**choices[0], "delta": {}, "finish_reason": "stop"}]}
                continue
            rest = {k: v for k, v in delta.items() if k not in ("content", "role")}
            finish = choices[0].get("finish_reason")
            if rest or finish:  # more than text (a tool call, the end): the text goes out whole first
                yield _with_text(chunk, held)
                held = ""
                yield {**chunk, "choices": [{**choices[0], "delta": rest, "finish_reason": finish}]}
                continue
            keep = held_back(held, self.sequences)
            if len(held) > keep:
                yield _with_text(chunk, held[: len(held) - keep])
                held = held[len(held) - keep :]
        if held and last is not None and self.matched is None:  # the stream ended without a finish
            yield _with_text(last, held)
