"""Calls to one worker through litellm: timeouts, retries with backoff, cost, clean OpenAI output.

Fallback across workers is the caller's job (it owns the admissible pool); this module retries one
worker on transient failures (429, 5xx, timeouts, connection errors) and classifies the final
failure as one the next worker may fix (`fallback=True`) or one the client must fix.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import litellm
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from policies import Worker

log = logging.getLogger("polyroute.upstream")

litellm.suppress_debug_info = True
litellm.telemetry = False

LOCAL_API_KEY = "sk-local-no-key"  # llama.cpp needs none, the OpenAI client insists on one
RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
CLIENT_FAULT_STATUS = frozenset({400, 413, 422})
MESSAGE_KEYS = ("role", "content", "tool_calls", "function_call", "refusal", "annotations", "audio")
DELTA_KEYS = ("role", "content", "tool_calls", "function_call", "refusal")
NANO = Decimal("0.000000001")


class WorkerError(Exception):
    """A worker's final failure after retries."""

    def __init__(self, worker: str, status: int, message: str, fallback: bool) -> None:
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.status = status
        self.message = message
        self.fallback = fallback


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, litellm.Timeout):
        return 504
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else 502


def _is_retryable(exc: BaseException) -> bool:
    return _status_of(exc) in RETRYABLE_STATUS


def to_worker_error(worker: Worker, exc: BaseException) -> WorkerError:
    status = _status_of(exc)
    message = str(getattr(exc, "message", None) or exc).strip() or type(exc).__name__
    if len(message) > 500:
        message = message[:500] + "…"
    client_fault = status in CLIENT_FAULT_STATUS and not isinstance(exc, litellm.ContextWindowExceededError)
    return WorkerError(worker.name, status, f"{status} {message}", fallback=not client_fault)


@dataclass(slots=True)
class Completion:
    worker: Worker
    body: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal


def litellm_cost(worker: Worker, prompt_tokens: int, completion_tokens: int) -> Decimal:
    """litellm's cost calculation, fed the catalog's list prices (not its own price map)."""
    prompt_cost, completion_cost = litellm.cost_per_token(
        model=worker.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        custom_cost_per_token={
            "input_cost_per_token": float(worker.input_price_per_m) / 1e6,
            "output_cost_per_token": float(worker.output_price_per_m) / 1e6,
        },
    )
    return (Decimal(repr(prompt_cost)) + Decimal(repr(completion_cost))).quantize(NANO)


def _usage_counts(usage: Any) -> tuple[int, int]:
    if usage is None:
        return 0, 0
    get = usage.get if isinstance(usage, dict) else lambda k, d=None: getattr(usage, k, d)
    return int(get("prompt_tokens", 0) or 0), int(get("completion_tokens", 0) or 0)


def _pick(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: data[k] for k in keys if data.get(k) is not None}


