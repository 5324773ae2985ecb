"""Authentication: `Authorization: Bearer <key>` (or, for tenant keys, `x-api-key: <key>`) → the
key's record (and so its tenant).

Async because verifying a key may need I/O (the shared key store): `KeyStore.verify_async`
answers from memory when it can and otherwise does the I/O off the event loop.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from gateway.errors import APIError
from gateway.keys import ADMIN_TENANT, KeyRecord, KeyStore, KeyStoreUnavailable, hash_key

_WWW = {"www-authenticate": "Bearer"}


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            type="authentication_error",
            code="missing_api_key",
            headers=_WWW,
        )
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Malformed Authorization header; expected 'Bearer <key>'.",
            type="authentication_error",
            code="invalid_api_key",
            headers=_WWW,
        )
    return token.strip()


def api_key(request: Request) -> str:
    """A tenant key: `Authorization: Bearer <key>`, or `x-api-key: <key>` as the anthropic SDK sends
    it (Claude Code's ANTHROPIC_AUTH_TOKEN sends Bearer). Bearer wins when both are present."""
    if request.headers.get("authorization") is None:
        key = request.headers.get("x-api-key")
        if key is not None and key.strip():
            return key.strip()
        if key is not None:
            raise APIError(
                401, "The x-api-key header is empty.", type="authentication_error", code="invalid_api_key"
            )
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            type="authentication_error",
            code="missing_api_key",
            headers=_WWW,
        )
    return bearer_token(request)


def _invalid() -> APIError:
    return APIError(
        401, "Incorrect API key provided.", type="authentication_error", code="invalid_api_key", headers=_WWW
    )


class Authenticator:
    """Checks keys against the store; the admin key may also come from settings (env)."""

    def __init__(self, store: KeyStore, admin_key: str | None) -> None:
        self.store = store
        self._admin_hash = hash_key(admin_key) if admin_key else None

    def _is_settings_admin(self, token: str) -> bool:
        return self._admin_hash is not None and hmac.compare_digest(hash_key(token), self._admin_hash)

    def _unchecked_message(self, exc: KeyStoreUnavailable) -> str:
        """The 503 body while Redis is down: what happened, why a key that worked a minute ago may be
        refused now (docs/replicas.md), and what to do. The same for every token, valid or not: it
        says nothing about the key itself."""
        grace_s = getattr(self.store, "stale_grace_s", None)
        kept = (
            f"during an outage only a key this gateway checked in the last {grace_s / 60:g} minutes, "
            "with no key revoked since, is accepted; "
            if grace_s
            else ""
        )
        return (
            f"The API key could not be checked: the key store (Redis) cannot be reached ({str(exc).rstrip('.')}). "
            f"Keys fail closed: {kept}no key is let through unchecked. Retry once Redis is back."
        )

    async def _verify(self, token: str) -> KeyRecord | None:
        try:
            return await self.store.verify_async(token)
        except KeyStoreUnavailable as exc:  # fail closed: no key is accepted unverified
            raise APIError(
                503,
                self._unchecked_message(exc),
                type="server_error",
                code="key_store_unavailable",
                headers={"retry-after": "1"},
            ) from None

    async def client(self, request: Request) -> KeyRecord:
        """A tenant key (admin keys are refused here: they carry no tenant)."""
        record = await self._verify(api_key(request))
        if record is None or record.admin:
            raise _invalid()
        return record

    async def admin(self, request: Request) -> KeyRecord:
        token = bearer_token(request)
        if self._is_settings_admin(token):
            return KeyRecord("admin-env", ADMIN_TENANT, "POLYROUTE_ADMIN_KEY", "", "", admin=True)
        record = await self._verify(token)
        if record is None:
            raise _invalid()
        if not record.admin:
            raise APIError(403, "This route needs the admin key.", type="permission_error", code="not_admin")
        return record
