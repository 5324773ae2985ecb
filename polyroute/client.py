"""The polyroute Python SDK: a thin httpx client over the gateway's HTTP API.

It adds what the `openai` package does not show: which worker answered, by which strategy, at
what cost (`Route`), plus the admin calls. It imports nothing from the server packages.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8400"

# The gateway's default deadline for one request's worker phase (attempts, retries, fallbacks,
# memory rounds, the whole stream): `request_timeout_s` in gateway/settings.py, env
# POLYROUTE_REQUEST_TIMEOUT_S. The SDK imports no server code, so the value is repeated here and
# tests/test_sdk_fixes.py checks that the two agree.
GATEWAY_REQUEST_TIMEOUT_S = 300.0
# The SDK waits that long plus a margin for the gateway's own work around the worker calls (body,
# policy, retrieval, the answer or the 504 it sends at the deadline): a client that gave up
# earlier would abandon requests the gateway still finishes and bills.
DEFAULT_TIMEOUT_S = GATEWAY_REQUEST_TIMEOUT_S + 30.0


def default_base_url() -> str:
    """POLYROUTE_BASE_URL, else the local gateway on POLYROUTE_PORT (the port `polyroute serve` reads)."""
    explicit = os.environ.get("POLYROUTE_BASE_URL")
    if explicit:
        return explicit.rstrip("/")
    port = os.environ.get("POLYROUTE_PORT")
    return f"http://127.0.0.1:{port}" if port else DEFAULT_BASE_URL


class PolyrouteError(Exception):
    """An error answer from the gateway, in the OpenAI error format."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{status} {code or type or ''}: {message}".strip())
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.request_id = request_id


class PolyrouteTimeout(PolyrouteError):
    """No answer from the gateway within the client's timeout (`status` 0: no HTTP answer arrived).

    `sent` says whether the request may have reached the gateway. If it did, the gateway keeps
    working on it up to its own deadline (POLYROUTE_REQUEST_TIMEOUT_S, 300 s by default) and bills
    it if a worker answers, so a retry can pay twice. No request id reached the client; the call is
    in the gateway's ledger under your key's tenant, started at `started_at` (UTC).
    """

    def __init__(self, message: str, method: str, path: str, started_at: datetime, sent: bool) -> None:
        super().__init__(0, message, "timeout_error", "client_timeout")
        self.method = method
        self.path = path
        self.started_at = started_at
        self.sent = sent


class PolyrouteConnectionError(PolyrouteError):
    """No HTTP answer from the gateway (`status` 0, `code` `connection_error`): nothing listens at
    the client's base URL, or the connection broke before the answer was whole.

    `sent` says whether the request may have reached the gateway: False (refused, no such host)
    means retrying is safe; True means the gateway may still finish and bill it, as for a timeout.
    """

    def __init__(self, message: str, method: str, path: str, base_url: str, sent: bool) -> None:
        super().__init__(0, message, "connection_error", "connection_error")
        self.method = method
        self.path = path
        self.base_url = base_url
        self.sent = sent


def usd(value: Any) -> Decimal:
    """A USD amount as the gateway sent it, without the exponent Decimal keeps from "0.000000000":
    `print(route.cost_usd)` shows 0 for a free worker and 0.0000123 for a cheap call, not 0E-9."""
    amount = Decimal(str(value))
    if amount == amount.to_integral_value():
        return amount.quantize(Decimal(1))
    return amount.normalize()


@dataclass(frozen=True)
class Route:
    """What the gateway decided, read from the x-polyroute-* headers."""

    worker: str | None
    strategy: str | None
    cost_usd: Decimal | None
    request_id: str | None
    reason: str | None
    policy_version: str | None
    fallbacks: tuple[str, ...] = ()
    cost_is_estimate: bool = False
    compose: str | None = None  # a workflow's outcome ("accepted at level 1 of 2"), or why it was degraded

    @classmethod
    def from_headers(cls, headers: httpx.Headers) -> Route:
        cost = headers.get("x-polyroute-cost-usd")
        fallbacks = headers.get("x-polyroute-fallbacks")
        return cls(
            worker=headers.get("x-polyroute-worker"),
            strategy=headers.get("x-polyroute-strategy"),
            cost_usd=usd(cost) if cost else None,
            request_id=headers.get("x-polyroute-request-id"),
            reason=headers.get("x-polyroute-route-reason"),
            policy_version=headers.get("x-polyroute-policy-version"),
            fallbacks=tuple(fallbacks.split(",")) if fallbacks else (),
            cost_is_estimate=headers.get("x-polyroute-cost-basis") == "prompt-estimate",
            compose=headers.get("x-polyroute-compose"),
        )


