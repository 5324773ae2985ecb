"""The OpenAI-wire fast path: litellm's provider transforms, sent over our own pooled HTTP client.

For a worker whose provider speaks the OpenAI chat wire format (openai, together_ai, deepseek,
mistral, hosted_vllm — including any OpenAI-compatible server behind a custom api_base, such as
llama.cpp), litellm still owns the translation: `get_llm_provider` resolves provider, model name,
api_base and key; the provider's chat config maps the OpenAI parameters (`get_optional_params`),
builds the body (`transform_request`), the headers (`validate_environment`) and the URL
(`get_complete_url`); litellm's exception mapping classifies upstream errors. What this module
skips is the per-call machinery around them (SDK client set-up, logging objects, callbacks,
response model objects, cost hooks): the request goes out over one keep-alive aiohttp
session per event loop, responses are parsed with orjson, SSE is split here.

Providers that are not OpenAI-wire (anthropic, bedrock, vertex, ...) and requests litellm would
bridge to the Responses API stay on `litellm.acompletion` (see gateway/upstream.py).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import aiohttp
import httpx
import litellm
import orjson
from litellm import LlmProviders, ProviderConfigManager
from litellm.litellm_core_utils.exception_mapping_utils import exception_type
from litellm.llms.openai.chat.gpt_transformation import OpenAIGPTConfig
from litellm.main import responses_api_bridge_check
from litellm.utils import get_optional_params

log = logging.getLogger("polyroute.upstream")

# litellm providers whose chat endpoint is the OpenAI wire format (request, response and SSE).
OPENAI_WIRE_PROVIDERS = frozenset({"openai", "together_ai", "deepseek", "mistral", "hosted_vllm"})

# One pool per event loop: HTTP/1.1 keep-alive to every upstream host. aiohttp rather than httpx:
# on this path httpx/httpcore cost 1.3-2.2 ms CPU per request, aiohttp 0.17-0.28 ms (measured
# against the test upstream; see bench/overhead_vs_litellm.py). litellm depends on aiohttp already.
POOL_LIMIT = 1024  # open connections across all upstreams
KEEPALIVE_S = 30.0


@dataclass(frozen=True, slots=True)
class WireRoute:
    """How to reach one worker over the OpenAI wire, as litellm resolved it (computed once)."""

    provider: str
    model: str  # the provider's model name (without the "openai/" prefix)
    api_base: str
    api_key: str | None
    config: OpenAIGPTConfig
    litellm_params: MappingProxyType
    attribution_headers: MappingProxyType
    proxy: str | None = None  # from HTTP(S)_PROXY / NO_PROXY, as litellm's own clients honour them
    _bridged: dict[bool, bool] = field(default_factory=dict, compare=False, hash=False)

    def bridges_to_responses(self, has_function_tools: bool) -> bool:
        """Would litellm send this request to the Responses API instead? (cached per tools/no tools)"""
        cached = self._bridged.get(has_function_tools)
        if cached is None:
            tools = [{"type": "function", "function": {"name": "f"}}] if has_function_tools else None
            try:
                info, _ = responses_api_bridge_check(
                    model=self.model, custom_llm_provider=self.provider, tools=tools, api_base=self.api_base
                )
                cached = info.get("mode") == "responses"
            except Exception:  # litellm could not tell: let litellm itself handle the call
                cached = True
            self._bridged[has_function_tools] = cached
        return cached

    def request(self, chat_params: dict[str, Any], messages: list[dict[str, Any]], stream: bool):
        """URL, headers and JSON body of one call, through the provider's litellm transforms."""
        config, model, provider = self.config, self.model, self.provider
        messages = config.translate_developer_role_to_system_role(messages=messages)
        optional = get_optional_params(
            model=model, custom_llm_provider=provider, messages=messages, **chat_params
        )
        litellm_params = dict(self.litellm_params)
        body = config.transform_request(model, messages, optional, litellm_params, {})
        extra = body.pop("extra_body", None)  # what the OpenAI SDK would merge into the JSON
        if extra:
            body.update(extra)
        body.pop("extra_headers", None)
        body.pop("extra_query", None)
        if stream:
            body["stream"] = True
        elif not body.get("stream"):
            body.pop("stream", None)  # litellm leaves a false `stream` out of the request
        headers = config.validate_environment(
            dict(self.attribution_headers),
            model,
            messages,
            optional,
            litellm_params,
            self.api_key,
            self.api_base,
        )
        url = config.get_complete_url(self.api_base, self.api_key, model, optional, litellm_params, stream)
        return url, headers, orjson.dumps(body)

    # ---- errors, classified by litellm's exception mapping -------------------------------------
    def status_error(self, status: int, content: bytes, headers: Mapping[str, str]) -> Exception:
        message = _error_message(content) or f"HTTP {status}"
        mapped = self._mapped(self.config.get_error_class(message, status, httpx.Headers(dict(headers))))
        return refused(mapped, status)

    def _mapped(self, exc: Exception) -> Exception:
        try:
            exception_type(model=self.model, original_exception=exc, custom_llm_provider=self.provider)
        except Exception as mapped:  # exception_type raises the mapped litellm exception
            return mapped
        return exc

    def transport_error(self, exc: BaseException) -> Exception:
        if isinstance(exc, TimeoutError):  # asyncio.timeout, aiohttp's socket timeouts
            return litellm.Timeout(
                message=f"no answer within the worker's timeout ({type(exc).__name__})",
                model=self.model,
                llm_provider=self.provider,
            )
        return litellm.APIConnectionError(
            message=f"{type(exc).__name__}: {exc}".rstrip(": "), llm_provider=self.provider, model=self.model
        )

    def body_error(self, error: Any, from_provider: bool = True) -> Exception:
        """An `{"error": ...}` object in a 200 body or an SSE event (``from_provider``: the provider's
        own, which says it refused or failed the call; False: a made-up one for a body that cannot be
        read, which says nothing of the kind)."""
        message = error.get("message") if isinstance(error, dict) else str(error)
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        mapped = self._mapped(self.config.get_error_class(str(message or error), status, httpx.Headers()))
        return refused(mapped, status) if from_provider else mapped


