"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same pipeline.

A Messages request is validated here (Anthropic's shape, strictly: unknown fields are a 400), then
translated into the internal chat-completions request by litellm's own adapter
(`LiteLLMAnthropicMessagesAdapter.translate_anthropic_to_openai`) and served by `completions.serve`:
keys, rate limits, memory, data class and policy, routing (auto, aliases, pinned workers), budgets
with reservation, fallback, ledger, metrics and headers are those of chat completions, not copies.
Plain answers go back through litellm's adapter too (`translate_openai_response_to_anthropic`); the
event stream is written by gateway/anthropic_stream.py (litellm's `AnthropicStreamWrapper` cost
~115 µs a chunk). What litellm lacked, written here: the request's validation,
Anthropic-format errors (JSON and the SSE `error` event), the message id, polyroute's metadata keys
and cost on the answer, the token count's endpoint, plain-text document blocks (the adapter drops
them), and stop sequences with the stop_reason that names them (gateway/stop_sequences.py: sent to
the worker by default and cut here as well, or kept and cut here only). See docs/anthropic.md.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import litellm
import orjson
from litellm.llms.anthropic.pass_through.adapters.transformation import LiteLLMAnthropicMessagesAdapter
from litellm.types.utils import ModelResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from gateway import compose, ratelimits, tracing
from gateway.anthropic_stream import AnthropicStream, event_batches
from gateway.body import heavy_if, is_large, read_json_object, validate
from gateway.completions import AUTO, EventStream, TranslatingWire, model_names, serve
from gateway.errors import APIError, JSONResponse
from gateway.schemas import ChatCompletionRequest
from gateway.state import AppState
from gateway.stop_sequences import StopScan, cut_completion

log = logging.getLogger("polyroute.gateway")

# Anthropic's error type for each HTTP status (docs.anthropic.com "Errors"); others by class.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}

# Accepted (clients such as Claude Code send them) but not forwarded: no OpenAI-form equivalent
# every worker understands. Named back in x-polyroute-ignored.
IGNORED = (
    "top_k",
    "thinking",
    "service_tier",
    "context_management",
    "container",
    "mcp_servers",
    "cache_control",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
)
# Block types a message may hold; anything else is refused before a worker sees it.
BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")
IGNORED_HEADER = "x-polyroute-ignored"
COUNTER_HEADER = "x-polyroute-token-counter"
DEFAULT_COUNTER = "litellm default (tiktoken cl100k_base)"


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(err: APIError, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": error_type(err.status), "message": err.message},
    }
    if request_id:
        body["request_id"] = request_id
    if err.code or err.param:  # polyroute's precise reason (e.g. policy_denied, budget_exceeded)
        body["polyroute"] = {"code": err.code, "param": err.param}
    return body


def error_response(err: APIError) -> JSONResponse:
    request_id = err.headers.get("x-polyroute-request-id")
    headers = {**err.headers, **({"request-id": request_id} if request_id else {})}
    return JSONResponse(error_body(err, request_id), status_code=err.status, headers=headers)


# ---- the request, validated in Anthropic's shape ---------------------------------------------------
class Block(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str

    @model_validator(mode="after")
    def _known(self) -> Block:
        if self.type not in BLOCK_TYPES:
            raise ValueError(f"content block type {self.type!r} is not supported (use one of {BLOCK_TYPES})")
        extra = self.model_extra or {}
        required = {
            "text": ("text",),
            "image": ("source",),
            "document": ("source",),
            "tool_use": ("id", "name", "input"),
            "tool_result": ("tool_use_id",),
        }.get(self.type, ())
        missing = [name for name in required if name not in extra]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        if self.type == "text" and not isinstance(extra["text"], str):
            raise ValueError("a text block's text must be a string")
        if self.type == "tool_use" and not isinstance(extra["input"], dict):
            raise ValueError("a tool_use block's input must be an object")
        return self


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a name")
        return self


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format becomes response_format; effort is not sent
    output_format: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None


def document_text(block: dict[str, Any]) -> str | None:
    """The text of a document block whose source is plain text (`text`, or `content` given inline),
    with its title and context; None for other sources (base64 and URL files: litellm's adapter
    sends those as files)."""
    source = block.get("source") or {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), str):
        text = source["content"]
    elif source.get("type") == "content" and isinstance(source.get("content"), list):
        parts = source["content"]
        text = "\n\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        return None
    return "\n\n".join(
        p for p in (block.get("title"), block.get("context"), text) if isinstance(p, str) and p
    )


