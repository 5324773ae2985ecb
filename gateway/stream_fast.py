"""Plain text deltas past litellm's Anthropic stream translator; every other chunk through it.

litellm's `AnthropicStreamWrapper` rebuilds each chunk as a pydantic `ModelResponseStream`, splits
and re-inspects it: about 115 µs a chunk on a loaded 2-core machine (cProfile), which put streamed
/v1/messages well past chat completions' overhead (docs/benchmarks.md). Most chunks of an answer
are one shape: a single choice whose delta is only text, while a text block is open and the
wrapper has nothing queued. For that shape the event is fixed (a `text_delta` at the open block's
index), so it is written here, in about 2 µs. (Responses streams are written by
gateway/responses_stream.py instead: there litellm's fixed cost per stream was the larger part.)
Everything else (the first chunk, role-only and empty chunks, tool calls, finish reasons, usage,
refusals, the start and stop envelopes) still goes through litellm's translator, unchanged.

`drive` owns the upstream iterator. It hands a chunk to litellm only when the chunk is not the hot
shape or the translator is not in the state where that shape's event is fixed (`busy`); litellm
reads the chunks it is handed through `Feed`, and when it asks for more than it was handed (it skips
empty chunks), `Feed` reads on from upstream, so litellm always sees an uninterrupted stream.
Tests (tests/test_stream_fast.py) check that the events equal the wrapper's own, chunk for chunk,
for text, tool calls, parallel tool calls and streams mixing the two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from litellm.types.utils import ModelResponseStream

# Yielded by `drive` before it waits for the worker: the events since the last one can go out now, in
# one write (a 5-word answer is 10 Anthropic events; written one by one they cost a send each).
FLUSH: Any = object()

# What a chunk's delta may hold and still be the hot shape (clean_chunk keeps only these keys and
# drops None values; a role rides on the first chunk).
PLAIN_KEYS = frozenset(("content", "role"))


def plain_text(chunk: dict[str, Any]) -> str | None:
    """The text of a chunk that is only one choice's text delta ("" for a blank one: a role, or empty
    content); None for any other chunk."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1 or chunk.get("usage") or "polyroute" in chunk:
        return None
    choice = choices[0]
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return None
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    if not isinstance(text, str) or not PLAIN_KEYS.issuperset(delta):
        return None
    return text


class Feed:
    """What litellm's translator reads: chunks handed to it by `drive`, else the next from upstream.

    Each becomes a `ModelResponseStream` (what litellm expects); the usage chunk's `polyroute` entry
    (the answer's cost) is kept in `extra` for the wire to put on its closing event."""

    def __init__(self, upstream: AsyncIterator[dict]) -> None:
        self.upstream = upstream
        self.pending: deque[dict] = deque()
        self.extra: dict[str, Any] = {}

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> ModelResponseStream:
        chunk = self.pending.popleft() if self.pending else await anext(self.upstream)
        if "polyroute" in chunk:
            chunk = dict(chunk)
            self.extra.update(chunk.pop("polyroute"))
        return ModelResponseStream(**chunk)


async def drive(
    translator: AsyncIterator[Any],
    feed: Feed,
    busy: Callable[[], bool],
    fast: Callable[[str, dict], list[dict] | None],
) -> AsyncIterator[Any]:
    """The translator's events, with `fast(text, chunk)`'s events in place of litellm's for each hot
    chunk that arrives while `busy()` is false. `fast` may decline (None): litellm translates it.
    `FLUSH` comes before each wait for the worker's next chunk, and at the end."""
    while True:
        if feed.pending or busy():
            try:
                event = await anext(translator)
            except StopAsyncIteration:
                return
            yield event
            continue
        yield FLUSH
        try:
            chunk = await anext(feed.upstream)
        except StopAsyncIteration:
            break
        text = plain_text(chunk)
        if text is not None and (events := fast(text, chunk)) is not None:
            for event in events:
                yield event
            continue
        feed.pending.append(chunk)
    async for event in translator:  # upstream ended: litellm closes the blocks and the message
        yield event
    yield FLUSH


# ---- Anthropic Messages: litellm's AnthropicStreamWrapper ---------------------------------------------
# The wrapper's state read here (all set in its __init__ or as class defaults); a litellm without them
# gets no fast path (every chunk through the wrapper), not wrong events.
ANTHROPIC_STATE = (
    "sent_first_chunk",
    "sent_content_block_start",
    "sent_content_block_finish",
    "current_content_block_type",
    "current_content_block_index",
    "holding_chunk",
    "holding_stop_reason_chunk",
    "queued_usage_chunk",
    "chunk_queue",
    "compaction_block",
    "sent_compaction_block",
)


def anthropic_events(wrapper: Any, feed: Feed) -> AsyncIterator[dict]:
    """`wrapper` (an AnthropicStreamWrapper reading `feed`)'s events; a text chunk inside an open text
    block is the wrapper's own `content_block_delta` for it (its translator maps content to a
    text_delta at the current index and changes no state), written here; a blank chunk (the role-only
    first chunk, empty content) while the block is, or will open as, a text block gives no event
    there, and none here."""
    splitter = wrapper.completion_stream  # litellm's _CombinedChunkSplitter: pieces of a split chunk
    ready = all(hasattr(wrapper, name) for name in ANTHROPIC_STATE) and hasattr(splitter, "_buffer")

    def busy() -> bool:
        return (
            not ready
            or not wrapper.sent_first_chunk
            or bool(wrapper.chunk_queue)
            or bool(splitter._buffer)
            or (wrapper.compaction_block is not None and not wrapper.sent_compaction_block)
        )

    def fast(text: str, chunk: dict) -> list[dict] | None:
        if (
            wrapper.current_content_block_type != "text"
            or wrapper.holding_chunk is not None
            or wrapper.holding_stop_reason_chunk is not None
            or wrapper.queued_usage_chunk
        ):
            return None
        if not text:
            return [] if not wrapper.sent_content_block_finish else None
        if not wrapper.sent_content_block_start or wrapper.sent_content_block_finish:
            return None
        index = wrapper.current_content_block_index
        return [
            {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}
        ]

    return drive(wrapper, feed, busy, fast)
