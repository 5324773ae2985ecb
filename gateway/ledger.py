"""The ledger: one JSON line per request and per feedback, the router's training data.

The embedded store appends to `<data dir>/ledger.jsonl` (the Redis ledger of the scale-out issue
keeps the same records). The query text is kept only for data classes that may be stored
(never PII or secrets), so training from traffic never copies personal data into the ledger; a
long query as its head and tail (:func:`stored_query`, read back by :func:`logged_query`).
Feedback is its own record, joined to its request at training time; a score says where it came
from (a user, the judge worker, a calibration probe) so training can weigh each source. A judge
call that was paid but gave no score is a feedback record too, of source `judge_unscored` with no
score: its cost is in the ledger, and no reader takes it for a label (training skips it).

A third record type, `intent`, marks a paid call sent and not ended yet (polyroute/calibrate.py
writes one before each paid probe call, closed by the call's request record of the same id). It is
the shape of a request record with `type: "intent"`; it is no request and no label, and every
reader here skips it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from router.routelog import is_number

log = logging.getLogger("polyroute.ledger")

STORABLE_CLASSES = frozenset({"public", "internal"})
# A long query is kept as its first MAX_QUERY_CHARS and its last QUERY_TAIL_CHARS characters: the
# head is what a whole-text model's embedding reads anyway (it truncates far sooner), the tail the
# question after any few-shot examples (what a last-paragraph model reads). Together they bound the
# record, and :func:`logged_query` joins them into the text training and the replay read.
MAX_QUERY_CHARS = 4000
QUERY_TAIL_CHARS = 2000
QUERY_GAP = "\n\n"  # where characters were left out between head and tail: a paragraph break
INDEX_SIZE = 200_000  # request ids remembered for feedback (tenant check); older ones are looked up on disk
INTENT = "intent"  # a paid call in flight (see the module docstring): skipped by every reader
RECORD_TYPES = ("request", "feedback", INTENT)


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
    query: str | None = None  # the query's first MAX_QUERY_CHARS characters (StoredQuery)
    query_tail: str | None = None  # a cut query's last characters, after `query` (else None)
    query_chars: int | None = None  # a cut query's full length in characters (else None)
    turns: int = 1
    trace: dict | None = None  # a composed request's steps (workers, costs, verdicts)
    # How the router chose, when it did (auto or an alias, one worker): the choice, its probability
    # and what replaying another router on this request needs (router/offline/ledger.py).
    route: dict | None = None
    at: float = field(default_factory=time.time)
    type: str = "request"


# Where a score comes from. Records written before sources existed are user feedback.
FEEDBACK_SOURCES = ("user", "judge", "calibration")
# The source of a judge call that was paid and returned no parsable score: a record of its cost,
# with no score. It is no label: training skips it (no source weight names it, and training_rows
# leaves it out even when every source counts).
UNSCORED_JUDGE = "judge_unscored"


@dataclass(frozen=True, slots=True)
class FeedbackRecord:
    request_id: str
    tenant: str
    score: float | None  # 0..1; None only for source UNSCORED_JUDGE (a paid grade without a score)
    worker: str | None  # the worker whose answer is scored
    at: float = field(default_factory=time.time)
    type: str = "feedback"
    source: str = "user"  # one of FEEDBACK_SOURCES, or UNSCORED_JUDGE
    judge: str | None = None  # source "judge": the worker that graded the answer
    cost_micros: int = 0  # what producing this score cost (the judge call)


@dataclass(frozen=True, slots=True)
class StoredQuery:
    """What the ledger keeps of a request's query (RequestRecord's query, query_tail, query_chars).

    `text` is the query, or its first MAX_QUERY_CHARS characters; a query cut there also keeps
    `tail`, the characters after the head up to the last QUERY_TAIL_CHARS (a query up to
    MAX_QUERY_CHARS + QUERY_TAIL_CHARS long is kept whole in two parts), and `chars`, its length."""

    text: str | None = None
    tail: str | None = None
    chars: int | None = None

    def record_fields(self) -> dict[str, str | int | None]:
        """RequestRecord's fields for this query (`query`, `query_tail`, `query_chars`)."""
        return {"query": self.text, "query_tail": self.tail, "query_chars": self.chars}


