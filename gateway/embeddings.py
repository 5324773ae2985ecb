"""POST /v1/embeddings: OpenAI's embeddings API over the catalog's embedding workers.

The same pipeline as chat, minus routing: key → tenant, a strict body, rate limits, data-class
detection and policy admission, a budget hold, one worker call (retried, never fallen back: another
model's vectors live in another space), settle, ledger, metrics, the access line and the
x-polyroute-* headers. `model: "auto"` is refused for that reason; clients name an embedding worker
or an embeddings alias of the policy (`aliases: {embed: {worker: minilm-local}}`).

Two kinds of worker:
- in-process (`embedder:` in the catalog): a retrieval embedder (retrieval/embed.py), the very
  MiniLM instance retrieval uses, run in one thread of its own (a fast tokenizer is not safe to
  share between threads);
- everything else through `litellm.aembedding`, with the chat calls' retries and error classes.

Budgets: the hold is an upper bound of what the call can cost, so settled + held never passes a
budget: tokens counted exactly for in-process workers and token arrays, and for text sent to a
provider the UTF-8 bytes plus two per input (a BPE token covers at least one byte).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from gateway import ratelimits, tracing
from gateway.body import heavy_if, is_large, read_model
from gateway.completions import (
    DATA_CLASS_HEADER,
    budget_store_down,
    budget_usage,
    evaluate_policy,
    format_cost,
    log_access,
    policy_headers,
    refused,
    require_policy,
    store_reply_error,
    tenant_budget,
)
from gateway.errors import APIError, error_response
from gateway.ledger import RequestRecord
from gateway.state import AppState
from gateway.store import BudgetExceeded, Limit, Reservation, StoreReplyError, StoreUnavailable, to_micros
from gateway.upstream import Attempt, CallScope, WorkerError, attempts_header, calling, with_attempts
from policies import Admission, PolicyRequest, Worker
from policies.admission import BUDGET_RULE_PREFIX
from policies.catalog import Catalog, Kind

log = logging.getLogger("polyroute.gateway")

AUTO = "auto"
STRATEGY = "embedding"  # the strategy label of embeddings in metrics, the access line and the ledger
MAX_BATCH = 2048  # inputs per request, as OpenAI allows
SPECIAL_TOKENS = 2  # per input: [CLS] and [SEP] (MiniLM), or a provider's BOS/EOS, in the budget bound
_LOCAL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyroute-embed")


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request. `input` is checked by `parse_inputs` (clearer errors than a union)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    input: Any
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(None, ge=1, le=65536)
    user: StrictStr | None = Field(None, max_length=512)
    metadata: dict[str, Any] | None = None  # polyroute: metadata.data_class, as on chat requests

    def data_class(self, request: Request) -> str | None:
        tag = (self.metadata or {}).get("data_class")
        return tag if isinstance(tag, str) else request.headers.get(DATA_CLASS_HEADER)


Input = str | list[int]
INPUT_SHAPES = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


def _bad_input(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param="input", code=code)


def parse_inputs(value: Any) -> list[Input]:
    """The batch: strings, or token-id arrays (cl100k_base ids, as OpenAI's embedding models take)."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise _bad_input(f"input must be {INPUT_SHAPES}")
    elif value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]  # one token array
    if not value:
        raise _bad_input("input must not be empty")
    if len(value) > MAX_BATCH:
        raise _bad_input(
            f"input has {len(value)} items; at most {MAX_BATCH} inputs per request (split the batch)",
            "batch_too_large",
        )
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise _bad_input(f"input[{i}] is an empty string; every input needs text")
        elif isinstance(item, list):
            if not item:
                raise _bad_input(f"input[{i}] is an empty token array")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise _bad_input(
                    f"input[{i}] mixes token ids with other values; input must be {INPUT_SHAPES}"
                )
        else:
            raise _bad_input(f"input[{i}] is neither text nor a token array; input must be {INPUT_SHAPES}")
    return value


