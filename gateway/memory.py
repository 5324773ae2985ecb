"""Chat memory: retrieved context for the chosen worker, and the memory_expand loop run in the gateway.

A chat request gets memory when `metadata.collections` names collections of its tenant, when its
tenant has default collections (`POLYROUTE_MEMORY_DEFAULT_COLLECTIONS`), or when it carries
`metadata.session_id` (earlier turns of that session are a collection of their own). The worker
then sees a system message with layer 0 (index: id, title, one-line summary) for every hit and
layer 1 (a passage) for the top few, and may ask for more:

- workers with the `tools` capability get a `memory_expand(id, level)` tool. The gateway runs the
  call itself, appends the result as a tool message and calls the worker again;
- other workers are told to reply with the single line `MEMORY_EXPAND <id> <level>`; the gateway
  answers with a user message holding the text.

At most `memory_max_expansions` expansions per request; after that the worker is called once
more without the tool and told to answer. The client sees one answer, whose usage and cost add up
every round. Streams run the expansion rounds first (each round's start is peeked: an expansion
is consumed, an answer is passed through), so only the final turn reaches the client.
`metadata.memory: false` turns memory off for one request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import orjson
from starlette.requests import Request

from gateway import tracing
from gateway.collections import retriever
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, Message
from gateway.upstream import Completion, OpenStream, WorkerError
from retrieval import (
    TEXT_DIRECTIVE,
    TOOL_NAME,
    TOOL_SPEC,
    CollectionNotFound,
    DocumentInput,
    InvalidName,
    MemoryContext,
    Retriever,
    check_name,
    directive_query,
    parse_directive,
    recall,
    session_collection,
)

log = logging.getLogger("polyroute.memory")
MAX_COLLECTIONS = 8
MEMORY_HEADER = "x-polyroute-memory"
_DIRECTIVE_LINE = re.compile(rf"^\s*{TEXT_DIRECTIVE}\b.*$", re.M)


@dataclass
class MemoryPlan:
    """One request's memory: what was recalled, and the running tally of expansions."""

    context: MemoryContext
    retriever: Retriever
    tenant: str
    max_expansions: int
    session: str | None = None  # the session collection to append this turn to
    query: str = ""
    expansions: int = 0
    log: list[str] = field(default_factory=list)
    # Set once the policy has admitted the request: returns why a text may not be shown to the
    # admitted workers (a stricter data class than the request's), or None.
    withhold: Callable[[str], str | None] | None = None
    # the number of drops the store had made when the request began (`Retriever.generation`): a
    # DELETE /v1/sessions after that forgets this turn too, so its background write is skipped
    session_generation: int = 0

    def reveal(self, handle: str, level: object, query: str | None = None) -> str:
        """An expansion's text, unless the policy classes it above what this request was admitted for."""
        text = self.context.expand(handle, level, query)
        reason = self.withhold(text) if self.withhold is not None else None
        if reason is not None:
            self.log.append(f"{handle}:withheld")
            return f"[memory {handle} withheld: {reason}]"
        return text

    def injected_text(self) -> str:
        """What is put in front of the worker up front (layers 0 and 1), for the policy's detection."""
        return self.context.render(tools=True)

    def header(self) -> str:
        return f"entries={self.context.shown}; expansions={self.expansions}"


def default_collections(setting: str | None, tenant: str) -> list[str]:
    for part in (setting or "").split(";"):
        name, _, collections = part.partition("=")
        if name.strip() == tenant:
            return [c.strip() for c in collections.split(",") if c.strip()]
    return []


def _collections_param(chat: ChatCompletionRequest) -> list[str] | None:
    value = (chat.metadata or {}).get("collections")
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise APIError(
            400, "metadata.collections must be a list of collection names", param="metadata.collections"
        )
    if len(value) > MAX_COLLECTIONS:
        raise APIError(
            400,
            f"metadata.collections names at most {MAX_COLLECTIONS} collections",
            param="metadata.collections",
        )
    for name in value:
        try:
            check_name(name)
        except InvalidName as exc:
            raise APIError(
                400, str(exc), param="metadata.collections", code="invalid_collection_name"
            ) from None
    return list(dict.fromkeys(value))