# litellm's UnsupportedParamsError names the parameters in its message, as a Python list
# ("anthropic does not support parameters: ['seed'], for model=..."); it carries no field for them.
_UNSUPPORTED_LIST = re.compile(r"does not support parameters: \[([^\]]*)\]")
_QUOTED = re.compile(r"'([^']+)'")


def unsupported_params(exc: BaseException) -> tuple[str, ...]:
    """The request parameters a worker's provider has no equivalent for, when litellm refused to
    build the worker's request for them (`UnsupportedParamsError`, raised by `get_optional_params`
    on both paths before anything is sent); () for any other failure.

    Such a refusal is about the worker, not the request: another worker may take the same
    parameters (`auto` falls back), and a pinned worker's client must be told which one to leave
    out, in OpenAI's terms rather than litellm's advice to set `drop_params`."""
    seen: list[BaseException] = []
    while exc is not None and len(seen) < 16 and all(exc is not s for s in seen):
        if isinstance(exc, litellm.UnsupportedParamsError):
            found = _UNSUPPORTED_LIST.search(str(getattr(exc, "message", "") or exc))
            names = tuple(_QUOTED.findall(found.group(1))) if found else ()
            return names or ("(a parameter litellm did not name)",)
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return ()


# Client parameters the gateway honours itself whatever the worker gets: the worker is always asked
# for the usage chunk, and the client's `include_usage` decides whether it is passed on.
GATEWAY_HONOURED = frozenset({"stream_options"})
MAX_CACHED_IGNORED = 4096
# (provider, model, the parameters' shapes) -> the parameters the worker's request goes without
_IGNORED: dict[tuple[str, str, tuple[tuple[str, Any], ...]], tuple[str, ...]] = {}


def _shape(name: str, value: Any) -> Any:
    """What of a parameter's value decides whether a provider's mapping keeps it: the kind of
    `response_format` (Anthropic drops `json_object`, keeps `json_schema` as a tool), the kind of
    `tool_choice`, a flag's value; presence alone for the rest (a `user` id or a temperature is kept
    or dropped whatever it is), so a per-end-user value does not defeat the cache."""
    if isinstance(value, bool):
        return value
    if name in ("response_format", "tool_choice"):
        return value.get("type") if isinstance(value, dict) else value
    return None


