"""Rate limits on the request path: which limits apply, the x-ratelimit-* headers, the 429.

Limits come from the API key (`rpm`/`tpm` set when it was created) and from the tenant's
`rate_limit` in the policy YAML; all that apply are checked together. Headers follow OpenAI's
names; when several limits of a kind apply, the one with the least left is reported.
When the shared store is unreachable, rate limits fail open (the request goes on, the skip is
logged and counted): availability over strictness, since budgets still fail closed.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.errors import APIError
from gateway.keys import KeyRecord
from gateway.metrics import Metrics
from gateway.store import Limit, Limiter, StoreUnavailable, Verdict

log = logging.getLogger("polyroute.ratelimit")

KINDS = {"rpm": "requests", "tpm": "tokens"}


def limits_for(key: KeyRecord, tenant_rpm: int | None, tenant_tpm: int | None, tokens: int) -> list[Limit]:
    limits = []
    for scope, owner, rpm, tpm in (
        ("key", key.id, key.rpm, key.tpm),
        ("tenant", key.tenant, tenant_rpm, tenant_tpm),
    ):
        if rpm:
            limits.append(Limit(f"{scope}:{owner}|rpm", "requests", rpm, 1))
        if tpm:
            limits.append(Limit(f"{scope}:{owner}|tpm", "tokens", tpm, tokens))
    return limits


def limits_under(engine: Any, key: KeyRecord, tokens: int) -> list[Limit]:
    """The key's limits and its tenant's under the policy in force (`engine`; None: no policy)."""
    tenant = engine.policy.tenants.get(key.tenant) if engine is not None else None
    rate = tenant.rate_limit if tenant is not None else None
    return limits_for(key, rate.rpm if rate else None, rate.tpm if rate else None, tokens)


def duration(ms: int) -> str:
    """OpenAI's reset format: 20ms, 1s, 6m0s."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def headers_for(verdicts: list[Verdict]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        of_kind = [v for v in verdicts if v.limit.kind == kind]
        if not of_kind:
            continue
        tightest = min(of_kind, key=lambda v: (v.remaining, -v.reset_ms))
        headers[f"x-ratelimit-limit-{kind}"] = str(tightest.limit.rate)
        headers[f"x-ratelimit-remaining-{kind}"] = str(tightest.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = duration(tightest.reset_ms)
    return headers


def _scope(limit: Limit) -> str:
    return limit.key.split(":", 1)[0]


async def enforce(limiter: Limiter, metrics: Metrics, tenant: str, limits: list[Limit]) -> dict[str, str]:
    """Charge the request against every limit, or raise the 429 that says which one and for how long."""
    if not limits:
        return {}
    for limit in limits:
        if limit.units > limit.rate:
            raise APIError(
                429,
                f"This request needs about {limit.units} tokens, more than the {_scope(limit)}'s limit of "
                f"{limit.rate} tokens per minute; lower max_tokens or shorten the prompt.",
                type="rate_limit_error",
                code="request_too_large",
                # a 429 is retried by the openai and anthropic SDKs (twice, by default) unless told not
                # to: this one fails the same way however long they wait
                headers={"x-should-retry": "false"},
            )
    try:
        verdicts = await limiter.check(tenant, limits)
    except StoreUnavailable as exc:
        metrics.store_unavailable.labels("rate_limits").inc()
        log.debug("rate limits skipped (fail open): %s", exc)
        return {"x-polyroute-ratelimit": "unavailable"}
    headers = headers_for(verdicts)
    refused = [v for v in verdicts if not v.allowed]
    if refused:
        worst = max(refused, key=lambda v: v.retry_after_ms)
        metrics.rate_limited.labels(_scope(worst.limit), worst.limit.kind).inc()
        retry_s = max(1, -(-worst.retry_after_ms // 1000))
        raise APIError(
            429,
            f"Rate limit reached for the {_scope(worst.limit)}: {worst.limit.rate} {worst.limit.kind} per "
            f"minute. Try again in {duration(worst.retry_after_ms)}.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={**headers, "retry-after": str(retry_s), "retry-after-ms": str(worst.retry_after_ms)},
        )
    return headers


async def correct_tokens(limiter: Limiter, tenant: str, limits: list[Limit], actual_tokens: int) -> None:
    """Replace the up-front token estimate by the actual count (refund or extra charge)."""
    for limit in limits:
        if limit.kind == "tokens" and actual_tokens != limit.units:
            try:
                await limiter.adjust(tenant, limit, actual_tokens - limit.units)
            except StoreUnavailable:
                return


async def give_back(limiter: Limiter, tenant: str, limits: list[Limit]) -> None:
    """A request `enforce` charged and then refused before any worker call (the policy, a budget, the
    budget store): it used no tokens, so its estimate goes back. Kept, the refusals alone drained the
    key's tokens per minute, and the next request that fit the limit was a 429."""
    await correct_tokens(limiter, tenant, limits, 0)
