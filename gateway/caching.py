"""The response cache on the request path: whether a request may use it, lookup, store.

Opt-in: a tenant turns it on in the policy YAML (`tenants.<t>.cache.enabled`), a request turns it
on or off with the `x-polyroute-cache: on|off` header. Only non-streamed requests of data
classes the gateway may store (public, internal: never PII or secrets) are cached, and only
successful answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from starlette.requests import Request

from gateway.errors import APIError
from gateway.ledger import STORABLE_CLASSES
from gateway.schemas import ChatCompletionRequest
from gateway.store import ResponseCache, cache_key

CACHE_HEADER = "x-polyroute-cache"
DEFAULT_TTL_S = 300


@dataclass(frozen=True, slots=True)
class CachePlan:
    tenant: str
    key: str
    ttl_s: int


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    worker: str
    body: bytes


def plan(
    request: Request,
    chat: ChatCompletionRequest,
    tenant: str,
    tenant_cache,
    versions: str,
    data_class: str,
) -> CachePlan | None:
    """Whether and under which key this request's answer is cached. ``versions``: the policy's and
    the worker catalog's versions in force for it; an answer is never served under others."""
    asked = request.headers.get(CACHE_HEADER)
    if asked is not None and asked.lower() not in ("on", "off"):
        raise APIError(400, f"{CACHE_HEADER} must be 'on' or 'off', not {asked!r}", code="invalid_value")
    enabled = asked.lower() == "on" if asked is not None else bool(tenant_cache and tenant_cache.enabled)
    if not enabled or chat.stream or data_class not in STORABLE_CLASSES:
        return None
    ttl = tenant_cache.ttl_s if tenant_cache is not None else DEFAULT_TTL_S
    return CachePlan(tenant, cache_key(tenant, versions, chat.model_dump(mode="json")), ttl)


async def lookup(cache: ResponseCache, plan: CachePlan) -> CachedAnswer | None:
    raw = await cache.get(plan.tenant, plan.key)
    if raw is None:
        return None
    entry = orjson.loads(raw)
    return CachedAnswer(entry["worker"], orjson.dumps(entry["body"]))


async def store(cache: ResponseCache, plan: CachePlan, worker: str, body: dict) -> None:
    await cache.put(plan.tenant, plan.key, orjson.dumps({"worker": worker, "body": body}), plan.ttl_s)
