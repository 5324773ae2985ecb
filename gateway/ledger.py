"""The ledger: one JSON line per request and per feedback, the router's training data.

The embedded store appends to `<data dir>/ledger.jsonl` (the Redis ledger of the scale-out issue
keeps the same records). The query text is kept only for data classes that may be stored
(never PII or secrets), so training from traffic never copies personal data into the ledger.
Feedback is its own record, joined to its request at training time.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("polyroute.ledger")

STORABLE_CLASSES = frozenset({"public", "internal"})
MAX_QUERY_CHARS = 4000
INDEX_SIZE = 200_000  # request ids remembered for feedback (tenant check); older ones are looked up on disk


@dataclass(frozen=True, slots=True)
class RequestRecord:
    id: str
    tenant: str
    model: str  # what the client asked for: auto, an alias or a worker
    worker: str | None
    strategy: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    latency_ms: float = 0.0
    policy_version: str | None = None
    router_version: str | None = None
    data_class: str | None = None
    fallbacks: tuple[str, ...] = ()
    query: str | None = None
    turns: int = 1
    trace: dict | None = None  # a composed request's steps (workers, costs, verdicts)
    at: float = field(default_factory=time.time)
    type: str = "request"


@dataclass(frozen=True, slots=True)
class FeedbackRecord:
    request_id: str
    tenant: str
    score: float  # 0..1
    worker: str | None
    at: float = field(default_factory=time.time)
    type: str = "feedback"


def storable_query(text: str | None, data_class: str | None) -> str | None:
    if text is None or data_class not in STORABLE_CLASSES:
        return None
    return text[:MAX_QUERY_CHARS]


class Ledger:
    """Append-only JSONL; a write is one `write()` of one line on an O_APPEND file (atomic enough
    for lines under the pipe buffer size on Linux and safe across threads under our lock)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # id -> (tenant, worker)
        self._index_truncated = False  # only then can an id be on disk but not in the index
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the app's life
        os.chmod(self.path, 0o600)
        self._load_index()

    def _load_index(self) -> None:
        for record in self.records():
            if record.get("type") == "request":
                self._remember(record["id"], record["tenant"], record.get("worker"))

    def _remember(self, request_id: str, tenant: str, worker: str | None) -> None:
        self._index[request_id] = (tenant, worker)
        if len(self._index) > INDEX_SIZE:
            self._index.popitem(last=False)
            self._index_truncated = True

    def _append(self, payload: dict) -> None:
        line = json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def record_request(self, record: RequestRecord) -> None:
        try:
            self._append(asdict(record))
        except OSError as exc:  # a full disk must not fail the answer the client already has
            log.error("ledger write failed for %s: %s", record.id, exc)
            return
        with self._lock:
            self._remember(record.id, record.tenant, record.worker)

    def lookup(self, request_id: str) -> tuple[str, str | None] | None:
        """(tenant, worker) of a request, or None if the ledger never saw it."""
        with self._lock:
            found = self._index.get(request_id)
        if found is not None or not self._index_truncated:
            return found
        for record in self.records():  # an old request, beyond the index: the rare slow path
            if record.get("type") == "request" and record.get("id") == request_id:
                return record["tenant"], record.get("worker")
        return None

    def record_feedback(self, record: FeedbackRecord) -> None:
        self._append(asdict(record))

    def records(self) -> Iterator[dict]:
        """Every record, oldest first; a torn last line (a crash mid-write) is skipped, not fatal."""
        try:
            fh = open(self.path, encoding="utf-8")  # noqa: SIM115
        except FileNotFoundError:
            return
        with fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    log.warning("ledger %s line %d is not JSON; skipped", self.path, number)

    buffered = 0  # written synchronously: nothing waits in memory

    def flush(self) -> int:
        return 0

    def status(self) -> dict:
        return {"backend": "file", "ok": True, "path": str(self.path)}

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def training_rows(records: Iterator[dict]) -> list[dict]:
    """Join feedback to requests: one row per (query, worker, score); the latest feedback wins."""
    requests: dict[str, dict] = {}
    scores: dict[str, float] = {}
    for record in records:
        if record.get("type") == "request" and record.get("query") and record.get("worker"):
            requests[record["id"]] = record
        elif record.get("type") == "feedback":
            scores[record["request_id"]] = float(record["score"])
    return [
        {"query": r["query"], "turns": r.get("turns", 1), "worker": r["worker"], "score": scores[rid]}
        for rid, r in requests.items()
        if rid in scores
    ]