@dataclass(frozen=True)
class ChatResult:
    response: dict[str, Any]
    route: Route

    @property
    def text(self) -> str:
        return self.response["choices"][0]["message"].get("content") or ""

    @property
    def trace(self) -> dict[str, Any] | None:
        """A composed answer's steps (workers, costs, verdicts), when asked for with explain=True."""
        return (self.response.get("polyroute") or {}).get("trace")


ERROR_TEXT_CHARS = 300  # how much of an answer that is not the gateway's JSON an error quotes


def _error_fields(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-format `error` object of an error answer. An answer that is not the gateway's (a
    proxy's HTML page, `{"error": "Bad Gateway"}`, `{"message": ...}`, `{"detail": ...}`) keeps its
    words in `message`, cut to ERROR_TEXT_CHARS, instead of failing to parse as the gateway's."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error
        for words in (error, body.get("message"), body.get("detail")):
            if isinstance(words, str) and words:
                return {"message": words}
    text = " ".join(response.text.split())
    if len(text) > ERROR_TEXT_CHARS:
        text = text[:ERROR_TEXT_CHARS] + "..."
    reason = response.reason_phrase or "error"
    return {"message": f"{reason} (not the gateway's error format): {text}" if text else reason}


# A base URL copied from an OpenAI client's setting ends in /v1, and the SDK adds /v1 to every path.
DOUBLED_V1_HINT = (
    " (the client's base URL ends in /v1, and the SDK adds /v1 itself: give the gateway's root, "
    "e.g. http://127.0.0.1:8400)"
)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    error = _error_fields(response)
    doubled = response.status_code == 404 and response.request.url.path.startswith("/v1/v1/")
    raise PolyrouteError(
        response.status_code,
        error["message"] + (DOUBLED_V1_HINT if doubled else ""),
        error.get("type") if isinstance(error.get("type"), str) else None,
        error.get("code") if isinstance(error.get("code"), str) else None,
        response.headers.get("x-polyroute-request-id"),
    )


@contextmanager
def _timeouts(method: str, path: str, timeout: float | None, base_url: str = "") -> Iterator[None]:
    """Turn httpx's timeouts into PolyrouteTimeout and its other transport errors into
    PolyrouteConnectionError, saying where the client looked and what the gateway may still do."""
    started_at = datetime.now(UTC)
    try:
        yield
    except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise PolyrouteTimeout(
            f"{method} {path}: could not connect to the gateway within the client's timeout "
            f"({timeout} s); the request was not sent, so retrying is safe.",
            method,
            path,
            started_at,
            sent=False,
        ) from exc
    except httpx.TimeoutException as exc:
        raise PolyrouteTimeout(
            f"{method} {path}: no answer within the client's timeout ({timeout} s). The gateway may "
            "still finish this request and bill it (it allows up to its POLYROUTE_REQUEST_TIMEOUT_S, "
            "300 s by default), so a retry can pay twice. No request id was received: an admin finds "
            f"the call in the gateway's ledger under your key's tenant, started at {started_at:%Y-%m-%dT%H:%M:%SZ}. "
            "Give the client a timeout longer than the gateway's deadline to get its answer.",
            method,
            path,
            started_at,
            sent=True,
        ) from exc
    except httpx.TransportError as exc:
        where = base_url or "the gateway"
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, httpx.ConnectError | httpx.UnsupportedProtocol):
            raise PolyrouteConnectionError(
                f"{method} {path}: cannot reach the gateway at {where} ({reason}); is it running there? "
                "Give the client its URL, or set POLYROUTE_BASE_URL or POLYROUTE_PORT. The request "
                "was not sent, so retrying is safe.",
                method,
                path,
                base_url,
                sent=False,
            ) from exc
        raise PolyrouteConnectionError(
            f"{method} {path}: the connection to the gateway at {where} broke before its answer was "
            f"whole ({reason}). The gateway may still finish this request and bill it, so a retry "
            "can pay twice.",
            method,
            path,
            base_url,
            sent=True,
        ) from exc


