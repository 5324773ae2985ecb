"""The test upstream: a real HTTP server on loopback that speaks the OpenAI chat wire format (and
Anthropic's Messages wire on /v1/messages, for workers whose provider is anthropic, and OpenAI's
Responses wire on /v1/responses, for workers whose chat calls litellm bridges to it).

Stop sequences are honoured as the providers do: the answer is cut before the first one the text
contains; OpenAI's wire says only finish_reason "stop", Anthropic's says stop_reason "stop_sequence"
and which one matched. On the OpenAI wire max_tokens (or max_completion_tokens) is honoured too: a
reply longer than it is cut there, billed that many tokens and ends with finish_reason "length".

It is the only stand-in the project allows (no real provider is reachable from CI). Behaviour is
set per upstream model name — latency, error status (always or the first N calls), streaming
chunk delay, a mid-stream drop, reported token counts (cached and reasoning tokens among them), a
tool call (alone or after some text, with or without an id, its arguments in one chunk or in
pieces), and misbehaviour (a raw body such as a truncated JSON or a 200 error object, empty
`choices`, a stream that stalls, ends without [DONE], carries a malformed event or a running usage
count on every chunk) — in-process through `FakeUpstream.behave()` or over HTTP
(`POST /_control/behaviour`) when it runs as its own process:

    python -m tests.fakes.upstream --port 9100 --latency-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import math
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULT_TEXT = "Hello from the test upstream."
HOLD_GUARD_S = 120.0  # a held call is answered after this at the latest: only against a hung test
ECHO = "__echo__"


@dataclass
class Behaviour:
    latency_s: float = 0.0  # before the response, or before the first streamed chunk
    status: int | None = None  # answer with this error status instead of a completion
    fail_times: int | None = None  # with status: fail only the first N calls (None: every call)
    retry_after_s: float | None = None  # sent as retry-after with a 429
    text: str = DEFAULT_TEXT  # the completion; ECHO repeats the last user message
    chunk_delay_s: float = 0.0  # between streamed chunks
    drop_after_chunks: int | None = None  # stream: cut the connection after N content chunks
    prompt_tokens: int | None = None  # reported usage; None counts words
    completion_tokens: int | None = None
    # reported in OpenAI's usage details (the OpenAI wire, plain and streamed), as OpenAI sends them:
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens (part of prompt_tokens)
    reasoning_tokens: int | None = None  # completion_tokens_details.reasoning_tokens
    # {"name": ..., "arguments": "..."} when tools are sent; an "id" key replaces the made-up call id
    # (None: the call carries no id, as some servers send it)
    tool_call: dict[str, Any] | None = None
    preamble: str | None = None  # with a tool call: text answered (streamed) before it, as models do
    arguments_chunk_chars: int | None = None  # stream a tool call's arguments in pieces (OpenAI's way)
    replies: dict[str, str] | None = None  # substring of the last user message -> text (first match wins)
    stream_usage: bool = True  # False: ignore stream_options.include_usage, as llama.cpp's server does
    context_window: int | None = None  # prompt words + max_tokens above this: OpenAI's (and llama.cpp's) 400
    finish_reason: str | None = None  # e.g. "length" (cut at max_tokens); None: "stop" or "tool_calls"
    ignore_stop: bool = False  # True: write past OpenAI's `stop` sequences, as some local servers do
    embedding_dimensions: int = 8  # /v1/embeddings: the vector size when the request sets no `dimensions`
    # ---- misbehaviour on the OpenAI wire (tests/test_worker_faults_*.py) ----
    # answer 200 with exactly this body instead of a completion (a truncated JSON, an error object, ...);
    # for a streamed request it is the whole event stream, sent as it is
    raw_body: str | None = None
    raw_media_type: str | None = None  # raw_body's content type (None: JSON, or SSE for a stream request)
    empty_choices: bool = False  # a 200 completion (or stream) whose `choices` is empty
    stall_after_chunks: int | None = None  # stream: after N content chunks send nothing more, ever
    # stream: end the body cleanly after N content chunks (no [DONE]; on Anthropic's wire, no
    # message_delta and no message_stop)
    end_after_chunks: int | None = None
    inject_after_chunks: int | None = None  # stream: after N content chunks write `inject` into the stream
    usage_every_chunk: bool = False  # stream: the running usage on every chunk (as some providers send it)
    inject: str = ""  # raw SSE text (e.g. "data: {not json\n\n" or an error event), then the stream goes on
    calls: int = field(default=0, repr=False)


def fake_embedding(item: str | list[int], size: int) -> list[float]:
    """The test upstream's vector for one input: deterministic, unit length, float32-exact."""
    key = item if isinstance(item, str) else ",".join(map(str, item))
    raw = []
    for j in range(size):
        digest = hashlib.sha256(f"{key}|{j}".encode()).digest()
        raw.append(int.from_bytes(digest[:4], "little") / 2**31 - 1.0)
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [struct.unpack("<f", struct.pack("<f", x / norm))[0] for x in raw]


