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
them), base64 and URL documents as OpenAI `file` parts (the adapter makes them `image_url` parts),
a 400 for attachment sources no worker can be sent (the adapter drops them), tool results without
output or with `is_error`, `disable_parallel_tool_use` as `parallel_tool_calls`, and stop sequences
with the stop_reason that names them (gateway/stop_sequences.py: sent to the worker by default and
cut here as well, or kept and cut here only). See docs/anthropic.md.
"""

from __future__ import annotations

import logging
import time
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
from gateway.schemas import NO_OUTPUT, ChatCompletionRequest
from gateway.state import AppState
from gateway.stop_sequences import StopScan, cut_completion
from gateway.wire import in_client_names

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
# The chat-completions parameters a worker's request may go without, in the Messages API's own names
# (x-polyroute-ignored; `response_format` is `output_format` when the client sent that); the rest
# are named alike in both.
CLIENT_NAMES = {
    "user": "metadata.user_id",
    "response_format": "output_config.format",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
COUNTER_HEADER = "x-polyroute-token-counter"
DEFAULT_COUNTER = "litellm default (tiktoken cl100k_base)"
# count_tokens' `strategy` label in polyroute_requests_total (its worker label is "-": none is called)
COUNT_TOKENS_STRATEGY = "count_tokens"


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
    # litellm's adapter ignores it; `translate` sends it as OpenAI's parallel_tool_calls=false
    disable_parallel_tool_use: StrictBool | None = None

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
    with its title and context; None for other sources (base64 and URL files: sent as file parts,
    see `file_blocks`)."""
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


# Source types each attachment block may carry. A Files API `file` source (a file_id) is not among
# them: polyroute keeps no uploaded files, so no worker could be shown it.
SOURCE_TYPES: dict[str, tuple[str, ...]] = {
    "image": ("base64", "url"),
    "document": ("base64", "url", "text", "content"),
}


def source_problem(block: dict[str, Any]) -> str | None:
    """Why an image or document block's source cannot reach a worker, or None when it can.

    Checked before translating because litellm's adapter silently drops a source it cannot turn into
    a URL (a Files API file_id, a base64 source without data): the worker would answer, and be
    billed, without the attachment the client sent."""
    kind, source = str(block.get("type")), block.get("source")
    if not isinstance(source, dict):
        return f"a {kind} block's source must be an object"
    source_type = source.get("type")
    if source_type == "file":
        return (
            "a Files API source (file_id) is not supported: polyroute keeps no uploaded files, so no "
            "worker could see it. Send the file inline (base64) or as a URL"
        )
    if source_type not in SOURCE_TYPES[kind]:
        allowed = ", ".join(SOURCE_TYPES[kind])
        return f"source type {source_type!r} is not supported for a {kind} block (use one of: {allowed})"
    if source_type == "base64" and not (isinstance(source.get("data"), str) and source["data"]):
        return "a base64 source needs data (a non-empty string)"
    if source_type == "url" and not (isinstance(source.get("url"), str) and source["url"]):
        return "a url source needs url (a non-empty string)"
    if source_type in ("text", "content") and document_text(block) is None:
        return "a text source needs data (a string), a content source content (a string or text blocks)"
    return None


def check_sources(messages: list[dict[str, Any]]) -> None:
    """A 400 naming the first image or document block (also inside a tool_result) whose source no
    worker can be sent (`source_problem`), as `messages.N.content.M.source`."""

    def check(block: Any, where: str) -> None:
        if not isinstance(block, dict):
            return
        if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            for k, inner in enumerate(block["content"]):
                check(inner, f"{where}.content.{k}")
        elif block.get("type") in SOURCE_TYPES and (problem := source_problem(block)) is not None:
            param = f"{where}.source"
            raise APIError(400, f"Invalid value for {param}: {problem}", param=param, code="invalid_value")

    for i, message in enumerate(messages):
        if isinstance(message["content"], list):
            for j, block in enumerate(message["content"]):
                check(block, f"messages.{i}.content.{j}")


# Put before a tool_result's content when it says `is_error: true`: OpenAI's tool message has no
# such flag, so the worker reads it in the text.
ERROR_PREFIX = "Error: "