async def plan(request: Request, state, tenant: str, chat: ChatCompletionRequest) -> MemoryPlan | None:
    """Recall layer 0/1 for this request, or None when no memory applies. Raises APIError (400/404)."""
    metadata = chat.metadata or {}
    if metadata.get("memory") is False:
        return None
    named = _collections_param(chat)
    session_id = metadata.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not 0 < len(session_id) <= 256):
        raise APIError(
            400, "metadata.session_id must be a string of 1 to 256 characters", param="metadata.session_id"
        )
    settings = state.settings
    if named is None and session_id is None:
        named = default_collections(settings.memory_default_collections, tenant)
        if not named:
            return None
        explicit = False
    else:
        explicit = True
    store = retriever(request.app)
    for name in named or []:
        if explicit and not store.exists(tenant, name):
            raise APIError(
                404,
                f"metadata.collections: no collection '{name}' for this tenant.",
                type="not_found_error",
                param="metadata.collections",
                code="collection_not_found",
            )
    sources = [(name, False) for name in named or []]
    session = session_collection(session_id) if session_id else None
    if session is not None:
        sources.append((session, True))
    generation = store.generation(tenant, session) if session is not None else 0  # before recall
    query = chat.last_user_text()
    try:
        with tracing.step("retrieval", **{"polyroute.collections": len(sources)}):
            context = await asyncio.to_thread(
                recall,
                store,
                tenant,
                sources,
                query,
                settings.memory_index_size,
                settings.memory_snippets,
                settings.memory_mode,
                pages=settings.memory_pages,
                title_words=settings.memory_title_words,
                summary_words=settings.memory_summary_words,
            )
    except Exception:
        log.exception("memory recall failed for tenant %s", tenant)
        raise APIError(
            503,
            "The request asks for memory and the collections cannot be searched right now; no worker was called.",
            type="server_error",
            code="memory_unavailable",
            headers={"retry-after": "1"},
        ) from None
    if not context and session is None:
        return None
    return MemoryPlan(
        context,
        store,
        tenant,
        settings.memory_max_expansions,
        session,
        query,
        session_generation=generation,
    )


# ---------------------------------------------------------------------------------- requests
def _uses_tools(worker) -> bool:
    return "tools" in worker.capabilities


def _with_memory(
    chat: ChatCompletionRequest, memory: MemoryPlan, tools: bool, offer: bool
) -> ChatCompletionRequest:
    """The request as the worker sees it: the memory system message after the client's own."""
    messages = list(chat.messages)
    if memory.context:
        note = Message(role="system", content=memory.context.render(tools=tools))
        at = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
        messages.insert(at, note)
    update: dict[str, Any] = {"messages": messages}
    if tools and offer and memory.context:
        update["tools"] = [*(chat.tools or []), TOOL_SPEC]
    return chat.model_copy(update=update)


def _final(
    chat: ChatCompletionRequest, client_chat: ChatCompletionRequest, tools: bool
) -> ChatCompletionRequest:
    """Expansion budget spent: no memory tool, and an instruction to answer now."""
    note = Message(
        role="system",
        content="The memory expansion limit for this request is reached: answer now with what you have"
        + ("." if tools else f"; do not write {TEXT_DIRECTIVE}."),
    )
    return chat.model_copy(
        update={
            "messages": [*chat.messages, note],
            "tools": client_chat.tools,
            "tool_choice": client_chat.tool_choice if client_chat.tools else None,
        }
    )


