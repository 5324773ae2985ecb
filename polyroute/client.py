"""The polyroute Python SDK: a thin httpx client over the gateway's HTTP API.

It adds what the `openai` package does not show: which worker answered, by which strategy, at
what cost (`Route`), plus the admin calls. It imports nothing from the server packages.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8400"


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


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json().get("error", {})
    except ValueError:
        error = {"message": response.text}
    raise PolyrouteError(
        response.status_code,
        error.get("message", ""),
        error.get("type"),
        error.get("code"),
        response.headers.get("x-polyroute-request-id"),
    )


def _chat_body(messages: list[dict[str, Any]], model: str, stream: bool, params: dict[str, Any]) -> dict:
    body = {"model": model, "messages": messages, **params}
    if stream:
        body["stream"] = True
        body.setdefault("stream_options", {"include_usage": True})
    return body


def _with_explain(headers: dict[str, str], explain: bool) -> dict[str, str]:
    return {**headers, "x-polyroute-trace": "1"} if explain else headers


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            raise PolyrouteError(502, err.get("message", ""), err.get("type"), err.get("code"))
        yield event


class ChatStream:
    """Iterate chunks; `route` is known at once, `usage`/`cost_usd` once the stream has ended."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.route = Route.from_headers(response.headers)
        self.usage: dict[str, Any] | None = None
        self.cost_usd: Decimal | None = None
        self.trace: dict[str, Any] | None = None

    def _observe(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("polyroute", {}).get("cost_usd") is not None:
            self.cost_usd = usd(chunk["polyroute"]["cost_usd"])
        if chunk.get("polyroute", {}).get("trace") is not None:
            self.trace = chunk["polyroute"]["trace"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for chunk in _events(self._response.iter_lines()):
                self._observe(chunk)
                yield chunk
        finally:
            self._response.close()

    def text(self) -> str:
        return "".join((c["choices"][0]["delta"].get("content") or "") for c in self if c.get("choices"))


class Client:
    """Synchronous client. `Client(base_url, api_key)`; the key defaults to $POLYROUTE_API_KEY."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        admin_key: str | None = None,
    ) -> None:
        self.base_url = (base_url or default_base_url()).rstrip("/")
        self.api_key = api_key or os.environ.get("POLYROUTE_API_KEY")
        self.admin_key = admin_key or os.environ.get("POLYROUTE_ADMIN_KEY")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        if not key:
            raise PolyrouteError(401, f"no {'admin' if admin else 'API'} key given to the client")
        return {"authorization": f"Bearer {key}"}

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
            response = self._http.post("/v1/chat/completions", json=body, headers=headers)
            _raise_for(response)
            return ChatResult(response.json(), Route.from_headers(response.headers))
        request = self._http.build_request("POST", "/v1/chat/completions", json=body, headers=headers)
        response = self._http.send(request, stream=True)
        if response.status_code >= 400:
            response.read()
            _raise_for(response)
        return ChatStream(response)

    def models(self) -> list[dict[str, Any]]:
        response = self._http.get("/v1/models", headers=self._headers())
        _raise_for(response)
        return response.json()["data"]

    # ---- retrieval collections (the tenant's own) ---------------------------------------------
    def add_documents(
        self, collection: str, documents: list[dict[str, Any]], delete: list[str] | None = None
    ) -> dict[str, Any]:
        """Upsert documents ({"id", "text", "title"?, "metadata"?}) by id; `delete` removes ids."""
        body: dict[str, Any] = {"documents": documents}
        if delete:
            body["delete"] = delete
        response = self._http.post(
            f"/v1/collections/{collection}/documents", json=body, headers=self._headers()
        )
        _raise_for(response)
        return response.json()

    def search(
        self, collection: str, query: str, top_k: int = 10, mode: str = "bm25_dense"
    ) -> list[dict[str, Any]]:
        """Ranked chunks with both scores (`bm25_score`, `dense_score`)."""
        response = self._http.post(
            f"/v1/collections/{collection}/search",
            json={"query": query, "top_k": top_k, "mode": mode},
            headers=self._headers(),
        )
        _raise_for(response)
        return response.json()["data"]

    def delete_collection(self, collection: str) -> dict[str, Any]:
        response = self._http.delete(f"/v1/collections/{collection}", headers=self._headers())
        _raise_for(response)
        return response.json()

    def create_key(self, tenant: str, name: str = "") -> dict[str, Any]:
        response = self._http.post(
            "/admin/keys", json={"tenant": tenant, "name": name}, headers=self._headers(admin=True)
        )
        _raise_for(response)
        return response.json()

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        response = self._http.delete(f"/admin/keys/{key_id}", headers=self._headers(admin=True))
        _raise_for(response)
        return response.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same API for asyncio; streaming yields chunks from `chat_stream()`."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        self.base_url = (base_url or default_base_url()).rstrip("/")
        self.api_key = api_key or os.environ.get("POLYROUTE_API_KEY")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        if not self.api_key:
            raise PolyrouteError(401, "no API key given to the client")
        return {"authorization": f"Bearer {self.api_key}"}

    async def chat(
        self, messages: list[dict[str, Any]], model: str = "auto", explain: bool = False, **params: Any
    ) -> ChatResult:
        response = await self._http.post(
            "/v1/chat/completions",
            json=_chat_body(messages, model, False, params),
            headers=_with_explain(self._headers(), explain),
        )
        _raise_for(response)
        return ChatResult(response.json(), Route.from_headers(response.headers))

    async def chat_stream(
        self, messages: list[dict[str, Any]], model: str = "auto", explain: bool = False, **params: Any
    ) -> AsyncIterator[tuple[dict[str, Any], Route]]:
        body = _chat_body(messages, model, True, params)
        async with self._http.stream(
            "POST", "/v1/chat/completions", json=body, headers=_with_explain(self._headers(), explain)
        ) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            route = Route.from_headers(resp.headers)
            async for line in resp.aiter_lines():
                for chunk in _events(iter((line,))):
                    yield chunk, route

    async def search(
        self, collection: str, query: str, top_k: int = 10, mode: str = "bm25_dense"
    ) -> list[dict[str, Any]]:
        response = await self._http.post(
            f"/v1/collections/{collection}/search",
            json={"query": query, "top_k": top_k, "mode": mode},
            headers=self._headers(),
        )
        _raise_for(response)
        return response.json()["data"]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
