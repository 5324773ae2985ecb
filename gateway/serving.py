"""How `polyroute serve` runs uvicorn: connection limits and timeouts (docs/production.md).

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) but nothing else about a slow
client: a connection that sends half a request line, or headers a byte a minute, stays open for
good (it has no header timeout), and under httptools nothing caps the header size. So the HTTP
protocol is wrapped once here: a request's line and headers must arrive within
`header_timeout_s` of its first byte (or of the connection, for the first request) and within
`max_header_bytes`, else the connection is answered 408 / 431 and closed. The body has its own
timeout in the app (gateway/app.py, `body_timeout_s`), so it also holds behind other servers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from gateway.settings import Settings

log = logging.getLogger("polyroute.serve")


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _HeaderGuard:
    """Mixin over uvicorn's HTTP protocol classes (h11 and httptools): a deadline and a size cap for
    the request line + headers of every request on a connection. Uses only what both classes share:
    the asyncio.Protocol callbacks, `transport`, `loop` and `cycle` (the request being served).

    The size is counted before the parser sees the bytes (up to the blank line that ends the
    headers), so an oversized request never reaches the parser's own buffers."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 16 * 1024

    _guard_timer: asyncio.TimerHandle | None = None
    _guard_bytes: int = 0
    _guard_tail: bytes = b""  # the last bytes seen, for a blank line split across two reads

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_arm()  # the first request's headers are due from now

    def data_received(self, data: bytes) -> None:
        if self._guard_timer is None and self._between_requests():
            self._guard_arm()  # the first bytes of the next request on a kept-alive connection
        if self._guard_timer is not None:
            window = self._guard_tail + data
            end = window.find(b"\r\n\r\n")
            head = len(data) if end < 0 else end + 4 - len(self._guard_tail)
            self._guard_bytes += head
            self._guard_tail = window[-3:]
            if self._guard_bytes > self.max_header_bytes:
                self._guard_refuse(431, "Request Header Fields Too Large", "request headers too large")
                return
        super().data_received(data)  # type: ignore[misc]
        if self._guard_timer is not None and (
            self.transport.is_closing() or not self._between_requests()  # type: ignore[attr-defined]
        ):
            self._guard_disarm()  # the headers are complete: the app has the request (or it was refused)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _between_requests(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is None or cycle.response_complete

    def _guard_arm(self) -> None:
        self._guard_bytes = 0
        self._guard_tail = b""
        loop = getattr(self, "loop", None) or asyncio.get_running_loop()
        self._guard_timer = loop.call_later(self.header_timeout_s, self._guard_expired)

    def _guard_disarm(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None

    def _guard_expired(self) -> None:
        self._guard_timer = None
        if self._between_requests():
            self._guard_refuse(408, "Request Timeout", "request headers not received in time")

    def _guard_refuse(self, status: int, reason: str, message: str) -> None:
        self._guard_disarm()
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing():
            return
        log.info("closing a connection from %s: %s", getattr(self, "client", None), message)
        transport.write(_refusal(status, reason, message))
        transport.close()


def guarded_protocol(base: type, header_timeout_s: float, max_header_bytes: int) -> type:
    """`base` (a uvicorn HTTP protocol class) with the header deadline and size cap."""
    return type(
        f"Guarded{base.__name__}",
        (_HeaderGuard, base),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )


def http_protocol(settings: Settings) -> type:
    """uvicorn's own choice ("auto": httptools when installed, else h11), guarded."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return guarded_protocol(base, settings.header_timeout_s, settings.max_header_bytes)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments `polyroute serve` gives uvicorn.run, from the gateway's settings."""
    return {
        "host": settings.host,
        "port": settings.port,
        "http": http_protocol(settings),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "limit_concurrency": settings.limit_concurrency,
        "timeout_graceful_shutdown": settings.graceful_shutdown_s,
        "access_log": False,
    }


def listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything starts (as uvicorn binds its own:
    SO_REUSEADDR, IPv6 for an IPv6 host). `polyroute serve` binds it first so that a port in use is
    refused in one line before the data dir is touched or a local worker started, and so that the
    port actually bound (`--port 0`) is the one the banner and the data-dir lock name. OSError when
    the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
