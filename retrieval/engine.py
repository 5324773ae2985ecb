"""The index behind a collection: one Qdrant collection holding everything, embedded or on a server.

Each tenant collection is one Qdrant collection with
- `dense`: the MiniLM chunk vector (cosine);
- `bm25`: the chunk's BM25 document vector, computed here (`bm25_document`), with Qdrant's IDF
  modifier, so Qdrant multiplies in `ln(1 + (N - df + 0.5) / (df + 0.5))` over the live points at
  query time (deletes and inserts need no re-weighting);
- payloads: chunk points (`kind=chunk`: doc, ver, idx, text, title) and one vector-less document
  record per document (`kind=doc`: ver, hash, title, summary, full text, chunk count, metadata).

Two engines behind one interface (`Engine`):
- `EdgeEngine`: a Qdrant Edge shard (qdrant-edge-py, in-process) under the collection's directory,
  the default. A shard is held by one process: a second one gets `ShardLocked`.
- `ClientEngine`: qdrant-client against `QDRANT_URL` (a server shared by replicas), or
  `":memory:"` (qdrant-client's in-process mode, which stands in for the server in tests).

Both receive the same points and the same queries (`QuerySpec`), so they rank the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_NAMESPACE = uuid.UUID("5b0c8a43-6a7e-4a53-9b8e-1f6f0f6c2d11")
DENSE = "dense"
SPARSE = "bm25"
KEYWORD_FIELDS = ("kind", "doc", "ver")
UPSERT_BATCH = 512


class ShardLocked(RuntimeError):
    """The collection's shard is open in another process (an embedded shard has one writer)."""


# ------------------------------------------------------------------------------------------ ids
def chunk_point_id(doc_id: str, ver: str, index: int) -> str:
    """A new id per document version: a new version never overwrites the committed one."""
    return str(uuid.uuid5(_NAMESPACE, f"chunk/{doc_id}/{ver}/{index}"))


def doc_point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, f"doc/{doc_id}"))


META_POINT = str(uuid.uuid5(_NAMESPACE, "meta"))


# ------------------------------------------------------------------------------------------ BM25
_term_ids: dict[str, int] = {}


def term_id(token: str) -> int:
    """A stable 31-bit index per token (blake2b): the same in every process, replica and mode."""
    found = _term_ids.get(token)
    if found is None:
        found = int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest(), "little")
        found &= 0x7FFFFFFF
        if len(_term_ids) < 1_000_000:
            _term_ids[token] = found
    return found


@dataclass(frozen=True)
class BM25Params:
    k1: float = 1.2
    b: float = 0.75
    avg_len: float = 100.0

    def as_dict(self) -> dict[str, float]:
        return {"k1": self.k1, "b": self.b, "avg_len": self.avg_len}


def bm25_document(tokens: list[str], params: BM25Params) -> tuple[list[int], list[float]]:
    """Term weights `tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len))`; Qdrant multiplies the IDF in."""
    ids = _term_ids
    counts = Counter([ids.get(t) or term_id(t) for t in tokens])
    norm = params.k1 * (1 - params.b + params.b * len(tokens) / params.avg_len)
    k1 = params.k1 + 1
    return list(counts), [tf * k1 / (tf + norm) for tf in counts.values()]


def bm25_query(tokens: list[str]) -> tuple[list[int], list[float]]:
    """Each distinct query term once (weight 1), as Lucene and bm25s score a query."""
    indices = sorted({term_id(t) for t in tokens})
    return indices, [1.0] * len(indices)


# ------------------------------------------------------------------------------------------ points
@dataclass
class PointData:
    id: str
    payload: dict[str, Any]
    dense: np.ndarray | None = None
    sparse: tuple[list[int], list[float]] | None = None


@dataclass(frozen=True)
class Fusion:
    """How `bm25_dense` combines the prefetched BM25 top-k with their dense scores, and RRF's k.

    `formula` (the default): `alpha · bm25 / (bm25 + c) + cosine`: BM25 saturated into [0, alpha),
    added to the cosine; `dbsf`: Qdrant's distribution-based score fusion of the two score lists;
    `rrf`: reciprocal-rank fusion of the two lists. `rrf_k` is the k of the `rrf` mode (and of
    `bm25_dense` when kind is `rrf`). Defaults: the best on SciFact's train tune half
    (bench/retrieval_tune.py, bench/results/retrieval_tune_scifact.json).
    """

    kind: str = "formula"
    alpha: float = 2.0
    c: float = 50.0
    rrf_k: int = 2

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "alpha": self.alpha, "c": self.c, "rrf_k": self.rrf_k}


