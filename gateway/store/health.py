"""One circuit breaker per Redis connection: fail fast while Redis is really down, never because of
one slow reply or one bad reply.

Two kinds of failure are told apart, because they call for opposite answers:

- *unavailability* (connection refused or reset, a timeout, Redis loading or read-only): Redis
  cannot serve anyone. After `threshold` of these in a row (or one failed health probe) the breaker
  opens: for `cooldown_s` every call fails at once with StoreUnavailable instead of waiting for a
  timeout, and each feature fails open or closed as documented. One slow reply on a busy machine
  is not an outage, so a single failure never opens it.
- a *reply error* (redis.ResponseError: WRONGTYPE, a Lua error in our script, "not an integer"):
  Redis is up and answered; our script or data is wrong. That must never turn into "store
  unavailable" for every tenant, so it never touches the breaker: it is logged loudly (once per
  kind), counted, and raised as StoreReplyError, which fails only the request that hit it.

After the cooldown the breaker is half-open: one call at a time goes through as a probe; its
success closes the breaker (the gateway recovers without a restart), its failure re-opens it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

log = logging.getLogger("polyroute.store")

# A reply slower than this is an outage. It is generous on purpose: on a loaded 2-core machine a busy
# event loop can read a reply late by a good fraction of a second, and one late reply must not fail
# a request, let alone open the breaker for everyone. A Redis that is really down is caught fast
# anyway: connections are refused at once, and the breaker opens after BREAKER_THRESHOLD failures
# in a row (or one failed health probe) and then fails every call at once for BREAKER_COOLDOWN_S.
REDIS_TIMEOUT_S = 5.0
BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN_S = 1.0

# Redis answers these when it cannot serve now (loading, failover, OOM, a busy script): an outage,
# even though they arrive as reply errors.
_TRANSIENT_REPLY = re.compile(r"^(LOADING|MASTERDOWN|READONLY|TRYAGAIN|CLUSTERDOWN|BUSY|OOM)\b")


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached now; each feature decides to fail open or closed."""


class StoreReplyError(RuntimeError):
    """Redis answered with an error: a bug in our script or in stored data, not an outage.

    Fails the one request that hit it (a 500), never the breaker."""

    def __init__(self, what: str, exc: BaseException) -> None:
        self.what = what
        super().__init__(f"{what}: Redis replied with an error: {exc}")