@cache
def _cl100k():
    """OpenAI's embedding tokenizer, from litellm's bundled copy (no download)."""
    from litellm.litellm_core_utils.default_encoding import encoding

    return encoding


def _not_a_token(encoding, token: int) -> bool:
    """Whether cl100k_base has no token of this id (it has gaps inside its range)."""
    try:
        encoding.decode_single_token_bytes(token)
    except KeyError:
        return True
    return False


def texts_of(inputs: list[Input]) -> list[str]:
    """Each input as text: token arrays decoded with cl100k_base, the encoding OpenAI's embedding
    models use (and LangChain's OpenAIEmbeddings sends). What detection reads and in-process
    workers embed; an id outside the encoding is a 400."""
    out: list[str] = []
    encoding = None
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            out.append(item)
            continue
        encoding = encoding or _cl100k()
        bad = next((t for t in item if not 0 <= t < encoding.n_vocab), None)
        try:
            if bad is not None:
                raise KeyError(bad)
            out.append(encoding.decode(item))
        except KeyError as exc:
            # out of range, or a gap inside it (100256, 100261..100275 are no tokens)
            token = bad if bad is not None else (exc.args[0] if exc.args else None)
            if not isinstance(token, int):
                token = next((t for t in item if _not_a_token(encoding, t)), "?")
            raise _bad_input(
                f"input[{i}] holds token id {token}, which is no token of cl100k_base "
                f"(ids 0..{encoding.n_vocab - 1}, with gaps)",
            ) from None
    return out


