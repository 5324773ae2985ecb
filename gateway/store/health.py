"""One circuit breaker per Redis connection: fail fast while Redis is down, log each transition once.

Without it every request would wait for a connect timeout while Redis is unreachable. After a
failure the breaker stays open for `cooldown_s`; the next call after that is a probe, and its
success closes the breaker again, so the gateway recovers without a restart.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("polyroute.store")


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached now; each feature decides to fail open or closed."""


class Breaker:
    def __init__(self, name: str, cooldown_s: float = 1.0) -> None:
        self.name = name
        self.cooldown_s = cooldown_s
        self._open_until = 0.0
        self._down_since: float | None = None
        self.last_error: str | None = None
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._down_since is None

    def check(self) -> None:
        """Raise StoreUnavailable at once while the breaker is open (no network wait)."""
        if self._down_since is not None and time.monotonic() < self._open_until:
            raise StoreUnavailable(f"{self.name} unreachable: {self.last_error}")

    def failure(self, exc: BaseException) -> StoreUnavailable:
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._open_until = time.monotonic() + self.cooldown_s
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.error(
                    "%s is unreachable (%s); see README 'When Redis is down'", self.name, self.last_error
                )
        return StoreUnavailable(f"{self.name} unreachable: {self.last_error}")

    def success(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                log.warning(
                    "%s is reachable again after %.1f s", self.name, time.monotonic() - self._down_since
                )
                self._down_since = None
                self.last_error = None

    def status(self) -> dict:
        return {"ok": self.up, "error": self.last_error}


def is_redis_error(exc: BaseException) -> bool:
    import asyncio

    import redis

    return isinstance(exc, (redis.RedisError, OSError, asyncio.TimeoutError))


async def guarded(breaker: Breaker, call):
    """Await `call()` under the breaker: fail fast while open, record the outcome."""
    breaker.check()
    try:
        result = await call()
    except Exception as exc:
        if is_redis_error(exc):
            raise breaker.failure(exc) from exc
        raise
    breaker.success()
    return result
