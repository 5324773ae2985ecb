"""The ledger in Redis, shared by replicas: one stream entry per request and per feedback.

A request must not wait for Redis nor fail because of it, so records go to a bounded in-process
buffer that a background task sends in batches (`flush()`). While Redis is unreachable the buffer
holds up to `buffer_max` records (oldest dropped beyond that, counted and logged); at shutdown
whatever could not be sent is written to `<data dir>/ledger-unsent.jsonl` and sent on the next
start, so a brief outage or a restart during one loses nothing.

A request's record therefore reaches Redis up to one flush interval after its answer, and a record
buffered in another replica is invisible here until then: the feedback endpoint waits for an id it
cannot find yet (gateway.store.find_request), woken by `Arrivals` when the record is written here
and polling the Redis index for one written elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from gateway.ledger import FeedbackRecord, RequestRecord, append_lines, numbered_lines
from gateway.store.health import REPLY_ERRORS, Breaker, StoreUnavailable, is_unavailable, sync_guarded

log = logging.getLogger("polyroute.ledger")

STREAM = "polyroute:ledger"
INDEX_PREFIX = "polyroute:ledger:req:"
INDEX_TTL_S = 90 * 86400  # feedback is accepted for 90 days after the request
BATCH = 500


class Arrivals:
    """Wakes whoever waits for a request id (a feedback that arrived before its request's record)
    when that record is written to this process's ledger, so the wait ends at once rather than at the
    next poll. A record may be written off the event loop (the ledger is a thread-safe object), so a
    waiter is woken through its own loop's ``call_soon_threadsafe``. Waiters exist only while a
    feedback request waits: nothing is kept per request recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def arrived(self, request_id: str) -> None:
        """The record of `request_id` was just written here: wake its waiters."""
        with self._lock:
            waiters = list(self._waiters.get(request_id, ()))
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop has closed (shutdown): nobody is left to wake
                pass

    @contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        """An event set when `request_id` is recorded here, for the duration of the block. Enter it
        before looking the id up, so a record written between the look and the wait still wakes it."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.setdefault(request_id, []).append(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(request_id, None)


class RedisLedger:
    # Records written by other replicas reach this one only through the Redis index, which nothing
    # signals: a feedback waiting for an id must poll (gateway.store.find_request).
    shared = True

    def __init__(
        self,
        redis,
        breaker: Breaker,
        spill_path: Path | None,
        buffer_max: int = 50_000,
        stream_max: int | None = None,
    ) -> None:
        self._redis = redis  # a synchronous client: flush() runs in a worker thread
        # about how many records the stream keeps (XADD MAXLEN ~, the oldest trimmed first); None:
        # all, and Redis's memory grows with every request (Settings.ledger_stream_max)
        self.stream_max = stream_max
        self.breaker = breaker
        self.spill_path = Path(spill_path) if spill_path is not None else None  # None: a reader only
        self.buffer_max = buffer_max
        self._buffer: deque[dict] = deque()
        self._recent: dict[str, tuple[str, str | None]] = {}  # ids still in the buffer
        self._lock = threading.Lock()
        self.dropped = 0
        self.arrivals = Arrivals()
        self._load_spill()

    # ---- writing ---------------------------------------------------------------------------
    def _enqueue(self, payload: dict) -> None:
        with self._lock:
            if len(self._buffer) >= self.buffer_max:
                lost = self._buffer.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.error(
                        "ledger buffer full (%d records, Redis unreachable): dropped %d so far (oldest %s)",
                        self.buffer_max,
                        self.dropped,
                        lost.get("id") or lost.get("request_id"),
                    )
            self._buffer.append(payload)
            if payload["type"] == "request":
                self._recent[payload["id"]] = (payload["tenant"], payload.get("worker"))
        if payload["type"] == "request":  # after the lock: lookup() now finds it
            self.arrivals.arrived(payload["id"])

    def record_request(self, record: RequestRecord) -> None:
        self._enqueue(asdict(record))

    def record_feedback(self, record: FeedbackRecord) -> None:
        self._enqueue(asdict(record))

    def flush(self) -> int:
        """Send buffered records in batches; returns how many were sent. Blocking: run in a thread."""
        sent = 0
        while True:
            with self._lock:
                batch = [self._buffer[i] for i in range(min(BATCH, len(self._buffer)))]
            if not batch:
                return sent
            try:
                self.breaker.check()
                pipe = self._redis.pipeline(transaction=False)
                for payload in batch:
                    record = {"r": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}
                    pipe.xadd(STREAM, record, maxlen=self.stream_max, approximate=True)
                    if payload["type"] == "request":
                        who = json.dumps([payload["tenant"], payload.get("worker")])
                        pipe.set(INDEX_PREFIX + payload["id"], who, ex=INDEX_TTL_S)
                # A command's reply error comes back in its place; the rest landed and are not resent.
                results = pipe.execute(raise_on_error=False)
            except StoreUnavailable:
                return sent
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                self.breaker.failure(exc)
                return sent
            self.breaker.success()
            for result in results:
                if isinstance(result, Exception):
                    REPLY_ERRORS.report("ledger.flush", result)
            with self._lock:
                for payload in batch:  # only these: records appended meanwhile stay
                    if self._buffer and self._buffer[0] is payload:
                        self._buffer.popleft()
                    if payload["type"] == "request":
                        self._recent.pop(payload["id"], None)
            sent += len(batch)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # ---- reading ---------------------------------------------------------------------------
    def lookup(self, request_id: str) -> tuple[str, str | None] | None:
        with self._lock:
            found = self._recent.get(request_id)
        if found is not None:
            return found
        raw = sync_guarded(self.breaker, lambda: self._redis.get(INDEX_PREFIX + request_id), "ledger.lookup")
        if raw is None:
            return None
        tenant, worker = json.loads(raw)
        return tenant, worker

    def records(self) -> Iterator[dict]:
        """Every record in Redis, oldest first, read in pages (then any still buffered here)."""
        start = "-"
        while True:
            page = self._redis.xrange(STREAM, min=start, max="+", count=1000)
            if not page:
                break
            for _entry_id, fields in page:
                yield json.loads(fields[b"r"] if b"r" in fields else fields["r"])
            last = page[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else last)
        with self._lock:
            yield from list(self._buffer)

    def status(self) -> dict:
        return {
            "backend": "redis",
            **self.breaker.status(),
            "buffered": len(self._buffer),
            "dropped": self.dropped,
        }

    # ---- shutdown and restart ------------------------------------------------------------
    def close(self) -> None:
        """Last flush; what still cannot be sent is spilled to disk for the next start."""
        self.flush()
        with self._lock:
            left = list(self._buffer)
            self._buffer.clear()
        if not left:
            return
        if self.spill_path is None:
            log.error("Redis unreachable at shutdown: %d ledger records lost (no spill file)", len(left))
            return
        append_lines(self.spill_path, left)
        log.error("Redis unreachable at shutdown: %d ledger records kept in %s", len(left), self.spill_path)

    def _load_spill(self) -> None:
        if self.spill_path is None or not self.spill_path.exists():
            return
        # a spill cut short (killed at the end of the grace period, a full disk) keeps its whole lines:
        # its torn last line is skipped with a warning, as the file ledger's is, not a failed start
        kept = [record for _, record in numbered_lines(self.spill_path) if isinstance(record, dict)]
        self.spill_path.unlink()
        for payload in kept:
            self._enqueue(payload)
        log.warning("re-queued %d ledger records kept at the last shutdown", len(kept))