# ---------------------------------------------------------------------------------- workers
@cache
def _wordpieces():
    """MiniLM's own tokenizer, without truncation: counts what an in-process worker reads."""
    from tokenizers import Tokenizer

    from retrieval.embed import model_path

    tokenizer = Tokenizer.from_file(str(model_path() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _local_window(worker: Worker) -> int:
    from retrieval.embed import shared_embedder

    return min(worker.context_window, shared_embedder(worker.embedder).max_seq_length)


def _count_local(worker: Worker, texts: list[str]) -> list[int]:
    """Tokens per input as the model reads them, special tokens included (runs in the embed thread)."""
    return [len(e.ids) for e in _wordpieces().encode_batch(texts, add_special_tokens=True)]


def _encode_local(worker: Worker, texts: list[str]) -> np.ndarray:
    from retrieval.embed import shared_embedder

    return shared_embedder(worker.embedder).encode(texts)


async def _in_embed_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_LOCAL, fn, *args)


@dataclass(slots=True)
class Embedded:
    vectors: np.ndarray  # [inputs, dimensions] float32
    prompt_tokens: int
    attempts: tuple[Attempt, ...] = ()  # the worker's calls given up before this answer (retried)


class UpstreamShapeError(Exception):
    """The worker answered, but not with one vector of the expected size per input."""

    status_code = 502


def _as_vectors(worker: Worker, data: list[Any], count: int, size: int) -> np.ndarray:
    rows: list[tuple[int, Any]] = []
    for item in data:
        get = item.get if isinstance(item, dict) else lambda k, d=None, item=item: getattr(item, k, d)
        rows.append((int(get("index", len(rows)) or 0), get("embedding")))
    rows.sort(key=lambda r: r[0])
    vectors = []
    for _, embedding in rows:
        if isinstance(embedding, str):  # a provider that answered base64 anyway
            embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
        vectors.append(np.asarray(embedding, dtype=np.float32))
    if len(vectors) != count or any(v.shape != (size,) for v in vectors):
        shapes = sorted({v.shape[0] if v.ndim == 1 else -1 for v in vectors})
        raise UpstreamShapeError(
            f"{worker.name} answered {len(vectors)} vectors of sizes {shapes}; expected {count} of {size}"
        )
    return np.stack(vectors)


@cache
def _NoRetry():  # noqa: N802 - a class, built on first use (openai is imported lazily)
    import openai

    class NoRetryOpenAI(openai.AsyncOpenAI):
        """litellm sets `client.max_retries` to its default (2) when asked for 0; this client stays at 0."""

        @property
        def max_retries(self) -> int:
            return 0

        @max_retries.setter
        def max_retries(self, value: int) -> None:
            pass

    return NoRetryOpenAI


_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {(base, key): client}


def _openai_client(model: str, base: str | None, key: str | None):
    """For OpenAI-wire workers, an AsyncOpenAI client of our own that never retries: litellm's embedding
    path turns max_retries=0 into its default of 2 (also on a client it is given), which would multiply
    our retries (the chat calls' policy, counted in metrics) by three. One client per event loop, base and key, reused. Other
    providers go through litellm's own clients (their retries, if any, are litellm's)."""
    import litellm

    try:
        _, provider, _, _ = litellm.get_llm_provider(model=model, api_base=base)
    except Exception:
        return None
    if provider != "openai":
        return None
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    client = clients.get((base, key))
    if client is None:
        if len(clients) >= 64:
            clients.clear()
        client = clients[(base, key)] = _NoRetry()(
            api_key=key or "sk-no-key", base_url=base or "https://api.openai.com/v1", max_retries=0
        )
    return client


async def _call_remote(
    state: AppState, worker: Worker, inputs: list[Input], dimensions: int | None, user: str | None
) -> Embedded:
    import litellm

    kwargs: dict[str, Any] = {
        "model": worker.model,
        "input": inputs,
        "timeout": worker.timeout_s,
        "num_retries": 0,  # retries are ours (the chat calls' tenacity policy), counted and bounded
        "max_retries": 0,
    }
    if dimensions is not None and dimensions != worker.dimensions:
        kwargs["dimensions"] = dimensions
        # The catalog says the worker can shorten (supports_dimensions); litellm would otherwise refuse
        # `dimensions` for any OpenAI-wire model not named text-embedding-3*.
        kwargs["allowed_openai_params"] = ["dimensions"]
    if user is not None:
        kwargs["user"] = user
    if (base := state.api_base(worker)) is not None:
        kwargs["api_base"] = base
    if (key := worker.api_key()) is not None:
        kwargs["api_key"] = key
    if (client := _openai_client(worker.model, base, key)) is not None:
        kwargs["client"] = client
    tracing.inject_kwargs(kwargs)  # the worker call's traceparent (when tracing is on)
    size = dimensions or worker.dimensions or 0

    async def attempt():
        response = await litellm.aembedding(**kwargs)
        raw = response.model_dump() if hasattr(response, "model_dump") else response
        tracing.responded(raw)  # gen_ai.response.model on the worker call's span, as chat's
        vectors = _as_vectors(worker, raw.get("data") or [], len(inputs), size)
        usage = raw.get("usage") or {}
        return Embedded(vectors, int(usage.get("prompt_tokens") or 0))

    failed: list[Attempt] = []
    result = await state.client._with_retries(worker, attempt, failed)
    result.attempts = tuple(failed)
    return result


# ---------------------------------------------------------------------------------- the request
def _resolve(catalog: Catalog, engine, model: str) -> Worker:
    """The embedding worker a request names, directly or through an embeddings alias of the policy,
    in `catalog` (the request's: AppState.catalog_for)."""
    if model == AUTO or model.startswith("compose:"):
        raise APIError(
            400,
            f"model '{model}' is not available for embeddings: each embedding model has its own vector "
            "space, so vectors from different workers cannot be compared, and a router choosing per "
            f"request would mix them. Name an embedding model ({', '.join(_embedding_names(catalog, engine))}) "
            "or an alias the policy maps to one (aliases: {name: {worker: ...}}).",
            param="model",
            code="model_not_supported",
        )
    worker = catalog.get(model, kind=Kind.embedding)
    if worker is not None:
        return worker
    alias = engine.policy.embedding_aliases.get(model) if engine is not None else None
    if alias is not None:
        worker = catalog.get(alias.worker, kind=Kind.embedding)
        if worker is None:
            raise APIError(
                404,
                f"The alias '{model}' maps to '{alias.worker}', which is not an embedding worker of this "
                "catalog (fix the policy's aliases or the catalog)",
                param="model",
                code="model_not_found",
            )
        return worker
    if catalog.get(model, kind=None) is not None or (engine is not None and model in engine.policy.aliases):
        raise APIError(
            400,
            f"'{model}' is a chat model; embeddings come from: {', '.join(_embedding_names(catalog, engine))}",
            param="model",
            code="model_not_embedding",
        )
    raise APIError(
        404,
        f"The embedding model '{model}' does not exist. Use one of: {', '.join(_embedding_names(catalog, engine))}",
        param="model",
        code="model_not_found",
    )


def _embedding_names(catalog: Catalog, engine) -> list[str]:
    aliases = list(engine.policy.embedding_aliases) if engine is not None else []
    return [*(w.name for w in catalog.of_kind(Kind.embedding)), *aliases] or ["(none in the catalog)"]


def _admit(state: AppState, engine, tenant: str, model: str, body: EmbeddingRequest, texts, request, spend):
    """The policy's verdict over the embedding workers (detection over every text a worker is sent)."""
    require_policy(state, engine)
    policy_request = PolicyRequest(
        tenant=tenant,
        model=model,
        texts=(*texts, *((body.user,) if body.user else ())),
        data_class=body.data_class(request),
        prompt_chars=sum(len(t) for t in texts),
        max_output_tokens=None,
        spend=spend,
    )
    return evaluate_policy(state, state.catalog_for(request), engine, policy_request, Kind.embedding)


def _not_admitted(admission: Admission, worker: Worker) -> APIError:
    exclusion = admission.exclusion_for(worker.name)
    reason = f"{exclusion.reason} [{exclusion.rule}]" if exclusion else "not admitted"
    if exclusion is not None and exclusion.rule.startswith(BUDGET_RULE_PREFIX):
        # the tenant's budget: the code the reservation gives for it too (`_Books.reserve`)
        return APIError(
            403,
            f"No worker was called: {worker.name}: {exclusion.rule}: {exclusion.reason}",
            type="insufficient_quota",
            code="budget_exceeded",
        )
    if exclusion is not None and exclusion.rule != "unavailable":
        return APIError(
            403,
            f"Policy {admission.policy_version} does not admit '{worker.name}' for this request (data class "
            f"{admission.data_class}; rule {exclusion.rule}: {exclusion.reason}). No worker was called.",
            type="permission_error",
            code="policy_denied",
        )
    return APIError(
        503, f"'{worker.name}' cannot be called: {reason}", type="server_error", code="no_admissible_worker"
    )


def _check_dimensions(worker: Worker, dimensions: int | None) -> None:
    if dimensions is None or dimensions == worker.dimensions:
        return
    if not worker.supports_dimensions:
        raise APIError(
            400,
            f"'{worker.name}' makes {worker.dimensions}-dimensional vectors and cannot shorten them; "
            f"leave dimensions out (or set it to {worker.dimensions})",
            param="dimensions",
            code="unsupported_dimensions",
        )
    if dimensions > (worker.dimensions or 0):
        raise APIError(
            400,
            f"'{worker.name}' makes {worker.dimensions}-dimensional vectors; dimensions must be at most that",
            param="dimensions",
            code="invalid_value",
        )


def _context_error(worker: Worker, index: int, tokens: int, window: int) -> APIError:
    return APIError(
        400,
        f"input[{index}] is {tokens} tokens; '{worker.name}' reads at most {window} per input. "
        "Split the text into smaller chunks.",
        param="input",
        code="context_length_exceeded",
    )


def _worker_error(err: WorkerError) -> APIError:
    if not err.fallback:  # the worker refused the request itself: the client must change it
        status = err.status if 400 <= err.status < 500 else 400
        return APIError(status, f"{err.worker}: {err.message}", code="upstream_rejected")
    if err.status == 429:
        return APIError(
            429,
            f"{err.worker} is rate limited: {err.message}",
            type="rate_limit_error",
            code="upstream_rate_limited",
            headers={"retry-after": "1"},
        )
    if err.status == 504:
        return APIError(
            504, f"{err.worker} timed out: {err.message}", type="server_error", code="upstream_timeout"
        )
    return APIError(502, f"{err.worker} failed: {err.message}", type="server_error", code="upstream_failed")


@dataclass(frozen=True, slots=True)
class EmbeddingRecord(RequestRecord):
    """A ledger request record of /v1/embeddings (no query: inputs are documents, never stored)."""

    endpoint: str = "embeddings"


@dataclass
class _Books:
    """One request's budget hold, rate-limit charge and ledger entry."""

    request_id: str
    tenant: str
    model: str
    worker: Worker
    admission: Admission
    budget: Any
    limits: list
    inputs: int
    started: float
    hold: Reservation | None = None

    async def reserve(self, state: AppState, micros: int) -> None:
        if not self.budget.any:
            return
        try:
            self.hold = await state.stores.budgets.reserve(self.tenant, micros, self.budget)
        except BudgetExceeded as exc:
            raise APIError(
                403,
                f"No worker was called: {self.worker.name}: budget:{exc.period}: {exc}",
                type="insufficient_quota",
                code="budget_exceeded",
            ) from None
        except StoreUnavailable as exc:
            state.metrics.store_unavailable.labels("budgets").inc()
            raise budget_store_down(exc) from None

    async def finish(
        self, state: AppState, status: int, prompt_tokens: int = 0, cost: Decimal = Decimal(0), trace=None
    ) -> int:
        """Settle the hold with the actual cost, correct the token limits, log and write the ledger."""
        micros = to_micros(cost)
        hold, self.hold = self.hold, None
        if hold is not None:
            await state.stores.budgets.settle(hold, micros)
        elif micros:
            state.stores.budgets.record(self.tenant, micros)
        if self.limits:
            await ratelimits.correct_tokens(state.stores.limiter, self.tenant, self.limits, prompt_tokens)
        latency_ms = round((time.perf_counter() - self.started) * 1000, 2)
        log_access(
            self.request_id,
            self.tenant,
            self.model,
            self.worker.name,
            STRATEGY,
            status,
            latency_ms,
            micros,
            f"endpoint=embeddings inputs={self.inputs}",
        )
        state.ledger.record_request(
            EmbeddingRecord(
                id=self.request_id,
                tenant=self.tenant,
                model=self.model,
                worker=self.worker.name,
                strategy=STRATEGY,
                status=status,
                prompt_tokens=prompt_tokens,
                cost_micros=micros,
                latency_ms=latency_ms,
                policy_version=self.admission.policy_version,
                data_class=self.admission.data_class,
                trace=trace,
            )
        )
        state.metrics.requests.labels(self.worker.name, STRATEGY, str(status)).inc()
        tracing.current().settled_embedding(self, status, cost)
        return micros


async def _failed(
    state: AppState, books: _Books, err: APIError, headers: dict[str, str], trace, attempts=()
) -> Response:
    """The worker was called and did not answer: the hold goes (nothing is billed), one access line,
    one ledger record, the error in OpenAI's shape; its calls given up (``attempts``: retried, or cut
    by the deadline) in the trace and the header, as chat's are."""
    err.headers = {**headers, **err.headers, **attempts_header(attempts), "x-polyroute-cost-usd": "0"}
    tracing.error(err, headers)
    await books.finish(state, err.status, trace=with_attempts(trace, attempts))
    state.metrics.errors.labels(err.code or err.type).inc()
    state.metrics.observe_latency(books.started)
    return error_response(err)


def _budget_bound(inputs: list[Input], local_counts: list[int] | None) -> int:
    """The most tokens this batch can be billed for (see the module's docstring)."""
    if local_counts is not None:
        return sum(local_counts)
    return sum(len(i) if isinstance(i, list) else len(i.encode("utf-8")) + SPECIAL_TOKENS for i in inputs)


def _prepare(state, engine, tenant, model, body, inputs, request, spend):
    """CPU work on the request's text (heavy lane for a large body): the texts and the policy's verdict."""
    texts = texts_of(inputs)
    return texts, _admit(state, engine, tenant, model, body, texts, request, spend)


@tracing.traced  # the request's span (gateway/tracing.py); nothing when tracing is off
async def embeddings(request: Request) -> Response:
    state: AppState = request.app.state.polyroute
    started = time.perf_counter()
    request_id = "req_" + uuid.uuid4().hex
    headers = {"x-polyroute-request-id": request_id}
    engine = state.policy.engine  # one policy snapshot for the whole request
    catalog = state.catalog_for(request)  # one catalog for the whole request, prices included
    charged: list[Limit] = []  # the rate limits this request's tokens were charged to
    try:
        key = await state.auth.client(request)
        body = await read_model(request, EmbeddingRequest, state.settings.max_body_bytes)
        large = is_large(request)
        inputs = await heavy_if(large, parse_inputs, body.input)
        worker = _resolve(catalog, engine, body.model)
        _check_dimensions(worker, body.dimensions)
        if engine is not None:
            headers["x-polyroute-policy-version"] = engine.version
        estimate = sum(len(i) if isinstance(i, list) else max(1, len(i) // 4) for i in inputs)
        limits = ratelimits.limits_under(engine, key, estimate)
        headers |= await ratelimits.enforce(state.stores.limiter, state.metrics, key.tenant, limits)
        charged = limits
        budget = tenant_budget(engine, key.tenant)
        spend = await budget_usage(state, key.tenant, budget)
        with tracing.step("policy"):
            texts, admission = await heavy_if(
                large, _prepare, state, engine, key.tenant, body.model, body, inputs, request, spend
            )
        tracing.admitted(admission)
        headers |= policy_headers(request_id, admission)
        if not admission.admits(worker.name):
            raise _not_admitted(admission, worker)
        local_counts = None
        if worker.embedder is not None:  # the model's own count: exact usage, and too long is a 400
            window = _local_window(worker)
            local_counts = await _in_embed_thread(_count_local, worker, texts)
            if (too_long := next((i for i, n in enumerate(local_counts) if n > window), None)) is not None:
                raise _context_error(worker, too_long, local_counts[too_long], window)
        books = _Books(
            request_id, key.tenant, body.model, worker, admission, budget, limits, len(inputs), started
        )
        await books.reserve(state, to_micros(worker.cost_usd(_budget_bound(inputs, local_counts), 0)))
    except (APIError, StoreReplyError) as exc:  # StoreReplyError: e.g. the rate-limit script
        err = exc if isinstance(exc, APIError) else store_reply_error(exc)
        if charged:  # refused before the worker call (policy, budget, a too-long input): no tokens used
            await ratelimits.give_back(state.stores.limiter, key.tenant, charged)
        return refused(state, err, headers, endpoint="embeddings", started=started)
    headers |= {"x-polyroute-worker": worker.name, "x-polyroute-strategy": STRATEGY}
    try:
        return await _answer(state, books, body, worker, inputs, texts, local_counts, headers)
    except StoreReplyError as exc:  # a settle Redis rejected: this request stops here
        return refused(state, store_reply_error(exc), headers, endpoint="embeddings", started=started)


async def _answer(state, books: _Books, body, worker, inputs, texts, local_counts, headers) -> Response:
    trace = {"inputs": len(inputs), "dimensions": body.dimensions or worker.dimensions}
    calls = CallScope()  # keeps the calls the deadline cuts short (gateway/upstream.py)
    try:
        try:
            async with asyncio.timeout(
                max(0.0, books.started + state.settings.request_timeout_s - time.perf_counter())
            ):
                with (
                    tracing.worker_call("embeddings", worker, state.api_base(worker)) as call,
                    calling(calls),
                ):
                    if worker.embedder is not None:
                        vectors = await _in_embed_thread(_encode_local, worker, texts)
                        result = Embedded(vectors, sum(local_counts or ()))
                        state.metrics.worker_attempts.labels(worker.name, "ok").inc()
                    else:
                        result = await _call_remote(state, worker, inputs, body.dimensions, body.user)
                    if call is not None:
                        call.usage(result.prompt_tokens)
        except WorkerError as exc:
            return await _failed(state, books, _worker_error(exc), headers, trace, exc.attempts)
        except TimeoutError:
            err = APIError(
                504,
                f"{worker.name} did not answer within the request's deadline of "
                f"{state.settings.request_timeout_s:g} s",
                type="server_error",
                code="request_timeout",
            )
            return await _failed(state, books, err, headers, trace, calls.cut_by("deadline", 504))
        except Exception:
            if worker.embedder is None:
                raise
            log.exception("in-process embedding worker %s failed", worker.name)
            state.metrics.worker_attempts.labels(worker.name, "error").inc()
            err = APIError(
                500, f"{worker.name} failed in the gateway", type="server_error", code="worker_failed"
            )
            return await _failed(state, books, err, headers, trace)
        cost = worker.cost_usd(result.prompt_tokens, 0)
        state.metrics.record_usage(worker.name, result.prompt_tokens, 0, cost)
        await books.finish(
            state, 200, result.prompt_tokens, cost, trace=with_attempts(trace, result.attempts)
        )
    except BaseException:  # cancelled (client gone) or a bug: no hold outlives the request
        if books.hold is not None:
            hold, books.hold = books.hold, None
            await asyncio.shield(state.stores.budgets.release(hold))
        raise
    state.metrics.observe_latency(books.started)
    headers = {**headers, **attempts_header(result.attempts), "x-polyroute-cost-usd": format_cost(cost)}
    return Response(
        orjson.dumps(
            _body(worker, result, body.encoding_format or "float"), option=orjson.OPT_SERIALIZE_NUMPY
        ),
        media_type="application/json",
        headers=headers,
    )


def _body(worker: Worker, result: Embedded, encoding: str) -> dict:
    vectors = result.vectors
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        raw = vectors.astype("<f4", copy=False)
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in raw]
    else:
        data = list(vectors)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": worker.name,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


# ---------------------------------------------------------------------------------- /v1/models
def model_cards(catalog: Catalog, engine) -> list[dict]:
    """/v1/models entries of the embedding workers of `catalog` (the request's, AppState.catalog_for:
    the same version as the chat workers listed beside them) and the policy's embeddings aliases."""
    cards = []
    for worker in catalog.of_kind(Kind.embedding):
        unavailable = worker.availability()
        cards.append(
            {
                "id": worker.name,
                "object": "model",
                "created": 0,
                "owned_by": worker.provider,
                "polyroute": {
                    "kind": "embedding",
                    "available": unavailable is None,
                    "unavailable_reason": unavailable,
                    "dimensions": worker.dimensions,
                    "supports_dimensions": worker.supports_dimensions,
                    "input_price_per_m": str(worker.input_price_per_m),
                    "tier": worker.tier.value,
                    "license": worker.license,
                    "jurisdiction": worker.jurisdiction,
                    "region": worker.region,
                    "context_window": worker.context_window,
                    "in_process": worker.embedder is not None,
                },
            }
        )
    for alias, target in engine.policy.embedding_aliases.items() if engine is not None else ():
        worker = catalog.get(target.worker, kind=Kind.embedding)
        cards.append(
            {
                "id": alias,
                "object": "model",
                "created": 0,
                "owned_by": "polyroute",
                "polyroute": {
                    "kind": "embedding",
                    "alias": True,
                    "worker": target.worker,
                    "description": target.description,
                    "available": worker is not None and worker.availability() is None,
                },
            }
        )
    return cards