def with_plain_documents(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain-text document blocks as text blocks: litellm's adapter drops them (it sends only file
    sources), so their text reached neither the worker nor the data-class detection."""
    out = []
    for block in blocks:
        if block.get("type") == "document" and (text := document_text(block)) is not None:
            block = {"type": "text", "text": text}
        elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            block = {**block, "content": with_plain_documents(block["content"])}
        out.append(block)
    return out


def translate(body: CountTokensRequest) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The chat-completions form of a Messages request, through litellm's adapter: (chat fields,
    truncated tool name -> original name, the parameters accepted but not forwarded)."""
    data = body.model_dump(exclude_none=True)
    ignored = [name for name in IGNORED if data.pop(name, None) is not None]
    if "effort" in (data.get("output_config") or {}):
        ignored.append("output_config.effort")
    metadata = dict(data.pop("metadata", None) or {})
    user = metadata.pop("user_id", None)
    stream = data.pop("stream", False)
    for message in data["messages"]:
        if isinstance(message["content"], list):
            message["content"] = with_plain_documents(message["content"])
    try:
        chat, mapping = LiteLLMAnthropicMessagesAdapter().translate_anthropic_to_openai(
            anthropic_message_request=data  # type: ignore[arg-type]
        )
    except Exception as exc:  # a block litellm cannot translate (e.g. an image source it does not know)
        log.debug("litellm could not translate a Messages request", exc_info=True)
        raise APIError(400, f"This request cannot be translated for the workers: {exc}") from None
    chat = dict(chat)
    for message in chat["messages"]:
        # earlier thinking (signed, Anthropic's): `thinking` is not sent, and some OpenAI-wire servers
        # refuse reasoning_content in a request
        message.pop("thinking_blocks", None)
        message.pop("reasoning_content", None)
        for key in [k for k, v in message.items() if v is None]:
            del message[key]
    fields = ChatCompletionRequest.model_fields
    # what litellm made of the rest that the internal request does not carry (e.g. a web search tool's
    # web_search_options): named back too
    ignored += sorted(k for k in chat if k not in fields)
    chat = {k: v for k, v in chat.items() if k in fields}
    if user is not None:
        chat["user"] = str(user)
    if metadata:  # polyroute's keys: data_class, cost_weight, min_quality, collections, session_id...
        chat["metadata"] = metadata
    if stream:
        # the usage chunk closes Anthropic's message_delta; the gateway asks the worker for it anyway
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, mapping, ignored


# ---- the answer, written in Anthropic's shape --------------------------------------------------------
def anthropic_message(body: dict[str, Any], mapping: dict[str, str], message_id: str) -> dict[str, Any]:
    """A chat completion (the worker's, or a cached or composed one) as a Messages answer."""
    extra = body.get("polyroute")
    plain = {k: v for k, v in body.items() if k != "polyroute"}
    answer = dict(
        LiteLLMAnthropicMessagesAdapter().translate_openai_response_to_anthropic(
            ModelResponse(**plain), tool_name_mapping=mapping
        )
    )
    answer["id"] = message_id
    answer["usage"] = dict(answer.get("usage") or {})
    if answer.get("stop_details") is None:
        answer.pop("stop_details", None)
    if extra:
        answer["polyroute"] = extra
    return answer


def sse_event(event: dict[str, Any]) -> bytes:
    return (
        b"event: " + str(event.get("type", "message")).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
    )


