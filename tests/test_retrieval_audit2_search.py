"""A search returns `top_k` visible hits while chunks of uncommitted versions sit in the collection.

An ingest writes a new version's chunks first and commits them with the document record after
(`Collection.ingest`); until then, or forever after a crash between the two steps, those chunks are
in the index but must not show. They were filtered out after the query had cut its candidates to
`top_k`, so they took the places of visible chunks: a search asked for 5 and got fewer, or none,
although the collection held enough. The two steps are taken here with the store's own first step
(`_write_versions`, what a crash leaves behind) on the real engines: the embedded Qdrant Edge shard
and qdrant-client's in-process mode (the `QDRANT_URL` path).
"""

from __future__ import annotations

import numpy as np
import pytest

from retrieval import DocumentInput, RetrievalConfig, Retriever
from retrieval.engine import QuerySpec, bm25_query, chunk_point_id, doc_point_id
from retrieval.text import normalize, tokenize

QUERY = "green tea leaves"
COMMITTED = [
    ("sencha", "Sencha is a green tea whose leaves are steamed, rolled and dried."),
    ("matcha", "Matcha is green tea ground from shaded leaves into a fine powder."),
    ("oolong", "Oolong tea leaves are partly oxidised before they are rolled."),
    ("black", "Black tea leaves are fully oxidised, which darkens them."),
    ("herbal", "Herbal infusions use leaves of mint or chamomile, not of the tea plant."),
    ("kettle", "A kettle with a thermostat keeps water below boiling for green tea."),
    ("garden", "A tea garden on a hillside is picked by hand every spring."),
    ("router", "A router forwards packets between networks using routing tables."),
]
K = 5
CANDIDATES = 6  # fewer than the uncommitted chunks that match better: they filled every candidate


def make_retriever(tmp_path, engine: str) -> Retriever:
    return Retriever(
        RetrievalConfig(
            root=tmp_path / "retrieval",
            qdrant_url=":memory:" if engine == "memory" else None,
            embedder="minilm-static",
            chunk_words=40,
            chunk_overlap=8,
        )
    )


@pytest.fixture(params=["edge", "memory"])
def collection(tmp_path, request):
    retriever = make_retriever(tmp_path, request.param)
    collection = retriever.get("acme", "tea", create=True)
    collection.ingest([DocumentInput(i, t) for i, t in COMMITTED])
    # what an ingest in flight (or cut short by a crash) leaves: chunks written, no record names them;
    # new documents (no record at all) and a new version of a committed one, all matching the query
    # better than any committed chunk, lexically and by meaning
    staged = [DocumentInput(f"ghost-{i}", f"{QUERY} {QUERY} number {i}") for i in range(12)]
    staged.append(DocumentInput("sencha", f"{QUERY}, {QUERY}: the new sencha text"))
    with collection._write:
        collection._write_versions([collection.prepare(d) for d in staged])
    yield collection
    retriever.close()


def committed_chunk_ids(collection) -> dict[str, str]:
    """point id → document id of every committed chunk (each document here is one chunk)."""
    records = collection.engine.retrieve([doc_point_id(i) for i, _ in COMMITTED], ["doc", "ver"])
    return {chunk_point_id(r["doc"], r["ver"], 0): r["doc"] for r in records.values()}


def expected_bm25_dense(collection, k: int, candidates: int) -> list[str]:
    """bm25_dense by its definition over the committed chunks only: the BM25 top-`candidates`,
    ranked by alpha·bm25/(bm25 + c) + cosine (each score asked of Qdrant for exactly these points)."""
    ids = committed_chunk_ids(collection)
    fusion = collection.retriever.config.fusion
    vector = collection.embedder.encode_query(normalize(QUERY))
    sparse = bm25_query(tokenize(QUERY))
    bm25 = {
        p.id: p.score
        for p in collection.engine.query(
            QuerySpec("bm25", len(ids), len(ids), sparse, None, fusion, ["doc"], ids=list(ids))
        )
    }
    cosine = {
        p.id: p.score
        for p in collection.engine.query(
            QuerySpec("dense", len(ids), len(ids), None, vector, fusion, ["doc"], ids=list(ids))
        )
    }
    pool = sorted(bm25, key=lambda i: -bm25[i])[:candidates]
    fused = {i: fusion.alpha * bm25[i] / (bm25[i] + fusion.c) + cosine[i] for i in pool}
    return [ids[i] for i in sorted(fused, key=lambda i: -fused[i])][:k]


@pytest.mark.parametrize("mode", ["bm25_dense", "rrf", "bm25", "dense"])
def test_uncommitted_chunks_take_no_place_of_visible_hits(collection, mode):
    hits = collection.search(QUERY, K, mode, candidates=CANDIDATES)
    assert len(hits) == K, [h.document_id for h in hits]
    committed = dict(COMMITTED)
    for hit in hits:
        assert hit.document_id in committed  # no ghost, and sencha's committed text, not the staged one
        assert hit.text == committed[hit.document_id]
    assert len({h.key for h in hits}) == K
    ranked = collection.rank(QUERY, K, mode, candidates=CANDIDATES)
    assert [key for key, *_ in ranked] == [h.key for h in hits]


def test_bm25_dense_ranks_the_visible_chunks_by_its_definition(collection):
    """The fusion itself is over visible chunks only: the BM25 candidates are the best committed
    ones (a hidden one took no candidate's place), and each hit's score is the formula of its two."""
    hits = collection.search(QUERY, K, "bm25_dense", candidates=CANDIDATES)
    assert [h.document_id for h in hits] == expected_bm25_dense(collection, K, CANDIDATES)
    fusion = collection.retriever.config.fusion
    for hit in hits:
        formula = fusion.alpha * hit.bm25_score / (hit.bm25_score + fusion.c) + hit.dense_score
        assert hit.score == pytest.approx(formula, abs=1e-4)


def test_dense_hits_equal_those_of_a_collection_without_the_uncommitted_chunks(collection, tmp_path):
    clean_retriever = make_retriever(tmp_path / "clean", "edge")
    try:
        clean = clean_retriever.get("acme", "tea", create=True)
        clean.ingest([DocumentInput(i, t) for i, t in COMMITTED])
        ours = collection.search(QUERY, K, "dense")
        theirs = clean.search(QUERY, K, "dense")
        assert [h.key for h in ours] == [h.key for h in theirs]
        np.testing.assert_allclose([h.score for h in ours], [h.score for h in theirs], atol=1e-5)
    finally:
        clean_retriever.close()


def test_a_later_ingest_commits_the_staged_version_and_it_shows(collection):
    """The staged chunks are hidden because nothing commits them, not for what they say: once
    the document is ingested (its record written), its chunks are found like any other."""
    results = collection.ingest([DocumentInput("ghost-3", f"{QUERY} {QUERY} number 3")])
    assert [r.status for r in results] == ["created"]
    hits = collection.search(QUERY, K, "bm25", candidates=CANDIDATES)
    assert len(hits) == K and hits[0].document_id == "ghost-3"
    assert all(h.document_id == "ghost-3" or not h.document_id.startswith("ghost") for h in hits)
