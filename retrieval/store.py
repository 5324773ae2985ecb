"""Collections: ingest (chunk, embed, index), delete and hybrid search, per tenant, all inside Qdrant.

One Qdrant collection per tenant collection holds everything (see `retrieval.engine`): per chunk the
BM25 sparse vector, the MiniLM dense vector and the chunk's text, title and document id; per
document a vector-less record with its title, layer-0 summary, full text (what layer-2 expansion
reads), content hash and chunk count. Nothing else is kept on a replica's disk, so replicas that
point at one Qdrant server (`QDRANT_URL`) share collections. The embedded default is a Qdrant Edge
shard under `<root>/tenants/<tenant>/<collection>/shard` with a `meta.json` beside it; a second
process opening that shard gets `ShardLocked`.

A document is written whole or not at all: it is parsed, chunked and embedded before anything is
stored. Its chunks get point ids of their own version (`ver`), so writing them touches nothing
visible; the document record, written next, is the commit: a search only shows chunks whose `ver`
is the one their document record names. Chunks of other versions are deleted last. A crash at any
step leaves the previous version whole and visible, and re-ingesting (ids are stable) tidies up.

Search modes (each one Qdrant query):
- ``bm25``: the sparse vector with Qdrant's IDF modifier, i.e. BM25.
- ``dense``: nearest neighbours by cosine.
- ``bm25_dense`` (default): BM25 top-`candidates` (a prefetch), then a second stage over exactly
  those chunks that combines lexical and dense evidence (`Fusion`, tuned on SciFact train:
  `docs/retrieval-engine.md`). When BM25 matches fewer than k chunks, dense neighbours fill the
  rest (a second query, only then), scored by the same formula with BM25 = 0 (their cosine).
- ``rrf``: dense top-`candidates` and BM25 top-`candidates`, reciprocal-rank fusion (k = `Fusion.rrf_k`, tuned: 2).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from retrieval.embed import Embedder, shared_embedder
from retrieval.engine import (
    META_POINT,
    BM25Params,
    ClientPool,
    EdgeEngine,
    Engine,
    Fusion,
    PointData,
    QuerySpec,
    ShardLocked,
    bm25_document,
    bm25_query,
    chunk_point_id,
    doc_point_id,
)
from retrieval.text import (
    SPACELESS_TEXT_VERSION,
    chunk_text,
    clean,
    content_hash,
    has_spaceless,
    normalize,
    summarize,
    title_from,
    tokenize,
)

# fullmatch, not match: with match, `$` also accepts a trailing newline ("docs\n")
COLLECTION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
SESSION_PREFIX = "_s-"  # session collections: a prefix no client-chosen name can have
MODES = ("bm25_dense", "rrf", "bm25", "dense")
MAX_DOC_ID = 512
# Drops remembered for writes planned before them (Retriever.generation): an hour, far beyond any
# request's life; pruned only once this many are remembered.
DROPS_REMEMBERED_S = 3600.0
DROPS_PRUNE_ABOVE = 1024
# A search whose candidates hold chunks of uncommitted versions runs again without them (`_ranked`);
# each run leaves out every such version it met, so more runs are needed only when more of them than
# a whole candidate set rank above the visible chunks.
SEARCH_ROUNDS = 8
# Chunks embedded and written at a time by an ingest: bounds its memory whatever the document's size.
WRITE_BATCH = 256


def _reading(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Collection read that a drop (a DELETE, a forgotten session) closes under it raises
    CollectionDropped, whatever the closed shard or the server raised: callers treat the collection
    as gone (a 404, a miss) instead of each reading the engine's own errors."""

    @functools.wraps(method)
    def read(self: Collection, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CollectionDropped:
            raise
        except Exception as exc:
            if self.dropped:
                raise CollectionDropped(self.name) from exc
            raise

    return read


class CollectionNotFound(KeyError):
    pass


class CollectionDropped(CollectionNotFound):
    """The collection was deleted while this call waited for it (or since the caller's turn began):
    nothing was written, and nothing was re-created. A new call re-creates it where that is wanted."""


class InvalidName(ValueError):
    pass


def check_name(name: str, internal: bool = False) -> str:
    session = internal and name.startswith(SESSION_PREFIX)
    if session and COLLECTION_NAME.fullmatch(name[len(SESSION_PREFIX) :]):
        return name
    if not COLLECTION_NAME.fullmatch(name):
        raise InvalidName(
            f"invalid collection name {name!r}: 1-64 characters of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def session_collection(session_id: str) -> str:
    return SESSION_PREFIX + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def tenant_dir(tenant: str) -> str:
    """A directory/Qdrant-safe token per tenant; distinct tenants never share one."""
    if re.fullmatch(r"[A-Za-z0-9_-]{1,40}", tenant):
        return tenant
    return "t" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class RetrievalConfig:
    root: Path  # <data dir>/retrieval
    qdrant_url: str | None = None
    qdrant_api_key: str | None = None
    embedder: str = "minilm"
    chunk_words: int = 200
    chunk_overlap: int = 40
    candidates: int = 100
    max_full_chars: int = 24_000
    # BM25 (fixed per collection on its first write: the document vectors carry it)
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    # the second stage of bm25_dense (tuned on SciFact train; see docs/retrieval-engine.md)
    fusion: Fusion = field(default_factory=Fusion)
    search_threads: int = 1  # per embedded shard
    # embedded shards kept open at once; the least recently used beyond it are suspended (closed
    # until their next call). 0: no limit. A gateway with a collection per chat session needs it.
    max_open_shards: int = 64
    optimize_every: int = 20_000  # changed points between optimisations of an embedded shard (0: never)
    migration_progress: Any = None  # callable(done, total) while an old-layout collection is migrated


@dataclass
class DocumentInput:
    id: str
    text: str
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class IngestResult:
    id: str
    status: str  # created | updated | unchanged
    chunks: int


@dataclass
class Hit:
    key: str
    document_id: str
    chunk: int
    text: str
    title: str
    score: float
    bm25_score: float | None
    dense_score: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.key,
            "document_id": self.document_id,
            "chunk": self.chunk,
            "title": self.title,
            "text": self.text,
            "score": self.score,
            "bm25_score": self.bm25_score,
            "dense_score": self.dense_score,
        }


@dataclass
class DocumentRecord:
    id: str
    title: str
    summary: str
    text: str
    chunks: int
    metadata: dict[str, Any]


def chunk_key(doc_id: str, index: int) -> str:
    return f"{doc_id}#{index}"


def version_of(doc_id: str, digest: str) -> str:
    """The id of one version of one document (unique across documents, even with equal texts)."""
    return hashlib.sha256(f"{doc_id}\x00{digest}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


LAYOUT = 2  # 1: docs.sqlite + bm25.npz + Qdrant local mode (migrated on open); 2: all in Qdrant
DOC_FIELDS = ["doc", "ver", "hash", "title", "summary", "chunks"]


class Collection:
    def __init__(
        self, retriever: Retriever, tenant: str, name: str, directory: Path, meta: dict, engine: Engine
    ) -> None:
        self.retriever = retriever
        self.tenant = tenant
        self.name = name
        self.directory = directory
        self.meta = meta
        self.qdrant_name = qdrant_name(tenant, name)
        self.engine = engine
        # Held by every write, and by `Retriever.drop` while it deletes: a delete waits for an
        # in-flight write to finish, and a write that waited for a delete finds `dropped` set.
        self._write = threading.Lock()
        self.dropped = False
        self._unoptimized = 0  # points written or deleted since the last optimize()

    def _check_not_dropped(self) -> None:
        """Called by each writer once it holds `_write`: after a drop the shard is closed and its
        files are gone, so a write would fail half-way or re-create `meta.json` (a ghost collection)."""
        if self.dropped:
            raise CollectionDropped(self.name)

    @property
    def embedder(self) -> Embedder:
        return shared_embedder(self.meta["embedder"])

    @property
    def bm25_params(self) -> BM25Params | None:
        found = self.meta.get("bm25")
        if not found or not found.get("avg_len"):
            return None
        return BM25Params(found["k1"], found["b"], found["avg_len"])

    def _fix_bm25(self, token_lists: list[list[str]]) -> BM25Params:
        """BM25's average length is fixed on the first write (the vectors carry it): that batch's mean
        when it has ≥ 20 chunks, else 60% of the chunk size (stop words dropped)."""
        params = self.bm25_params or self._shared_bm25()
        if params is not None:
            return params
        config = self.retriever.config
        if len(token_lists) >= 20:
            avg = sum(len(t) for t in token_lists) / len(token_lists)
        else:
            avg = 0.6 * config.chunk_words
        params = BM25Params(config.bm25_k1, config.bm25_b, round(max(avg, 1.0), 2))
        self.meta["bm25"] = params.as_dict()
        self.retriever._save_meta(self)
        return params

    def _shared_bm25(self) -> BM25Params | None:
        """On a shared server another replica may have fixed BM25's parameters since we opened the
        collection: read them from the collection's meta point."""
        if self.retriever.pool is None:
            return None
        stored = self.engine.retrieve([META_POINT]).get(META_POINT)
        if stored and (stored.get("meta") or {}).get("bm25"):
            self.meta = stored["meta"]
        return self.bm25_params

    # --------------------------------------------------------------------------- ingest
    def prepare(self, doc: DocumentInput) -> tuple[DocumentInput, str, list]:
        """Validate and chunk one document (no writes): raises ValueError with a clear message."""
        if not isinstance(doc.id, str) or not doc.id.strip() or len(doc.id) > MAX_DOC_ID:
            raise ValueError(f"document id must be a non-empty string of at most {MAX_DOC_ID} characters")
        # The text is stored as sent (only lone surrogates replaced, outer whitespace trimmed): NFKC
        # would turn "10⁻³" into "10−3" and "ﬁ" into "fi" in what layer 2 and hits give back. NFKC
        # applies only to what is matched: the BM25 tokens (`tokenize`) and the embedding input.
        text = clean(doc.text or "").strip()
        if not text:
            raise ValueError(f"document {doc.id!r} has no text")
        title = clean(doc.title).strip() if doc.title else title_from(text, doc.id)
        config = self.retriever.config
        digest = content_hash(
            title,
            text,
            orjson.dumps(doc.metadata, option=orjson.OPT_SORT_KEYS).decode(),
            f"{config.chunk_words}/{config.chunk_overlap}/{self.meta['embedder']}",
            # tokens and chunks of these scripts changed: such a document sent again is rewritten
            *((SPACELESS_TEXT_VERSION,) if has_spaceless(title + text) else ()),
        )
        chunks = chunk_text(text, config.chunk_words, config.chunk_overlap)
        return DocumentInput(doc.id, text, title, doc.metadata), digest, chunks

    def ingest(
        self, docs: list[DocumentInput], timings: dict[str, float] | None = None
    ) -> list[IngestResult]:
        """Idempotent upsert of already-validated documents (see `prepare`).

        `timings`, when given, accumulates seconds spent in `embed` (the dense model) and `index`
        (tokenising, BM25 vectors and Qdrant writes)."""
        prepared = [self.prepare(d) for d in docs]
        results: list[IngestResult] = []
        with self._write:
            self._check_not_dropped()
            records = self.engine.retrieve(
                [doc_point_id(doc.id) for doc, _, _ in prepared], ["doc", "hash", "chunks"]
            )
            current = {p["doc"]: p for p in records.values()}
            todo = []
            seen: set[str] = set()
            for doc, digest, chunks in reversed(prepared):  # the last copy of a repeated id wins
                if doc.id in seen:
                    continue
                seen.add(doc.id)
                row = current.get(doc.id)
                if row is not None and row.get("hash") == digest:
                    results.append(IngestResult(doc.id, "unchanged", int(row.get("chunks", 0))))
                    continue
                todo.append((doc, digest, chunks))
                results.append(IngestResult(doc.id, "updated" if row else "created", len(chunks)))
            results.reverse()
            todo.reverse()
            if not todo:
                return results
            started = time.perf_counter()
            written, embed_seconds = self._write_versions(todo)
            embedded = started + embed_seconds
            now = time.time()
            self.engine.upsert(
                [
                    PointData(
                        doc_point_id(doc.id),
                        {
                            "kind": "doc",
                            "doc": doc.id,
                            "ver": version_of(doc.id, digest),
                            "hash": digest,
                            "title": doc.title,
                            "summary": summarize(doc.text),
                            "text": doc.text,
                            "chunks": len(chunks),
                            "metadata": doc.metadata,
                            "updated": now,
                        },
                    )
                    for doc, digest, chunks in todo
                ],
                atomic=True,
            )  # the commit
            self.engine.delete_chunks(
                [doc.id for doc, _, _ in todo], [version_of(doc.id, digest) for doc, digest, _ in todo]
            )
            self._after_write(written + len(todo))
            if timings is not None:
                timings["embed"] = timings.get("embed", 0.0) + (embedded - started)
                timings["index"] = timings.get("index", 0.0) + (time.perf_counter() - embedded)
        return results

    def _write_versions(self, todo: list[tuple[DocumentInput, str, list]]) -> tuple[int, float]:
        """The first step of an ingest: embed and write the chunks of each new version, under point ids
        of that version, so nothing visible changes. Until `ingest` writes the document records (the
        commit) a search does not show them; a crash between the two steps leaves them behind, unseen,
        until the document is ingested again. The caller holds `_write`. Returns the number of
        chunks written and the seconds spent embedding.

        Chunks are embedded and written WRITE_BATCH at a time: embedded all at once, a 20 MB document
        (~20,000 chunks) held every chunk's text, tokenizer encoding and vector together, 3.4 GB
        resident. A batch that fails (the embedder, the engine) takes the batches written before it
        with it: what is left is what was there before."""
        token_lists, owners = [], []
        for doc, digest, chunks in todo:
            for chunk in chunks:
                token_lists.append(tokenize(f"{doc.title} {chunk.text}" if doc.title else chunk.text))
                owners.append((doc, digest, chunk))
        params = self._fix_bm25(token_lists)  # on a collection's first write: the mean over all of them
        embed_seconds = 0.0
        try:
            for start in range(0, len(owners), WRITE_BATCH):
                batch = owners[start : start + WRITE_BATCH]
                # the model reads the NFKC form, as queries are (`_ranked`)
                texts = [
                    normalize(f"{doc.title}. {chunk.text}" if doc.title else chunk.text)
                    for doc, _, chunk in batch
                ]
                started = time.perf_counter()
                vectors = self.embedder.encode(texts)
                embed_seconds += time.perf_counter() - started
                points = []
                for (doc, digest, chunk), tokens, vector in zip(
                    batch, token_lists[start : start + WRITE_BATCH], vectors, strict=True
                ):
                    ver = version_of(doc.id, digest)
                    points.append(
                        PointData(
                            chunk_point_id(doc.id, ver, chunk.index),
                            {
                                "kind": "chunk",
                                "doc": doc.id,
                                "ver": ver,
                                "idx": chunk.index,
                                "text": chunk.text,
                                "title": doc.title,
                            },
                            vector,
                            bm25_document(tokens, params),
                        )
                    )
                self.engine.upsert(points)  # new version's chunks: invisible until their record commits
        except BaseException:
            self._discard_uncommitted([doc.id for doc, _, _ in todo])
            raise
        return len(owners), embed_seconds

    def _discard_uncommitted(self, doc_ids: list[str]) -> None:
        """Delete the chunks of these documents that their records do not name (what a failed first
        step wrote), best effort: what stays is invisible and goes with the next ingest of them."""
        try:
            records = self.engine.retrieve([doc_point_id(d) for d in doc_ids], ["doc", "ver"])
            self.engine.delete_chunks(doc_ids, [r["ver"] for r in records.values() if r.get("ver")])
        except Exception:  # the engine that failed the write may fail this too: the next ingest tidies
            logging.getLogger("polyroute.retrieval").warning(
                "could not remove the chunks a failed ingest of %s wrote; they stay unseen",
                doc_ids,
                exc_info=True,
            )

    def _after_write(self, changed: int) -> None:
        """An embedded shard optimises (indexes, vacuums) only when asked: ask every
        `optimize_every` changed points, so HNSW covers bulk ingests and IDF forgets deletes."""
        self._unoptimized += changed
        every = self.retriever.config.optimize_every
        if every and self._unoptimized >= every:
            self.engine.optimize()
            self._unoptimized = 0

    def delete(self, doc_ids: list[str]) -> list[str]:
        """Delete documents (all their chunks); returns the ids that existed."""
        with self._write:
            self._check_not_dropped()
            records = self.engine.retrieve([doc_point_id(d) for d in doc_ids], ["doc"])
            found = [d for d in dict.fromkeys(doc_ids) if doc_point_id(d) in records]
            if not found:
                return []
            self.engine.delete_ids([doc_point_id(d) for d in found])  # from now on no search shows them
            self.engine.delete_chunks(found)
            self._after_write(len(found))
            return found

    def optimize(self) -> None:
        """Build the HNSW/sparse indexes of the embedded shard now (after a bulk ingest)."""
        with self._write:
            self._check_not_dropped()
            self.engine.optimize()
            self._unoptimized = 0

    # --------------------------------------------------------------------------- reading
    @_reading
    def stats(self) -> dict[str, Any]:
        return {
            "object": "collection",
            "name": self.name,
            "documents": self.engine.count("doc"),
            "chunks": self.engine.count("chunk"),
            "embedder": self.meta["embedder"],
            "created": self.meta.get("created"),
            "vector_backend": f"qdrant-{self.engine.mode}",
        }

    @_reading
    def document(self, doc_id: str) -> DocumentRecord | None:
        row = self.engine.retrieve([doc_point_id(doc_id)]).get(doc_point_id(doc_id))
        if row is None:
            return None
        return DocumentRecord(
            row["doc"],
            row.get("title", ""),
            row.get("summary", ""),
            row.get("text", ""),
            int(row.get("chunks", 0)),
            row.get("metadata") or {},
        )

    @_reading
    def documents(self, doc_ids: list[str]) -> dict[str, tuple[str, str]]:
        """id → (title, summary) for the ids that exist."""
        rows = self.engine.retrieve([doc_point_id(d) for d in doc_ids], ["doc", "title", "summary"])
        return {r["doc"]: (r.get("title", ""), r.get("summary", "")) for r in rows.values()}

    @_reading
    def list_documents(self, limit: int = 100, after: str = "") -> list[dict[str, Any]]:
        rows = sorted(
            (r for r in self.engine.scroll("doc", ["doc", "title", "summary", "chunks"]) if r["doc"] > after),
            key=lambda r: r["doc"],
        )[:limit]
        return [
            {"id": r["doc"], "title": r["title"], "summary": r["summary"], "chunks": r["chunks"]}
            for r in rows
        ]

    @_reading
    def all_documents(self) -> list[DocumentRecord]:
        """Every document with its text (migration, export)."""
        return [
            DocumentRecord(
                r["doc"],
                r.get("title", ""),
                r.get("summary", ""),
                r.get("text", ""),
                int(r.get("chunks", 0)),
                r.get("metadata") or {},
            )
            for r in self.engine.scroll("doc", ["doc", "title", "summary", "text", "chunks", "metadata"])
        ]

    @_reading
    def search(
        self, query: str, k: int = 10, mode: str = "bm25_dense", candidates: int | None = None
    ) -> list[Hit]:
        return [
            Hit(
                chunk_key(p["doc"], p["idx"]),
                p["doc"],
                p["idx"],
                p.get("text", ""),
                p.get("title", ""),
                score,
                sparse,
                dense,
            )
            for p, score, sparse, dense in self._ranked(query, k, mode, candidates, details=True)
        ]

    @_reading
    def rank(
        self, query: str, k: int = 10, mode: str = "bm25_dense", candidates: int | None = None
    ) -> list[tuple[str, float, float | None, float | None]]:
        """(chunk key, score, bm25 score, dense score), best first: one Qdrant query (run again only
        when it met uncommitted chunks, see `_ranked`), no texts.

        The per-part scores are filled as far as that one query gives them (`search` gives both)."""
        return [
            (chunk_key(p["doc"], p["idx"]), score, sparse, dense)
            for p, score, sparse, dense in self._ranked(query, k, mode, candidates, details=False)
        ]

    def _ranked(self, query, k, mode, candidates, details):
        """The top `k` visible chunks: (payload, score, bm25 score, dense score), best first.

        Chunks no document record names (a new version an ingest has written but not committed yet,
        or one a crash left behind) never show, and never take a visible chunk's place: when the
        top `k` hold such a version, the query runs again with the versions met so far filtered out
        inside Qdrant, in every stage (BM25 prefetch, dense re-score, fusion), until the top `k` hold
        none (at most SEARCH_ROUNDS runs). A search that meets none, nearly all, runs once, as
        before. Only BM25's IDF still counts them, as it counts every stored point."""
        if mode not in MODES:
            raise ValueError(f"unknown search mode {mode!r}; expected one of {', '.join(MODES)}")
        if k <= 0 or (self.bm25_params is None and self._shared_bm25() is None):  # nothing was ever written
            return []
        config = self.retriever.config
        pool = max(candidates or config.candidates, k)
        tokens = tokenize(query)
        sparse = bm25_query(tokens) if tokens else None
        vector = self.embedder.encode_query(normalize(query)) if mode != "bm25" else None
        payload = ["doc", "ver", "idx"] + (["text", "title"] if details else [])
        hidden: set[str] = set()
        for _ in range(SEARCH_ROUNDS):
            found, fill = self._candidates(mode, k, pool, sparse, vector, payload, details, hidden)
            uncommitted = self._uncommitted(found)
            if not uncommitted - hidden - {None}:  # none met (or none Qdrant can filter out)
                break
            hidden |= uncommitted - {None}
        # bounded: what is still uncommitted after the last round is left out, never shown
        found = [p for p in found if p.payload.get("ver") not in uncommitted]
        bm25_scores: dict[str, float] = {}
        if details and found and sparse is not None and mode != "bm25":
            ids = [p.id for p in found]
            bm25_scores = {
                p.id: p.score
                for p in self.engine.query(
                    QuerySpec("bm25", len(ids), len(ids), sparse, None, config.fusion, ["doc"], ids=ids)
                )
            }
        out = []
        for p in found:
            if mode == "bm25":
                out.append((p.payload, p.score, p.score, None))
                continue
            dense = (
                float(np.dot(np.asarray(p.dense, dtype=np.float32), vector)) if p.dense is not None else None
            )
            if mode == "dense":
                dense = p.score
            lexical = bm25_scores.get(p.id, 0.0) if details else None
            # a filled-in chunk has no BM25 score: the formula gives it its cosine (p.score, from
            # the dense query), and the list is ordered by the formula over all of them
            out.append((p.payload, p.score, lexical, dense))
        # Best first, and equal scores in one order (document, chunk), not the engine's: RRF gives
        # equal scores to chunks ranked a-then-b and b-then-a, and Qdrant returned them in either
        # order, so one query's hits came in two orders from run to run (a filled-in list, too, is
        # ordered here by the formula over all of them)
        out.sort(key=lambda item: (-item[1], item[0]["doc"], item[0]["idx"]))
        return out

    def _candidates(self, mode, k, pool, sparse, vector, payload, details, hidden: set[str]):
        """One run of the query without the `hidden` versions: its top `k`, best first, and whether
        dense neighbours filled in for too few BM25 matches."""
        config = self.retriever.config
        hide = sorted(hidden) or None
        if sparse is None and mode in ("bm25", "bm25_dense"):
            found = []  # no query term: BM25 matches nothing
        else:
            run_mode = "dense" if mode == "rrf" and sparse is None else mode
            found = self.engine.query(
                QuerySpec(
                    run_mode,
                    k,
                    pool,
                    sparse,
                    vector,
                    config.fusion,
                    payload,
                    with_dense=details,
                    hidden_versions=hide,
                )
            )
        fill = mode == "bm25_dense" and len(found) < k
        if fill:  # too few lexical matches (vocabulary mismatch): dense neighbours fill the rest
            lexical_ids = {p.id for p in found}
            extra = self.engine.query(
                QuerySpec(
                    "dense", k, pool, None, vector, config.fusion, payload, details, hidden_versions=hide
                )
            )
            found = found + [p for p in extra if p.id not in lexical_ids][: k - len(found)]
        return found, fill

    def _uncommitted(self, found) -> set[str]:
        """The versions among `found` that are not their document's committed one (or whose document
        does not exist): an ingest in flight, a crash between its two steps, a delete's leftovers."""
        if not found:
            return set()
        docs = sorted({p.payload["doc"] for p in found})
        records = self.engine.retrieve([doc_point_id(d) for d in docs], ["doc", "ver"])
        committed = {r["doc"]: r["ver"] for r in records.values()}
        return {
            p.payload.get("ver") for p in found if committed.get(p.payload["doc"]) != p.payload.get("ver")
        }

    def close(self) -> None:
        self.engine.close()


QDRANT_PREFIX = "pr2."  # the first layout's vector-only server collections were "pr.<tenant>.<name>"


def qdrant_name(tenant: str, name: str) -> str:
    return f"{QDRANT_PREFIX}{tenant_dir(tenant)}.{name}"


class Retriever:
    """All collections of one data dir (embedded Qdrant Edge shards) or of one Qdrant server.

    Deletes and writes of one collection are ordered (`drop`): a delete waits for the write in
    flight, and a write that lost the race writes nothing. On a server shared by replicas
    (`QDRANT_URL`), another replica may delete a collection this one has open: `get` and `exists`
    ask the server, so this replica then reports it missing (404) or creates it afresh.
    """

    def __init__(self, config: RetrievalConfig) -> None:
        self.config = config
        config.root.mkdir(parents=True, exist_ok=True)
        self._pool: ClientPool | None = None
        self._open: dict[tuple[str, str], Collection] = {}
        self._lock = threading.RLock()
        # (tenant, name) → set while `drop` deletes it: `get` and other drops of it wait for that
        self._dropping: dict[tuple[str, str], threading.Event] = {}
        # drops in this process, numbered (see `generation`): the last drop of each (tenant, name), with
        # when it happened; forgotten after DROPS_REMEMBERED_S, far longer than any request lives
        self._drop_count = 0
        self._drops: dict[tuple[str, str], tuple[int, float]] = {}

    @property
    def pool(self) -> ClientPool | None:
        """qdrant-client for QDRANT_URL (":memory:" in tests), opened on first use; None: embedded."""
        if not self.config.qdrant_url:
            return None
        with self._lock:
            if self._pool is None:
                self._pool = ClientPool(self.config.qdrant_url, self.config.qdrant_api_key)
            return self._pool

    @property
    def engine_name(self) -> str:
        return "qdrant-client" if self.config.qdrant_url else "qdrant-edge"

    def _dir(self, tenant: str, name: str) -> Path:
        return self.config.root / "tenants" / tenant_dir(tenant) / name

    def _new_meta(self, tenant: str, name: str) -> dict:
        return {
            "name": name,
            "tenant": tenant,
            "embedder": self.config.embedder,
            "created": int(time.time()),
            "layout": LAYOUT,
            "engine": self.engine_name,
            "bm25": None,
        }

    def _save_meta(self, collection: Collection) -> None:
        collection._check_not_dropped()  # never re-create a dropped collection's meta.json
        if self.pool is not None:
            collection.engine.upsert([PointData(META_POINT, {"kind": "meta", "meta": collection.meta})])
            return
        path = collection.directory / "meta.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(collection.meta))
        tmp.replace(path)

    def _dim(self, embedder: str) -> int:
        return shared_embedder(embedder).dim

    def generation(self, tenant: str, name: str) -> int:
        """The number of drops this process has made so far: a caller that will write to the
        collection later (a chat turn's background write to its session) reads it first and passes it
        to `get`, so a delete in between (DELETE /v1/sessions) is not undone by that write. Local to
        this process."""
        with self._lock:
            return self._drop_count

    def get(
        self,
        tenant: str,
        name: str,
        create: bool = False,
        internal: bool = False,
        generation: int | None = None,
    ) -> Collection:
        """The collection, opened on first use; `create` makes a missing one.

        Raises CollectionNotFound when it is missing (and not `create`), and CollectionDropped when
        `generation` (from `generation()`) is older than a drop of it: the caller's write is moot.
        Waits while the collection is being dropped, so it never hands out what a drop deletes."""
        check_name(name, internal=internal)
        key = (tenant, name)
        while True:
            with self._lock:
                pending = self._dropping.get(key)
                if pending is None:
                    dropped = self._drops.get(key)
                    if generation is not None and dropped is not None and dropped[0] > generation:
                        raise CollectionDropped(name)
                    opened = self._open.get(key)
                    if opened is None:
                        return self._open_new(tenant, name, create)
                    if isinstance(opened.engine, EdgeEngine):
                        # The common case, an open shard, returns at once: it must not wait here, under
                        # the Retriever's lock, for a long call (an ingest, an optimise) another thread
                        # is making. Embedded shards are this process's own: no other replica drops them.
                        if not opened.engine.is_open:
                            opened.engine.ensure_open()
                        self._bound_open_shards(keep=opened)  # never waits: a busy shard is skipped
                        return opened
            if pending is not None:
                pending.wait()
                continue
            # A server collection this replica has open: another replica may have dropped it. One
            # round trip (outside the lock), on the server path only; a dropped one is forgotten
            # here and the next turn of the loop re-creates it or raises CollectionNotFound.
            # (Tested with qdrant-client's in-process mode standing in for the server.)
            pool = self.pool
            if pool is None or pool.exists(opened.qdrant_name):
                return opened
            with self._lock:
                if self._open.get(key) is opened:
                    del self._open[key]

    def _open_new(self, tenant: str, name: str, create: bool) -> Collection:
        """Open (or, with `create`, make) a collection not open here yet; the caller holds `_lock`."""
        directory = self._dir(tenant, name)
        pool = self.pool
        if pool is not None:
            qname = qdrant_name(tenant, name)
            legacy_dir = self._legacy(tenant, name)
            if not pool.exists(qname) and not create and legacy_dir is None:
                raise CollectionNotFound(name)
            meta = self._new_meta(tenant, name)
            engine = pool.engine(qname, self._dim(meta["embedder"]))
            stored = engine.retrieve([META_POINT]).get(META_POINT)
            collection = Collection(self, tenant, name, directory, stored["meta"] if stored else meta, engine)
            if stored is None:
                self._save_meta(collection)
            if legacy_dir is not None:  # this replica's first-layout copy: into the shared collection
                from retrieval.migrate import migrate_collection

                migrate_collection(collection, self.config.migration_progress)
        else:
            meta_path = directory / "meta.json"
            if meta_path.exists():
                meta = orjson.loads(meta_path.read_bytes())
            elif create:
                directory.mkdir(parents=True, exist_ok=True)
                meta = self._new_meta(tenant, name)
            else:
                raise CollectionNotFound(name)
            legacy = meta.get("layout", 1) < LAYOUT
            engine = EdgeEngine(
                directory, self._dim(meta["embedder"]), search_threads=self.config.search_threads
            )
            collection = Collection(self, tenant, name, directory, meta, engine)
            try:
                if legacy:
                    from retrieval.migrate import migrate_collection

                    migrate_collection(collection, self.config.migration_progress)
                elif not meta_path.exists():
                    self._save_meta(collection)  # the collection exists from here on
            except BaseException:
                engine.close()  # release the shard: the next open tries again
                raise
        self._open[(tenant, name)] = collection
        self._bound_open_shards(keep=collection)
        return collection

    def _bound_open_shards(self, keep: Collection) -> None:
        """Suspend the least recently used embedded shards beyond `max_open_shards` (never `keep`,
        nor one in use on another thread). They reopen on their next call: nothing is lost, a
        rarely used collection only pays its open again."""
        limit = self.config.max_open_shards
        if limit <= 0 or len(self._open) <= limit:
            return
        engines = [
            c.engine for c in self._open.values() if isinstance(c.engine, EdgeEngine) and c.engine.is_open
        ]
        excess = len(engines) - limit
        if excess <= 0:
            return
        for engine in sorted(engines, key=lambda e: e.last_used):
            if excess <= 0:
                break
            if engine is not keep.engine and engine.suspend():
                excess -= 1

    def _legacy(self, tenant: str, name: str) -> Path | None:
        """The directory of a first-layout collection of this name on this replica's disk, if any."""
        directory = self._dir(tenant, name)
        if not (directory / "docs.sqlite").exists() or not (directory / "meta.json").exists():
            return None
        meta = orjson.loads((directory / "meta.json").read_bytes())
        return directory if meta.get("layout", 1) < LAYOUT else None

    def exists(self, tenant: str, name: str) -> bool:
        if self.pool is not None:  # the server, not this replica's cache: another may have dropped it
            return self.pool.exists(qdrant_name(tenant, name)) or self._legacy(tenant, name) is not None
        return (self._dir(tenant, name) / "meta.json").exists()

    def names(self, tenant: str, sessions: bool = False) -> list[str]:
        if self.pool is not None:
            prefix = f"{QDRANT_PREFIX}{tenant_dir(tenant)}."
            found = [n[len(prefix) :] for n in self.pool.names(prefix)]
            base = self.config.root / "tenants" / tenant_dir(tenant)
            if base.is_dir():  # first-layout collections not migrated yet (they migrate when opened)
                found += [p.name for p in base.iterdir() if self._legacy(tenant, p.name) is not None]
            found = list(set(found))
        else:
            base = self.config.root / "tenants" / tenant_dir(tenant)
            found = [p.name for p in base.iterdir() if (p / "meta.json").exists()] if base.is_dir() else []
        return sorted(n for n in found if sessions or not n.startswith(SESSION_PREFIX))

    def drop(self, tenant: str, name: str, internal: bool = False) -> bool:
        """Delete the collection; False if there was none. When it returns, the collection is gone.

        A write in flight on this process finishes first (the drop waits for the collection's write
        lock, not holding the Retriever's lock, so other collections stay usable meanwhile); a write
        that starts later finds the collection dropped and writes nothing (`CollectionDropped`); a
        `get` of it waits until the drop is done. The drop counts as a new `generation` even when
        nothing existed: a session turn answered before a forget is not stored after it."""
        check_name(name, internal=internal)
        key = (tenant, name)
        done = threading.Event()
        while True:
            with self._lock:
                other = self._dropping.get(key)
                if other is None:
                    self._dropping[key] = done
                    self._remember_drop(key)
                    collection = self._open.pop(key, None)
                    break
            other.wait()  # a concurrent drop of the same collection: then this one finds it gone
        try:
            if collection is not None:
                with collection._write:
                    collection.dropped = True
                    collection.close()
            return self._remove(tenant, name, had_open=collection is not None)
        finally:
            with self._lock:
                del self._dropping[key]
            done.set()

    def _remember_drop(self, key: tuple[str, str]) -> None:
        """Number this drop (the caller holds `_lock`). Drops older than DROPS_REMEMBERED_S are
        forgotten once many are remembered: no write planned before them is still waiting (a request
        lives POLYROUTE_REQUEST_TIMEOUT_S at most), and a gateway forgetting a session a second
        keeps one entry per session otherwise."""
        now = time.monotonic()
        self._drop_count += 1
        self._drops.pop(key, None)  # re-inserted last: the dict stays in drop order
        self._drops[key] = (self._drop_count, now)
        if len(self._drops) > DROPS_PRUNE_ABOVE:
            for old, (_, at) in list(self._drops.items())[:-1]:  # never this drop
                if now - at < DROPS_REMEMBERED_S:
                    break
                del self._drops[old]

    def _remove(self, tenant: str, name: str, had_open: bool) -> bool:
        """Delete the collection's data (server collection, shard directory, first-layout files)."""
        pool = self.pool
        if pool is not None:
            legacy = self._legacy(tenant, name)
            if legacy is not None:  # never migrated: its first-layout files go too
                (legacy / "meta.json").unlink(missing_ok=True)
                shutil.rmtree(legacy, ignore_errors=True)
            # the server says whether it existed: this replica's cache may be stale
            return pool.drop(qdrant_name(tenant, name)) or legacy is not None
        directory = self._dir(tenant, name)
        if not had_open and not (directory / "meta.json").exists():
            return False
        (directory / "meta.json").unlink(missing_ok=True)  # gone for readers before the files go
        shutil.rmtree(directory, ignore_errors=True)
        return True

    def close(self) -> None:
        with self._lock:
            for collection in self._open.values():
                collection.close()
            self._open.clear()
            if self._pool is not None:
                self._pool.close()
                self._pool = None


__all__ = ["ShardLocked"]
