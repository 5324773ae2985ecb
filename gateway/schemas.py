"""The OpenAI chat-completions request, validated strictly at the edge.

Nothing reaches a worker unless it parses here. Unknown top-level fields are refused (as OpenAI
does) rather than silently dropped, so a client's typo is an error, not a surprise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from policies.cost import token_chars

# OpenAI parameters forwarded to workers unchanged (litellm maps them per provider).
FORWARDED_PARAMS = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)


def payload_strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, depth first in document order: str values, dict keys, and
    numbers as written (an int can carry a card number as well as a string can).

    This is what data-class detection reads, so it must not know the schema: whatever the request
    forwards to a worker, in whichever field (tool schemas, extra keys, `stop`, `logit_bias` keys...),
    is a string here. Iterative, so a deeply nested body cannot exhaust the recursion limit.
    """
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append(child)
                stack.append(key if isinstance(key, str) else str(key))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
        elif isinstance(item, int | float) and not isinstance(item, bool):
            yield str(int(item)) if isinstance(item, float) and item.is_integer() else str(item)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# What a worker is sent for a tool result with no output ("", blank text, or Anthropic's tool_result
# without content). OpenAI accepts an empty tool message, other providers refuse an empty text
# block, so one placeholder serves every API dialect (gateway/anthropic.py, gateway/responses.py
# reach the workers through this schema).
NO_OUTPUT = "(no output)"


def _no_output(content: str | list[ContentPart] | None) -> bool:
    """True when a tool message gives the worker nothing to read: no content, or only blank text."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    return all(p.type == "text" and not str(getattr(p, "text", "") or "").strip() for p in content)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.role == "assistant" and self.tool_calls:
            return self
        if self.role == "tool" and _no_output(self.content):
            # A tool that printed nothing is a normal turn of an agent loop, not a client error.
            self.content = NO_OUTPUT
            return self
        if self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, str) and not self.content.strip() and self.role != "assistant":
            raise ValueError(f"a {self.role} message has empty content")
        if isinstance(self.content, list) and not self.content:
            raise ValueError(f"a {self.role} message has an empty content list")
        return self

    def texts(self) -> list[str]:
        if isinstance(self.content, str):
            return [self.content]
        if isinstance(self.content, list):
            return [str(getattr(p, "text", "") or "") for p in self.content if getattr(p, "text", None)]
        return []


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    messages: list[Message] = Field(min_length=1, max_length=4096)
    # Strict, as OpenAI is: "yes", "true" or 1 are refused rather than read as true.
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, Any] | None = None

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=1, description="one choice per request for now")
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        """A tool_choice that asks for a tool call (`required`, a named function; Anthropic's `any` and
        `tool` arrive as these) with no tools to call is refused, as OpenAI refuses it: litellm would
        drop it and the client would get text it did not ask for. `auto` and `none` ask for nothing."""
        if not self.tools and self.tool_choice is not None and self.tool_choice not in ("auto", "none"):
            raise ValueError(
                f"tool_choice {self.tool_choice!r} asks for a tool call, but the request has no tools: "
                "give tools, or tool_choice auto or none"
            )
        return self

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        """`stream_options` without `stream: true` is refused, as OpenAI refuses it, rather than
        ignored: a plain answer has no usage chunk to include. (`stream` is declared, so validated,
        first; a `stream` that failed validation is reported on its own.)"""
        if options is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not tool["function"].get("name"):
                raise ValueError(f"tools[{i}].function.name is required")
        return tools

    def forwarded_params(self) -> dict[str, Any]:
        params = {k: getattr(self, k) for k in FORWARDED_PARAMS if getattr(self, k) is not None}
        if self.stream and self.stream_options is not None:
            params["stream_options"] = self.stream_options.model_dump()
        return params

    def messages_payload(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def texts(self) -> tuple[str, ...]:
        """Every string a worker is sent, for data-class detection: one walk over the very payload
        the upstream call is built from (`messages_payload()` and `forwarded_params()`), so that no
        field can be forwarded without having been classified. Routing reads `last_user_text()` and
        `prompt_chars()` instead, which stay about message content."""
        return tuple(payload_strings([self.messages_payload(), self.forwarded_params()]))

    def last_user_text(self) -> str:
        """The query the router reads: the last user message (its text parts joined)."""
        for message in reversed(self.messages):
            if message.role == "user":
                return " ".join(message.texts())
        return ""

    def user_turns(self) -> int:
        return max(1, sum(1 for m in self.messages if m.role == "user"))

    def metadata_str(self, key: str) -> str | None:
        value = (self.metadata or {}).get(key)
        return value if isinstance(value, str) else None

    def prompt_chars(self) -> int:
        """The prompt's size as every cost prediction reads it (policies.cost.token_chars): the
        messages' characters, a non-ASCII one counted as a token (CJK text is about a token a
        character, and four characters a token let it pass budgets and ceilings)."""
        return token_chars(text for message in self.messages for text in message.texts())

    def output_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
