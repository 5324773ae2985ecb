"""Collections: ingest (chunk, embed, index), delete, and hybrid search, per tenant.

On disk, under `<root>/<tenant>/<collection>/`: `docs.sqlite` (documents and chunk texts, the
source of truth for what a collection holds), `bm25.npz` + `bm25.wal` (the sparse index) and
`meta.json`. Vectors live in Qdrant, one Qdrant collection per tenant + name.

A document is written whole or not at all: it is parsed, chunked and embedded before anything is
stored; then vectors go to Qdrant, postings to BM25, and the document row commits last. A search
only returns chunks whose document row exists, so a crash between the steps leaves nothing
visible, and re-ingesting (ids are stable) repairs it.

Search modes:
- ``bm25``: sparse only.
- ``dense``: Qdrant nearest neighbours only.
- ``bm25_dense`` (default): BM25 top-`candidates`, re-scored by cosine similarity of their stored
  vectors with the query's; when BM25 matches fewer than k chunks, dense neighbours fill the rest
  (after the BM25 matches, so a query in other words than the documents' still finds something).
- ``rrf``: dense top-`candidates` ∪ BM25 top-`candidates`, reciprocal-rank fusion (k=60).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from retrieval.dense import DenseStore
from retrieval.embed import Embedder, shared_embedder
from retrieval.sparse import BM25Index
from retrieval.text import chunk_text, content_hash, normalize, summarize, title_from, tokenize

# fullmatch, not match: with match, `$` also accepts a trailing newline ("docs\n")
COLLECTION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
SESSION_PREFIX = "_s-"  # session collections: a prefix no client-chosen name can have
MODES = ("bm25_dense", "rrf", "bm25", "dense")
RRF_K = 60
MAX_DOC_ID = 512


class CollectionNotFound(KeyError):
    pass


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


class Collection:
    def __init__(self, retriever: Retriever, tenant: str, name: str, directory: Path, meta: dict) -> None:
        self.retriever = retriever
        self.tenant = tenant
        self.name = name
        self.directory = directory
        self.meta = meta
        self.qdrant_name = f"pr.{tenant_dir(tenant)}.{name}"
        self._write = threading.Lock()
        self.bm25 = BM25Index(directory)
        self._db = sqlite3.connect(directory / "docs.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS docs (id TEXT PRIMARY KEY, title TEXT, summary TEXT, text TEXT,
                hash TEXT, chunks INTEGER, metadata TEXT, updated REAL);
            CREATE TABLE IF NOT EXISTS chunks (key TEXT PRIMARY KEY, doc TEXT, idx INTEGER, text TEXT);
            CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc);
            """
        )
        self._db_lock = threading.Lock()

    @property
    def embedder(self) -> Embedder:
        return shared_embedder(self.meta["embedder"])

    @property
    def dense(self) -> DenseStore:
        return self.retriever.dense

    # --------------------------------------------------------------------------- ingest
    def prepare(self, doc: DocumentInput) -> tuple[DocumentInput, str, list]:
        """Validate and chunk one document (no writes): raises ValueError with a clear message."""
        if not isinstance(doc.id, str) or not doc.id.strip() or len(doc.id) > MAX_DOC_ID:
            raise ValueError(f"document id must be a non-empty string of at most {MAX_DOC_ID} characters")
        text = normalize(doc.text or "").strip()
        if not text:
            raise ValueError(f"document {doc.id!r} has no text")
        title = normalize(doc.title).strip() if doc.title else title_from(text, doc.id)
        config = self.retriever.config
        digest = content_hash(
            title,
            text,
            orjson.dumps(doc.metadata, option=orjson.OPT_SORT_KEYS).decode(),
            f"{config.chunk_words}/{config.chunk_overlap}/{self.meta['embedder']}",
        )
        chunks = chunk_text(text, config.chunk_words, config.chunk_overlap)
        return DocumentInput(doc.id, text, title, doc.metadata), digest, chunks

    def ingest(self, docs: list[DocumentInput]) -> list[IngestResult]:
        """Idempotent upsert of already-validated documents (see `prepare`)."""
        prepared = [self.prepare(d) for d in docs]
        results: list[IngestResult] = []
        with self._write:
            todo = []
            for doc, digest, chunks in prepared:
                row = self._one("SELECT hash, chunks FROM docs WHERE id = ?", (doc.id,))
                if row is not None and row[0] == digest:
                    results.append(IngestResult(doc.id, "unchanged", row[1]))
                    continue
                todo.append((doc, digest, chunks, row[1] if row else 0))
                results.append(IngestResult(doc.id, "updated" if row else "created", len(chunks)))
            if not todo:
                return results
            keys, texts, owners, tokens = [], [], [], []
            for doc, _, chunks, _ in todo:
                for chunk in chunks:
                    keys.append(chunk_key(doc.id, chunk.index))
                    body = f"{doc.title}. {chunk.text}" if doc.title else chunk.text
                    texts.append(body)
                    owners.append(doc.id)
                    tokens.append(tokenize(f"{doc.title} {chunk.text}" if doc.title else chunk.text))
            vectors = self.embedder.encode(texts)  # before any write: a failure leaves nothing behind
            stale = [
                chunk_key(doc.id, i) for doc, _, chunks, before in todo for i in range(len(chunks), before)
            ]
            self.dense.ensure(self.qdrant_name, vectors.shape[1])
            self.dense.upsert(self.qdrant_name, keys, vectors, owners)
            self.dense.delete(self.qdrant_name, stale)
            self.bm25.delete(stale)
            self.bm25.add(list(zip(keys, tokens, strict=True)))
            now = time.time()
            with self._db_lock:
                self._db.execute("BEGIN")
                try:
                    for doc, digest, chunks, _ in todo:
                        self._db.execute("DELETE FROM chunks WHERE doc = ?", (doc.id,))
                        self._db.executemany(
                            "INSERT INTO chunks VALUES (?, ?, ?, ?)",
                            [(chunk_key(doc.id, c.index), doc.id, c.index, c.text) for c in chunks],
                        )
                        self._db.execute(
                            "INSERT OR REPLACE INTO docs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (
                                doc.id,
                                doc.title,
                                summarize(doc.text),
                                doc.text,
                                digest,
                                len(chunks),
                                orjson.dumps(doc.metadata).decode(),
                                now,
                            ),
                        )
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        return results

    def delete(self, doc_ids: list[str]) -> list[str]:
        """Delete documents (all their chunks); returns the ids that existed."""
        with self._write:
            found: list[tuple[str, int]] = []
            for doc_id in doc_ids:
                row = self._one("SELECT chunks FROM docs WHERE id = ?", (doc_id,))
                if row is not None:
                    found.append((doc_id, row[0]))
            if not found:
                return []
            with self._db_lock:  # the row goes first: from now on no search shows these chunks
                self._db.execute("BEGIN")
                for doc_id, _ in found:
                    self._db.execute("DELETE FROM docs WHERE id = ?", (doc_id,))
                    self._db.execute("DELETE FROM chunks WHERE doc = ?", (doc_id,))
                self._db.execute("COMMIT")
            keys = [chunk_key(d, i) for d, n in found for i in range(n)]
            self.bm25.delete(keys)
            self.dense.delete(self.qdrant_name, keys)
            return [d for d, _ in found]

    # --------------------------------------------------------------------------- reading
    def _one(self, sql: str, args: tuple) -> tuple | None:
        with self._db_lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple | list = ()) -> list[tuple]:
        with self._db_lock:
            return self._db.execute(sql, args).fetchall()

    def stats(self) -> dict[str, Any]:
        docs, chunks = self._one("SELECT COUNT(*), COALESCE(SUM(chunks), 0) FROM docs", ()) or (0, 0)
        return {
            "object": "collection",
            "name": self.name,
            "documents": docs,
            "chunks": chunks,
            "embedder": self.meta["embedder"],
            "created": self.meta.get("created"),
            "vector_backend": f"qdrant-{self.dense.mode}",
        }

    def document(self, doc_id: str) -> DocumentRecord | None:
        row = self._one("SELECT id, title, summary, text, chunks, metadata FROM docs WHERE id = ?", (doc_id,))
        if row is None:
            return None
        return DocumentRecord(row[0], row[1], row[2], row[3], row[4], orjson.loads(row[5] or "{}"))

    def documents(self, doc_ids: list[str]) -> dict[str, tuple[str, str]]:
        """id → (title, summary) for the ids that exist."""
        if not doc_ids:
            return {}
        marks = ",".join("?" * len(doc_ids))
        rows = self._all(f"SELECT id, title, summary FROM docs WHERE id IN ({marks})", list(doc_ids))
        return {r[0]: (r[1], r[2]) for r in rows}

    def list_documents(self, limit: int = 100, after: str = "") -> list[dict[str, Any]]:
        rows = self._all(
            "SELECT id, title, summary, chunks FROM docs WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
        )
        return [{"id": r[0], "title": r[1], "summary": r[2], "chunks": r[3]} for r in rows]

    def _chunks(self, keys: list[str]) -> dict[str, tuple[str, int, str]]:
        out: dict[str, tuple[str, int, str]] = {}
        for start in range(0, len(keys), 500):
            part = keys[start : start + 500]
            marks = ",".join("?" * len(part))
            for key, doc, idx, text in self._all(
                f"SELECT key, doc, idx, text FROM chunks WHERE key IN ({marks})", part
            ):
                out[key] = (doc, idx, text)
        return out

    def search(
        self, query: str, k: int = 10, mode: str = "bm25_dense", candidates: int | None = None
    ) -> list[Hit]:
        ranked = self.rank(query, k, mode, candidates)
        chunks = self._chunks([key for key, *_ in ranked])
        titles = self.documents(sorted({chunks[key][0] for key, *_ in ranked if key in chunks}))
        hits = []
        for key, score, sparse, dense in ranked:
            if key not in chunks:  # a chunk whose document is not (or no longer) committed
                continue
            doc, idx, text = chunks[key]
            hits.append(Hit(key, doc, idx, text, titles.get(doc, ("", ""))[0], score, sparse, dense))
        return hits

    def rank(
        self, query: str, k: int = 10, mode: str = "bm25_dense", candidates: int | None = None
    ) -> list[tuple[str, float, float | None, float | None]]:
        """(chunk key, score, bm25 score, dense score), best first: no texts, for speed."""
        if mode not in MODES:
            raise ValueError(f"unknown search mode {mode!r}; expected one of {', '.join(MODES)}")
        if not len(self.bm25) or k <= 0:
            return []
        pool = max(k, candidates or self.retriever.config.candidates)
        tokens = tokenize(query)
        if mode == "bm25":
            return [(key, s, s, None) for key, s in self.bm25.search(tokens, k)]
        vector = self.embedder.encode_query(normalize(query))
        if mode == "dense":
            found = self.dense.search(self.qdrant_name, vector, k)
            sparse = self.bm25.score(tokens, [key for key, _ in found]) if tokens else {}
            return [(key, s, sparse.get(key, 0.0), s) for key, s in found]
        lexical = self.bm25.search(tokens, pool)
        if mode == "bm25_dense":
            vectors = self.dense.vectors(self.qdrant_name, [key for key, _ in lexical])
            rescored = [(key, float(vectors[key] @ vector), s) for key, s in lexical if key in vectors]
            rescored.sort(key=lambda item: -item[1])
            if len(rescored) < k:  # too few lexical matches (vocabulary mismatch): dense fills up
                seen = {key for key, *_ in rescored}
                extra = [(key, cos, 0.0) for key, cos in self.dense.search(self.qdrant_name, vector, k)]
                rescored += [item for item in extra if item[0] not in seen][: k - len(rescored)]
            return [(key, cos, s, cos) for key, cos, s in rescored[:k]]
        semantic = self.dense.search(self.qdrant_name, vector, pool)
        fused: dict[str, float] = {}
        for ranking in (lexical, semantic):
            for rank, (key, _) in enumerate(ranking):
                fused[key] = fused.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
        sparse = dict(lexical)
        dense = dict(semantic)
        missing_dense = [key for key in fused if key not in dense]
        if missing_dense:
            for key, vec in self.dense.vectors(self.qdrant_name, missing_dense).items():
                dense[key] = float(vec @ vector)
        missing_sparse = [key for key in fused if key not in sparse]
        if missing_sparse and tokens:
            sparse.update(self.bm25.score(tokens, missing_sparse))
        order = sorted(fused, key=lambda key: -fused[key])[:k]
        return [(key, fused[key], sparse.get(key, 0.0), dense.get(key)) for key in order]

    def close(self) -> None:
        self.bm25.checkpoint()
        self.bm25.close()
        with self._db_lock:
            self._db.close()