def _asks_default(name: str, value: Any) -> bool:
    """A value that asks for what a worker does anyway (OpenAI's default): nothing is lost when a
    provider's mapping leaves it out, so it is not named back. (Anthropic's mapping folds
    `tool_choice: auto` into the one `parallel_tool_calls: false` makes, so the request reads the
    same without it; an empty `stop` is no stop sequence.)"""
    if name == "n":
        return value == 1
    if name == "logprobs":
        return value is False
    if name == "tool_choice":
        return value == "auto"
    if name == "stop":
        return not value
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    return False


def ignored_params(
    provider: str, model: str, params: Mapping[str, Any], messages: Callable[[], list[dict[str, Any]]]
) -> tuple[str, ...]:
    """The client's parameters that litellm's mapping for this provider and model leaves out of the
    worker's request without an error (`user` for an OpenAI-wire model outside OpenAI's catalog,
    `response_format: json_object` for Anthropic): a parameter is left out when the request built
    without it is the same as the one built with it.

    The request is built (`get_optional_params`, as both paths build it) once per provider, model
    and shape of the parameters (`_shape`), then cached: the hot path pays a dict lookup. One the
    provider refuses outright (`unsupported_params`) never reaches here: its worker is not called.
    ``messages`` gives the worker's messages, asked for only when the request is built."""
    checked = {k: v for k, v in params.items() if k not in GATEWAY_HONOURED and not _asks_default(k, v)}
    if not checked:
        return ()
    key = (provider, model, tuple(sorted((k, _shape(k, v)) for k, v in checked.items())))
    found = _cached(_IGNORED, key, lambda: _left_out(provider, model, checked, messages()))
    if "tools" in checked and "tools" not in found:
        found += tool_fields_left_out(provider, model, checked["tools"], messages)
    return found


def _left_out(
    provider: str, model: str, params: dict[str, Any], messages: list[dict[str, Any]]
) -> tuple[str, ...]:
    def built(without: str | None = None) -> dict[str, Any]:
        kept = copy.deepcopy({k: v for k, v in params.items() if k != without})
        return get_optional_params(
            model=model, custom_llm_provider=provider, messages=copy.deepcopy(messages), **kept
        )

    try:
        full = built()
    except Exception:  # refused (the worker is not called) or not buildable here: nothing to name
        log.debug("the request of %s/%s could not be rebuilt to check its parameters", provider, model)
        return ()
    left_out = []
    for name in params:
        try:
            if built(name) == full:
                left_out.append(name)
        except Exception:  # the request cannot be built without it: it is carried
            continue
    return tuple(sorted(left_out))


# A function tool's fields a provider's mapping may leave out while it keeps the tool (Anthropic's
# keeps the name, description and parameters, not `strict`); a false one asks for the default.
TOOL_FIELDS = ("strict",)
# (provider, model, (tool index, field) asked) -> those the worker's request goes without
_TOOLS_IGNORED: dict[tuple[str, str, tuple[tuple[int, str], ...]], tuple[str, ...]] = {}


def tool_fields_left_out(
    provider: str, model: str, tools: Any, messages: Callable[[], list[dict[str, Any]]]
) -> tuple[str, ...]:
    """The fields of the client's function tools (`TOOL_FIELDS`) that litellm's mapping for this
    provider and model leaves out of the worker's request while it sends the tool, named in chat
    completions' terms (`tools.0.strict`): `ignored_params` sees `tools` as a whole, which is sent.
    A field is left out when the request built without it is the same. Cached per provider, model and
    which tools ask for which field, as `ignored_params` is."""
    if not isinstance(tools, list):
        return ()
    asked = tuple(
        (n, name)
        for n, tool in enumerate(tools)
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        for name in TOOL_FIELDS
        if tool["function"].get(name)
    )
    if not asked:
        return ()
    return _cached(
        _TOOLS_IGNORED,
        (provider, model, asked),
        lambda: _tool_fields_left_out(provider, model, tools, asked, messages()),
    )