class Breaker:
    """closed → (threshold consecutive failures, or a failed probe) → open → (cooldown) → half-open:
    one probe at a time → closed on success, open again on failure."""

    def __init__(
        self,
        name: str,
        cooldown_s: float = BREAKER_COOLDOWN_S,
        threshold: int = BREAKER_THRESHOLD,
        probe_timeout_s: float = 2 * REDIS_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.cooldown_s = cooldown_s
        self.threshold = threshold
        self.probe_timeout_s = probe_timeout_s  # a probe that never reports is given up after this
        self.last_error: str | None = None
        self.failures = 0  # consecutive unavailability failures
        self.opened = 0  # how many times it opened (status, tests)
        self._open = False
        self._open_until = 0.0
        self._probe_until = 0.0  # half-open: a probe is in flight until then
        self._down_since: float | None = None
        self._lock = threading.Lock()  # the Redis ledger reports from a worker thread

    @property
    def up(self) -> bool:
        """Closed: calls go through. (A failure or two below the threshold is still 'up'.)"""
        return not self._open

    @property
    def state(self) -> str:
        if not self._open:
            return "closed"
        return "open" if time.monotonic() < self._open_until else "half-open"

    def check(self) -> bool:
        """Raise StoreUnavailable at once while open. After the cooldown one caller at a time is let
        through as the probe (returns True); it must report success() or failure(), or release_probe()."""
        if not self._open:
            return False
        now = time.monotonic()
        with self._lock:
            if not self._open:
                return False
            if now >= self._open_until and now >= self._probe_until:
                # A probe that never reports is given up after probe_timeout_s, so a lost one cannot
                # keep the breaker open for good.
                self._probe_until = now + self.probe_timeout_s
                return True
        raise StoreUnavailable(f"{self.name} unreachable: {self.last_error}")

    def release_probe(self) -> None:
        """The probe was cancelled before it learnt anything: let the next caller probe."""
        with self._lock:
            self._probe_until = 0.0

    def failure(self, exc: BaseException) -> StoreUnavailable:
        """An unavailability failure (connection, timeout): opens after `threshold` in a row."""
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.failures += 1
            if self._open or self.failures >= self.threshold:
                self._trip_locked()
        return StoreUnavailable(f"{self.name} unreachable: {self.last_error}")

    def probe_failed(self, exc: BaseException) -> StoreUnavailable:
        """A failed health probe (PING): Redis is down, open at once."""
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.failures += 1
            self._trip_locked()
        return StoreUnavailable(f"{self.name} unreachable: {self.last_error}")

    def _trip_locked(self) -> None:
        now = time.monotonic()
        self._open_until = now + self.cooldown_s
        self._probe_until = 0.0
        if not self._open:
            self._open = True
            self.opened += 1
            self._down_since = now
            log.error(
                "%s is unreachable (%s); failing fast for %.1f s at a time, see README 'When Redis is down'",
                self.name,
                self.last_error,
                self.cooldown_s,
            )

    def success(self) -> None:
        """Redis answered (a reply error is an answer too): reset the count, close if open."""
        if not self._open and not self.failures:
            return
        with self._lock:
            self.failures = 0
            if self._open:
                log.warning(
                    "%s is reachable again after %.1f s",
                    self.name,
                    time.monotonic() - (self._down_since or 0),
                )
                self._open = False
                self._down_since = None
                self.last_error = None

    def status(self) -> dict:
        return {"ok": self.up, "error": self.last_error if self._open else None, "opened": self.opened}


def is_unavailable(exc: BaseException) -> bool:
    """Redis cannot serve now: the network, a timeout, or a reply that says it is loading/failing over."""
    import redis
    from redis import exceptions

    # (redis-py strips the code from these replies and raises its own class instead)
    if isinstance(
        exc,
        (
            exceptions.ReadOnlyError,  # a failover in progress
            exceptions.OutOfMemoryError,  # Redis is full: nobody can write
            exceptions.TryAgainError,
            exceptions.ClusterDownError,  # MASTERDOWN too
        ),
    ):
        return True
    if isinstance(exc, redis.ResponseError):
        return bool(_TRANSIENT_REPLY.match(str(exc)))
    return isinstance(
        exc,
        (
            redis.ConnectionError,  # refused, reset, "No connection available", LOADING, auth
            redis.TimeoutError,
            exceptions.InvalidResponse,  # a broken connection mid-reply
            OSError,
            asyncio.TimeoutError,
        ),
    )


def is_reply_error(exc: BaseException) -> bool:
    """Redis (or the client) refused what we sent: our bug, not an outage."""
    import redis

    return isinstance(exc, (redis.ResponseError, redis.DataError)) and not is_unavailable(exc)


def sync_client(url: str, timeout_s: float = REDIS_TIMEOUT_S):
    """A blocking client (ledger, keys; used from worker threads). redis-py would retry a failed
    command up to 10 times with backoff by default, which turns "Redis is down" into seconds of
    waiting per call; one immediate retry on a dropped connection (a Redis restart) is enough, the
    breaker does the rest."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )


class ReplyErrors:
    """Counts reply errors and logs each kind loudly once (a bug repeats on every request)."""

    MAX_KINDS = 256

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def report(self, what: str, exc: BaseException) -> StoreReplyError:
        # The kind: where it happened and the message without the script digest and line.
        kind = what + "|" + type(exc).__name__ + "|" + str(exc).split(" script:")[0][:200]
        with self._lock:
            self.count += 1
            first = kind not in self._seen and len(self._seen) < self.MAX_KINDS
            if first:
                self._seen.add(kind)
        if first:
            log.error(
                "BUG: Redis replied with an error to %s (%s: %s). This is our script or data, not an "
                "outage: the request that hit it fails with a 500 and the breaker stays closed. "
                "Logged once per kind; see the store status for the count.",
                what,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        else:
            log.debug("Redis reply error again in %s: %s", what, exc)
        return StoreReplyError(what, exc)


REPLY_ERRORS = ReplyErrors()


def _failed(breaker: Breaker, probe: bool, exc: Exception, what: str) -> Exception:
    """What a failed call becomes: a reply error (Redis answered: the breaker hears it is up), an
    outage (counted by the breaker), or anything else, re-raised as it is (a probe gives its slot back)."""
    if is_reply_error(exc):
        breaker.success()
        return REPLY_ERRORS.report(what, exc)
    if is_unavailable(exc):
        return breaker.failure(exc)
    if probe:
        breaker.release_probe()
    return exc


async def guarded(breaker: Breaker, call, what: str = "redis call"):
    """Await `call()` under the breaker: fail fast while open, count unavailability, and turn a
    reply error into StoreReplyError without touching the breaker."""
    probe = breaker.check()
    try:
        result = await call()
    except Exception as exc:
        failure = _failed(breaker, probe, exc, what)
        if failure is exc:
            raise
        raise failure from exc
    except BaseException:  # cancelled (the client went away): the outcome is unknown
        if probe:
            breaker.release_probe()
        raise
    breaker.success()
    return result


def sync_guarded(breaker: Breaker, call, what: str = "redis call"):
    """The same for the synchronous client (ledger, keys), run in worker threads."""
    probe = breaker.check()
    try:
        result = call()
    except Exception as exc:
        failure = _failed(breaker, probe, exc, what)
        if failure is exc:
            raise
        raise failure from exc
    breaker.success()
    return result