def _blank(content: Any) -> bool:
    """True for a tool_result content that gives the worker nothing to read."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(
            (isinstance(p, str) and not p.strip())
            or (isinstance(p, dict) and p.get("type") == "text" and not str(p.get("text") or "").strip())
            for p in content
        )
    return False


def _as_error(content: str | list[Any]) -> str | list[Any]:
    """`content` with ERROR_PREFIX in front of its first text."""
    if isinstance(content, str):
        return ERROR_PREFIX + content
    first = content[0] if content else None
    if isinstance(first, str):
        return [ERROR_PREFIX + first, *content[1:]]
    if isinstance(first, dict) and first.get("type") == "text" and isinstance(first.get("text"), str):
        return [{**first, "text": ERROR_PREFIX + first["text"]}, *content[1:]]
    return [{"type": "text", "text": ERROR_PREFIX.strip()}, *content]


def file_blocks(block: dict[str, Any], files: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A base64 or URL document as blocks litellm's adapter passes on: its title and context as a text
    block, and an image block whose URL is a placeholder key in `files`, mapped there to the OpenAI
    `file` part the worker gets (`with_file_parts` swaps it in). The adapter itself would send the
    document as an `image_url` part, which OpenAI-wire servers take for images only.

    The part is the one litellm's Responses bridge makes of an `input_file` (gateway/responses.py):
    `file.file_data` is a data URL, and a URL goes as `file.file_id` (litellm's convention: its
    Anthropic provider turns an http(s) file_id back into a URL document)."""
    source = block["source"]
    if source["type"] == "base64":
        media_type = str(source.get("media_type") or "application/pdf")
        title = block.get("title")
        filename = title if isinstance(title, str) and title else "document." + media_type.rpartition("/")[2]
        file: dict[str, Any] = {
            "file_data": f"data:{media_type};base64,{source['data']}",
            "filename": filename,
        }
    else:
        file = {"file_id": source["url"]}
    key = f"polyroute-file:{uuid.uuid4().hex}"
    files[key] = file
    out: list[dict[str, Any]] = []
    about = [p for p in (block.get("title"), block.get("context")) if isinstance(p, str) and p]
    if about:
        out.append({"type": "text", "text": "\n\n".join(about)})
    placeholder: dict[str, Any] = {"type": "image", "source": {"type": "url", "url": key}}
    if "cache_control" in block:
        placeholder["cache_control"] = block["cache_control"]
    out.append(placeholder)
    return out


