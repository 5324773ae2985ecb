"""Migration of collections in the first layout (docs.sqlite + bm25.npz/.wal + Qdrant local mode).

The first layout kept every document's full text, title and metadata in `docs.sqlite`, the source
of truth for what the collection held; the BM25 files and the local-mode vectors were derived from
it. Migration re-ingests those documents into the collection's Qdrant Edge shard, or with QDRANT_URL
into the shared server collection (chunked, embedded and BM25-indexed exactly as a fresh ingest:
with several replicas, each one's copy is merged in), then moves the old files into `legacy-v1/`
(nothing is deleted) and only then marks the collection as migrated.
A crash part-way leaves the old files and the old `meta.json` in place: the next open migrates
again, and the documents already written come back `unchanged`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from retrieval.store import Collection

LEGACY_FILES = ("docs.sqlite", "docs.sqlite-wal", "docs.sqlite-shm", "bm25.npz", "bm25.wal")
BATCH = 128


def legacy_documents(directory: Path) -> list[tuple[str, str, str, dict]]:
    """(id, title, text, metadata) of every document of a first-layout collection."""
    path = directory / "docs.sqlite"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id, title, text, metadata FROM docs ORDER BY id").fetchall()
    finally:
        db.close()
    out = []
    for doc_id, title, text, metadata in rows:
        try:
            meta = orjson.loads(metadata or "{}")
        except orjson.JSONDecodeError:
            meta = {"legacy_metadata": metadata}  # kept as it was, not dropped
        out.append(
            (doc_id, title or "", text or "", meta if isinstance(meta, dict) else {"legacy_metadata": meta})
        )
    return out


def migrate_collection(collection: Collection, progress: Callable[[int, int], None] | None = None) -> int:
    """Re-index a first-layout collection into its shard; returns the number of documents moved."""
    from retrieval.store import LAYOUT, DocumentInput

    directory = collection.directory
    docs = legacy_documents(directory)
    started = time.perf_counter()
    if progress is None:
        progress = _default_progress(f"{collection.tenant}/{collection.name}")
    valid, skipped = [], []
    for doc_id, title, text, meta in docs:
        doc = DocumentInput(doc_id, text, title or None, meta)
        try:
            collection.prepare(doc)
        except ValueError as exc:  # cannot be indexed (the first layout would have refused it too)
            skipped.append({"id": doc_id, "reason": str(exc)})
            continue
        valid.append(doc)
    for start in range(0, len(valid), BATCH):
        collection.ingest(valid[start : start + BATCH])
        progress(min(start + BATCH, len(valid)), len(valid))
    if not valid:
        progress(0, 0)
    if collection.engine.count("doc") < len(valid):  # never move the old files unless all arrived
        raise RuntimeError(f"migration of {directory} is incomplete; the old files are kept")
    legacy = directory / "legacy-v1"
    legacy.mkdir(exist_ok=True)
    if skipped:  # listed beside the old files, which keep their text
        (legacy / "skipped.json").write_bytes(orjson.dumps(skipped, option=orjson.OPT_INDENT_2))
    for name in LEGACY_FILES:
        if (directory / name).exists():
            (directory / name).replace(legacy / name)
    collection.meta["layout"] = LAYOUT
    collection.meta["engine"] = collection.retriever.engine_name
    collection.meta["migrated"] = {
        "documents": len(valid),
        "skipped": len(skipped),
        "seconds": round(time.perf_counter() - started, 2),
    }
    collection.retriever._save_meta(collection)
    return len(valid)


def _default_progress(label: str) -> Callable[[int, int], None]:
    """A progress line with the rate on stderr (the gateway's log when it migrates on first start)."""
    import sys

    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        elapsed = max(time.perf_counter() - started, 1e-9)
        width = 30
        filled = int(width * done / total) if total else width
        sys.stderr.write(
            f"\rmigrating {label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"documents, {done / elapsed:.1f} docs/s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return report
