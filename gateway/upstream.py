"""Calls to one worker through litellm: timeouts, retries with backoff, cost, clean OpenAI output.

Fallback across workers is the caller's job (it owns the admissible pool); this module retries one
worker on transient failures (429, 5xx, timeouts, connection errors; waiting as long as a
Retry-After asks, and not at all when it asks longer than a retry waits) and classifies the final
failure as one the next worker may fix (`fallback=True`) or one the client must fix. A worker that
reports no usage, or none readable, is billed on counts made here (marked estimated), a stream as a
plain answer.

Two ways to reach a worker, chosen once per worker (and cached):
- OpenAI-wire providers (openai and OpenAI-compatible servers, together_ai, deepseek, mistral,
  hosted_vllm): litellm's provider transforms build the request, which goes out over our pooled
  HTTP client (gateway/wire.py) — a fraction of `litellm.acompletion`'s CPU per call and chunk.
- Everything else (anthropic, ...) and calls litellm would bridge to the Responses API:
  `litellm.acompletion`.
Both give the same clean OpenAI output, retries, timeouts and error classification.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from decimal import Decimal
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import httpx
import litellm
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from gateway import tracing, wire
from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from policies import Worker
from policies.cost import estimate_tokens

log = logging.getLogger("polyroute.upstream")

litellm.suppress_debug_info = True
litellm.telemetry = False
# litellm logged an INFO line per call ("LiteLLM completion() model=..."), twice: through its own
# handler and through the root logger. The access log (polyroute.access) already says which worker
# served each request; litellm's warnings and errors still show, once, in the gateway's format.
for _name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
    logging.getLogger(_name).setLevel(logging.WARNING)
    logging.getLogger(_name).handlers.clear()

LOCAL_API_KEY = "sk-local-no-key"  # llama.cpp needs none, the OpenAI client insists on one
RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
CLIENT_FAULT_STATUS = frozenset({400, 413, 422})
MESSAGE_KEYS = ("role", "content", "tool_calls", "function_call", "refusal", "annotations", "audio")
DELTA_KEYS = ("role", "content", "tool_calls", "function_call", "refusal")
ANSWER_KEYS = ("content", "tool_calls", "function_call", "refusal")  # a delta's part of the answer
NANO = Decimal("0.000000001")
STREAM_USAGE = {"include_usage": True}  # we always account; the client may not see it
MAX_CACHED_ROUTES = 4096
# The longest Retry-After a retry of the same worker waits for (the backoff's own ceiling): a worker
# that asks for longer is given up at once, so `auto` falls back now and the client hears how long.
MAX_RETRY_AFTER_S = 4.0


class WorkerError(Exception):
    """A worker's final failure after retries."""

    def __init__(
        self,
        worker: str,
        status: int,
        message: str,
        fallback: bool,
        context_exceeded: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.status = status
        self.message = message
        self.fallback = fallback
        # The prompt did not fit the worker's context window: a worker with a larger window may still
        # answer, one with the same or a smaller window would fail the same way.
        self.context_exceeded = context_exceeded
        self.retry_after_s = retry_after_s  # the worker's Retry-After (a 429's, a 503's), if it sent one
        # The request's parameters this worker's provider has none of (wire.unsupported_params): it
        # was not called; another worker may take them, a pinned one's client must leave them out.
        self.unsupported: tuple[str, ...] = ()
        # What the failed call cost: a 200 that held no answer was still billed by the provider.
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cost_usd = Decimal(0)
        # Every call of this worker that was given up, retries and the last one (`Attempt`): the
        # ledger's trace and the response's header name them (`given_up`); () when none was made.
        self.attempts: tuple[Attempt, ...] = ()
        # The end of `message` the gateway appended to the provider's (`append`): a bounded copy of
        # the error (router.compose.base `error_text`) keeps it whole and shortens the provider's part.
        self.appended = ""

    def append(self, note: str) -> None:
        """Add the gateway's ``note`` (e.g. why the call was not retried) to the end of the message."""
        self.message += note
        self.appended += note

    def __str__(self) -> str:
        # the message as it is now: a note added after the error was made (e.g. "not retried") shows
        return f"{self.worker}: {self.message}"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One call of a worker given up: retried on the same worker, or the last before the caller fell
    back (or failed). A read timeout means the request reached the provider, which may run and bill
    it though nothing came back; only `polyroute_worker_attempts_total{outcome="error"}` counted
    these before, so a provider's invoice could not be matched to requests.

    `may_be_billed` is a flag, not a cost (none is guessed): True when the request was, or may have
    been, delivered and no refusal came back (a timeout, a connection lost after it was sent, an
    answer that could not be read, an empty answer); False when the provider refused it (an error
    status or error object, which providers do not bill; a 504 is its proxy timing out on a backend
    that may still run it, so it counts as may-be-billed) or it never left (no connection made)."""

    worker: str
    outcome: str  # timeout | connection_lost | unreadable | not_sent | empty_answer | http_<status>
    status: int  # the status the failure is classified as (504 for a timeout, as the final error says)
    may_be_billed: bool

    def trace(self) -> dict[str, Any]:
        """The ledger trace's form (trace.attempts[])."""
        return {
            "worker": self.worker,
            "outcome": self.outcome,
            "status": self.status,
            "may_be_billed": self.may_be_billed,
        }

    def label(self) -> str:
        """The header's form: worker:outcome, and :may-be-billed when it may be."""
        return f"{self.worker}:{self.outcome}" + (":may-be-billed" if self.may_be_billed else "")


ATTEMPTS_HEADER = "x-polyroute-attempts"  # the calls given up on the way to the answer (or the error)
# The outcome of a call a cancellation cut short, until its caller, who knows what cut it (the
# request's deadline, ...), says so (`CallScope.cut_by`); 503 as a request cancelled at shutdown.
CANCELLED = "cancelled"
# A request that never left: the connection (or a pooled one, or TLS) could not be had.
NOT_SENT = (
    aiohttp.ClientConnectorError,  # refused, unreachable, DNS, TLS handshake
    aiohttp.ConnectionTimeoutError,
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
TRANSPORT = (aiohttp.ClientError, httpx.TransportError, ConnectionError)


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and what it was raised from or during, outermost first (a cycle stops it)."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain) and len(chain) < 16:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _answered_status(chain: list[BaseException]) -> int | None:
    """The error status the provider answered, if it answered one: the fast path marks its
    exceptions (gateway/wire.py `refused`); litellm's keep the httpx error of the response they
    were made from (not their own status: litellm's exceptions subclass openai's status errors,
    and a lost connection or an unreadable body is a 500 there too)."""
    for exc in chain:
        status = wire.refused_status(exc)
        if status is not None:
            return status
        if isinstance(exc, httpx.HTTPStatusError):
            return exc.response.status_code
    return None


def attempt_of(worker: Worker, exc: BaseException) -> Attempt:
    """What a failed call of ``worker`` was, as far as the provider's bill goes (see `Attempt`)."""
    status = _status_of(exc)
    if isinstance(exc, EmptyAnswer):
        return Attempt(worker.name, "empty_answer", status, True)
    if wire.unsupported_params(exc):  # litellm refused to build the request: nothing was sent
        return Attempt(worker.name, "not_sent", status, False)
    chain = _causes(exc)
    answered = _answered_status(chain)
    if answered is not None:
        return Attempt(worker.name, f"http_{answered}", status, answered == 504)
    if any(isinstance(e, NOT_SENT) for e in chain):
        return Attempt(worker.name, "not_sent", status, False)
    if isinstance(exc, litellm.Timeout) or any(isinstance(e, TimeoutError) for e in chain):
        return Attempt(worker.name, "timeout", status, True)
    if any(isinstance(e, (*TRANSPORT, StreamCut)) for e in chain):  # a cut stream: as the fast path books it
        return Attempt(worker.name, "connection_lost", status, True)
    return Attempt(worker.name, "unreadable", status, True)  # an answer that could not be read


def given_up(failures: Sequence[WorkerError], answer: Any = None) -> list[Attempt]:
    """The request's given-up calls in order: each failed worker's (its retries included), then
    those of the worker that answered (a Completion or an OpenStream), before its answer."""
    attempts = [a for failure in failures for a in failure.attempts]
    return [*attempts, *getattr(answer, "attempts", ())]


def with_attempts(trace: dict | None, attempts: Sequence[Attempt]) -> dict | None:
    """``trace`` (a ledger trace, or None) with ``attempts`` (`given_up`) under `attempts`, after any
    already there (a workflow's, answered in fast mode); unchanged when there are none."""
    if not attempts:
        return trace
    trace = dict(trace or {})
    trace["attempts"] = [*trace.get("attempts", ()), *(a.trace() for a in attempts)]
    return trace


# Asked before each retry of a worker: None, or why the policy in force no longer admits it for the
# request (gateway/readmit.py; the shape of router.compose.base.Admissible).
Readmit = Callable[[Worker], Awaitable[str | None]]


@dataclass(slots=True)
class CallScope:
    """What one request's worker calls share with the retry loop (`WorkerClient._with_retries`)
    without this module knowing the request: set by the caller around its calls (`calling`), so the
    code between (memory rounds) need not pass it on.

    - ``readmit`` is asked before each retry: a policy reload between two calls of the same worker
      may have excluded it, and a retry is a call like any other (a policy decision is never undone
      downstream). A worker no longer admitted is not called again: its last failure is final, and
      its message says it was not retried (the caller's readmit keeps why).
    - ``cut`` receives the given-up calls of a worker whose call a cancellation cut short (the
      request's deadline): its calls retried before, then the one in flight (outcome `CANCELLED`).
      A cancellation carries no WorkerError, so these were lost, and with them the calls the
      provider may bill; the caller names what cut them with `cut_by`.
    """

    readmit: Readmit | None = None
    cut: list[Attempt] = field(default_factory=list)

    def cut_by(self, outcome: str, status: int) -> list[Attempt]:
        """The cut calls, the one in flight labelled with what cut it (e.g. "deadline", 504)."""
        return [replace(a, outcome=outcome, status=status) if a.outcome == CANCELLED else a for a in self.cut]


_SCOPE: ContextVar[CallScope | None] = ContextVar("polyroute_call_scope", default=None)


@contextmanager
def calling(scope: CallScope) -> Iterator[CallScope]:
    """Make the worker calls inside (in this task, and tasks it starts) under ``scope``."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def attempts_header(attempts: Sequence[Attempt]) -> dict[str, str]:
    """The response header naming the given-up calls ({} when there are none): `worker:outcome`,
    with `:may-be-billed` for those the provider may bill, comma-separated in order."""
    return {ATTEMPTS_HEADER: ",".join(a.label() for a in attempts)} if attempts else {}


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, litellm.Timeout):
        return 504
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else 502


def retry_after_of(exc: BaseException) -> float | None:
    """The seconds the worker asked to wait (retry-after-ms, or Retry-After in seconds or as an
    HTTP date), from the response headers litellm keeps on its exception; None when it sent none."""
    headers = getattr(exc, "litellm_response_headers", None)
    if headers is None:
        headers = getattr(getattr(exc, "response", None), "headers", None)
    if not headers:
        return None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            seconds = float(ms) / 1000
        elif (value := headers.get("retry-after")) is not None:
            try:
                seconds = float(value)
            except ValueError:
                seconds = parsedate_to_datetime(value).timestamp() - time.time()
        else:
            return None
    except (TypeError, ValueError, OverflowError):
        return None
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def _is_retryable(exc: BaseException) -> bool:
    # Cancellation (a client gone, a workflow step's timeout) is not a failure to retry: tenacity
    # would otherwise swallow CancelledError and call the worker again.
    if not (isinstance(exc, Exception) and _status_of(exc) in RETRYABLE_STATUS):
        return False
    if isinstance(exc, EmptyAnswer):  # it answered, and was billed: asking again would bill again
        return False
    # A worker that asks for a longer pause than a retry waits would only refuse the retry too
    # (and count it against its limit): give it up now.
    wait = retry_after_of(exc)
    return wait is None or wait <= MAX_RETRY_AFTER_S


def to_worker_error(worker: Worker, exc: BaseException) -> WorkerError:
    if unsupported := wire.unsupported_params(exc):
        err = WorkerError(
            worker.name,
            400,
            f"400 cannot take {', '.join(unsupported)}: {worker.model} has no such parameter "
            "(the worker was not called)",
            # the client's to change for this worker; chat's `auto` tries the next one (`unsupported`)
            fallback=False,
        )
        err.unsupported = unsupported
        return err
    status = _status_of(exc)
    message = str(getattr(exc, "message", None) or exc).strip() or type(exc).__name__
    if len(message) > 500:
        message = message[:500] + "…"
    too_long = isinstance(exc, litellm.ContextWindowExceededError)
    client_fault = status in CLIENT_FAULT_STATUS and not too_long
    err = WorkerError(
        worker.name,
        status,
        f"{status} {message}",
        fallback=not client_fault,
        context_exceeded=too_long,
        retry_after_s=retry_after_of(exc),
    )
    if isinstance(exc, EmptyAnswer):  # answered, and billed, with nothing in it
        err.prompt_tokens, err.completion_tokens = exc.prompt_tokens, exc.completion_tokens
        err.cost_usd = litellm_cost(worker, exc.prompt_tokens, exc.completion_tokens)
    return err


@dataclass(slots=True)
class Completion:
    worker: Worker
    body: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    usage_estimated: bool = False  # the worker reported no (readable) usage: counted here
    attempts: tuple[Attempt, ...] = ()  # this worker's calls given up before this answer (retried)


SYSTEM_ROLES = frozenset({"system", "developer"})


def _content_text(content: Any) -> str:
    """A message's text: the string, or a list of content parts' text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p["text"]) for p in content if isinstance(p, dict) and p.get("text"))
    return ""


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a chat template without a system role (llama.cpp's `gemma` drops them).

    Each system or developer message's text is prepended, in order and separated by a blank line, to
    the next user turn: the leading ones (the client's prompt, injected memory) go into the first user
    turn, one sent later in the conversation stays where it was said. Text left after the last user
    turn becomes a user turn of its own at that place. A user turn whose content is a list of parts
    gets a text part in front. Other messages are passed as they are; nothing to fold: unchanged.
    """
    if not any(m.get("role") in SYSTEM_ROLES for m in messages):
        return messages
    folded: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in messages:
        if message.get("role") in SYSTEM_ROLES:
            text = _content_text(message.get("content"))
            if text.strip():
                pending.append(text)
            continue
        if pending and message.get("role") == "user":
            prefix = "\n\n".join(pending)
            pending = []
            content = message.get("content")
            if isinstance(content, list):
                content = [{"type": "text", "text": prefix}, *content]
            else:
                content = f"{prefix}\n\n{content}" if content else prefix
            message = {**message, "content": content}
        folded.append(message)
    if pending:
        folded.append({"role": "user", "content": "\n\n".join(pending)})
    return folded


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


def _token_count(value: Any) -> int | None:
    """A token count as a provider reports it: a non-negative whole number (None and 0 are 0)."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def _usage_counts(usage: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a usage object, or None when there is none or it is not
    readable (a string, a negative count: that would refund the budget, and Prometheus' counters
    refuse it). All zeros is none too: litellm fills them in for a provider that sent no usage,
    and no call is free of prompt tokens."""
    if not usage:
        return None
    get = usage.get if isinstance(usage, dict) else lambda k, d=None: getattr(usage, k, d)
    prompt, completion = _token_count(get("prompt_tokens", 0)), _token_count(get("completion_tokens", 0))
    if prompt is None or completion is None or prompt == completion == 0:
        return None
    return prompt, completion


def _add_text(part: dict[str, Any], texts: list[str]) -> None:
    """Add what a message (or a stream's delta) says to ``texts``, as its answer's tokens are counted
    here: content, and tool calls' names and arguments."""
    content = part.get("content")
    if content and isinstance(content, str):
        texts.append(content)
    for call in part.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            texts.append(str(function.get("name") or "") + str(function.get("arguments") or ""))


def _answer_text(body: dict[str, Any]) -> str:
    """A completion's text as a stream's is counted (`_add_text`)."""
    texts: list[str] = []
    for choice in body.get("choices") or ():
        _add_text(choice.get("message") or {}, texts)
    return "".join(texts)


def rendered_prompt(worker: Worker, messages: list[dict[str, Any]] | None) -> str | None:
    """The prompt text a local worker's chat template (`local.chat_template`) makes of ``messages``,
    as its llama.cpp server renders it (gateway/llama_server.py; the model's own BOS, a special token,
    left out); None for a worker without one, or messages it cannot render."""
    template = worker.local.template if worker.local is not None else None
    if template is None or not messages:
        return None
    try:
        return template.render(messages)
    except Exception:  # a conversation the template refuses: llama.cpp would refuse it too
        log.debug("cannot render the chat template of %s for counting", worker.name, exc_info=True)
        return None


def count_tokens(worker: Worker, messages: list[dict[str, Any]] | None, text: str) -> tuple[int, int]:
    """The prompt and answer counted here, for a worker that reported no usage (llama.cpp's server
    streams none): litellm's token counter for the model, else a rough 4 characters a token.

    The prompt counted is what the worker was sent: for a local worker with a chat template, the
    rendered template (base-qa's few-shot examples are most of it: "Hi" counts 63 here, llama.cpp
    counts 70 with Gemma's tokenizer; the bare message counted 8)."""
    rendered = rendered_prompt(worker, messages)
    try:
        if rendered is not None:
            prompt = litellm.token_counter(model=worker.model, text=rendered)
        else:
            prompt = litellm.token_counter(model=worker.model, messages=messages) if messages else 0
        completion = litellm.token_counter(model=worker.model, text=text) if text else 0
    except Exception:  # no tokenizer for this model
        if rendered is None:
            rendered = "".join(str(m.get("content") or "") for m in messages or ())
        prompt = len(rendered) // 4
        completion = max(1, len(text) // 4) if text else 0
    return prompt, completion


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


# The usage details a stream's usage chunk keeps: OpenAI's fields, under OpenAI's names, plus litellm's
# cache_creation_tokens (an Anthropic worker's cache writes), which gateway/anthropic_stream.py reads.
USAGE_DETAILS = {
    "prompt_tokens_details": ("cached_tokens", "audio_tokens", "cache_creation_tokens"),
    "completion_tokens_details": (
        "reasoning_tokens",
        "audio_tokens",
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
    ),
}


def _stream_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage chunk's counts: the three totals, and the details the worker reported, so the
    Messages and Responses streams count cached (and reasoning) tokens as their plain answers do.

    Only positive counts of the fields above are kept: litellm's stream makes up details the worker
    never sent (`text_tokens`, zeros, None), which would make its chunks differ from the same
    worker's on the fast path (a zero says nothing a missing field does not)."""
    out = _pick(usage, ("prompt_tokens", "completion_tokens", "total_tokens"))
    for name, keys in USAGE_DETAILS.items():
        details = usage.get(name)
        if isinstance(details, dict):
            kept = {
                k: details[k]
                for k in keys
                if isinstance(details.get(k), int) and not isinstance(details[k], bool) and details[k] > 0
            }
            if kept:
                out[name] = kept
    return out


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
        chunk["usage"] = _stream_usage(usage)
    return chunk


class EmptyAnswer(Exception):
    """A worker's stream ended without a single choice: no answer, so `auto` falls back, but the
    provider billed the call. (A plain completion with empty `choices` is returned as it is: each
    caller judges it — the chat pipeline falls back, a workflow step counts it an empty answer.)"""

    status_code = 502

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
        super().__init__("the worker answered with no choices (no message, no finish_reason)")
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class StreamCut(Exception):
    """A stream whose provider ended it before the answer did: no finish reason came (an Anthropic
    stream closed cleanly after some content_block_delta events, without message_delta and
    message_stop; an OpenAI-wire one without its finish chunk). litellm's stream wrapper ends such a
    stream with a finish chunk of its own ("stop"), which passed the half answer for a whole one;
    the fast path raises its own for the same cut (gateway/wire.py `_sse_chunks`)."""

    status_code = 502

    def __init__(self) -> None:
        super().__init__("the stream ended before the answer did (the provider sent no finish reason)")


def _litellm_stream(stream: Any) -> bool:
    return isinstance(stream, litellm.CustomStreamWrapper)


def _finish_made_up(stream: Any, raw: Any) -> bool:
    """Whether ``raw`` (a chunk of ``stream``) carries a finish reason litellm made up: its wrapper
    says "stop" at the end of a provider stream that sent none, and keeps the provider's own in
    `received_finish_reason` (or, for one on the last content chunk, `intermittent_finish_reason`;
    litellm's own logging tells the two apart the same way)."""
    if not _litellm_stream(stream):
        return False
    if not any(_field(choice, "finish_reason") for choice in _field(raw, "choices") or ()):
        return False
    return stream.received_finish_reason is None and stream.intermittent_finish_reason is None


def _usage_made_up(stream: Any) -> bool:
    """Whether the usage ``stream`` (litellm's wrapper, at its end) gives is its own count: asked for
    stream usage, it sends one whether or not the provider did (llama.cpp's server sends none), made
    by its tokenizer over the bare messages (a local worker's chat template uncounted). The chunks it
    keeps (`chunks`) hold the usage the provider did send."""
    if not _litellm_stream(stream):
        return False
    chunks = getattr(stream, "chunks", None)
    if not isinstance(chunks, list):  # a litellm that keeps no chunks: its usage is taken as sent
        return False
    return not any(_field(chunk, "usage") for chunk in chunks)


def _raw_dict(raw: Any) -> dict[str, Any]:
    return raw.model_dump() if hasattr(raw, "model_dump") else raw


def _field(raw: Any, name: str) -> Any:
    """A field of a raw chunk: a dict's key or litellm's object's attribute (no copy made)."""
    return raw.get(name) if isinstance(raw, dict) else getattr(raw, name, None)


def _answers(raw: Any) -> bool:
    """Whether a chunk carries some of the answer: text, a refusal, a tool call, or a finish reason.
    A chunk that only opens the message (OpenAI-wire servers' first, `{"role": "assistant",
    "content": ""}`; litellm's for Anthropic's `message_start`) does not."""
    for choice in _field(raw, "choices") or ():
        if _field(choice, "finish_reason"):
            return True
        delta = _field(choice, "delta")
        if delta is not None and any(_field(delta, key) for key in ANSWER_KEYS):
            return True
    return False


async def _past_prelude(
    worker: Worker, first: Any, rest: AsyncIterator[Any], messages: list[dict[str, Any]] | None
) -> tuple[list[Any], Any]:
    """Read a stream up to its first chunk that carries some of the answer (`_answers`): (the chunks
    before it, that chunk).

    Nothing goes to the client before that chunk, so a stream that fails before it is a failure of
    the call, retried and fallen back from like a refused one, not a stream cut mid-way: chunks
    without choices may lead (Azure's prompt_filter_results), and a message's opening chunk (its role;
    an Anthropic worker's `message_start`) comes before any content. A stream made only of such
    chunks answered nothing: EmptyAnswer; one whose finish litellm made up (the provider closed it
    before the answer began) is StreamCut. The stream is closed then."""
    prelude: list[Any] = []
    usage: Any = None
    try:
        while not _answers(first):
            prelude.append(first)
            usage = _field(first, "usage") or usage
            first = await anext(rest)
        if _finish_made_up(rest, first):
            raise StreamCut()
    except BaseException as exc:
        close = getattr(rest, "aclose", None)
        if close is not None:
            await close()
        if isinstance(exc, StopAsyncIteration):
            raise EmptyAnswer(*(_usage_counts(usage) or count_tokens(worker, messages, ""))) from None
        raise
    return prelude, first


@dataclass(slots=True)
class OpenStream:
    """A stream whose first chunk has arrived (so fallback is no longer possible).

    The provider's usage is passed on once, in a usage chunk after the last choice chunk, whether it
    came in a chunk of its own, on the finish chunk or (as some providers send it) as a running count
    on every chunk; the token and cost metrics count the stream once, when it ends or is cut."""

    worker: Worker
    first: Any
    rest: AsyncIterator[Any]
    metrics: Metrics
    prompt_cost_usd: Decimal
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = field(default=Decimal(0))
    messages: list[dict[str, Any]] | None = None  # to count the prompt if the provider reports no usage
    trace: Any = None  # the worker call's span (tracing.WorkerCall), ended with the stream
    # the chunks before `first` that carry none of the answer (`_past_prelude`): choice-less ones, the
    # message's opening, and any the worker sends before its answer begins (a reasoning model's)
    prelude: list[Any] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list)
    _usage: dict[str, Any] | None = None  # the provider's latest usage (a running count is replaced)
    _estimated: bool = False  # the usage was counted here, not reported by the provider
    _recorded: bool = False  # the token and cost metrics have counted this stream
    _counted: bool = False  # `polyroute_worker_attempts_total` has counted this call (when it ended)
    attempts: tuple[Attempt, ...] = ()  # this worker's calls given up before this stream opened

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        pending = deque((*self.prelude, self.first))  # a long prelude is let out in linear time
        last: dict[str, Any] = {}
        outcome = CANCELLED  # closed before its end: the client left, the deadline, the shutdown
        try:
            while True:
                raw = pending.popleft() if pending else await anext(self.rest)
                if _finish_made_up(self.rest, raw):
                    raise StreamCut()
                chunk = clean_chunk(self.worker, _raw_dict(raw))
                last = chunk
                for choice in chunk["choices"]:
                    if choice["finish_reason"]:
                        self.finish_reasons.append(choice["finish_reason"])
                    _add_text(choice["delta"], self._texts)
                usage = chunk.pop("usage", None)
                if usage is not None and _usage_made_up(self.rest):  # not the provider's: counted here
                    if not chunk["choices"]:
                        continue
                    usage = None
                if usage is not None and (counts := _usage_counts(usage)) is not None:
                    self._usage = usage
                    self.prompt_tokens, self.completion_tokens = counts
                    self._settle()
                if chunk["choices"] or usage is None:  # a usage-only chunk waits for the end
                    yield chunk
        except StopAsyncIteration:
            outcome = "ok"
            # The provider sent no usage: litellm's token counter stands in, as it does on its path.
            usage = self._usage if self._usage is not None else self._count_usage()
            self._record()
            if usage is not None:
                yield {**last, "choices": [], "usage": usage}
            return
        except Exception as exc:
            outcome = "mid_stream_error"
            err = to_worker_error(self.worker, exc)
            if self.trace is not None:
                self.trace.failed(err)
            raise err from exc
        finally:
            self._count(outcome)
            await self.aclose()

    def _count(self, outcome: str) -> None:
        """The call in `polyroute_worker_attempts_total`, once, with how it ended: `ok` (read to its
        end), `mid_stream_error` (the worker failed it) or `cancelled` (closed before its end). Not
        when it opened (`WorkerClient._with_retries` leaves a stream to this), so a stream cut
        mid-way is one call, as the worker saw it, not an `ok` and a `mid_stream_error`."""
        if not self._counted:
            self._counted = True
            self.metrics.worker_attempts.labels(self.worker.name, outcome).inc()

    async def aclose(self) -> None:
        """Release the upstream connection (also when the consumer stops early)."""
        self._count(CANCELLED)  # closed without being read (counted already when it was read)
        if self.trace is not None:
            self.trace.stream_ended(self)
        close = getattr(self.rest, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:  # closing a broken stream: nothing more to learn from it
                log.debug("closing the stream of %s failed", self.worker.name, exc_info=True)

    @property
    def usage_estimated(self) -> bool:
        """True when the token counts were counted here because the provider reported none."""
        return self._estimated and self._usage is None

    @property
    def text(self) -> str:
        """What the stream has delivered so far (content and tool-call text)."""
        return "".join(self._texts)

    def account_cut(self) -> bool:
        """A stream that ended early (client gone, deadline, worker failure): bill what was streamed.

        Returns True when the count is an estimate: the provider's usage never arrived, so the prompt
        and the text streamed so far are counted here (litellm's token counter, or 4 characters a token).
        """
        if self._usage is None and not self._estimated:
            self._count_usage()
        self._record()
        return self._usage is None

    def _count_usage(self) -> dict[str, int] | None:
        text = "".join(self._texts)
        if not text and not self.messages:
            return None
        prompt, completion = count_tokens(self.worker, self.messages, text)
        self.prompt_tokens, self.completion_tokens = prompt, completion
        self._estimated = True
        self._settle()
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _settle(self) -> None:
        self.cost_usd = litellm_cost(self.worker, self.prompt_tokens, self.completion_tokens)

    def _record(self) -> None:
        """Count the stream's tokens and cost in the metrics, once (its final counts)."""
        if not self._recorded:
            self._recorded = True
            self.metrics.record_usage(
                self.worker.name, self.prompt_tokens, self.completion_tokens, self.cost_usd
            )


class _NotReadmitted(Exception):
    """A retry the policy in force no longer admits (`CallScope.readmit`; the argument says why):
    raised from the failure it would have followed, which becomes the worker's final one."""


class WorkerClient:
    def __init__(
        self, metrics: Metrics, retries: int = 2, backoff_s: float = 0.25, fast_path: bool = True
    ) -> None:
        """`fast_path=False` sends every call through litellm.acompletion (a diagnostic switch)."""
        self.metrics = metrics
        self.retries = retries
        self.backoff_s = backoff_s
        self.fast_path = fast_path
        self.pool = wire.HttpPool()
        self._routes: dict[tuple[str, str | None, str | None], wire.WireRoute | None] = {}
        self._providers: dict[tuple[str, str | None], tuple[str, str]] = {}  # (provider, its model name)

    @staticmethod
    def _api_key(worker: Worker) -> str | None:
        key = worker.api_key()
        if key:
            return key
        return LOCAL_API_KEY if worker.local is not None else None

    def wire_route(self, worker: Worker, api_base: str | None) -> wire.WireRoute | None:
        """The OpenAI-wire route for this worker, or None for the litellm.acompletion path (cached)."""
        if not self.fast_path:
            return None
        key = (worker.model, api_base, self._api_key(worker))
        try:
            return self._routes[key]
        except KeyError:
            pass
        route = wire.resolve_route(worker.model, api_base, key[2])
        if len(self._routes) >= MAX_CACHED_ROUTES:
            self._routes.clear()
        self._routes[key] = route
        if route is None:
            log.info("worker %s (%s): calls go through litellm.acompletion", worker.name, worker.model)
        else:
            log.info(
                "worker %s (%s): OpenAI-wire fast path, provider %s at %s",
                worker.name,
                worker.model,
                route.provider,
                route.api_base,
            )
        return route

    def _fast_route(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> wire.WireRoute | None:
        route = self.wire_route(worker, api_base)
        if route is None or route.bridges_to_responses(bool(chat.tools)):
            return None
        return route

    def ignored_params(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> tuple[str, ...]:
        """The client's parameters the worker's request went without, though litellm raised no error
        (wire.ignored_params): named back to the client, never forced on a provider that may refuse
        an unknown field. () when litellm cannot say which provider the worker is."""
        key = (worker.model, api_base)
        resolved = self._providers.get(key)
        if resolved is None:
            try:
                name, provider, _, _ = litellm.get_llm_provider(worker.model, api_base=api_base)
            except Exception:  # the call itself would have failed: nothing was answered to check
                return ()
            if len(self._providers) >= MAX_CACHED_ROUTES:
                self._providers.clear()
            resolved = self._providers[key] = (provider, name)
        provider, name = resolved
        return wire.ignored_params(
            provider, name, chat.forwarded_params(), lambda: self.messages_for(worker, chat)
        )

    async def aclose(self) -> None:
        """Close the pooled upstream connections of the running event loop."""
        await self.pool.aclose()

    @staticmethod
    def messages_for(worker: Worker, chat: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as sent to this worker: system text folded into user turns if it takes none."""
        messages = chat.messages_payload()
        return fold_system(messages) if worker.folds_system else messages

    def _kwargs(
        self,
        worker: Worker,
        api_base: str | None,
        chat: ChatCompletionRequest,
        messages: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": worker.model,
            "messages": self.messages_for(worker, chat) if messages is None else messages,
            "timeout": worker.timeout_s,
            "num_retries": 0,  # retries are ours (tenacity), so they are counted and bounded here
            # Tools belong to the client; without this litellm sends them through its MCP gateway.
            "_skip_mcp_handler": True,
            **chat.forwarded_params(),
        }
        if api_base:
            kwargs["api_base"] = api_base
        key = self._api_key(worker)
        if key:
            kwargs["api_key"] = key
        return kwargs

    def retries_for(self, worker: Worker) -> int:
        """The catalog entry's own `retries`, else the gateway's default."""
        return self.retries if worker.retries is None else worker.retries

    def _retrying(self, worker: Worker) -> AsyncRetrying:
        backoff = wait_exponential_jitter(
            initial=self.backoff_s, max=MAX_RETRY_AFTER_S, jitter=self.backoff_s
        )

        def wait(state: RetryCallState) -> float:
            """The backoff, or longer when the worker said how long to wait (Retry-After)."""
            failure = state.outcome.exception() if state.outcome is not None else None
            asked = retry_after_of(failure) if failure is not None else None
            return max(backoff(state), asked or 0.0)

        return AsyncRetrying(
            stop=stop_after_attempt(self.retries_for(worker) + 1),
            wait=wait,
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )

    async def _with_retries(
        self, worker: Worker, attempt_fn, failed: list[Attempt] | None = None, count_ok: bool = True
    ):
        """Run one call with retries on transient failures; the final failure becomes a WorkerError.

        Each call counts once in `polyroute_worker_attempts_total`: a failed or cut one here, an
        answered one here too unless ``count_ok`` is False (a stream, which counts itself when it ends
        with its final outcome: `OpenStream._count`).

        Each failed call is added to ``failed`` (when given) and the WorkerError carries them all
        (`WorkerError.attempts`), so the ledger can say which calls the provider may bill. Under a
        `CallScope` (`calling`), the policy in force is asked before each retry, and the calls a
        cancellation cuts short are handed to the scope (`CallScope.cut`)."""
        failed = [] if failed is None else failed
        scope = _SCOPE.get()
        last: Exception | None = None  # the failure the next retry would follow
        try:
            async for attempt in self._retrying(worker):
                if last is not None and scope is not None and scope.readmit is not None:
                    if (why := await scope.readmit(worker)) is not None:
                        raise _NotReadmitted(why) from last
                with attempt:
                    try:
                        result = await attempt_fn()
                    except Exception as exc:
                        self.metrics.worker_attempts.labels(worker.name, "error").inc()
                        tracing.attempt_failed(exc)
                        failed.append(attempt_of(worker, exc))
                        last = exc
                        raise
                    except asyncio.CancelledError:
                        # the call was sent and then cut: a workflow step's timeout, the request's
                        # deadline, a client gone or the shutdown. Counted, and not retried.
                        self.metrics.worker_attempts.labels(worker.name, "cancelled").inc()
                        failed.append(Attempt(worker.name, CANCELLED, 503, True))
                        raise
        except asyncio.CancelledError:
            if scope is not None:  # what it cut, and the calls retried before it, for the books
                scope.cut.extend(failed)
            raise
        except Exception as exc:
            left_out = isinstance(exc, _NotReadmitted)
            failure = exc.__cause__ if left_out and exc.__cause__ is not None else exc
            err = to_worker_error(worker, failure)
            err.attempts = tuple(failed)
            if left_out:
                err.append(" (not retried: the policy in force no longer admits it)")
            log.warning("worker %s failed: %s", worker.name, err.message)
            if err.prompt_tokens or err.completion_tokens:  # the provider billed it all the same
                self.metrics.record_usage(worker.name, err.prompt_tokens, err.completion_tokens, err.cost_usd)
            raise err from failure
        if count_ok:
            self.metrics.worker_attempts.labels(worker.name, "ok").inc()
        return result

    async def complete(self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest) -> Completion:
        with tracing.worker_call("chat", worker, api_base, chat) as call:  # None when tracing is off
            result = await self._complete(worker, api_base, chat)
            if call is not None:
                call.completed(result.body, result.prompt_tokens, result.completion_tokens)
            return result

    async def _complete(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> Completion:
        route = self._fast_route(worker, api_base, chat)
        messages = self.messages_for(worker, chat)  # sent, and kept to count usage the worker may not send
        if route is None:
            kwargs = self._kwargs(worker, api_base, chat, messages)
            tracing.inject_kwargs(kwargs)

            async def attempt() -> dict[str, Any]:
                response = await litellm.acompletion(**kwargs)
                return response.model_dump()

        else:
            built: list[tuple[str, dict[str, str], bytes]] = []

            async def attempt() -> dict[str, Any]:
                if not built:  # inside the retry wrapper, so a refused parameter is classified too
                    built.append(route.request(chat.forwarded_params(), messages, False))
                url, headers, payload = built[0]
                headers = tracing.inject(headers)  # the worker call's traceparent (when tracing is on)
                return await wire.complete(self.pool, route, url, headers, payload, worker.timeout_s)

        failed: list[Attempt] = []
        raw = await self._with_retries(worker, attempt, failed)
        tracing.responded(raw)
        body = clean_completion(worker, raw)
        counts = _usage_counts(body.get("usage"))
        estimated = counts is None
        if counts is None:  # no usage, or none readable: counted here, as a stream's is
            counts = count_tokens(worker, messages, _answer_text(body))
            body["usage"] = {
                "prompt_tokens": counts[0],
                "completion_tokens": counts[1],
                "total_tokens": sum(counts),
            }
        prompt_tokens, completion_tokens = counts
        cost = litellm_cost(worker, prompt_tokens, completion_tokens)
        self.metrics.record_usage(worker.name, prompt_tokens, completion_tokens, cost)
        return Completion(
            worker,
            body,
            prompt_tokens,
            completion_tokens,
            cost,
            usage_estimated=estimated,
            attempts=tuple(failed),
        )

    async def open_stream(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> OpenStream:
        """Start a stream and wait for its first chunk; failures up to then are retried and raised."""
        with tracing.worker_call("chat", worker, api_base, chat, end=False) as call:  # ends with the stream
            stream = await self._open_stream(worker, api_base, chat)
            stream.trace = call
            return stream

    async def _open_stream(
        self, worker: Worker, api_base: str | None, chat: ChatCompletionRequest
    ) -> OpenStream:
        route = self._fast_route(worker, api_base, chat)
        messages = self.messages_for(worker, chat)  # sent, and kept to count usage the worker may not send
        if route is None:
            kwargs = self._kwargs(worker, api_base, chat, messages)
            tracing.inject_kwargs(kwargs)
            kwargs["stream"] = True
            kwargs["stream_options"] = dict(STREAM_USAGE)

            async def start():
                response = await litellm.acompletion(**kwargs)
                rest = aiter(response)
                return await anext(rest), rest

        else:
            built: list[tuple[str, dict[str, str], bytes]] = []

            async def start():
                if not built:
                    params = {**chat.forwarded_params(), "stream": True, "stream_options": dict(STREAM_USAGE)}
                    built.append(route.request(params, messages, True))
                url, headers, payload = built[0]
                headers = tracing.inject(headers)  # the worker call's traceparent (when tracing is on)
                return await wire.open_stream(self.pool, route, url, headers, payload, worker.timeout_s)

        async def opened() -> tuple[list[Any], Any, AsyncIterator[Any]]:
            first, rest = await start()
            prelude, first = await _past_prelude(worker, first, rest, messages)
            return prelude, first, rest

        failed: list[Attempt] = []
        prelude, first, rest = await self._with_retries(worker, opened, failed, count_ok=False)
        tracing.responded(first)
        # the header's prompt-side estimate, as every prediction counts a prompt (policies/cost.py)
        prompt_cost = litellm_cost(worker, estimate_tokens(chat.prompt_chars(), None)[0], 0)
        return OpenStream(
            worker,
            first,
            rest,
            self.metrics,
            prompt_cost,
            messages=messages,
            prelude=prelude,
            attempts=tuple(failed),
        )