def _missing_key(admin: bool) -> str:
    """Why a call was not sent for want of a key, and where the client looks for one."""
    if admin:
        return "no admin key given to the client: pass admin_key= or set POLYROUTE_ADMIN_KEY"
    return "no API key given to the client: pass api_key= or set POLYROUTE_API_KEY"


def _segment(value: str) -> str:
    """One path segment, percent-encoded ('/' too); '.' and '..' are encoded so that no URL
    normalisation removes them."""
    return {".": "%2E", "..": "%2E%2E"}.get(value) or quote(value, safe="")


def _doc_path(collection: str, doc_id: str) -> str:
    """/v1/collections/{name}/documents/{id}: the server's route takes '/' in an id as is."""
    return f"/v1/collections/{_segment(collection)}/documents/{'/'.join(map(_segment, doc_id.split('/')))}"


def _feedback_body(
    request_id: str, score: float | None, thumbs: str | None, comment: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": request_id}
    if score is not None:
        body["score"] = score
    if thumbs is not None:
        body["thumbs"] = thumbs
    if comment is not None:
        body["comment"] = comment
    return body


def _chat_body(messages: list[dict[str, Any]], model: str, stream: bool, params: dict[str, Any]) -> dict:
    body = {"model": model, "messages": messages, **params}
    if stream:
        body["stream"] = True
        body.setdefault("stream_options", {"include_usage": True})
    return body


def _with_explain(headers: dict[str, str], explain: bool) -> dict[str, str]:
    return {**headers, "x-polyroute-trace": "1"} if explain else headers


# An error event's status, as the gateway's ledger records how the stream ended: its deadline
# passing mid-stream is a 504 (code request_timeout), a worker failing mid-stream a 502.
STREAM_ERROR_STATUS = {"request_timeout": 504}


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):  # not the gateway's: a proxy's, or a body cut and spliced
            raise PolyrouteError(
                502,
                f"the stream sent an event that is not a JSON object: {data[:ERROR_TEXT_CHARS]!r}",
                "server_error",
                "invalid_stream_event",
            )
        if "error" in event:
            err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            code = err.get("code")
            status = STREAM_ERROR_STATUS.get(code, 502)
            raise PolyrouteError(status, err.get("message", ""), err.get("type"), code)
        yield event