def prepared_blocks(blocks: list[dict[str, Any]], files: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's blocks made ready for litellm's adapter, which would otherwise lose or mangle them:

    * plain-text documents become text blocks (the adapter drops them, so their text reached neither
      the worker nor the data-class detection);
    * base64 and URL documents become file placeholders (`file_blocks`);
    * a tool_result with no output gets NO_OUTPUT (providers refuse an empty text block), and one with
      `is_error: true` gets ERROR_PREFIX (the flag has no OpenAI equivalent)."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        if block.get("type") == "document":
            text = document_text(block)
            out += [{"type": "text", "text": text}] if text is not None else file_blocks(block, files)
            continue
        if block.get("type") == "tool_result":
            content = block.get("content")
            if isinstance(content, list):
                content = prepared_blocks(content, files)
            if _blank(content):
                content = NO_OUTPUT
            if block.get("is_error") is True:
                content = _as_error(content)
            block = {**block, "content": content}
        out.append(block)
    return out


def with_file_parts(messages: list[dict[str, Any]], files: dict[str, dict[str, Any]]) -> None:
    """Swap the adapter's image_url parts for the file placeholders of `file_blocks` back into
    OpenAI `file` parts (keeping what the adapter added to the part, e.g. cache_control)."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for n, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if isinstance(url, str) and url in files:
                rest = {k: v for k, v in part.items() if k not in ("type", "image_url")}
                content[n] = {"type": "file", "file": files[url], **rest}


def asks_citations(blocks: list[Any]) -> bool:
    """Whether a document among `blocks` (or inside a tool_result of them) asks for citations.
    Neither OpenAI's wire nor litellm's adapter carries the flag: the document is sent, the answer
    cites nothing, so the request names `citations` as ignored."""
    for block in blocks:
        if not isinstance(block, dict):
            continue
        citations = block.get("citations")
        if block.get("type") == "document" and isinstance(citations, dict) and citations.get("enabled"):
            return True
        if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            if asks_citations(block["content"]):
                return True
    return False


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
    check_sources(data["messages"])
    if any(isinstance(m["content"], list) and asks_citations(m["content"]) for m in data["messages"]):
        ignored.append("citations")
    files: dict[str, dict[str, Any]] = {}  # placeholder URL -> OpenAI file part (`file_blocks`)
    for message in data["messages"]:
        if isinstance(message["content"], list):
            message["content"] = prepared_blocks(message["content"], files)
    try:
        chat, mapping = LiteLLMAnthropicMessagesAdapter().translate_anthropic_to_openai(
            anthropic_message_request=data  # type: ignore[arg-type]
        )
    except Exception as exc:  # a block litellm cannot translate (e.g. an image source it does not know)
        log.debug("litellm could not translate a Messages request", exc_info=True)
        raise APIError(400, f"This request cannot be translated for the workers: {exc}") from None
    chat = dict(chat)
    if files:
        with_file_parts(chat["messages"], files)
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
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use and chat.get("tools"):
        # at most one tool call, as Anthropic's flag asks (OpenAI refuses the field without tools)
        chat["parallel_tool_calls"] = False
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
        self.names: dict[str, str] = CLIENT_NAMES
        self.tool_index: dict[int, int] = {}  # a chat tool's position -> the client's tool's
        self.message_id = "msg_" + uuid.uuid4().hex
        self.stops: list[str] = []  # stop_sequences, cut here too (gateway/stop_sequences.py)
        self.kept: tuple[str, ...] = ()  # those not sent to the worker ("gateway" mode)

    async def read(self, request: Request, state: AppState) -> ChatCompletionRequest:
        data = await read_json_object(request, state.settings.max_body_bytes)
        body = await heavy_if(is_large(request), validate, MessagesRequest, data)
        chat, self.mapping, self.ignored = await heavy_if(is_large(request), translate, body)
        if body.output_format is not None:
            self.names = {**CLIENT_NAMES, "response_format": "output_format"}
        names = [tool.name for tool in body.tools or ()]
        for n, tool in enumerate(chat.get("tools") or ()):
            name = (tool.get("function") or {}).get("name")
            if (name := self.mapping.get(name, name)) in names:
                self.tool_index[n] = names.index(name)
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
        # what the worker's request went without, in chat's names (gateway/completions.py
        # `note_ignored`; a composed answer's steps': gateway/compose.py), renamed to this API's
        left_out = [name for name in headers.get(IGNORED_HEADER, "").split(",") if name]
        ignored = [*self.ignored, *in_client_names(left_out, self.names, self.tool_index)]
        if ignored:
            out[IGNORED_HEADER] = ",".join(dict.fromkeys(ignored))
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
    started = time.perf_counter()
    state: AppState = request.app.state.polyroute
    engine = state.policy.engine
    try:
        key = await state.auth.client(request)
        data = await read_json_object(request, state.settings.max_body_bytes)
        body = await heavy_if(is_large(request), validate, CountTokensRequest, data)
        compose.checked_workflow(body.model, "not_found_error")  # as /v1/messages checks it
        model = AUTO if body.model.startswith(compose.PREFIX) else body.model
        catalog = state.catalog_for(request)  # read once: the catalog is hot-reloaded
        worker = catalog.get(model)
        aliases = engine.policy.aliases if engine is not None else {}
        if worker is None and model != AUTO and model not in aliases:
            names = model_names(catalog, aliases)
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
        state.metrics.count_request(started, err.status, COUNT_TOKENS_STRATEGY, err.code or err.type)
        return error_response(err)
    headers[COUNTER_HEADER] = worker.model if worker else DEFAULT_COUNTER
    state.metrics.count_request(started, 200, COUNT_TOKENS_STRATEGY)
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