def stored_query(text: str | None, data_class: str | None) -> StoredQuery:
    """What the ledger may keep of ``text``: nothing unless the data class may be stored (never PII or
    secrets); a long query's head and tail, not all of it, so a record stays small. Two slices: the
    per-request path does no more than that."""
    if text is None or data_class not in STORABLE_CLASSES:
        return StoredQuery()
    if len(text) <= MAX_QUERY_CHARS:
        return StoredQuery(text)
    tail = text[max(MAX_QUERY_CHARS, len(text) - QUERY_TAIL_CHARS) :]
    return StoredQuery(text[:MAX_QUERY_CHARS], tail, len(text))


def logged_query(record: Mapping) -> str | None:
    """The query a request record holds, as `router train` and `router eval --from-ledger` read it.

    A query cut on the way in comes back as its head, a paragraph break (QUERY_GAP) where characters
    were left out, and its tail: its last paragraph is the live question (when that paragraph fits
    in the tail), and a whole-text model reads the head its embedding keeps anyway. Approximate
    only in what was left out (lexical counts such as length see head + tail). A query kept whole,
    or a record written before tails were kept, reads as it is stored."""
    head, tail = record.get("query"), record.get("query_tail")
    if not head or not tail:
        return head
    chars = record.get("query_chars")
    whole = isinstance(chars, int) and len(head) + len(tail) >= chars
    return head + ("" if whole else QUERY_GAP) + tail