def _words(text: str) -> list[str]:
    parts = text.split(" ")
    return [p + (" " if i < len(parts) - 1 else "") for i, p in enumerate(parts)]


def _logprobs(text: str | None) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs` for ``text``: one entry per word (the fake's token), a made-up
    but deterministic log probability each."""
    words = _words(text or "") if text else []
    return {
        "content": [
            {"token": w, "logprob": round(-0.01 * (i + 1), 4), "bytes": list(w.encode()), "top_logprobs": []}
            for i, w in enumerate(words)
        ],
        "refusal": None,
    }


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _cut_at_stop(text: str, stops: Any) -> tuple[str, str | None]:
    """The text up to the first stop sequence it contains (where the model would have stopped), and
    that sequence; (text, None) when it contains none."""
    if isinstance(stops, str):
        stops = [stops]
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops or () if s and s in text]
    if not found:
        return text, None
    _, start, stop = min(found)
    return text[:start], stop


def _finish(behaviour: Behaviour, tool_call: dict[str, Any] | None, cut: bool = False) -> str:
    if cut:
        return "length"
    return behaviour.finish_reason or ("tool_calls" if tool_call else "stop")


def _output_limit(body: dict[str, Any]) -> int | None:
    """The request's max_completion_tokens / max_tokens: a provider never writes (nor bills) more."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(limit) if limit else None


def _anthropic_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _anthropic_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts = []
    for block in content or []:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif isinstance(block, dict) and block.get("type") == "tool_result":
            texts.extend(_anthropic_texts(block.get("content")))
    return texts


def _anthropic_last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            return " ".join(_anthropic_texts(message.get("content")))
    return ""


def _anthropic_prompt_words(body: dict[str, Any]) -> int:
    words = sum(len(t.split()) for t in _anthropic_texts(body.get("system")))
    for message in body.get("messages") or []:
        words += sum(len(t.split()) for t in _anthropic_texts(message.get("content")))
    return max(words, 1)


def _prompt_word_count(body: dict[str, Any]) -> int:
    total = 0
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content.split())
    return max(total, 1)


def _responses_texts(content: Any) -> list[str]:
    """The texts of a Responses input item's content (a string, or input_text parts)."""
    if isinstance(content, str):
        return [content]
    return [
        part["text"] for part in content or [] if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]


def _responses_last_user_text(body: dict[str, Any]) -> str:
    items = body.get("input")
    if isinstance(items, str):
        return items
    for item in reversed(items or []):
        if isinstance(item, dict) and item.get("role") == "user":
            return " ".join(_responses_texts(item.get("content")))
    return ""


def _responses_prompt_words(body: dict[str, Any]) -> int:
    items = body.get("input")
    texts = [items] if isinstance(items, str) else []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict):
            texts += _responses_texts(item.get("content"))
    texts += [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    return max(sum(len(t.split()) for t in texts), 1)


class FakeUpstream:
    """State and ASGI app of the test upstream."""

    def __init__(self, default: Behaviour | None = None) -> None:
        self.default = default or Behaviour()
        self.behaviours: dict[str, Behaviour] = {}
        self.requests: deque[dict[str, Any]] = deque(maxlen=2000)
        # the HTTP headers of each recorded request, in the same order (e.g. the traceparent sent)
        self.headers: deque[dict[str, str]] = deque(maxlen=2000)
        # (model, arrived, answered) per chat request, monotonic clock: which calls were in flight at once
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=2000)
        self.generation = 0  # resets so far: a span is kept only if no reset came between its ends
        # models of the streams that stopped before their end because the client went away (or the
        # stream stalled and was given up): the gateway cancelled its worker call
        self.abandoned: deque[str] = deque(maxlen=2000)
        self.held: dict[str, threading.Event] = {}  # models whose calls wait until the test releases them
        self.hold_after: dict[str, int] = {}  # a held model's calls still to answer at once (`hold`)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),  # OpenAI's embeddings wire
                Route("/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/messages", self._messages, methods=["POST"]),  # Anthropic's wire
                Route("/v1/responses", self._responses, methods=["POST"]),  # OpenAI's Responses wire
                Route("/responses", self._responses, methods=["POST"]),
                Route("/_control/behaviour", self._control_behaviour, methods=["POST"]),
                Route("/_control/reset", self._control_reset, methods=["POST"]),
                Route("/_control/requests", self._control_requests, methods=["GET"]),
            ]
        )

    # ---- configuration -------------------------------------------------------------------
    def behave(self, model: str, **settings: Any) -> Behaviour:
        behaviour = Behaviour(**settings)
        self.behaviours[model] = behaviour
        return behaviour

    def hold(self, model: str, after: int = 0) -> threading.Event:
        """Hold `model`'s chat (and embeddings) calls until the returned event is set: a call has
        arrived (it is in `requests`) and is not answered yet, so a change the test makes meanwhile
        lands between that step and the next, whatever the machine's load. The first `after` calls
        are answered at once (e.g. a failure, then its retry held). `reset` releases every hold."""
        self.held[model] = threading.Event()
        self.hold_after[model] = after
        return self.held[model]

    def release_all(self) -> None:
        for gate in self.held.values():
            gate.set()
        self.held.clear()
        self.hold_after.clear()

    def reset(self) -> None:
        self.release_all()
        self.generation += 1  # a call still in flight from before the reset is not recorded after it
        self.behaviours.clear()
        self.requests.clear()
        self.spans.clear()
        self.headers.clear()
        self.abandoned.clear()

    def requests_for(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("model") == model]

    def headers_for(self, model: str) -> list[dict[str, str]]:
        """The headers of the requests for `model`, in order."""
        return [h for r, h in zip(self.requests, self.headers, strict=False) if r.get("model") == model]

    def _behaviour(self, model: str) -> Behaviour:
        return self.behaviours.get(model, self.default)

    # ---- the OpenAI endpoints -------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.behaviours]
        return JSONResponse({"object": "list", "data": data})

    async def _chat(self, request: Request) -> Response:
        arrived, generation = time.monotonic(), self.generation
        received = await self._received(request)
        if isinstance(received, Response):
            return received
        body, model = received
        try:
            return await self._answer(body, model)
        finally:
            if generation == self.generation:  # not a previous test's call that outlived its reset
                self.spans.append((model, arrived, time.monotonic()))

    async def _received(self, request: Request) -> tuple[dict[str, Any], str] | Response:
        """An OpenAI-wire request's body and model, recorded (`requests`, `headers`); the 400 for a
        body that is not JSON."""
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return JSONResponse({"error": {"message": "bad json", "type": "invalid_request_error"}}, 400)
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        return body, str(body.get("model", ""))

    async def _called(self, model: str) -> tuple[Behaviour, Response | None]:
        """A call of `model` on the OpenAI wire, once its hold (`hold`) and latency are over: its
        behaviour, the call counted, and the error answer when the behaviour fails this call."""
        await self._held(model)
        behaviour = self._behaviour(model)
        behaviour.calls += 1
        if behaviour.latency_s:
            await asyncio.sleep(behaviour.latency_s)
        if behaviour.status and (behaviour.fail_times is None or behaviour.calls <= behaviour.fail_times):
            headers = {}
            if behaviour.retry_after_s is not None:
                headers["retry-after"] = str(behaviour.retry_after_s)
            error = {"message": f"fake upstream error {behaviour.status}", "type": "server_error"}
            return behaviour, JSONResponse({"error": error}, behaviour.status, headers=headers)
        return behaviour, None

    async def _held(self, model: str) -> None:
        """Wait while `model`'s calls are held (`hold`)."""
        if (gate := self.held.get(model)) is not None:
            if self.hold_after.get(model, 0) > 0:
                self.hold_after[model] -= 1
            else:
                await asyncio.to_thread(gate.wait, HOLD_GUARD_S)

    async def _answer(self, body: dict[str, Any], model: str) -> Response:
        behaviour, refused = await self._called(model)
        if refused is not None:
            return refused
        if behaviour.raw_body is not None:
            media = behaviour.raw_media_type or (
                "text/event-stream" if body.get("stream") else "application/json"
            )
            return Response(behaviour.raw_body.encode(), 200, media_type=media)
        requested = _prompt_word_count(body) + int(body.get("max_tokens") or 0)
        if behaviour.context_window is not None and requested > behaviour.context_window:
            error = {
                "message": f"This model's maximum context length is {behaviour.context_window} tokens. "
                f"However, you requested {requested} tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            return JSONResponse({"error": error}, 400)

        text = _last_user_text(body) if behaviour.text == ECHO else behaviour.text
        for needle, reply in (behaviour.replies or {}).items():
            if needle in _last_user_text(body):
                text = reply
                break
        text, stopped = _cut_at_stop(text, None if behaviour.ignore_stop else body.get("stop"))
        prompt_tokens = behaviour.prompt_tokens or _prompt_word_count(body)
        completion_tokens = behaviour.completion_tokens or len(text.split()) or 1
        limit = _output_limit(body)
        cut = limit is not None and completion_tokens > limit
        if cut:  # as a provider does: stop at max_tokens, bill that many, say "length"
            completion_tokens = limit
            if len(text.split()) > limit:
                text = " ".join(text.split()[:limit])
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if behaviour.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": behaviour.cached_tokens}
        if behaviour.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": behaviour.reasoning_tokens}
        tool_call = None
        if behaviour.tool_call and body.get("tools") and stopped is None:
            tool_call = {
                "id": behaviour.tool_call.get("id", "call_" + uuid.uuid4().hex[:12]),
                "type": "function",
                "function": {
                    "name": behaviour.tool_call["name"],
                    "arguments": behaviour.tool_call.get("arguments", "{}"),
                },
            }
            if tool_call["id"] is None:
                del tool_call["id"]
        completion_id = "chatcmpl-" + uuid.uuid4().hex[:20]
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(
                self._stream(body, behaviour, completion_id, created, text, usage, tool_call, cut),
                media_type="text/event-stream",
            )
        content = behaviour.preamble if tool_call else text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_call:
            message["tool_calls"] = [tool_call]
        choices = [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(content) if body.get("logprobs") and not tool_call else None,
                "finish_reason": _finish(behaviour, tool_call, cut),
            }
        ]
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [] if behaviour.empty_choices else choices,
                "usage": usage,
            }
        )

    async def _stream(self, body, behaviour, completion_id, created, text, usage, tool_call, cut=False):
        """The event stream; a stream the client leaves before its end is recorded in `abandoned`."""
        events = self._events(body, behaviour, completion_id, created, text, usage, tool_call, cut)
        try:
            async for piece in events:
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.abandoned.append(str(body.get("model")))
            raise
        finally:
            await events.aclose()

    async def _events(self, body, behaviour, completion_id, created, text, usage, tool_call, cut=False):
        model = body.get("model")

        def bare(**extra: Any) -> bytes:  # a chunk with no choices (e.g. the usage chunk)
            payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created}
            return b"data: " + orjson.dumps({**payload, "model": model, "choices": [], **extra}) + b"\n\n"

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            return bare(choices=[{"index": 0, "delta": delta, "finish_reason": finish}], **extra)

        if behaviour.empty_choices:  # no choice at all: an empty chunk, the usage if asked, [DONE]
            yield bare()
            if (body.get("stream_options") or {}).get("include_usage"):
                yield bare(usage=usage)
            yield b"data: [DONE]\n\n"
            return
        yield chunk({"role": "assistant", "content": ""})
        if tool_call and behaviour.preamble:
            for word in _words(behaviour.preamble):
                yield chunk({"content": word})
        if tool_call and behaviour.arguments_chunk_chars:
            arguments, size = tool_call["function"]["arguments"], behaviour.arguments_chunk_chars
            named = {**tool_call, "function": {**tool_call["function"], "arguments": ""}}
            yield chunk({"tool_calls": [{"index": 0, **named}]})
            for start in range(0, len(arguments), size):
                piece = {"index": 0, "function": {"arguments": arguments[start : start + size]}}
                yield chunk({"tool_calls": [piece]})
        elif tool_call:
            yield chunk({"tool_calls": [{"index": 0, **tool_call}]})
        else:
            for i, word in enumerate(_words(text)):
                if behaviour.drop_after_chunks is not None and i >= behaviour.drop_after_chunks:
                    raise ConnectionResetError("fake upstream dropped the stream")
                if behaviour.inject_after_chunks == i:
                    yield behaviour.inject.encode()
                if behaviour.end_after_chunks == i:
                    return  # the body ends here, cleanly: no finish chunk, no [DONE]
                if behaviour.stall_after_chunks == i:
                    await asyncio.Event().wait()  # until the client goes away (which cancels this)
                if behaviour.chunk_delay_s:
                    await asyncio.sleep(behaviour.chunk_delay_s)
                if behaviour.usage_every_chunk:  # the running count, as Gemini's OpenAI layer sends it
                    so_far = {
                        **usage,
                        "completion_tokens": i + 1,
                        "total_tokens": usage["prompt_tokens"] + i + 1,
                    }
                    yield chunk({"content": word}, usage=so_far)
                else:
                    yield chunk({"content": word})
        yield chunk({}, _finish(behaviour, tool_call, cut))
        if behaviour.stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            yield bare(usage=usage)
        yield b"data: [DONE]\n\n"

    # ---- Anthropic's Messages wire (workers with provider anthropic, called through litellm) -------
    async def _messages(self, request: Request) -> Response:
        """The same behaviours, answered as Anthropic's API does (JSON, or its event stream).

        Only models given a behaviour (`behave`) exist here; any other is Anthropic's 404 for an
        unknown model, and is not recorded: tests that call an anthropic worker without setting it
        up still see nothing answer."""
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return JSONResponse(_anthropic_error("invalid_request_error", "bad json"), 400)
        model = str(body.get("model", ""))
        if model not in self.behaviours:
            return JSONResponse(_anthropic_error("not_found_error", f"model: {model}"), 404)
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        behaviour = self._behaviour(model)
        behaviour.calls += 1
        if behaviour.latency_s:
            await asyncio.sleep(behaviour.latency_s)
        if behaviour.status and (behaviour.fail_times is None or behaviour.calls <= behaviour.fail_times):
            message = f"fake upstream error {behaviour.status}"
            return JSONResponse(_anthropic_error("api_error", message), behaviour.status)
        last = _anthropic_last_user_text(body)
        text = last if behaviour.text == ECHO else behaviour.text
        for needle, reply in (behaviour.replies or {}).items():
            if needle in last:
                text = reply
                break
        text, stopped = _cut_at_stop(text, body.get("stop_sequences"))
        use = None
        if behaviour.tool_call and body.get("tools") and stopped is None:
            arguments = orjson.loads(behaviour.tool_call.get("arguments", "{}"))
            use = {
                "type": "tool_use",
                "id": "toolu_" + uuid.uuid4().hex[:12],
                "name": behaviour.tool_call["name"],
            }
            use["input"] = arguments
        stop = {"length": "max_tokens", "tool_calls": "tool_use"}.get(
            behaviour.finish_reason or "", "end_turn"
        )
        stop = "tool_use" if use else ("stop_sequence" if stopped else stop)
        input_tokens = behaviour.prompt_tokens or _anthropic_prompt_words(body)
        output_tokens = behaviour.completion_tokens or len(text.split()) or 1
        message_id = "msg_" + uuid.uuid4().hex[:20]
        if body.get("stream"):
            return StreamingResponse(
                self._messages_stream(
                    behaviour, message_id, model, text, use, stop, stopped, input_tokens, output_tokens
                ),
                media_type="text/event-stream",
            )
        return JSONResponse(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [use] if use else [{"type": "text", "text": text}],
                "stop_reason": stop,
                "stop_sequence": stopped,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            }
        )

    async def _messages_stream(
        self, behaviour, message_id, model, text, use, stop, stopped, input_tokens, output_tokens
    ):
        def event(payload: dict[str, Any]) -> bytes:
            return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        start = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": []}
        start |= {"stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": input_tokens, "output_tokens": 1}
        yield event({"type": "message_start", "message": start})
        if use:
            block = {**use, "input": {}}
            yield event({"type": "content_block_start", "index": 0, "content_block": block})
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(use["input"]).decode()}
            yield event({"type": "content_block_delta", "index": 0, "delta": delta})
        else:
            yield event(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            )
            for i, word in enumerate(_words(text)):
                if behaviour.drop_after_chunks is not None and i >= behaviour.drop_after_chunks:
                    raise ConnectionResetError("fake upstream dropped the stream")
                if behaviour.end_after_chunks == i:
                    return  # the body ends here, cleanly: no message_delta, no message_stop
                if behaviour.chunk_delay_s:
                    await asyncio.sleep(behaviour.chunk_delay_s)
                delta = {"type": "text_delta", "text": word}
                yield event({"type": "content_block_delta", "index": 0, "delta": delta})
        yield event({"type": "content_block_stop", "index": 0})
        yield event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": stopped},
                "usage": {"output_tokens": output_tokens},
            }
        )
        yield event({"type": "message_stop"})

    # ---- OpenAI's Responses wire (workers litellm's chat call bridges to /v1/responses) -----------
    async def _responses(self, request: Request) -> Response:
        """The same behaviours, answered as OpenAI's Responses API does (JSON, or its typed events):
        the text as one `message` output item, `usage` as input/output tokens. A finish_reason
        "length" is an `incomplete` response (max_output_tokens); `stream_usage=False` leaves
        `usage` out of `response.completed`; `drop_after_chunks` / `end_after_chunks` cut the stream
        after N text deltas (a reset, or a body that ends with no `response.completed`)."""
        received = await self._received(request)
        if isinstance(received, Response):
            return received
        body, model = received
        behaviour, refused = await self._called(model)
        if refused is not None:
            return refused
        last = _responses_last_user_text(body)
        text = last if behaviour.text == ECHO else behaviour.text
        for needle, reply in (behaviour.replies or {}).items():
            if needle in last:
                text = reply
                break
        usage = {
            "input_tokens": behaviour.prompt_tokens or _responses_prompt_words(body),
            "input_tokens_details": {"cached_tokens": behaviour.cached_tokens or 0},
            "output_tokens": behaviour.completion_tokens or len(text.split()) or 1,
            "output_tokens_details": {"reasoning_tokens": behaviour.reasoning_tokens or 0},
        }
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        response_id = "resp_" + uuid.uuid4().hex[:20]
        item_id = "msg_" + uuid.uuid4().hex[:20]
        incomplete = behaviour.finish_reason == "length"
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {
            "type": "message",
            "id": item_id,
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        answer = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"),
            "model": model,
            "output": [item],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage,
        }
        if body.get("stream"):
            return StreamingResponse(
                self._responses_stream(body, behaviour, answer, text), media_type="text/event-stream"
            )
        return JSONResponse(answer)

    async def _responses_stream(self, body, behaviour, answer, text):
        """The Responses API's event stream; one the client leaves early is recorded in `abandoned`."""
        sequence = 0

        def event(payload: dict[str, Any]) -> bytes:
            nonlocal sequence
            payload = {**payload, "sequence_number": sequence}
            sequence += 1
            return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        item = answer["output"][0]
        opened = {**answer, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        try:
            yield event({"type": "response.created", "response": opened})
            yield event({"type": "response.in_progress", "response": opened})
            added = {**item, "status": "in_progress", "content": []}
            yield event({"type": "response.output_item.added", "output_index": 0, "item": added})
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield event({"type": "response.content_part.added", **where, "part": empty})
            for i, word in enumerate(_words(text)):
                if behaviour.drop_after_chunks is not None and i >= behaviour.drop_after_chunks:
                    raise ConnectionResetError("fake upstream dropped the stream")
                if behaviour.end_after_chunks == i:
                    return  # the body ends here, cleanly: no response.completed
                if behaviour.stall_after_chunks == i:
                    await asyncio.Event().wait()  # until the client goes away (which cancels this)
                if behaviour.chunk_delay_s:
                    await asyncio.sleep(behaviour.chunk_delay_s)
                yield event({"type": "response.output_text.delta", **where, "delta": word, "logprobs": []})
            yield event({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
            yield event({"type": "response.content_part.done", **where, "part": item["content"][0]})
            yield event({"type": "response.output_item.done", "output_index": 0, "item": item})
            final = answer if behaviour.stream_usage else {**answer, "usage": None}
            kind = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
            yield event({"type": kind, "response": final})
        except (asyncio.CancelledError, GeneratorExit):
            self.abandoned.append(str(body.get("model")))
            raise

    # ---- OpenAI's embeddings wire (embedding workers called through litellm.aembedding) -----------
    async def _embeddings(self, request: Request) -> Response:
        """One deterministic unit vector per input (`fake_embedding`), `dimensions` honoured, float or
        base64 (little-endian float32) as asked; usage counts words (a token array: its length)."""
        received = await self._received(request)
        if isinstance(received, Response):
            return received
        body, model = received
        behaviour, refused = await self._called(model)
        if refused is not None:
            return refused
        inputs = body.get("input")
        if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
            inputs = [inputs]
        if not inputs:
            error = {"message": "'$.input' is invalid.", "type": "invalid_request_error", "param": None}
            return JSONResponse({"error": error}, 400)
        size = int(body.get("dimensions") or behaviour.embedding_dimensions)
        data = []
        for i, item in enumerate(inputs):
            vector = fake_embedding(item, size)
            if body.get("encoding_format") == "base64":
                embedding: Any = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode("ascii")
            else:
                embedding = vector
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = behaviour.prompt_tokens or sum(
            len(item) if isinstance(item, list) else max(1, len(str(item).split())) for item in inputs
        )
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})

    # ---- control over HTTP (when the upstream runs as its own process) -------------------
    async def _control_behaviour(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        model = body.pop("model")
        allowed = {f.name for f in fields(Behaviour)} - {"calls"}
        unknown = set(body) - allowed
        if unknown:
            return JSONResponse({"error": f"unknown settings: {sorted(unknown)}"}, 400)
        return JSONResponse(asdict(self.behave(model, **body)))

    async def _control_reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"ok": True})

    async def _control_requests(self, request: Request) -> Response:
        return JSONResponse(list(self.requests))


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="OpenAI-compatible test upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()
    upstream = FakeUpstream(Behaviour(latency_s=args.latency_ms / 1000))
    uvicorn.run(upstream.app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