def clean_completion(worker: Worker, raw: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat.completion shape, without litellm's private fields."""
    choices = []
    for choice in raw.get("choices") or []:
        message = _pick(choice.get("message") or {}, MESSAGE_KEYS)
        message.setdefault("role", "assistant")
        message.setdefault("content", None)
        choices.append(
            {
                "index": choice.get("index", 0),
                "message": message,
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice.get("finish_reason"),
            }
        )
    body = {
        "id": raw.get("id"),
        "object": "chat.completion",
        "created": raw.get("created"),
        "model": worker.name,
        "choices": choices,
    }
    usage = raw.get("usage")
    if usage:
        body["usage"] = _pick(
            usage,
            (
                "prompt_tokens",
                "completion_tokens",
                "total_tokens",
                "prompt_tokens_details",
                "completion_tokens_details",
            ),
        )
    return body


def clean_chunk(worker: Worker, raw: dict[str, Any]) -> dict[str, Any]:
    choices = [
        {
            "index": c.get("index", 0),
            "delta": _pick(c.get("delta") or {}, DELTA_KEYS),
            "logprobs": c.get("logprobs"),
            "finish_reason": c.get("finish_reason"),
        }
        for c in raw.get("choices") or []
    ]
    chunk = {
        "id": raw.get("id"),
        "object": "chat.completion.chunk",
        "created": raw.get("created"),
        "model": worker.name,
        "choices": choices,
    }
    usage = raw.get("usage")
    if usage:
        chunk["usage"] = _pick(usage, ("prompt_tokens", "completion_tokens", "total_tokens"))
    return chunk


@dataclass(slots=True)
class OpenStream:
    """A stream whose first chunk has arrived (so fallback is no longer possible)."""

    worker: Worker
    first: Any
    rest: AsyncIterator[Any]
    metrics: Metrics
    prompt_cost_usd: Decimal
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = field(default=Decimal(0))
    _text_chars: int = 0

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        raw = self.first
        try:
            while True:
                chunk = clean_chunk(self.worker, raw.model_dump() if hasattr(raw, "model_dump") else raw)
                for choice in chunk["choices"]:
                    self._text_chars += len(choice["delta"].get("content") or "")
                if "usage" in chunk:
                    self.prompt_tokens, self.completion_tokens = _usage_counts(chunk["usage"])
                    self._settle()
                    if chunk["choices"]:  # usage rode on a content chunk: split it off
                        usage = chunk.pop("usage")
                        yield chunk
                        yield {**chunk, "choices": [], "usage": usage}
                        raw = await anext(self.rest)
                        continue
                yield chunk
                raw = await anext(self.rest)
        except StopAsyncIteration:
            if not self.completion_tokens and self._text_chars:
                self.completion_tokens = max(1, self._text_chars // 4)  # provider sent no usage
                self._settle()
            return
        except Exception as exc:
            self.metrics.worker_attempts.labels(self.worker.name, "mid_stream_error").inc()
            raise to_worker_error(self.worker, exc) from exc

    def _settle(self) -> None:
        self.cost_usd = litellm_cost(self.worker, self.prompt_tokens, self.completion_tokens)
        self.metrics.record_usage(self.worker.name, self.prompt_tokens, self.completion_tokens, self.cost_usd)


class WorkerClient:
    def __init__(self, metrics: Metrics, retries: int = 2, backoff_s: float = 0.25) -> None:
        self.metrics = metrics
        self.retries = retries
        self.backoff_s = backoff_s

    def _kwargs(self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": worker.model,
            "messages": chat.messages_payload(),
            "timeout": worker.timeout_s,
            "num_retries": 0,  # retries are ours (tenacity), so they are counted and bounded here
            # Tools belong to the client; without this litellm sends them through its MCP gateway.
            "_skip_mcp_handler": True,
            **chat.forwarded_params(),
        }
        if api_base:
            kwargs["api_base"] = api_base
        key = worker.api_key()
        if key:
            kwargs["api_key"] = key
        elif worker.local is not None:
            kwargs["api_key"] = LOCAL_API_KEY
        return kwargs

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(initial=self.backoff_s, max=4.0, jitter=self.backoff_s),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )

    async def _with_retries(self, worker: Worker, attempt_fn):
        """Run one call with retries on transient failures; the final failure becomes a WorkerError."""
        try:
            async for attempt in self._retrying():
                with attempt:
                    try:
                        result = await attempt_fn()
                    except Exception:
                        self.metrics.worker_attempts.labels(worker.name, "error").inc()
                        raise
        except Exception as exc:
            err = to_worker_error(worker, exc)
            log.warning("worker %s failed: %s", worker.name, err.message)
            raise err from exc
        self.metrics.worker_attempts.labels(worker.name, "ok").inc()
        return result

    async def complete(self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest) -> Completion:
        kwargs = self._kwargs(worker, api_base, chat)
        response = await self._with_retries(worker, lambda: litellm.acompletion(**kwargs))
        body = clean_completion(worker, response.model_dump())
        prompt_tokens, completion_tokens = _usage_counts(body.get("usage"))
        cost = litellm_cost(worker, prompt_tokens, completion_tokens)
        self.metrics.record_usage(worker.name, prompt_tokens, completion_tokens, cost)
        return Completion(worker, body, prompt_tokens, completion_tokens, cost)

    async def open_stream(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> OpenStream:
        """Start a stream and wait for its first chunk; failures up to then are retried and raised."""
        kwargs = self._kwargs(worker, api_base, chat)
        kwargs["stream"] = True
        kwargs["stream_options"] = {"include_usage": True}  # we always account; the client may not see it

        async def start():
            response = await litellm.acompletion(**kwargs)
            rest = aiter(response)
            return await anext(rest), rest

        first, rest = await self._with_retries(worker, start)
        prompt_cost = litellm_cost(worker, max(1, chat.prompt_chars() // 4), 0)
        return OpenStream(worker, first, rest, self.metrics, prompt_cost)