def numbered_lines(
    path: Path, *, warn: bool = True, refuse_foreign: bool = False
) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) per non-blank line of a ledger file, oldest first; nothing if there
    is no file. The one reader of ledger lines: the gateway's index and records, and (through
    gateway.ledger_export.located_jsonl_lines) `router train --ledger` and the data dir's reader.

    A line that is not JSON, or not UTF-8, is a write torn by a crash or a full disk: skipped with a
    warning (unless `warn` is off: a reader's second pass), not fatal. The gateway ends a torn line
    before it appends, so one can sit anywhere in the file. The file is read as bytes, decoded line
    by line: the gateway writes non-ASCII text as UTF-8, and a write cut inside a character used to
    raise from the text reader, which kept the gateway from starting. With `refuse_foreign`, a bad
    line before any JSON that does not begin like a record either is a ValueError naming it: the
    file is no JSON ledger at all (a CSV, a Parquet export, a log), which a reader given a file must
    say rather than find it empty. The numbers let a reader name the line of a record it cannot use;
    whether a JSON value is a ledger record is the caller's to check."""
    try:
        fh = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return
    seen_json = False
    with fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                if refuse_foreign and not seen_json and not _looks_torn(raw):
                    raise ValueError(
                        f"{path}:{number}: not a JSON ledger record (give a gateway's ledger.jsonl or a "
                        "`polyroute ledger export`)"
                    ) from None
                if warn:
                    log.warning("ledger %s line %d is not JSON; skipped", path, number)
                continue
            seen_json = True
            yield number, value


def append_lines(path: Path, payloads: Iterable[Mapping]) -> None:
    """Append ``payloads`` to ``path`` as JSON lines in one write, synced to disk, readable by this
    user only: what a replica could not send to Redis at shutdown (its ledger records, its budget
    settles), for its next start to read back with :func:`numbered_lines`, which skips a line torn
    by a crash or a full disk."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(p, ensure_ascii=False, separators=(",", ":")) + "\n" for p in payloads))
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, 0o600)


def _looks_torn(raw: bytes) -> bool:
    """Whether a line that is not JSON can be what a crash leaves of a gateway's write: the start of
    a record (the gateway writes ``{...}`` lines) or the zeros a file system may leave after a crash."""
    content = raw.strip()
    return content.startswith(b"{") or not content.strip(b"\0")


def _request_key(record: dict) -> tuple[str, str, str | None] | None:
    """(id, tenant, worker) of a request record, None when it lacks an id or tenant (a line the
    gateway did not write): what the index keeps of it."""
    request_id, tenant, worker = record.get("id"), record.get("tenant"), record.get("worker")
    if not isinstance(request_id, str) or not isinstance(tenant, str):
        return None
    return request_id, tenant, worker if isinstance(worker, str) else None


def _ends_unterminated(path: Path) -> bool:
    """Whether the file's last byte is there and is not a newline."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except FileNotFoundError:
        return False


class Ledger:
    """Append-only JSONL; a write is one `write()` of one line on an O_APPEND file (atomic enough
    for lines under the pipe buffer size on Linux and safe across threads under our lock)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # id -> (tenant, worker)
        self._index_truncated = False  # only then can an id be on disk but not in the index
        # a last line torn by a crash or a full disk is ended before anything is appended: else the
        # next record would be glued onto it, and both skipped as "not JSON" when read
        self._torn = _ends_unterminated(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the app's life
        os.chmod(self.path, 0o600)
        self._load_index()

    def _load_index(self) -> None:
        """Index the requests already in the file (feedback looks its request up). A line the
        gateway did not write as a request record (edited by hand, another tool's) is skipped with a
        warning: the gateway must start whatever an old line holds."""
        for number, record in numbered_lines(self.path):
            if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
                log.warning(
                    "ledger %s line %d is not a request or feedback record; skipped", self.path, number
                )
            elif record["type"] == "request":
                if (key := _request_key(record)) is None:
                    log.warning(
                        "ledger %s line %d: a request without an id or tenant; skipped", self.path, number
                    )
                else:
                    self._remember(*key)

    def _remember(self, request_id: str, tenant: str, worker: str | None) -> None:
        self._index[request_id] = (tenant, worker)
        if len(self._index) > INDEX_SIZE:
            self._index.popitem(last=False)
            self._index_truncated = True

    def _append(self, payload: dict) -> None:
        line = json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._torn:  # the last write may have ended mid-line: start on a line of our own
                line = "\n" + line
            try:
                self._fh.write(line)
                self._fh.flush()
            except OSError:
                self._torn = True
                raise
            self._torn = False

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
            if isinstance(record, dict) and record.get("type") == "request":
                key = _request_key(record)
                if key is not None and key[0] == request_id:
                    return key[1], key[2]
        return None

    def record_feedback(self, record: FeedbackRecord) -> None:
        self._append(asdict(record))

    def records(self) -> Iterator[dict]:
        """Every record, oldest first; a torn last line (a crash mid-write) is skipped, not fatal."""
        for _, record in numbered_lines(self.path):
            yield record

    buffered = 0  # written synchronously: nothing waits in memory

    def flush(self) -> int:
        return 0

    def status(self) -> dict:
        return {"backend": "file", "ok": True, "path": str(self.path)}

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def record_problem(record: object) -> str | None:
    """What makes a record unusable for :func:`training_rows` and `router train` (None: nothing).

    The gateway writes every field checked here; a record that lacks one was edited or written by
    something else. Checked before training so the error can name the record's line instead of a
    KeyError halfway through; the fields mirror RequestRecord and FeedbackRecord."""
    if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
        return "not a ledger record (a JSON object with type request or feedback)"
    if record["type"] == INTENT:  # a call in flight: no request, no label; training skips it
        return None if isinstance(record.get("id"), str) and record["id"] else "intent without an id"
    if record["type"] == "feedback":
        if not isinstance(record.get("request_id"), str) or not record["request_id"]:
            return "feedback without a request_id"
        if record.get("source") == UNSCORED_JUDGE:  # a paid grade without a score: no label
            if record.get("score") is not None:
                return f"feedback of source {UNSCORED_JUDGE} has a score"
            return None
        if "score" not in record:
            return "feedback without a score"
        score = record["score"]
        if not is_number(score) or not 0 <= score <= 1:
            return f"feedback score {score!r} is not a number from 0 to 1"
        if not isinstance(record.get("source") or "user", str):
            return f"feedback source {record['source']!r} is not a string"
        if record.get("at") is not None and not is_number(record["at"]):
            return f"feedback at {record['at']!r} is not a Unix time"
        return None
    if not isinstance(record.get("id"), str) or not record["id"]:
        return "request without an id"
    for name in ("query", "query_tail", "worker"):
        if record.get(name) is not None and not isinstance(record[name], str):
            return f"request {name} {record[name]!r} is not a string"
    chars = record.get("query_chars")
    if chars is not None and (not isinstance(chars, int) or isinstance(chars, bool) or chars < 0):
        return f"request query_chars {chars!r} is not a whole number >= 0"
    turns = record.get("turns", 1)
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
        return f"request turns {turns!r} is not a positive whole number"
    for name in ("cost_micros", "completion_tokens"):
        if record.get(name) is not None and (not is_number(record[name]) or record[name] < 0):
            return f"request {name} {record[name]!r} is not a number >= 0"
    return None


def training_rows(records: Iterator[dict], weights: Mapping[str, float] | None = None) -> list[dict]:
    """Join scores to requests: one row per request with a stored query and at least one counted score.

    Scores come from several sources (FeedbackRecord.source: users, the judge worker, calibration
    probes). Per request and source the latest score counts (a user may change their mind): the one
    with the greatest `at`, the later in the ledger on a tie. Not simply the last in the ledger: with
    Redis that is flush order, and a replica re-sending a spilled verdict after an outage would
    override the user's newer one (a record without `at` counts as the oldest). A row's
    `score` is the mean of its sources' scores weighted by `weights[source]` and its `weight` the sum
    of those weights, so a weight-averaged mean of rows (router/offline/ledger.py) weighs each
    (request, source) score by its source's weight. A source weighted 0 or absent from `weights` is
    left out; `weights=None` counts every source once. Rows also carry what an offline evaluation
    of another router needs: the request id, its `route` record and its cost.
    """
    if weights is not None:
        bad = {s: w for s, w in weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad:
            raise ValueError(f"source weights must be finite and >= 0, got {bad}")
    requests: dict[str, dict] = {}
    scores: dict[str, dict[str, tuple[float, float]]] = {}  # request -> source -> (at, score)
    for record in records:
        if record.get("type") == "request" and record.get("query") and record.get("worker"):
            requests[record["id"]] = record
        elif record.get("type") == "feedback":
            source = record.get("source") or "user"
            if source == UNSCORED_JUDGE:  # a paid grade that gave no score: its cost, not a label
                continue
            at = float(record["at"]) if is_number(record.get("at")) else -math.inf
            by_source = scores.setdefault(record["request_id"], {})
            if source not in by_source or at >= by_source[source][0]:
                by_source[source] = (at, float(record["score"]))
    rows = []
    for rid, request in requests.items():
        weighed = {
            source: (1.0 if weights is None else weights.get(source, 0.0), score)
            for source, (_, score) in scores.get(rid, {}).items()
        }
        weighed = {source: pair for source, pair in weighed.items() if pair[0] > 0}
        if not weighed:
            continue
        total = sum(w for w, _ in weighed.values())
        rows.append(
            {
                "id": rid,
                "query": logged_query(request),
                "turns": request.get("turns", 1),
                "worker": request["worker"],
                "score": sum(w * score for w, score in weighed.values()) / total,
                "weight": total,
                "sources": {source: score for source, (_, score) in weighed.items()},
                "route": request.get("route"),
                "cost_micros": int(request.get("cost_micros") or 0),
            }
        )
    return rows
