"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the same pipeline.

A Responses request is validated here (OpenAI's shape, strictly: unknown fields are a 400), its
`previous_response_id` conversation is read from the tenant's response store, and the whole is
translated into the internal chat-completions request by litellm's own bridge
(`LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request`),
then served by `completions.serve`: keys, rate limits, memory, data class and policy, routing (auto,
aliases, pinned workers, workflows), budgets with reservation, fallback, ledger, metrics and headers
are those of chat completions, not copies. Answers are written by gateway/responses_output.py
(the bridge's mapping, without its pydantic round trip) and streams by gateway/responses_stream.py
(litellm's streaming iterator cost more than the rest of the endpoint); see those modules. No
litellm call is made from here.

What litellm lacked, written here: the request's validation; a response store (litellm's bridge
keeps sessions in its proxy's spend-log database, which polyroute does not have); response ids,
sequence numbers and the response object's envelope as OpenAI writes them (litellm's events encode
a provider id into the response id and number some events, not all); OpenAI-format errors and the
stream's `error` / `response.failed` events. See docs/responses.md.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from litellm.responses.litellm_completion_transformation.transformation import (
    LiteLLMCompletionResponsesConfig as Bridge,
)
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from gateway import ratelimits
from gateway.body import heavy_if, is_large, read_json_object, validate
from gateway.completions import EventStream, TranslatingWire, serve, store_reply_error
from gateway.errors import APIError, JSONResponse, error_response
from gateway.responses_output import output_of
from gateway.responses_stream import response_events
from gateway.schemas import ChatCompletionRequest
from gateway.state import AppState
from gateway.store import StoreReplyError, StoreUnavailable
from gateway.store.responses import ResponseStore, responses_store
from gateway.wire import in_client_names

log = logging.getLogger("polyroute.gateway")

IGNORED_HEADER = "x-polyroute-ignored"
STORED_HEADER = "x-polyroute-response-stored"
# Accepted (SDKs and agents send them) but not acted on; named back in x-polyroute-ignored.
IGNORED = (
    "reasoning",
    "include",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "stream_options",
    "top_logprobs",
    "max_tool_calls",
    "truncation",
)
PART_TYPES = ("input_text", "output_text", "refusal", "input_image", "input_file")
ROLES = ("user", "assistant", "system", "developer")


# ---- the request, validated in the Responses API's shape --------------------------------------------
class Part(BaseModel):
    """One content part of a message item; each type must carry what the workers are sent."""

    model_config = ConfigDict(extra="allow")

    type: str

    @model_validator(mode="after")
    def _known(self) -> Part:
        if self.type not in PART_TYPES:
            raise ValueError(f"content part type {self.type!r} is not supported (use one of {PART_TYPES})")
        extra = self.model_extra or {}
        field = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(self.type)
        if field is not None and not isinstance(extra.get(field), str):
            raise ValueError(f"an {self.type} part needs {field} (a string)")
        if self.type == "input_image" and not (
            isinstance(extra.get("image_url"), str) and extra["image_url"]
        ):
            # OpenAI also takes a file_id (its Files API); polyroute has no file store, and without
            # this check the bridge would send the worker an image of URL ""
            by_file = " (file_id is not supported: polyroute has no Files API)" if "file_id" in extra else ""
            raise ValueError(f"an input_image part needs image_url, a URL or a data: URL{by_file}")
        if self.type == "input_file" and not any(
            isinstance(extra.get(name), str) and extra[name] for name in ("file_data", "file_url")
        ):
            # the bridge would send a file_id on as a file the worker cannot open (an OpenAI-wire
            # worker gets OpenAI's own Files API id; an Anthropic one a container_upload block), and a
            # part with neither as an empty `file`: refused, as Messages refuses a Files API source
            by_file = " (file_id is not supported: polyroute has no Files API)" if "file_id" in extra else ""
            raise ValueError(f"an input_file part needs file_data (a data: URL) or file_url{by_file}")
        return self


class Item(BaseModel):
    """One input item: a message (type "message" or none), a function_call, a function_call_output,
    or a reasoning item (accepted, not sent: its text is the worker's own, in a form others refuse)."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = Field(None, min_length=1, max_length=256)
    name: str | None = Field(None, min_length=1, max_length=256)
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _shape(self) -> Item:
        if self.type == "message":
            if self.role not in ROLES:
                raise ValueError(f"a message item needs a role, one of {ROLES}")
            if self.content is None:
                raise ValueError("a message item needs content")
            if isinstance(self.content, list) and not self.content:
                raise ValueError(f"a message item of role {self.role!r} has an empty content list")
        elif self.type == "function_call":
            missing = [n for n in ("call_id", "name", "arguments") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"a function_call item needs {', '.join(missing)}")
        elif self.type == "function_call_output":
            if self.call_id is None or self.output is None:
                raise ValueError("a function_call_output item needs call_id and output")
        elif self.type == "item_reference":
            raise ValueError("item_reference items are not supported: send the item, or previous_response_id")
        elif self.type != "reasoning":
            raise ValueError(
                f"input item type {self.type!r} is not supported (use message, function_call, "
                "function_call_output or reasoning)"
            )
        return self


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _function(self) -> Tool:
        if self.type != "function":
            raise ValueError(
                f"tool type {self.type!r} is not supported: the gateway's workers run function tools "
                "only (hosted tools such as web_search or file_search are OpenAI's own)"
            )
        if not self.name:
            raise ValueError("a function tool needs a name")
        return self


class TextFormat(BaseModel):
    """`text.format`: what the answer is written as. Checked here because litellm's bridge drops a
    format it does not know (the worker then answers in free text) and sends a json_schema without
    its schema as an empty one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema":
            missing = [n for n, v in (("name", self.name), ("schema", self.schema_)) if v is None]
            if missing:
                raise ValueError(f"a json_schema format needs {' and '.join(missing)}")
        return self


class TextConfig(BaseModel):
    """`text`: its `format` is sent as response_format; `verbosity` has no chat-completions form, so
    it is named back in x-polyroute-ignored (as `text.verbosity`). Anything else is a 400: a typo
    here would otherwise be an answer in a format the client did not ask for, without a word."""

    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def as_sent(self) -> dict[str, Any]:
        """The object as OpenAI writes it (the echo in the response, and the bridge's input)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    input: str | list[Item] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    store: StrictBool = True
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: TextConfig | None = None
    background: StrictBool | None = None
    # accepted and named back as ignored (IGNORED)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = Field(None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background responses are not supported; use stream or a plain request")
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or not self.tool_choice.get("name"):
                raise ValueError(
                    "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}"
                )
        if isinstance(self.input, str) and not self.input.strip():
            raise ValueError("input is empty")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ValueError("input is an empty list")
        return self


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as items (a string is one user message)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(exclude_none=True) for item in body.input]


def bridge_params(body: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters as litellm's bridge reads them (and as the response echoes them)."""
    params = body.model_dump(
        include={"instructions", "tool_choice", "temperature", "top_p", "max_output_tokens", "user"},
        exclude_none=True,
    )
    if body.text is not None and body.text.format is not None:
        params["text"] = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
    if body.tools:
        params["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if body.parallel_tool_calls is not None:
        params["parallel_tool_calls"] = body.parallel_tool_calls
    return params


def refusals_as_text(item: dict[str, Any]) -> dict[str, Any]:
    """The item with each `refusal` part as an `output_text` part of the same text.

    litellm's bridge drops refusal parts, so an assistant turn that was a refusal (OpenAI's own
    output, replayed as history) became an empty message and a 400, and one beside text was lost
    without a word. OpenAI's chat format carries a refusal as the assistant message's `refusal`
    field, which the gateway's workers (any OpenAI-wire server) do not all read; its text as the
    message's content is the one mapping every worker sees. The stored conversation keeps the
    refusal part as it was sent."""
    content = item.get("content")
    if not isinstance(content, list) or not any(part.get("type") == "refusal" for part in content):
        return item
    parts = [
        {"type": "output_text", "text": part["refusal"]} if part.get("type") == "refusal" else part
        for part in content
    ]
    return {**item, "content": parts}


def translate(
    body: ResponsesRequest, items: list[dict[str, Any]], params: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions form of a Responses request (its conversation `items`, earlier turns
    included), through litellm's bridge; and the parameters accepted but not forwarded."""
    ignored = [name for name in IGNORED if getattr(body, name) is not None]
    if body.text is not None and body.text.verbosity is not None:
        ignored.append("text.verbosity")
    sent = [refusals_as_text(item) for item in items if item.get("type") != "reasoning"]
    if any(item.get("type") == "reasoning" for item in items):
        ignored.append("input.reasoning")
    try:
        chat = Bridge.transform_responses_api_request_to_chat_completion_request(
            model=body.model,
            input=sent,  # type: ignore[arg-type]
            responses_api_request=params,  # type: ignore[arg-type]
            stream=body.stream,
        )
    except Exception as exc:  # an item litellm cannot translate
        log.debug("litellm could not translate a Responses request", exc_info=True)
        raise APIError(
            400, f"This request cannot be translated for the workers: {exc}", param="input"
        ) from None
    messages = []
    for message in chat.get("messages") or []:
        message = dict(message)
        message.pop("thinking_blocks", None)  # some OpenAI-wire servers refuse these in a request
        message.pop("reasoning_content", None)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {k: v for k, v in dict(call).items() if k != "index"} for call in message["tool_calls"]
            ]
        messages.append({k: v for k, v in message.items() if v is not None})
    chat["messages"] = messages
    if chat.get("tools"):
        chat["tools"] = unset_strict_left_out(body, chat["tools"])
    fields = ChatCompletionRequest.model_fields
    ignored += sorted(k for k in chat if k not in fields)
    chat = {k: v for k, v in chat.items() if k in fields}
    if body.metadata:  # polyroute's keys: data_class, cost_weight, min_quality, collections, session_id...
        chat["metadata"] = dict(body.metadata)
    if body.tool_choice is not None and "tool_choice" not in chat:
        # the bridge drops a tool_choice sent without tools; kept, so the pipeline sees what was asked
        # (gateway/compose.py answers a workflow that must call a tool in fast mode)
        choice = body.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        chat["tool_choice"] = choice
    if body.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # usage closes response.completed
    return chat, ignored


def unset_strict_left_out(body: ResponsesRequest, tools: list[Any]) -> list[Any]:
    """The chat tools without the `strict: false` litellm's bridge writes for a function tool whose
    client set no `strict`: that is an explicit opt-out of strict mode, which the client did not ask
    for. OpenAI's Responses API, given no `strict`, normalizes the schema into strict mode (all fields
    required, no additional properties), which polyroute cannot do for every worker; sent without
    it, the tool gets the worker's own default (non-strict on a chat-completions worker). See
    docs/responses.md."""
    unset = {tool.name for tool in body.tools or () if tool.strict is None}
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") in unset:
            tool = {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
        out.append(tool)
    return out


# The chat-completions parameters a worker's request may go without, in this API's own names
# (x-polyroute-ignored); the rest are named alike in both.
CLIENT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


# ---- the answer, written in the Responses API's shape -----------------------------------------------
class StoredAnswer(JSONResponse):
    """A JSON answer that is stored before its first byte is sent, so a client that continues the
    conversation at once (previous_response_id) always finds it."""

    def __init__(self, content: Any, wire: ResponsesWire, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._wire = wire
        self._response = content

    async def __call__(self, scope, receive, send) -> None:
        stored = await self._wire.save(self._response)
        self.raw_headers.append((STORED_HEADER.encode(), b"true" if stored else b"false"))
        await super().__call__(scope, receive, send)


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


TERMINAL = ("response.completed", "response.incomplete")


class ResponsesWire(TranslatingWire):
    """Reads a Responses request; writes the response object, typed events and errors as OpenAI's
    Responses API does, and stores the response (unless store is false). One per request."""

    def __init__(self) -> None:
        self.tenant = ""
        self.state: AppState | None = None
        self.body: ResponsesRequest | None = None
        self.items: list[dict[str, Any]] = []  # the conversation so far, this request's input included
        self.params: dict[str, Any] = {}
        self.ignored: list[str] = []
        self.tool_index: dict[int, int] = {}  # a chat tool's position -> the client's tool's
        self.response_id = "resp_" + uuid.uuid4().hex  # the request's id once known (`_headers`)
        self.created_at = int(time.time())
        self.sequence = 0

    def authenticated(self, tenant: str) -> None:
        self.tenant = tenant

    async def read(self, request: Request, state: AppState) -> ChatCompletionRequest:
        self.state = state
        data = await read_json_object(request, state.settings.max_body_bytes)
        body = await heavy_if(is_large(request), validate, ResponsesRequest, data)
        self.body = body
        context: list[dict[str, Any]] = []
        if body.previous_response_id:
            record = await load(state, self.tenant, body.previous_response_id, "previous_response_id")
            context = list(record["context"]) + list(record["response"].get("output") or [])
        self.items = context + input_items(body)
        self.params = bridge_params(body)
        chat, self.ignored = await heavy_if(is_large(request), translate, body, self.items, self.params)
        names = [tool.name for tool in body.tools or ()]
        self.tool_index = {
            n: names.index(name)
            for n, tool in enumerate(chat.get("tools") or ())
            if (name := (tool.get("function") or {}).get("name")) in names
        }
        try:
            return await heavy_if(is_large(request), validate, ChatCompletionRequest, chat)
        except APIError as err:  # named as this API names it: the messages came from input
            if err.param and err.param.startswith("messages"):
                err.message = err.message.replace(err.param, "input (as chat messages: " + err.param + ")")
                err.param = "input"
            raise

    # ---- the response object -------------------------------------------------------------------
    def envelope(self, status: str, output: list, usage: dict | None, model: str, **extra: Any) -> dict:
        body = self.body
        assert body is not None
        tools = self.params.get("tools") or []
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": extra.get("error"),
            "incomplete_details": extra.get("incomplete_details"),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "model": model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": {"type": "text"}, **(body.text.as_sent() if body.text else {})},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [{"strict": None, "description": None, **tool} for tool in tools],
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": body.truncation or "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
            **({"polyroute": extra["polyroute"]} if extra.get("polyroute") else {}),
        }

    def response_object(self, body: dict) -> dict:
        """A chat completion (the worker's, or a cached or composed one) as a response object
        (gateway/responses_output.py)."""
        status, details, output, usage = output_of(body)
        response = self.envelope(status, output, usage, body.get("model") or "", incomplete_details=details)
        if extra := body.get("polyroute"):
            response["polyroute"] = extra
        return response

    async def save(self, response: dict) -> bool:
        """Store the response and its conversation (unless store is false); False if that failed."""
        if self.body is None or not self.body.store or self.state is None:
            return False
        record = {
            "tenant": self.tenant,
            "response": {k: v for k, v in response.items() if k != "polyroute"},
            "context": self.items,
        }
        try:
            await store_of(self.state).put(
                self.tenant, self.response_id, record, self.state.settings.responses_ttl_s
            )
        except (StoreUnavailable, StoreReplyError) as exc:
            self.state.metrics.store_unavailable.labels("responses").inc()
            log.warning("response %s could not be stored: %s", self.response_id, exc)
            return False
        return True

    # ---- the Wire ------------------------------------------------------------------------------
    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        if request_id := headers.get("x-polyroute-request-id"):
            self.response_id = "resp_" + request_id.removeprefix("req_")
        # in chat's names (gateway/completions.py `note_ignored`, gateway/compose.py), renamed here
        left_out = [name for name in headers.get(IGNORED_HEADER, "").split(",") if name]
        ignored = [*self.ignored, *in_client_names(left_out, CLIENT_NAMES, self.tool_index)]
        if ignored:
            out[IGNORED_HEADER] = ",".join(dict.fromkeys(ignored))
        return out

    def answer(self, body: dict, headers: dict[str, str], background: BackgroundTask | None) -> Response:
        headers = self._headers(headers)
        return StoredAnswer(self.response_object(body), self, headers=headers, background=background)

    def cached(self, body: bytes, headers: dict[str, str]) -> Response:
        return self.answer(orjson.loads(body), headers, None)

    def _event(self, event: dict[str, Any]) -> bytes:
        self.sequence += 1
        return sse_event({**event, "sequence_number": self.sequence})

    async def frames(
        self, chunks: AsyncIterator[dict], worker: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The Responses API's typed events (gateway/responses_stream.py): response.created,
        response.in_progress, per output item output_item.added, content_part.added,
        output_text.delta... (function_call_arguments.delta/done for a tool call), output_item.done,
        and response.completed (or response.incomplete) with the usage; the response is stored."""
        extra: dict[str, Any] = {}

        async def source() -> AsyncIterator[dict]:
            async for chunk in chunks:
                if "polyroute" in chunk:  # the usage chunk: what the answer cost
                    chunk = dict(chunk)
                    extra.update(chunk.pop("polyroute"))
                yield chunk

        events = response_events(
            source(), lambda: self.envelope("in_progress", [], None, worker), self.response_object
        )
        async for batch in events:  # the events one chunk gave: written at once
            for event in batch:
                if event["type"] in TERMINAL:
                    response = event["response"]
                    response["model"] = worker
                    if extra:
                        response["polyroute"] = dict(extra)
                    await self.save(response)
            yield b"".join([self._event(event) for event in batch])

    def error_event(self, message: str, code: str) -> bytes:
        """OpenAI's `error` event, then `response.failed`: the stream's end for clients that wait
        for a terminal response event.

        The `error` event's code is free text in OpenAI's API, so it is polyroute's own
        (`upstream_stream_error`, `request_timeout`). The failed response's `error.code` is one of a
        fixed list in the SDK's `ResponseError`, in which every mid-stream failure here (a worker
        that drops, a deadline) is a `server_error`; polyroute's code rides beside it, in the
        response's `polyroute.error_code` (extra fields are kept, not refused, by the SDK)."""
        failed = (
            self.envelope(
                "failed",
                [],
                None,
                "",
                error={"code": "server_error", "message": message},
                polyroute={"error_code": code},
            )
            if self.body is not None
            else {"id": self.response_id, "status": "failed"}
        )
        return self._event({"type": "error", "code": code, "message": message, "param": None}) + self._event(
            {"type": "response.failed", "response": failed}
        )

    def done(self) -> bytes:
        return b""  # response.completed (or the error events) closed the stream

    def stream(self, body: AsyncIterator[bytes], headers: dict[str, str]) -> Response:
        return EventStream(body, media_type="text/event-stream", headers=self._headers(headers))


# ---- the endpoints ----------------------------------------------------------------------------------
def store_of(state: AppState) -> ResponseStore:
    return responses_store(state.stores)


def _not_found(response_id: str, param: str | None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(
        404,
        f"{what} with id '{response_id}' not found.",
        code="previous_response_not_found" if param else "response_not_found",
        param=param,
    )


def _store_down(exc: Exception) -> APIError:
    return APIError(
        503,
        f"the response store cannot be reached right now: {exc}",
        type="server_error",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )


async def load(state: AppState, tenant: str, response_id: str, param: str | None = None) -> dict:
    """The tenant's stored response record; 404 when it is not there (expired, deleted, or another
    tenant's: the tenant is part of the key, so those look the same)."""
    try:
        record = await store_of(state).get(tenant, response_id)
    except StoreUnavailable as exc:
        state.metrics.store_unavailable.labels("responses").inc()
        raise _store_down(exc) from None
    except StoreReplyError as exc:
        raise store_reply_error(exc) from None
    if record is None:
        raise _not_found(response_id, param)
    return record


async def create(request: Request) -> Response:
    """POST /v1/responses: OpenAI's Responses API, served by the chat-completions pipeline."""
    try:
        return await serve(request, ResponsesWire())
    except APIError as err:  # raised outside the pipeline's own handling
        return error_response(err)


# The `strategy` label of GET and DELETE /v1/responses/{id} in polyroute_requests_total (worker "-")
RETRIEVE_STRATEGY = "response_get"
DELETE_STRATEGY = "response_delete"


async def _authorized(request: Request) -> tuple[AppState, str, dict[str, str]]:
    """GET/DELETE: the key's tenant, rate limited as one request of no tokens (as count_tokens is)."""
    state: AppState = request.app.state.polyroute
    key = await state.auth.client(request)
    limits = ratelimits.limits_under(state.policy.engine, key, 0)
    headers = await ratelimits.enforce(state.stores.limiter, state.metrics, key.tenant, limits)
    return state, key.tenant, headers


async def retrieve(request: Request, response_id: str) -> Response:
    """GET /v1/responses/{id}: the stored response object, as it was answered."""
    started = time.perf_counter()
    state: AppState = request.app.state.polyroute
    try:
        state, tenant, headers = await _authorized(request)
        record = await load(state, tenant, response_id)
    except APIError as err:
        state.metrics.count_request(started, err.status, RETRIEVE_STRATEGY, err.code or err.type)
        return error_response(err)
    state.metrics.count_request(started, 200, RETRIEVE_STRATEGY)
    return JSONResponse(record["response"], headers=headers)


async def delete(request: Request, response_id: str) -> Response:
    """DELETE /v1/responses/{id}: removes it; a follow-up naming it is then a 404."""
    started = time.perf_counter()
    state: AppState = request.app.state.polyroute
    try:
        state, tenant, headers = await _authorized(request)
        try:
            removed = await store_of(state).delete(tenant, response_id)
        except StoreUnavailable as exc:
            state.metrics.store_unavailable.labels("responses").inc()
            raise _store_down(exc) from None
        except StoreReplyError as exc:
            raise store_reply_error(exc) from None
        if not removed:
            raise _not_found(response_id, None)
    except APIError as err:
        state.metrics.count_request(started, err.status, DELETE_STRATEGY, err.code or err.type)
        return error_response(err)
    state.metrics.count_request(started, 200, DELETE_STRATEGY)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True}, headers=headers)
