"""retrieval/: hybrid search inside Qdrant (BM25 first, dense second) and progressive-disclosure memory.

Imports neither gateway nor router. The public surface:
- `Retriever(RetrievalConfig)`: the collections of one data dir, per tenant (`get`, `names`, `drop`);
  a `Collection` ingests, deletes and searches (`bm25_dense`, `rrf`, `bm25`, `dense`), all in one
  Qdrant collection (embedded Qdrant Edge shard, or a server at QDRANT_URL: `retrieval.engine`).
- `recall(...)` → `MemoryContext`: layer 0/1 for a query, `expand(handle, level)` for more.
- `extract(name, bytes)`: text of a .txt/.md/.pdf/.html file.
"""

from retrieval.engine import ShardLocked
from retrieval.memory import (
    TEXT_DIRECTIVE,
    TOOL_NAME,
    TOOL_SPEC,
    MemoryContext,
    directive_query,
    parse_directive,
    recall,
)
from retrieval.store import (
    MODES,
    SESSION_PREFIX,
    Collection,
    CollectionDropped,
    CollectionNotFound,
    DocumentInput,
    Hit,
    IngestResult,
    InvalidName,
    RetrievalConfig,
    Retriever,
    check_name,
    session_collection,
)
from retrieval.text import SUPPORTED_SUFFIXES, ExtractionError, extract

__all__ = [
    "MODES",
    "SESSION_PREFIX",
    "SUPPORTED_SUFFIXES",
    "TEXT_DIRECTIVE",
    "TOOL_NAME",
    "TOOL_SPEC",
    "Collection",
    "CollectionDropped",
    "CollectionNotFound",
    "DocumentInput",
    "ExtractionError",
    "Hit",
    "IngestResult",
    "InvalidName",
    "MemoryContext",
    "RetrievalConfig",
    "Retriever",
    "ShardLocked",
    "check_name",
    "extract",
    "directive_query",
    "parse_directive",
    "recall",
    "session_collection",
]