def _cached(cache: dict, key: Any, compute: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
    """``cache[key]``, computed once; the cache is emptied when it holds MAX_CACHED_IGNORED (a bound
    against shapes without end, as many as a provider's mapping can tell apart)."""
    found = cache.get(key)
    if found is None:
        found = compute()
        if len(cache) >= MAX_CACHED_IGNORED:
            cache.clear()
        cache[key] = found
    return found


def _tool_fields_left_out(
    provider: str,
    model: str,
    tools: list[dict[str, Any]],
    asked: tuple[tuple[int, str], ...],
    messages: list[dict[str, Any]],
) -> tuple[str, ...]:
    def built(tools: list[dict[str, Any]]) -> dict[str, Any]:
        return get_optional_params(
            model=model, custom_llm_provider=provider, messages=copy.deepcopy(messages), tools=tools
        )

    try:
        full = built(copy.deepcopy(tools))
    except Exception:  # refused, or not buildable here: nothing to name
        log.debug("the tools of %s/%s could not be rebuilt to check their fields", provider, model)
        return ()
    left_out = []
    for n, name in asked:
        without = copy.deepcopy(tools)
        del without[n]["function"][name]
        try:
            if built(without) == full:
                left_out.append(f"tools.{n}.{name}")
        except Exception:  # the request cannot be built without it: it is carried
            continue
    return tuple(left_out)


def in_client_names(
    names: Iterable[str], renames: Mapping[str, str], tool_index: Mapping[int, int]
) -> list[str]:
    """Chat-completions parameter names (as `ignored_params` gives them) in another API's own field
    names, for that API's x-polyroute-ignored: ``renames`` maps a parameter's chat name to the
    client's (`max_tokens` -> `max_output_tokens`), ``tool_index`` a chat tool's position to the
    client's tool's (`tools.N.strict`). In order, without duplicates."""
    out: list[str] = []
    for name in names:
        head, _, rest = name.partition(".")
        position, _, field = rest.partition(".")
        if head == "tools" and position.isdigit() and field:
            name = f"tools.{tool_index.get(int(position), int(position))}.{field}"
        else:
            name = renames.get(name, name)
        if name not in out:
            out.append(name)
    return out


REFUSED_ATTR = "polyroute_refused_status"


def refused(exc: Exception, status: int) -> Exception:
    """Mark ``exc`` as the provider's own refusal (an error status, an error object): the call
    reached it and it said it would not, or could not, answer, so it is no call it bills — unlike
    a timeout or a lost connection (gateway/upstream.py `attempt_of`)."""
    try:
        setattr(exc, REFUSED_ATTR, status)
    except AttributeError:  # an exception type with __slots__: left unmarked (read as unanswered)
        pass
    return exc


def refused_status(exc: BaseException) -> int | None:
    """The status of a refusal `refused` marked, or None."""
    status = getattr(exc, REFUSED_ATTR, None)
    return status if isinstance(status, int) else None


def _error_message(content: bytes) -> str:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace").strip()[:1000]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return content.decode("utf-8", "replace").strip()[:1000]


def resolve_route(model: str, api_base: str | None, api_key: str | None) -> WireRoute | None:
    """The wire route for a litellm model string, or None when litellm.acompletion must handle it."""
    try:
        name, provider, dynamic_key, base = litellm.get_llm_provider(
            model, api_base=api_base, api_key=api_key
        )
    except Exception:
        return None
    if provider not in OPENAI_WIRE_PROVIDERS:
        return None
    try:
        config = ProviderConfigManager.get_provider_chat_config(model=name, provider=LlmProviders(provider))
    except Exception:
        return None
    if not isinstance(config, OpenAIGPTConfig):
        return None
    if provider == "openai":  # the OpenAI SDK's resolution: argument, litellm.api_base, env, default
        base = OpenAIGPTConfig.get_api_base(api_base or base)
        api_key = api_key or dynamic_key or OpenAIGPTConfig.get_api_key()
    else:
        api_key = api_key or dynamic_key
    if not base:
        return None
    litellm_params = {"custom_llm_provider": provider, "api_base": base}
    return WireRoute(
        proxy=_env_proxy(base),
        provider=provider,
        model=name,
        api_base=base,
        api_key=api_key,
        config=config,
        litellm_params=MappingProxyType(litellm_params),
        attribution_headers=MappingProxyType(dict(config.get_attribution_headers())),
    )


def _env_proxy(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies().get(parts.scheme)


class HttpPool:
    """One pooled keep-alive aiohttp session per event loop (a session cannot cross loops)."""

    def __init__(self, limit: int = POOL_LIMIT, keepalive_s: float = KEEPALIVE_S) -> None:
        self.limit = limit
        self.keepalive_s = keepalive_s
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
            weakref.WeakKeyDictionary()
        )

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.limit, limit_per_host=0, keepalive_timeout=self.keepalive_s, ttl_dns_cache=300
            )
            # no trust_env: aiohttp would then read netrc and the proxy env in a thread on every
            # request; the proxy is resolved once per route instead (WireRoute.proxy)
            session = aiohttp.ClientSession(connector=connector)
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close the pool of the running loop (the others close with their loops)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