@dataclass
class QuerySpec:
    mode: str  # bm25 | dense | bm25_dense | rrf
    limit: int
    candidates: int
    sparse: tuple[list[int], list[float]] | None
    dense: np.ndarray | None
    fusion: Fusion
    payload: list[str] | None = None
    with_dense: bool = False  # return the dense vector (to report the cosine)
    ids: list[str] | None = None  # restrict to these points
    # chunk versions no document record names (an ingest in flight, or one a crash cut short): kept
    # out of every stage, so they take no candidate's place (see `Collection._ranked`)
    hidden_versions: list[str] | None = None


@dataclass
class Scored:
    id: str
    score: float
    payload: dict[str, Any]
    dense: list[float] | None = None


class Engine:
    """One Qdrant collection. Writers are serialised by the caller."""

    mode: str

    def upsert(self, points: list[PointData], atomic: bool = False) -> None:
        """Write points; `atomic`: as one operation where the engine can (the commit of a batch)."""

    def delete_ids(self, ids: list[str]) -> None: ...
    def delete_chunks(self, doc_ids: list[str], keep_vers: list[str] | None = None) -> None: ...
    def retrieve(self, ids: list[str], payload: list[str] | bool = True) -> dict[str, dict[str, Any]]: ...
    def scroll(self, kind: str, payload: list[str]) -> list[dict[str, Any]]: ...
    def count(self, kind: str) -> int: ...
    def query(self, spec: QuerySpec) -> list[Scored]: ...
    def optimize(self) -> None: ...
    def close(self) -> None: ...
    def drop(self) -> None: ...