def _memory_calls(message: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    calls = message.get("tool_calls") or []
    mine = [c for c in calls if (c.get("function") or {}).get("name") == TOOL_NAME]
    return mine, [c for c in calls if c not in mine]


def _arguments(call: dict) -> tuple[str, object, str | None]:
    """(id, level, steering query) of a memory_expand call; a malformed call reads as an unknown id."""
    try:
        args = orjson.loads((call.get("function") or {}).get("arguments") or "{}")
    except orjson.JSONDecodeError:
        args = {}
    if not isinstance(args, dict):
        args = {}
    query = args.get("query")
    return str(args.get("id", "")), args.get("level", 2), query if isinstance(query, str) else None


async def _expand_tools(
    chat: ChatCompletionRequest, memory: MemoryPlan, message: dict, calls: list[dict]
) -> ChatCompletionRequest:
    results = []
    for call in calls:
        handle, level, query = _arguments(call)
        memory.expansions += 1
        memory.log.append(f"{handle}:{level}" + (":query" if query else ""))
        results.append(
            Message(
                role="tool",
                tool_call_id=call.get("id") or "call",
                # Off the event loop: a full read or a steered search waits on the shard (and embeds).
                content=await asyncio.to_thread(memory.reveal, handle, level, query),
            )
        )
    assistant = Message.model_validate(
        {"role": "assistant", "content": message.get("content") or None, "tool_calls": calls}
    )
    return chat.model_copy(update={"messages": [*chat.messages, assistant, *results]})


async def _expand_text(
    chat: ChatCompletionRequest, memory: MemoryPlan, content: str, directive: tuple[str, str]
) -> ChatCompletionRequest:
    handle, level = directive
    query = directive_query(content)
    memory.expansions += 1
    memory.log.append(f"{handle}:{level}" + (":query" if query else ""))
    text = await asyncio.to_thread(memory.reveal, handle, level, query)
    messages = [
        *chat.messages,
        Message(role="assistant", content=content.strip() or f"{TEXT_DIRECTIVE} {handle} {level}"),
        Message(
            role="user", content=f"[memory {handle}, level {level}]\n{text}\n\nContinue with your answer."
        ),
    ]
    return chat.model_copy(update={"messages": messages})


def _strip_directives(body: dict[str, Any]) -> None:
    """The final answer must not show the protocol to the client."""
    for choice in body.get("choices") or []:
        message = choice.get("message") or {}
        if isinstance(message.get("content"), str):
            message["content"] = _DIRECTIVE_LINE.sub("", message["content"]).strip()
        mine, others = _memory_calls(message)
        if mine:
            message["tool_calls"] = others or None
            if not others:
                message.pop("tool_calls", None)
                if choice.get("finish_reason") == "tool_calls":
                    choice["finish_reason"] = "stop"


def _merge(rounds: list[Completion]) -> Completion:
    """One answer for the rounds of a memory loop: the last one's body, every round's usage and cost.
    Estimated if any round's was (the ledger's trace then says so, as for one call)."""
    last = rounds[-1]
    if len(rounds) == 1:
        return last
    prompt = sum(r.prompt_tokens for r in rounds)
    completion = sum(r.completion_tokens for r in rounds)
    body = dict(last.body)
    body["usage"] = {
        **(body.get("usage") or {}),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return Completion(
        last.worker,
        body,
        prompt,
        completion,
        sum((r.cost_usd for r in rounds), Decimal(0)),
        usage_estimated=any(r.usage_estimated for r in rounds),
        attempts=tuple(a for r in rounds for a in r.attempts),  # every round's calls given up
    )


def _remember(state, memory: MemoryPlan, answer: str) -> None:
    """Append this turn (user + answer) to the session's collection, off the request path.

    A forget (DELETE /v1/sessions) that lands before this write, or while it waits, wins: the
    turn belongs to the forgotten session and is not stored (`CollectionDropped`), rather than
    re-creating the session the user just deleted. A forget after the write deletes the turn."""
    if memory.session is None:
        return
    question = memory.query
    session = memory.session

    def write() -> None:
        try:
            collection = memory.retriever.get(
                memory.tenant, session, create=True, internal=True, generation=memory.session_generation
            )
            stamp = f"{time.time():.6f}"
            title = "Turn: " + " ".join(question.split()[:10])
            collection.ingest(
                [DocumentInput(f"turn-{stamp}", f"User: {question}\nAssistant: {answer}", title)]
            )
        except CollectionNotFound:  # dropped since the request began: forgotten, as asked
            log.info("session turn not stored: the session was forgotten while it was answered")

    async def run() -> None:
        await asyncio.to_thread(write)

    state.spawn(run())


# ------------------------------------------------------------------------------ the calls
async def _covered(ex, state, worker, chat: ChatCompletionRequest, rounds: int) -> None:
    """Extend the request's budget hold to cover this round before it runs (`Exchange.cover`).

    The hold taken before the attempt covers one call with the client's prompt; the loop makes up
    to max_expansions + 2 calls, each with a longer prompt (memory, expansions). A round that would
    cross the budget is refused here (a 403 once no other worker fits); the rounds already
    answered stay billed."""
    try:
        await ex.cover(state, worker, chat)
    except WorkerError as refusal:
        if rounds:
            refusal.message = (
                f"memory round {rounds + 1} refused after {rounds} answered (those are billed): "
                + refusal.message
            )
        raise


async def _ask(state, ex, worker, api_base, chat: ChatCompletionRequest, rounds: list[Completion]) -> None:
    await _covered(ex, state, worker, chat, len(rounds))
    result = await state.client.complete(worker, api_base, chat)
    ex.spent(result.prompt_tokens, result.completion_tokens, result.cost_usd)
    rounds.append(result)


async def complete(state, ex, worker, api_base) -> Completion:
    """`state.client.complete` with memory: inject, run expansions, return one merged answer."""
    memory: MemoryPlan | None = ex.memory
    if memory is None:
        return await state.client.complete(worker, api_base, ex.chat)
    tools = _uses_tools(worker)
    chat = _with_memory(ex.chat, memory, tools, offer=memory.max_expansions > 0)
    rounds: list[Completion] = []
    memory.expansions = 0
    while True:
        await _ask(state, ex, worker, api_base, chat, rounds)
        result = rounds[-1]
        choices = result.body.get("choices") or []
        message = (choices[0].get("message") or {}) if choices else {}
        spent = memory.expansions >= memory.max_expansions
        if tools:
            mine, others = _memory_calls(message)
            if not mine or others:  # an answer, or the client's own tools (theirs to run)
                break
            if spent:
                chat = _final(chat, ex.chat, tools)
                await _ask(state, ex, worker, api_base, chat, rounds)
                break
            chat = await _expand_tools(chat, memory, message, mine)
        else:
            content = message.get("content") or ""
            directive = parse_directive(content) if isinstance(content, str) else None
            if directive is None:
                break
            if spent:
                chat = _final(chat, ex.chat, tools)
                await _ask(state, ex, worker, api_base, chat, rounds)
                break
            chat = await _expand_text(chat, memory, content, directive)
    ex.answered()  # the merged answer carries every round's usage and cost
    merged = _merge(rounds)
    _strip_directives(merged.body)
    ex.headers[MEMORY_HEADER] = memory.header()
    choices = merged.body.get("choices") or []
    _remember(state, memory, (choices[0].get("message") or {}).get("content") or "" if choices else "")
    return merged


def _plain(raw: Any) -> dict[str, Any]:
    return raw.model_dump() if hasattr(raw, "model_dump") else raw


async def _peek(iterator: AsyncIterator[dict], tools: bool) -> tuple[list[dict], str, dict | None, str]:
    """Read a round's first chunks: ('answer', …) to pass on, or ('expand', …) fully consumed.

    Returns (buffered chunks, kind, assembled assistant message for 'expand', text so far).
    """
    buffered: list[dict] = []
    text = ""
    calls: dict[int, dict] = {}
    async for chunk in iterator:
        buffered.append(chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(
                    call.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                function = call.get("function") or {}
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""
            text += delta.get("content") or ""
        if tools:
            if calls:
                if any(c["function"]["name"] and c["function"]["name"] != TOOL_NAME for c in calls.values()):
                    return buffered, "answer", None, text  # the client's own tool
                continue  # a memory call: read it to the end
            if text.strip():
                return buffered, "answer", None, text
        else:
            head = text.lstrip()
            if head and not (
                TEXT_DIRECTIVE.startswith(head[: len(TEXT_DIRECTIVE)]) or head.startswith(TEXT_DIRECTIVE)
            ):
                return buffered, "answer", None, text
    if calls:
        message = {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [calls[i] for i in sorted(calls)],
        }
        for i, call in enumerate(message["tool_calls"]):
            call["id"] = call["id"] or f"call_memory_{i}"
        return buffered, "expand", message, text
    if not tools and parse_directive(text):
        return buffered, "expand", None, text
    return buffered, "answer", None, text


def _scrub(buffered: list[dict], text: str) -> list[dict]:
    """Replace the content of buffered chunks by `text` (in the first content-bearing chunk)."""
    out, placed = [], False
    for chunk in buffered:
        choices = []
        for choice in chunk.get("choices") or []:
            delta = dict(choice.get("delta") or {})
            if "content" in delta:
                delta["content"] = "" if placed else text
                placed = True
            choices.append({**choice, "delta": delta})
        out.append({**chunk, "choices": choices})
    return out


class MemoryStream(OpenStream):
    """The final round's stream, after expansion rounds: buffered chunks first, usage summed."""

    def __init__(
        self,
        inner: OpenStream,
        iterator,
        buffered: list[dict],
        prior: tuple[int, int, Decimal],
        on_done: Callable[[str], None],
        prior_estimated: bool = False,
    ) -> None:
        OpenStream.__init__(self, inner.worker, None, None, inner.metrics, inner.prompt_cost_usd + prior[2])
        self._inner = inner
        self._prior_estimated = prior_estimated  # a consumed round's usage was counted here
        self._iterator = iterator
        self._buffered = buffered
        self._prior = prior
        self._on_done = on_done
        self.cost_usd = prior[2]
        self.prompt_tokens, self.completion_tokens = prior[0], prior[1]

    def _account(self, chunk: dict) -> dict:
        usage = chunk.get("usage")
        if usage and not chunk.get("choices"):
            p, c, cost = self._prior
            self.prompt_tokens = p + self._inner.prompt_tokens
            self.completion_tokens = c + self._inner.completion_tokens
            self.cost_usd = cost + self._inner.cost_usd
            chunk = {
                **chunk,
                "usage": {
                    **usage,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": self.prompt_tokens + self.completion_tokens,
                },
            }
        return chunk

    @property
    def usage_estimated(self) -> bool:  # type: ignore[override]
        """The final round's counts, or a consumed round's, were counted here (the provider reported
        none): the usage chunk and the ledger say "estimated", as for a stream without memory."""
        return self._prior_estimated or self._inner.usage_estimated

    def account_cut(self) -> bool:
        """Cut short: the final round's streamed part (estimated if need be) plus the consumed rounds."""
        estimated = self._inner.account_cut()
        self._total()
        return estimated or self._prior_estimated

    def _total(self) -> None:
        self.prompt_tokens = self._prior[0] + self._inner.prompt_tokens
        self.completion_tokens = self._prior[1] + self._inner.completion_tokens
        self.cost_usd = self._prior[2] + self._inner.cost_usd

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        text: list[str] = []
        try:
            for chunk in self._buffered:
                for choice in chunk.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
                yield self._account(chunk)
            async for chunk in self._iterator:
                for choice in chunk.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
                yield self._account(chunk)
        finally:
            self._total()
            await self._iterator.aclose()
            self._on_done("".join(text))


async def open_stream(state, ex, worker, api_base) -> OpenStream:
    """`state.client.open_stream` with memory: expansion rounds are consumed, the answer streams."""
    memory: MemoryPlan | None = ex.memory
    if memory is None:
        return await state.client.open_stream(worker, api_base, ex.chat)
    tools = _uses_tools(worker)
    chat = _with_memory(ex.chat, memory, tools, offer=memory.max_expansions > 0)
    prior = (0, 0, Decimal(0))
    prior_estimated = False  # a consumed round's usage was counted here
    given_up: tuple = ()  # calls a consumed round's worker gave up before its stream opened
    memory.expansions = 0
    rounds = 0
    iterator = None

    async def start(chat: ChatCompletionRequest):
        nonlocal rounds
        await _covered(ex, state, worker, chat, rounds)  # the round that would cross the budget: refused
        rounds += 1
        stream = await state.client.open_stream(worker, api_base, chat)
        return stream, stream.__aiter__()

    try:
        while True:
            stream, iterator = await start(chat)
            buffered, kind, message, text = await _peek(iterator, tools)
            if kind == "answer" or (message is not None and not _memory_calls(message)[0]):
                break  # an answer (or calls without a name: nothing to run) streams on as it is
            prior = (
                prior[0] + stream.prompt_tokens,
                prior[1] + stream.completion_tokens,
                prior[2] + stream.cost_usd,
            )
            prior_estimated = prior_estimated or stream.usage_estimated
            given_up += stream.attempts
            ex.spent(stream.prompt_tokens, stream.completion_tokens, stream.cost_usd)  # owed from now on
            if memory.expansions >= memory.max_expansions:
                chat = _final(chat, ex.chat, tools)
                stream, iterator = await start(chat)
                buffered, kind, _, text = await _peek(iterator, tools)
                if kind == "expand" and not tools:  # still asking: show the client only the rest
                    buffered = _scrub(buffered, _DIRECTIVE_LINE.sub("", text).strip())
                break
            if message is not None:
                chat = await _expand_tools(chat, memory, message, _memory_calls(message)[0])
            else:
                directive = parse_directive(text)
                assert directive is not None
                chat = await _expand_text(chat, memory, text, directive)
    except BaseException:
        if iterator is not None:  # a round cut short (deadline, failure): its connection goes now
            await asyncio.shield(iterator.aclose())
        raise
    ex.answered()  # the stream's usage carries the consumed rounds (`prior`)
    ex.headers[MEMORY_HEADER] = memory.header()
    merged = MemoryStream(
        stream, iterator, buffered, prior, lambda answer: _remember(state, memory, answer), prior_estimated
    )
    merged.attempts = given_up + stream.attempts  # the ledger's trace says which calls may be billed
    return merged


# ------------------------------------------------------------------------------ workflows
def workflow_messages(memory: MemoryPlan | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A composed workflow's view of the conversation: layers 0 and 1 as a system message after
    the client's own. Workflows run no expansion loop, so the how-to-expand line is left out."""
    if memory is None or not memory.context:
        return messages
    lines = memory.context.render(tools=True).split("\n")
    note = {"role": "system", "content": "Memory retrieved for this request:\n" + "\n".join(lines[1:])}
    at = next(
        (i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages)
    )
    return [*messages[:at], note, *messages[at:]]


def remember(state, memory: MemoryPlan | None, answer: str) -> None:
    """Store a composed answer's turn in the session memory, as fast mode does."""
    if memory is not None:
        _remember(state, memory, answer)