class ChatStream:
    """Iterate chunks; `route` is known at once, `usage`/`cost_usd` once the stream has ended.

    The stream holds a connection until it has been read to the end or closed: `close()` it (or use
    it as a context manager) when you stop early or never read it; the gateway then ends the call
    and bills what it streamed. An error event in the stream raises `PolyrouteError` with the
    stream's request id."""

    def __init__(
        self, response: httpx.Response, read_timeout: float | None = None, base_url: str = ""
    ) -> None:
        self._response = response
        self._read_timeout = read_timeout
        self._base_url = base_url
        self.route = Route.from_headers(response.headers)
        self.usage: dict[str, Any] | None = None
        self.cost_usd: Decimal | None = None
        self.trace: dict[str, Any] | None = None
        self._text: list[str] = []  # the answer's text so far, for text() once the stream has ended
        self._started = False
        self._ended = False

    def _observe(self, chunk: dict[str, Any]) -> None:
        if chunk.get("choices"):
            self._text.append(chunk["choices"][0].get("delta", {}).get("content") or "")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("polyroute", {}).get("cost_usd") is not None:
            self.cost_usd = usd(chunk["polyroute"]["cost_usd"])
        if chunk.get("polyroute", {}).get("trace") is not None:
            self.trace = chunk["polyroute"]["trace"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._started:
            raise RuntimeError(
                "this stream has been read already: a stream can be read once (its text, once it has "
                "ended: stream.text())"
            )
        self._started = True
        try:
            with _timeouts("POST", "/v1/chat/completions", self._read_timeout, self._base_url):
                for chunk in _events(self._response.iter_lines()):
                    self._observe(chunk)
                    yield chunk
            self._ended = True
        except PolyrouteError as exc:
            if exc.request_id is None:
                exc.request_id = self.route.request_id  # the headers arrived: the call has an id
            raise
        finally:
            self._response.close()

    def text(self) -> str:
        """The answer's text: reads the stream to its end, or, once it has ended, returns what it said."""
        if not self._ended:
            for _ in self:
                pass
        return "".join(self._text)

    @property
    def closed(self) -> bool:
        """Whether the stream's connection has been given back (read to the end, or closed)."""
        return self._response.is_closed

    def close(self) -> None:
        """Hang up: the gateway stops the call and bills what it streamed so far."""
        self._response.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Synchronous client. `Client(base_url, api_key)`; the key defaults to $POLYROUTE_API_KEY.

    `timeout` (seconds, or an `httpx.Timeout`) bounds each connect and each read. The default
    outlasts the gateway's own request deadline, so the gateway's answer (or its 504) arrives; a
    shorter one raises `PolyrouteTimeout` while the gateway may still finish and bill the call. No
    HTTP answer at all (nothing listening at `base_url`, a connection cut) raises
    `PolyrouteConnectionError`; both are `PolyrouteError`s, like every error answer.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        admin_key: str | None = None,
    ) -> None:
        self.base_url = (base_url or default_base_url()).rstrip("/")
        self.api_key = api_key or os.environ.get("POLYROUTE_API_KEY")
        self.admin_key = admin_key or os.environ.get("POLYROUTE_ADMIN_KEY")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        if not key:
            raise PolyrouteError(401, _missing_key(admin))
        return {"authorization": f"Bearer {key}"}

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        admin: bool = False,
    ) -> httpx.Response:
        """Send one request and return its answer; an error answer raises PolyrouteError."""
        with _timeouts(method, path, self._http.timeout.read, self.base_url):
            response = self._http.request(
                method, path, json=json, params=params, headers=headers or self._headers(admin)
            )
        _raise_for(response)
        return response

    def chat(
        self,
        messages: list[dict[str, Any]],
        model: str = "auto",
        stream: bool = False,
        explain: bool = False,
        **params: Any,
    ) -> ChatResult | ChatStream:
        """`model="compose:cascade"` (ensemble, builder, debate) runs a workflow; `explain=True`
        returns its trace (`result.trace`, or `stream.trace` once a stream has ended)."""
        body = _chat_body(messages, model, stream, params)
        headers = _with_explain(self._headers(), explain)
        if not stream:
            response = self._request("POST", "/v1/chat/completions", json=body, headers=headers)
            return ChatResult(response.json(), Route.from_headers(response.headers))
        request = self._http.build_request("POST", "/v1/chat/completions", json=body, headers=headers)
        with _timeouts("POST", "/v1/chat/completions", self._http.timeout.read, self.base_url):
            response = self._http.send(request, stream=True)
            if response.status_code >= 400:
                response.read()
        _raise_for(response)
        return ChatStream(response, self._http.timeout.read, self.base_url)

    def models(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/models").json()["data"]

    def feedback(
        self,
        request_id: str,
        score: float | None = None,
        thumbs: str | None = None,
        comment: str | None = None,
    ) -> dict[str, Any]:
        """Rate one of your tenant's answers (`POST /v1/feedback`), by its request id
        (`result.route.request_id`): exactly one of `score` (0 bad .. 1 good) or `thumbs`
        ("up"/"down"). Returns {"request_id", "worker", "score"}; an unknown id is a 404."""
        body = _feedback_body(request_id, score, thumbs, comment)
        return self._request("POST", "/v1/feedback", json=body).json()

    # ---- retrieval collections (the tenant's own) ---------------------------------------------
    def list_collections(self) -> list[dict[str, Any]]:
        """The tenant's collections with their counts (`GET /v1/collections`). A collection that
        cannot be opened now is listed with `"status": "locked"` and a `message`."""
        return self._request("GET", "/v1/collections").json()["data"]

    def get_collection(self, collection: str) -> dict[str, Any]:
        """One collection's counts, embedder and backend (`GET /v1/collections/{name}`)."""
        return self._request("GET", f"/v1/collections/{_segment(collection)}").json()

    def add_documents(
        self, collection: str, documents: list[dict[str, Any]], delete: list[str] | None = None
    ) -> dict[str, Any]:
        """Upsert documents ({"id", "text", "title"?, "metadata"?}) by id; `delete` removes ids."""
        body: dict[str, Any] = {"documents": documents}
        if delete:
            body["delete"] = delete
        return self._request("POST", f"/v1/collections/{_segment(collection)}/documents", json=body).json()

    def list_documents(self, collection: str, limit: int = 100, after: str = "") -> dict[str, Any]:
        """One page of ids, titles and summaries, ordered by id: {"data", "has_more"}. For the next
        page pass the last id as `after` (`GET /v1/collections/{name}/documents`)."""
        path = f"/v1/collections/{_segment(collection)}/documents"
        return self._request("GET", path, params={"limit": limit, "after": after}).json()

    def get_document(self, collection: str, doc_id: str, level: int = 2, query: str = "") -> dict[str, Any]:
        """A document's memory layer: 0 = index line (title, summary), 1 = the passage best
        matching `query`, 2 = full text, chunks and metadata. An unknown id is a 404."""
        params: dict[str, Any] = {"level": level}
        if query:
            params["query"] = query
        return self._request("GET", _doc_path(collection, doc_id), params=params).json()

    def delete_document(self, collection: str, doc_id: str) -> dict[str, Any]:
        """Delete one document by id; an unknown id is a 404."""
        return self._request("DELETE", _doc_path(collection, doc_id)).json()

    def search(
        self, collection: str, query: str, top_k: int = 10, mode: str = "bm25_dense"
    ) -> list[dict[str, Any]]:
        """Ranked chunks with both scores (`bm25_score`, `dense_score`)."""
        body = {"query": query, "top_k": top_k, "mode": mode}
        return self._request("POST", f"/v1/collections/{_segment(collection)}/search", json=body).json()[
            "data"
        ]

    def delete_collection(self, collection: str) -> dict[str, Any]:
        """Delete a collection and its documents; an unknown name is a 404."""
        return self._request("DELETE", f"/v1/collections/{_segment(collection)}").json()

    def forget_session(self, session_id: str) -> dict[str, Any]:
        """Forget a conversation's session memory (the turns stored for `metadata.session_id`);
        a session with nothing stored is a 404 (`DELETE /v1/sessions/{session_id}`)."""
        return self._request("DELETE", f"/v1/sessions/{_segment(session_id)}").json()

    # ---- admin (the admin key) -------------------------------------------------------------------
    def create_key(self, tenant: str, name: str = "") -> dict[str, Any]:
        body = {"tenant": tenant, "name": name}
        return self._request("POST", "/admin/keys", json=body, admin=True).json()

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/admin/keys/{_segment(key_id)}", admin=True).json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same API for asyncio; streaming yields chunks from `chat_stream()`. `timeout` as in
    `Client`: a timeout raises `PolyrouteTimeout`."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        admin_key: str | None = None,
    ) -> None:
        self.base_url = (base_url or default_base_url()).rstrip("/")
        self.api_key = api_key or os.environ.get("POLYROUTE_API_KEY")
        self.admin_key = admin_key or os.environ.get("POLYROUTE_ADMIN_KEY")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    def _headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        if not key:
            raise PolyrouteError(401, _missing_key(admin))
        return {"authorization": f"Bearer {key}"}

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        admin: bool = False,
    ) -> httpx.Response:
        """Send one request and return its answer; an error answer raises PolyrouteError."""
        with _timeouts(method, path, self._http.timeout.read, self.base_url):
            response = await self._http.request(
                method, path, json=json, params=params, headers=headers or self._headers(admin)
            )
        _raise_for(response)
        return response

    async def chat(
        self, messages: list[dict[str, Any]], model: str = "auto", explain: bool = False, **params: Any
    ) -> ChatResult:
        response = await self._request(
            "POST",
            "/v1/chat/completions",
            json=_chat_body(messages, model, False, params),
            headers=_with_explain(self._headers(), explain),
        )
        return ChatResult(response.json(), Route.from_headers(response.headers))

    async def chat_stream(
        self, messages: list[dict[str, Any]], model: str = "auto", explain: bool = False, **params: Any
    ) -> AsyncIterator[tuple[dict[str, Any], Route]]:
        body = _chat_body(messages, model, True, params)
        headers = _with_explain(self._headers(), explain)
        route: Route | None = None
        try:
            with _timeouts("POST", "/v1/chat/completions", self._http.timeout.read, self.base_url):
                async with self._http.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        _raise_for(resp)
                    route = Route.from_headers(resp.headers)
                    async for line in resp.aiter_lines():
                        for chunk in _events(iter((line,))):
                            yield chunk, route
        except PolyrouteError as exc:
            if route is not None and exc.request_id is None:
                exc.request_id = route.request_id  # the headers arrived: the call has an id
            raise

    async def models(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/models")).json()["data"]

    async def feedback(
        self,
        request_id: str,
        score: float | None = None,
        thumbs: str | None = None,
        comment: str | None = None,
    ) -> dict[str, Any]:
        """Rate one of your tenant's answers by request id: exactly one of `score` (0..1) or
        `thumbs` ("up"/"down"). See `Client.feedback`."""
        body = _feedback_body(request_id, score, thumbs, comment)
        return (await self._request("POST", "/v1/feedback", json=body)).json()

    async def list_collections(self) -> list[dict[str, Any]]:
        """The tenant's collections; one that cannot be opened now has `"status": "locked"`."""
        return (await self._request("GET", "/v1/collections")).json()["data"]

    async def get_collection(self, collection: str) -> dict[str, Any]:
        """One collection's counts, embedder and backend."""
        return (await self._request("GET", f"/v1/collections/{_segment(collection)}")).json()

    async def add_documents(
        self, collection: str, documents: list[dict[str, Any]], delete: list[str] | None = None
    ) -> dict[str, Any]:
        """Upsert documents ({"id", "text", "title"?, "metadata"?}) by id; `delete` removes ids."""
        body: dict[str, Any] = {"documents": documents}
        if delete:
            body["delete"] = delete
        path = f"/v1/collections/{_segment(collection)}/documents"
        return (await self._request("POST", path, json=body)).json()

    async def list_documents(self, collection: str, limit: int = 100, after: str = "") -> dict[str, Any]:
        """One page {"data", "has_more"} of ids, titles and summaries; the next starts `after` the last id."""
        path = f"/v1/collections/{_segment(collection)}/documents"
        return (await self._request("GET", path, params={"limit": limit, "after": after})).json()

    async def get_document(
        self, collection: str, doc_id: str, level: int = 2, query: str = ""
    ) -> dict[str, Any]:
        """A document's memory layer: 0 index line, 1 passage for `query`, 2 full text and metadata."""
        params: dict[str, Any] = {"level": level}
        if query:
            params["query"] = query
        return (await self._request("GET", _doc_path(collection, doc_id), params=params)).json()

    async def delete_document(self, collection: str, doc_id: str) -> dict[str, Any]:
        """Delete one document by id; an unknown id is a 404."""
        return (await self._request("DELETE", _doc_path(collection, doc_id))).json()

    async def search(
        self, collection: str, query: str, top_k: int = 10, mode: str = "bm25_dense"
    ) -> list[dict[str, Any]]:
        """Ranked chunks with both scores (`bm25_score`, `dense_score`)."""
        body = {"query": query, "top_k": top_k, "mode": mode}
        path = f"/v1/collections/{_segment(collection)}/search"
        return (await self._request("POST", path, json=body)).json()["data"]

    async def delete_collection(self, collection: str) -> dict[str, Any]:
        """Delete a collection and its documents; an unknown name is a 404."""
        return (await self._request("DELETE", f"/v1/collections/{_segment(collection)}")).json()

    async def forget_session(self, session_id: str) -> dict[str, Any]:
        """Forget a conversation's session memory; a session with nothing stored is a 404."""
        return (await self._request("DELETE", f"/v1/sessions/{_segment(session_id)}")).json()

    async def create_key(self, tenant: str, name: str = "") -> dict[str, Any]:
        body = {"tenant": tenant, "name": name}
        return (await self._request("POST", "/admin/keys", json=body, admin=True)).json()

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        return (await self._request("DELETE", f"/admin/keys/{_segment(key_id)}", admin=True)).json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
