"""OpenAI-format errors. Every failure a client sees has this shape; never a stack trace."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("polyroute.gateway")


class JSONResponse(Response):
    """orjson-encoded JSON (FastAPI's JSONResponse is deprecated; this is all it did)."""

    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return orjson.dumps(content)


class APIError(Exception):
    """An error the client caused or must know about; rendered as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ClientGone:
    """ASGI middleware: a client that hung up ends its request with one log line.

    Starlette raises ClientDisconnect when the app reads a body the client stopped sending (or
    streams to a client that left). Unhandled, it reached the catch-all handler and uvicorn: two
    tracebacks for an everyday event. It is not an exception handler on purpose: Starlette refuses
    to run one once the response has started (a stream), and there is nobody left to answer anyway.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            if scope["type"] != "http":
                raise
            log.info(
                "client disconnected before its request was answered: %s %s", scope["method"], scope["path"]
            )


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(ClientGone)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return error_response(
            APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        if request.url.path.startswith("/v1/messages"):  # an Anthropic client reads its own shape
            from gateway.anthropic import error_response as anthropic_error_response

            return anthropic_error_response(err)
        return error_response(err)

    from gateway.keys import KeyStoreUnavailable
    from gateway.store.health import StoreUnavailable

    async def _store_down(_: Request, exc: Exception) -> JSONResponse:
        return error_response(
            APIError(
                503,
                f"the shared store cannot be reached right now, nothing was changed: {exc}",
                type="server_error",
                code="store_unavailable",
                headers={"retry-after": "1"},
            )
        )

    app.add_exception_handler(KeyStoreUnavailable, _store_down)
    app.add_exception_handler(StoreUnavailable, _store_down)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal error in the gateway", type="server_error"))