# ------------------------------------------------------------------------------------------ Edge
class _ProcessLock:
    """An exclusive, non-blocking flock on `<dir>/LOCK` naming the holder's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 64).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise ShardLocked(
                f"the Qdrant Edge shard {path.parent} is held by another process (pid {holder}); an embedded "
                "shard has one owner: run one gateway per data dir, or set QDRANT_URL so replicas "
                "share a Qdrant server"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


class EdgeEngine(Engine):
    """One Qdrant Edge shard in this process.

    A shard holds a search thread pool, its WAL and its in-RAM indexes while open. A gateway with
    many collections (one per chat session) cannot keep them all open, so the Retriever may
    `suspend` an idle shard: it is flushed and closed, its process lock released, and the next call
    opens it again. `close` is final."""

    mode = "edge"

    def __init__(self, directory: Path, dim: int, search_threads: int = 1) -> None:
        import qdrant_edge as q

        self.q = q
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # One call into the shard at a time: the gateway reaches a collection from several threads
        # (searches, ingest, memory, a session's drop), and the engine's Python object refuses a
        # call while another holds it ("RuntimeError: Already borrowed", seen in CI on a close).
        self._guard = threading.RLock()
        self.shard: Any = None
        self.closed = False
        self.last_used = time.monotonic()
        self._config = q.EdgeConfig(
            vectors={DENSE: q.EdgeVectorParams(size=dim, distance=q.Distance.Cosine)},
            sparse_vectors={SPARSE: q.EdgeSparseVectorParams(modifier=q.Modifier.Idf)},
            max_search_threads=search_threads,
            # vacuum on `optimize()` as soon as anything was deleted: BM25's IDF counts deleted points
            # until their segment is vacuumed (as on a Qdrant server)
            optimizers=q.EdgeOptimizersConfig(deleted_threshold=0.0, vacuum_min_vector_number=1),
        )
        self._open_shard()

    def _open_shard(self) -> None:
        q = self.q
        path = self.directory / "shard"
        self._lock = _ProcessLock(self.directory / "LOCK")
        try:
            if (path / "edge_config.json").exists():
                self.shard = q.EdgeShard.load(str(path), self._config)
            else:
                self.shard = q.EdgeShard.create(str(path), self._config)
                for field in KEYWORD_FIELDS:
                    self.shard.update(
                        q.UpdateOperation.create_field_index(field, q.PayloadSchemaType.Keyword)
                    )
        except Exception as exc:
            self.shard = None
            self._lock.release()
            if "WouldBlock" in str(exc):
                raise ShardLocked(f"the Qdrant Edge shard {path} is held by another process") from exc
            raise

    @property
    def is_open(self) -> bool:
        return self.shard is not None

    def _op(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._guard:
            self.ensure_open()
            return getattr(self.shard, name)(*args, **kwargs)

    def ensure_open(self) -> None:
        """Open the shard again if it was suspended while idle (the Retriever calls this for a
        collection it hands out, so its count of open shards is right); a closed one stays closed."""
        with self._guard:
            if self.shard is None:
                if self.closed:
                    raise RuntimeError(f"the Qdrant Edge shard in {self.directory} is closed")
                self._open_shard()
            self.last_used = time.monotonic()

    def suspend(self) -> bool:
        """Flush and close the shard until the next call; False if it was not open (or is in use:
        a call in progress on another thread keeps it open)."""
        if not self._guard.acquire(blocking=False):
            return False
        try:
            if self.shard is None:
                return False
            with contextlib.suppress(Exception):
                self.shard.flush()
            self.shard.close()
            self.shard = None
            self._lock.release()
            return True
        finally:
            self._guard.release()

    # writes
    def upsert(self, points: list[PointData], atomic: bool = False) -> None:
        q = self.q
        step = max(1, len(points)) if atomic else UPSERT_BATCH  # one WAL operation: all or none
        for start in range(0, len(points), step):
            batch = []
            for p in points[start : start + step]:
                vector: dict[str, Any] = {}
                if p.dense is not None:
                    vector[DENSE] = p.dense.tolist()
                if p.sparse is not None:
                    vector[SPARSE] = q.SparseVector(p.sparse[0], p.sparse[1])
                batch.append(q.Point(p.id, vector, p.payload))
            self._op("update", q.UpdateOperation.upsert_points(batch))

    def delete_ids(self, ids: list[str]) -> None:
        if ids:
            self._op("update", self.q.UpdateOperation.delete_points(ids))

    def _match(self, key: str, values: list[str]):
        q = self.q
        return q.FieldCondition(
            key, match=q.MatchAny(values) if len(values) != 1 else q.MatchValue(values[0])
        )

    def delete_chunks(self, doc_ids: list[str], keep_vers: list[str] | None = None) -> None:
        if not doc_ids:
            return
        q = self.q
        flt = q.Filter(
            must=[self._match("kind", ["chunk"]), self._match("doc", doc_ids)],
            must_not=[self._match("ver", keep_vers)] if keep_vers else None,
        )
        self._op("update", q.UpdateOperation.delete_points_by_filter(flt))

    # reads
    def retrieve(self, ids: list[str], payload: list[str] | bool = True) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        records = self._op("retrieve", ids, with_payload=payload, with_vector=False)
        return {str(r.id): dict(r.payload or {}) for r in records}

    def scroll(self, kind: str, payload: list[str]) -> list[dict[str, Any]]:
        q = self.q
        out: list[dict[str, Any]] = []
        offset = None
        while True:
            records, offset = self._op(
                "scroll",
                q.ScrollRequest(
                    offset=offset,
                    limit=1024,
                    filter=q.Filter(must=[self._match("kind", [kind])]),
                    with_payload=payload,
                    with_vector=False,
                ),
            )
            out.extend(dict(r.payload or {}) for r in records)
            if offset is None or not records:
                return out

    def count(self, kind: str) -> int:
        q = self.q
        return self._op(
            "count", q.CountRequest(exact=True, filter=q.Filter(must=[self._match("kind", [kind])]))
        )

    def query(self, spec: QuerySpec) -> list[Scored]:
        q = self.q
        E = q.Expression
        must = [q.HasIdCondition(set(spec.ids))] if spec.ids is not None else None
        must_not = [self._match("ver", spec.hidden_versions)] if spec.hidden_versions else None
        flt = q.Filter(must=must, must_not=must_not) if must or must_not else None
        sparse = q.SparseVector(*spec.sparse) if spec.sparse is not None else None
        dense = spec.dense.tolist() if spec.dense is not None else None
        prefetches = None
        if spec.mode == "bm25":
            query: Any = q.Query.Nearest(sparse, using=SPARSE)
        elif spec.mode == "dense":
            query = q.Query.Nearest(dense, using=DENSE)
        elif spec.mode == "rrf":
            prefetches = [
                q.Prefetch(limit=spec.candidates, query=q.Query.Nearest(sparse, using=SPARSE), filter=flt),
                q.Prefetch(limit=spec.candidates, query=q.Query.Nearest(dense, using=DENSE), filter=flt),
            ]
            query = q.Fusion.Rrf(k=spec.fusion.rrf_k)
        elif spec.mode == "bm25_dense":
            lexical = q.Prefetch(
                limit=spec.candidates, query=q.Query.Nearest(sparse, using=SPARSE), filter=flt
            )
            rescored = q.Prefetch(
                limit=spec.candidates, query=q.Query.Nearest(dense, using=DENSE), prefetches=[lexical]
            )
            lexical2 = q.Prefetch(
                limit=spec.candidates, query=q.Query.Nearest(sparse, using=SPARSE), filter=flt
            )
            prefetches = [lexical2, rescored]
            f = spec.fusion
            if f.kind == "formula":
                s0, s1 = E.Variable("$score[0]"), E.Variable("$score[1]")
                query = q.Formula(
                    E.Sum([E.Mult([E.Constant(f.alpha), E.Div(s0, E.Sum([s0, E.Constant(f.c)]), 0.0)]), s1]),
                    defaults={"$score[0]": 0.0, "$score[1]": 0.0},
                )
            elif f.kind == "dbsf":
                query = q.Fusion.Dbsf()
            else:
                query = q.Fusion.Rrf(k=f.rrf_k)
        else:
            raise ValueError(spec.mode)
        request = q.QueryRequest(
            limit=spec.limit,
            query=query,
            prefetches=prefetches,
            filter=flt if prefetches is None else None,
            with_payload=spec.payload if spec.payload is not None else True,
            with_vector=[DENSE] if spec.with_dense else False,
        )
        out = []
        for p in self._op("query", request):
            vec = p.vector.get(DENSE) if spec.with_dense and isinstance(p.vector, dict) else None
            out.append(Scored(str(p.id), float(p.score), dict(p.payload or {}), vec))
        return out

    def optimize(self) -> None:
        self._op(
            "optimize",
        )

    def close(self) -> None:
        with self._guard:
            self.closed = True
            if self.shard is not None:
                with contextlib.suppress(Exception):
                    self.shard.flush()
                self.shard.close()
                self.shard = None
            self._lock.release()

    def drop(self) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ client
class ClientEngine(Engine):
    """qdrant-client: a server at QDRANT_URL (thread-safe, shared by replicas) or ":memory:"."""

    mode = "server"

    def __init__(self, client: Any, name: str, dim: int, lock: Any, indexes: bool = True) -> None:
        from qdrant_client import models

        self.m = models
        self.client = client
        self.name = name
        self._lock = lock
        with self._lock:
            if not client.collection_exists(name):
                client.create_collection(
                    name,
                    vectors_config={DENSE: models.VectorParams(size=dim, distance=models.Distance.COSINE)},
                    sparse_vectors_config={SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)},
                )
                for field in KEYWORD_FIELDS if indexes else ():  # (in-memory mode has none)
                    with contextlib.suppress(Exception):
                        client.create_payload_index(name, field, models.PayloadSchemaType.KEYWORD)

    def _match(self, key: str, values: list[str]):
        m = self.m
        match = m.MatchAny(any=values) if len(values) != 1 else m.MatchValue(value=values[0])
        return m.FieldCondition(key=key, match=match)

    def upsert(self, points: list[PointData], atomic: bool = False) -> None:
        # a server caps a request's size (32 MB by default): records holding whole documents go in
        # batches of UPSERT_BATCH even for a commit, so one request is atomic, a large batch is not
        m = self.m
        for start in range(0, len(points), UPSERT_BATCH):
            batch = []
            for p in points[start : start + UPSERT_BATCH]:
                vector: dict[str, Any] = {}
                if p.dense is not None:
                    vector[DENSE] = p.dense.tolist()
                if p.sparse is not None:
                    vector[SPARSE] = m.SparseVector(indices=p.sparse[0], values=p.sparse[1])
                batch.append(m.PointStruct(id=p.id, vector=vector, payload=p.payload))
            with self._lock:
                self.client.upsert(self.name, points=batch, wait=True)

    def delete_ids(self, ids: list[str]) -> None:
        if ids:
            with self._lock:
                self.client.delete(self.name, self.m.PointIdsList(points=ids), wait=True)

    def delete_chunks(self, doc_ids: list[str], keep_vers: list[str] | None = None) -> None:
        if not doc_ids:
            return
        m = self.m
        flt = m.Filter(
            must=[self._match("kind", ["chunk"]), self._match("doc", doc_ids)],
            must_not=[self._match("ver", keep_vers)] if keep_vers else None,
        )
        with self._lock:
            self.client.delete(self.name, m.FilterSelector(filter=flt), wait=True)

    def retrieve(self, ids: list[str], payload: list[str] | bool = True) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        with self._lock:
            records = self.client.retrieve(self.name, ids, with_payload=payload, with_vectors=False)
        return {str(r.id): dict(r.payload or {}) for r in records}

    def scroll(self, kind: str, payload: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        offset = None
        while True:
            with self._lock:
                records, offset = self.client.scroll(
                    self.name,
                    scroll_filter=self.m.Filter(must=[self._match("kind", [kind])]),
                    limit=1024,
                    offset=offset,
                    with_payload=payload,
                    with_vectors=False,
                )
            out.extend(dict(r.payload or {}) for r in records)
            if offset is None or not records:
                return out

    def count(self, kind: str) -> int:
        with self._lock:
            return self.client.count(
                self.name, count_filter=self.m.Filter(must=[self._match("kind", [kind])]), exact=True
            ).count

    def query(self, spec: QuerySpec) -> list[Scored]:
        m = self.m
        must = [m.HasIdCondition(has_id=list(spec.ids))] if spec.ids is not None else None
        must_not = [self._match("ver", spec.hidden_versions)] if spec.hidden_versions else None
        flt = m.Filter(must=must, must_not=must_not) if must or must_not else None
        sparse = m.SparseVector(indices=spec.sparse[0], values=spec.sparse[1]) if spec.sparse else None
        dense = spec.dense.tolist() if spec.dense is not None else None
        prefetch = None
        using = None
        if spec.mode == "bm25":
            query: Any = sparse
            using = SPARSE
        elif spec.mode == "dense":
            query = dense
            using = DENSE
        elif spec.mode == "rrf":
            prefetch = [
                m.Prefetch(query=sparse, using=SPARSE, limit=spec.candidates, filter=flt),
                m.Prefetch(query=dense, using=DENSE, limit=spec.candidates, filter=flt),
            ]
            query = m.RrfQuery(rrf=m.Rrf(k=spec.fusion.rrf_k))
        elif spec.mode == "bm25_dense":
            lexical = m.Prefetch(query=sparse, using=SPARSE, limit=spec.candidates, filter=flt)
            rescored = m.Prefetch(query=dense, using=DENSE, limit=spec.candidates, prefetch=[lexical])
            prefetch = [lexical, rescored]
            f = spec.fusion
            if f.kind == "formula":
                query = m.FormulaQuery(
                    formula=m.SumExpression(
                        sum=[
                            m.MultExpression(
                                mult=[
                                    f.alpha,
                                    m.DivExpression(
                                        div=m.DivParams(
                                            left="$score[0]",
                                            right=m.SumExpression(sum=["$score[0]", f.c]),
                                            by_zero_default=0.0,
                                        )
                                    ),
                                ]
                            ),
                            "$score[1]",
                        ]
                    ),
                    defaults={"$score[0]": 0.0, "$score[1]": 0.0},
                )
            elif f.kind == "dbsf":
                query = m.FusionQuery(fusion=m.Fusion.DBSF)
            else:
                query = m.RrfQuery(rrf=m.Rrf(k=f.rrf_k))
        else:
            raise ValueError(spec.mode)
        with self._lock:
            response = self.client.query_points(
                self.name,
                query=query,
                using=using,
                prefetch=prefetch,
                query_filter=flt if prefetch is None else None,
                limit=spec.limit,
                with_payload=spec.payload if spec.payload is not None else True,
                with_vectors=[DENSE] if spec.with_dense else False,
            )
        out = []
        for p in response.points:
            vec = p.vector.get(DENSE) if spec.with_dense and isinstance(p.vector, dict) else None
            out.append(Scored(str(p.id), float(p.score), dict(p.payload or {}), vec))
        return out

    def optimize(self) -> None:
        pass

    def close(self) -> None:
        pass

    def drop(self) -> None:
        with self._lock:
            if self.client.collection_exists(self.name):
                self.client.delete_collection(self.name)


class ClientPool:
    """One qdrant-client per Retriever (a server is thread-safe; ":memory:" is serialised)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        from qdrant_client import QdrantClient

        if url == ":memory:":
            self.client = QdrantClient(":memory:")
            self.lock: Any = threading.RLock()
            self.mode = "memory"
        else:
            self.client = QdrantClient(url=url, api_key=api_key, timeout=60)
            self.lock = contextlib.nullcontext()
            self.mode = "server"

    def names(self, prefix: str) -> list[str]:
        with self.lock:
            return [c.name for c in self.client.get_collections().collections if c.name.startswith(prefix)]

    def exists(self, name: str) -> bool:
        with self.lock:
            return bool(self.client.collection_exists(name))

    def drop(self, name: str) -> bool:
        """Delete a server collection; False if it did not exist (asked of the server: replicas
        share it, so no replica's own view says whether it is there)."""
        with self.lock:
            if not self.client.collection_exists(name):
                return False
            return bool(self.client.delete_collection(name))

    def engine(self, name: str, dim: int) -> ClientEngine:
        engine = ClientEngine(self.client, name, dim, self.lock, indexes=self.mode == "server")
        engine.mode = self.mode
        return engine

    def close(self) -> None:
        with self.lock:
            self.client.close()