class AnthropicWire(TranslatingWire):
    """Reads a Messages request; writes answers, event streams and errors as Anthropic's API does.
    One per request: it keeps the request's tool-name mapping and message id."""

    def __init__(self) -> None:
        self.mapping: dict[str, str] = {}
        self.ignored: list[str] = []
        self.message_id = "msg_" + uuid.uuid4().hex
        self.stops: list[str] = []  # stop_sequences, cut here too (gateway/stop_sequences.py)
        self.kept: tuple[str, ...] = ()  # those not sent to the worker ("gateway" mode)

    async def read(self, request: Request, state: AppState) -> ChatCompletionRequest:
        data = await read_json_object(request, state.settings.max_body_bytes)
        body = await heavy_if(is_large(request), validate, MessagesRequest, data)
        chat, self.mapping, self.ignored = await heavy_if(is_large(request), translate, body)
        self.stops = [s for s in body.stop_sequences or () if s]
        if state.settings.messages_stop_sequences == "gateway":
            chat.pop("stop", None)  # kept here: cut and named by the gateway (gateway/stop_sequences.py)
            self.kept = tuple(self.stops)
        # "forward": the worker gets them as `stop`; the cut here still catches a worker that ignores them
        return await heavy_if(is_large(request), validate, ChatCompletionRequest, chat)

    def policy_texts(self) -> tuple[str, ...]:
        return self.kept  # forwarded ones are in the request as `stop`, classified with it

    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        if request_id := headers.get("x-polyroute-request-id"):
            out["request-id"] = request_id
            self.message_id = "msg_" + request_id.removeprefix("req_")
        if self.ignored:
            out[IGNORED_HEADER] = ",".join(self.ignored)
        return out

    def error(self, err: APIError) -> Response:
        return error_response(err)

    def answer(self, body: dict, headers: dict[str, str], background: BackgroundTask | None) -> Response:
        headers = self._headers(headers)
        body, matched = cut_completion(body, self.stops) if self.stops else (body, None)
        message = anthropic_message(body, self.mapping, self.message_id)
        if matched is not None:
            message["stop_reason"], message["stop_sequence"] = "stop_sequence", matched
        return JSONResponse(message, headers=headers, background=background)

    def cached(self, body: bytes, headers: dict[str, str]) -> Response:
        return self.answer(orjson.loads(body), headers, None)

    async def frames(
        self, chunks: AsyncIterator[dict], worker: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """Anthropic's events, written by gateway/anthropic_stream.py: message_start,
        content_block_start/delta/stop per block, message_delta (stop_reason, stop_sequence, usage,
        polyroute's cost), message_stop. The events one read of the worker makes go out in one write.
        Stop sequences cut the chunks before they are translated; message_delta then names the one."""
        stops = StopScan(self.stops)
        source = stops.scan(chunks) if self.stops else chunks
        stream = AnthropicStream(self.message_id, worker, self.mapping, lambda: stops.matched)
        async for batch in event_batches(source, stream):
            yield b"".join([sse_event(event) for event in batch])

    def error_event(self, message: str, code: str) -> bytes:
        return sse_event(error_body(APIError(502, message, type="server_error", code=code)))

    def done(self) -> bytes:
        return b""  # message_stop closed the stream (an error event ends it as Anthropic's does)

    def stream(self, body: AsyncIterator[bytes], headers: dict[str, str]) -> Response:
        return EventStream(body, media_type="text/event-stream", headers=self._headers(headers))


async def messages(request: Request) -> Response:
    """POST /v1/messages: the Anthropic Messages API, served by the chat-completions pipeline."""
    try:
        return await serve(request, AnthropicWire())
    except APIError as err:  # raised outside the pipeline's own handling
        return error_response(err)
    except Exception:
        log.exception("unhandled error on POST /v1/messages")
        return error_response(APIError(500, "internal error in the gateway", type="server_error"))


@tracing.traced  # a SERVER span like every endpoint's (nothing when tracing is off)
async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": N}. Counted with litellm's token counter for
    the named worker's model; for auto, an alias or a workflow (the worker is not chosen yet), with
    litellm's default tokenizer. The counter used is named in x-polyroute-token-counter. Authenticated
    and rate limited (one request, no tokens) like any call; nothing is sent to a worker."""
    state: AppState = request.app.state.polyroute
    engine = state.policy.engine
    try:
        key = await state.auth.client(request)
        data = await read_json_object(request, state.settings.max_body_bytes)
        body = await heavy_if(is_large(request), validate, CountTokensRequest, data)
        compose.checked_workflow(body.model, "not_found_error")  # as /v1/messages checks it
        model = AUTO if body.model.startswith(compose.PREFIX) else body.model
        worker = state.catalog.get(model)
        aliases = engine.policy.aliases if engine is not None else {}
        if worker is None and model != AUTO and model not in aliases:
            names = model_names(state, aliases)
            raise APIError(
                404,
                f"The model '{body.model}' does not exist. Use one of: {', '.join(names)}",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )
        limits = ratelimits.limits_under(engine, key, 0)
        headers = await ratelimits.enforce(state.stores.limiter, state.metrics, key.tenant, limits)
        chat, _, _ = translate(body)
        counted = await heavy_if(is_large(request), _count, worker.model if worker else None, chat)
    except APIError as err:
        state.metrics.errors.labels(err.code or err.type).inc()
        return error_response(err)
    headers[COUNTER_HEADER] = worker.model if worker else DEFAULT_COUNTER
    return JSONResponse({"input_tokens": counted}, headers=headers)


def _count(model: str | None, chat: dict[str, Any]) -> int:
    kwargs: dict[str, Any] = {"messages": chat["messages"]}
    if chat.get("tools"):
        kwargs["tools"] = chat["tools"]
    try:
        return litellm.token_counter(model=model or "", **kwargs)
    except Exception:  # no tokenizer for this model: the default one
        log.debug("no tokenizer for %s; counting with the default", model, exc_info=True)
        return litellm.token_counter(**kwargs)