def _timeout(timeout_s: float) -> aiohttp.ClientTimeout:
    # connect and every read within the worker's timeout; the whole call is bounded by the caller
    return aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)


async def complete(
    pool: HttpPool, route: WireRoute, url: str, headers: dict[str, str], body: bytes, timeout_s: float
) -> dict[str, Any]:
    """One non-streaming call: the raw OpenAI chat.completion dict, or a litellm exception."""
    try:
        async with asyncio.timeout(timeout_s):
            async with pool.session().post(
                url, data=body, headers=headers, timeout=_timeout(timeout_s), proxy=route.proxy
            ) as response:
                content = await response.read()
                status = response.status
                if status >= 400:
                    raise route.status_error(status, content, response.headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise route.transport_error(exc) from exc
    try:
        raw = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise route.body_error({"message": f"invalid JSON from upstream: {exc}"}, False) from exc
    if not isinstance(raw, dict):
        raise route.body_error({"message": "upstream answered with a non-object JSON body"}, False)
    if raw.get("error"):
        raise route.body_error(raw["error"])
    if (problem := shape_problem(raw, "message")) is not None:
        raise route.body_error({"message": f"malformed completion from upstream: {problem}"}, False)
    return raw


def shape_problem(raw: dict[str, Any], part: str) -> str | None:
    """Why a completion (`part` "message") or a stream chunk ("delta") cannot be read, or None.

    Valid JSON of the wrong shape (a string where the choices go, a choice that is not an object)
    is a worker failure like invalid JSON: retried and fallen back from, never a gateway crash."""
    choices = raw.get("choices")
    if choices is not None and not isinstance(choices, list):
        return f"'choices' is a {type(choices).__name__}, not a list"
    for choice in choices or ():
        if not isinstance(choice, dict):
            return f"a choice is a {type(choice).__name__}, not an object"
        if choice.get(part) is not None and not isinstance(choice[part], dict):
            return f"a choice's '{part}' is a {type(choice[part]).__name__}, not an object"
    usage = raw.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return f"'usage' is a {type(usage).__name__}, not an object"
    return None


async def open_stream(
    pool: HttpPool, route: WireRoute, url: str, headers: dict[str, str], body: bytes, timeout_s: float
) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
    """Start a streamed call and read up to its first chunk (within the worker's timeout).

    Returns the first chunk and an async generator of the rest; closing that generator (or reaching
    its end) releases the connection. Later reads time out after `timeout_s` of silence.
    """
    response: aiohttp.ClientResponse | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await pool.session().post(
                url, data=body, headers=headers, timeout=_timeout(timeout_s), proxy=route.proxy
            )
            if response.status >= 400:
                content = await response.read()
                raise route.status_error(response.status, content, response.headers)
            head = b""
            if response.content_type == "application/json":  # a JSON body, or events mislabelled
                head = await response.read()
                if (error := _json_for_stream(route, head)) is not None:
                    raise error
            chunks = _sse_chunks(route, response, head)
            first = await anext(chunks)
    except StopAsyncIteration:
        raise route.transport_error(
            aiohttp.ServerDisconnectedError("the stream ended before its first chunk")
        ) from None
    except BaseException as exc:
        if chunks is not None:
            await chunks.aclose()
        elif response is not None:
            response.close()
        if isinstance(exc, aiohttp.ClientError | TimeoutError):
            raise route.transport_error(exc) from exc
        raise
    return first, chunks


def _json_for_stream(route: WireRoute, content: bytes) -> Exception | None:
    """A stream request answered 200 with a JSON body: the failure it is (its error object when it
    holds one, as some servers report an overload), or None when the body is not JSON after all
    (events under the wrong content type, read as events)."""
    try:
        raw = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if isinstance(raw, dict) and raw.get("error"):
        return route.body_error(raw["error"])
    return route.body_error(
        {"message": "upstream answered a stream request with a JSON body, not events"}, False
    )


async def _pieces(response: aiohttp.ClientResponse, head: bytes) -> AsyncIterator[bytes]:
    """The body as it arrives, after `head` (what was read of it already)."""
    if head:
        yield head
    async for piece in response.content.iter_any():
        yield piece


async def _sse_chunks(
    route: WireRoute, response: aiohttp.ClientResponse, head: bytes = b""
) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events → chunk dicts, until `[DONE]` or the end; errors become litellm exceptions.

    A body that ends with neither `[DONE]` nor a finish_reason was cut (a proxy or a crashed server
    closing the connection cleanly): that is a failure like a reset, not the answer's end."""
    buffer = b""
    data: list[bytes] = []
    event = b""
    finished = False
    answered = False  # a choice carried a finish_reason: the answer is whole even without [DONE]
    try:
        try:
            async for piece in _pieces(response, head) if head else response.content.iter_any():
                buffer += piece
                if b"\n" not in piece:
                    continue
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.endswith(b"\r"):
                        line = line[:-1]
                    if line:
                        if line.startswith(b"data:"):
                            data.append(line[6:] if line[5:6] == b" " else line[5:])
                        elif line.startswith(b"event:"):
                            event = line[6:].strip()
                        continue  # comments (": ping"), id:, retry: are ignored
                    if not data:
                        event = b""
                        continue
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    data.clear()
                    if payload.startswith(b"[DONE]"):
                        finished = True
                        return
                    chunk = _decode_event(route, payload, event)
                    event = b""
                    if chunk is not None:
                        answered = answered or _finishes(chunk)
                        yield chunk
            finished = True
            if buffer.rstrip(b"\r").startswith(b"data:"):  # a last line without its newline
                line = buffer.rstrip(b"\r")
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            if data:  # a last event without its blank line
                payload = b"\n".join(data)
                if payload.startswith(b"[DONE]"):
                    return
                chunk = _decode_event(route, payload, event)
                if chunk is not None:
                    answered = answered or _finishes(chunk)
                    yield chunk
            if not answered:
                raise aiohttp.ServerDisconnectedError(
                    "the stream ended before the answer did (no finish_reason, no [DONE])"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise route.transport_error(exc) from exc
    finally:
        if finished:
            response.release()  # read to the end: the connection goes back to the pool
        else:
            response.close()  # stopped part-way: this connection cannot be reused


def _decode_event(route: WireRoute, payload: bytes, event: bytes) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise route.body_error({"message": f"invalid JSON in the stream: {exc}"}, False) from exc
    if not isinstance(chunk, dict):
        return None
    if event == b"error" or chunk.get("error"):
        raise route.body_error(chunk.get("error") or chunk)
    if (problem := shape_problem(chunk, "delta")) is not None:
        raise route.body_error({"message": f"malformed chunk in the stream: {problem}"}, False)
    return chunk


def _finishes(chunk: dict[str, Any]) -> bool:
    """Does this chunk end a choice (carry its finish_reason)?"""
    return any(choice.get("finish_reason") for choice in chunk.get("choices") or ())