class Retriever:
    """All collections of one data dir (and one Qdrant), opened on demand, per tenant."""

    def __init__(self, config: RetrievalConfig) -> None:
        self.config = config
        config.root.mkdir(parents=True, exist_ok=True)
        self._dense: DenseStore | None = None
        self._open: dict[tuple[str, str], Collection] = {}
        self._lock = threading.RLock()

    @property
    def dense(self) -> DenseStore:
        """The Qdrant client, opened on first use (local mode locks its directory)."""
        with self._lock:
            if self._dense is None:
                self._dense = DenseStore(
                    None if self.config.qdrant_url else self.config.root / "qdrant",
                    self.config.qdrant_url,
                    self.config.qdrant_api_key,
                )
            return self._dense

    def _dir(self, tenant: str, name: str) -> Path:
        return self.config.root / "tenants" / tenant_dir(tenant) / name

    def get(self, tenant: str, name: str, create: bool = False, internal: bool = False) -> Collection:
        check_name(name, internal=internal)
        with self._lock:
            opened = self._open.get((tenant, name))
            if opened is not None:
                return opened
            directory = self._dir(tenant, name)
            meta_path = directory / "meta.json"
            if meta_path.exists():
                meta = orjson.loads(meta_path.read_bytes())
            elif create:
                directory.mkdir(parents=True, exist_ok=True)
                meta = {
                    "name": name,
                    "tenant": tenant,
                    "embedder": self.config.embedder,
                    "created": int(time.time()),
                }
                tmp = meta_path.with_suffix(".tmp")
                tmp.write_bytes(orjson.dumps(meta))
                tmp.replace(meta_path)
            else:
                raise CollectionNotFound(name)
            collection = self._open[(tenant, name)] = Collection(self, tenant, name, directory, meta)
            return collection

    def exists(self, tenant: str, name: str) -> bool:
        return (self._dir(tenant, name) / "meta.json").exists()

    def names(self, tenant: str, sessions: bool = False) -> list[str]:
        base = self.config.root / "tenants" / tenant_dir(tenant)
        if not base.is_dir():
            return []
        return sorted(
            p.name
            for p in base.iterdir()
            if (p / "meta.json").exists() and (sessions or not p.name.startswith(SESSION_PREFIX))
        )

    def drop(self, tenant: str, name: str, internal: bool = False) -> bool:
        import shutil

        check_name(name, internal=internal)
        with self._lock:
            collection = self._open.pop((tenant, name), None)
            directory = self._dir(tenant, name)
            if collection is None and not (directory / "meta.json").exists():
                return False
            if collection is not None:
                collection.close()
            self.dense.drop(f"pr.{tenant_dir(tenant)}.{name}")
            (directory / "meta.json").unlink(missing_ok=True)  # gone for readers before the files go
            shutil.rmtree(directory, ignore_errors=True)
            return True

    def close(self) -> None:
        with self._lock:
            for collection in self._open.values():
                collection.close()
            self._open.clear()
            if self._dense is not None:
                self._dense.close()
                self._dense = None
