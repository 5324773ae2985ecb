"""Retrieval: tokenizer, BM25 inside Qdrant (checked against bm25s), collections on both engines (an
embedded Qdrant Edge shard; qdrant-client's in-memory mode for the QDRANT_URL path), their identical
ranking, the shard lock, migration of the first layout,
the /v1/collections API (JSON and files, bad files, tenant isolation), `polyroute ingest` and
`polyroute retrieval eval`.

Fast tests embed with the `minilm-static` backend (the MiniLM word-piece table, no forward pass);
the tests that load the real sentence-transformers model are marked slow.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from retrieval import DocumentInput, RetrievalConfig, Retriever, extract
from retrieval.text import ExtractionError, chunk_text, summarize, tokenize
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

FIXTURES = Path(__file__).parent / "fixtures"

CORPUS = [
    ("fox", "The quick brown fox jumps over the lazy dog. Foxes hunt rabbits at dusk."),
    ("router", "Routers forward packets between networks using routing tables and metrics."),
    ("bgp", "BGP routers exchange reachability information between autonomous systems."),
    ("cats", "Cats sleep most of the day and hunt mice at night; a cat purrs when content."),
    ("tea", "Green tea is brewed from unoxidised leaves; black tea leaves are fully oxidised."),
    ("muenchen", "Die Große Straße in München ist für Fußgänger gesperrt. 東京 is written in kanji."),
]


# ------------------------------------------------------------------------------ text
def test_tokenizer_lowercases_drops_stop_words_and_stems():
    assert tokenize("The Routers were ROUTING packets!") == ["router", "rout", "packet"]
    assert tokenize("a an the of") == []
    assert tokenize("Straße MÜNCHEN 東京") == ["strass", "münchen", "東京"]  # casefold: ß → ss


def test_chunks_overlap_and_are_deterministic():
    text = " ".join(f"w{i}." if i % 10 == 9 else f"w{i}" for i in range(500))
    chunks = chunk_text(text, max_words=100, overlap_words=20)
    assert chunks == chunk_text(text, max_words=100, overlap_words=20)
    assert len(chunks) >= 5
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.start < before.end  # overlap
        assert text[before.start : before.end] == before.text
    assert chunks[-1].text.endswith("w499.")
    assert chunk_text("   ") == []


def test_summary_is_one_clipped_sentence():
    assert (
        summarize("Short. This sentence is the first real one here. Another.")
        == "This sentence is the first real one here."
    )
    assert summarize("word " * 50).endswith("…")


# ------------------------------------------------------------------------------ BM25
@pytest.mark.parametrize("engine", ["edge", "memory"])
def test_bm25_in_qdrant_matches_bm25s(tmp_path, engine):
    """Client-side BM25 document vectors × Qdrant's IDF modifier = Lucene BM25 (bm25s), times (k1+1)."""
    import bm25s

    from retrieval.engine import BM25Params

    docs = [tokenize(text) for _, text in CORPUS]
    avg = sum(len(d) for d in docs) / len(docs)
    r = make_retriever(tmp_path, engine)
    try:
        collection = r.get("acme", "bm25", create=True)
        collection.meta["bm25"] = BM25Params(1.2, 0.75, avg).as_dict()  # the corpus' true mean length
        collection.ingest([DocumentInput(str(i), text, title="") for i, (_, text) in enumerate(CORPUS)])
        reference = bm25s.BM25(k1=1.2, b=0.75, method="lucene")
        reference.index(docs, show_progress=False)
        for query in ("routers exchange packets", "hunt at night", "tea leaves oxidised"):
            expected = reference.get_scores(tokenize(query)) * (1.2 + 1)
            ours = {int(k.split("#")[0]): s for k, s, *_ in collection.rank(query, 10, "bm25")}
            np.testing.assert_allclose(
                [ours.get(i, 0.0) for i in range(len(docs))], expected, rtol=1e-4, atol=1e-5
            )
    finally:
        r.close()


# ------------------------------------------------------------------------------ collections
def make_retriever(tmp_path, engine="edge", **kwargs) -> Retriever:
    """`edge`: the embedded Qdrant Edge shard; `memory`: qdrant-client's in-process mode, standing in
    for a Qdrant server (none can run here) — the code path of QDRANT_URL."""
    options = {"embedder": "minilm-static", "chunk_words": 40, "chunk_overlap": 8, **kwargs}
    return Retriever(
        RetrievalConfig(
            root=tmp_path / "retrieval", qdrant_url=":memory:" if engine == "memory" else None, **options
        )
    )


@pytest.fixture(params=["edge", "memory"])
def retriever(tmp_path, request):
    r = make_retriever(tmp_path, request.param)
    yield r
    r.close()


def test_collection_round_trip_idempotent_and_unicode(retriever):
    collection = retriever.get("acme", "notes", create=True)
    assert collection.search("anything", 5) == []  # empty collection
    docs = [DocumentInput(k, t) for k, t in CORPUS]
    assert {r.status for r in collection.ingest(docs)} == {"created"}
    assert {r.status for r in collection.ingest(docs)} == {"unchanged"}
    for mode in ("bm25", "dense", "bm25_dense", "rrf"):
        hits = collection.search("which routers exchange reachability", 3, mode)
        assert hits and hits[0].document_id in ("bgp", "router"), mode
    hit = collection.search("Straße München", 1, "bm25_dense")[0]
    assert hit.document_id == "muenchen" and hit.bm25_score > 0 and hit.dense_score is not None
    assert collection.search("東京", 1, "bm25")[0].document_id == "muenchen"

    long_text = " ".join(f"sentence {i} about gardening tomatoes." for i in range(60))
    assert collection.ingest([DocumentInput("long", long_text)])[0].chunks > 3
    assert collection.ingest([DocumentInput("long", "short now: gardening tomatoes")])[0].status == "updated"
    assert collection.stats()["chunks"] == len(CORPUS) + 1  # stale chunks of the old version are gone
    assert collection.engine.count("chunk") == len(CORPUS) + 1
    assert collection.document("long").text == "short now: gardening tomatoes"

    assert collection.delete(["fox", "nope"]) == ["fox"]
    assert all(h.document_id != "fox" for h in collection.search("quick brown fox", 5, "rrf"))
    assert collection.ingest([DocumentInput("fox", CORPUS[0][1])])[0].status == "created"  # re-ingest
    assert collection.search("quick brown fox", 1, "bm25")[0].document_id == "fox"
    assert collection.delete(["fox"]) == ["fox"]
    if retriever.config.qdrant_url:  # in-memory mode: the data lives as long as the client
        return
    retriever.close()

    reopened = Retriever(retriever.config)  # persisted: the Edge shard (WAL + segments) and meta.json
    again = reopened.get("acme", "notes")
    assert again.stats()["documents"] == len(CORPUS)
    assert again.search("green tea leaves", 1, "bm25_dense")[0].document_id == "tea"
    reopened.close()


def test_tenants_do_not_share_collections(retriever):
    retriever.get("acme", "docs", create=True).ingest([DocumentInput("a", "acme secret roadmap")])
    retriever.get("globex", "docs", create=True).ingest([DocumentInput("g", "globex public notes")])
    assert [h.document_id for h in retriever.get("globex", "docs").search("secret roadmap", 5, "rrf")] != [
        "a"
    ]
    assert all(
        h.document_id == "g" for h in retriever.get("globex", "docs").search("roadmap notes", 5, "rrf")
    )
    assert retriever.names("acme") == ["docs"] and retriever.names("other") == []
    assert retriever.get("acme", "docs").qdrant_name != retriever.get("globex", "docs").qdrant_name


PARITY_CORPUS = CORPUS + [
    ("ospf", "OSPF routers flood link-state advertisements and compute shortest paths with Dijkstra."),
    ("coffee", "Coffee beans are roasted; espresso is brewed under pressure, filter coffee by gravity."),
    ("dogs", "Dogs bark at strangers, fetch sticks and sleep near the door at night."),
    (  # several chunks, none alike (equal BM25 scores could come in either order, and RRF with them)
        "long",
        " ".join(
            f"Note {i}: "
            + "routing policy " * (i % 3 + 1)
            + "tea gardens " * (i % 4 + 1)
            + "sleepy cats " * (i % 7 + 1)
            for i in range(20)
        ),
    ),
]
PARITY_QUERIES = [
    "which routers exchange reachability",
    "tea brewing leaves",
    "cats sleeping at night",
    "coffee espresso pressure",
    "shortest path link state",
    "zzzunknown",
]


def test_both_engines_rank_identically(tmp_path):
    """The embedded shard and the qdrant-client path get the same points and queries: same ranking."""
    edge, memory = make_retriever(tmp_path / "e"), make_retriever(tmp_path / "m", "memory")
    try:
        collections = [r.get("acme", "kb", create=True) for r in (edge, memory)]
        for c in collections:
            c.ingest([DocumentInput(k, t) for k, t in PARITY_CORPUS])
            c.delete(["dogs"])
            c.ingest([DocumentInput("coffee", "Coffee: espresso under pressure, cold brew over hours.")])
            c.optimize()  # the shard vacuums deleted points, which BM25's IDF counts until then
        assert collections[0].meta["bm25"] == collections[1].meta["bm25"]
        for query in PARITY_QUERIES:
            for mode in ("bm25", "dense", "bm25_dense", "rrf"):
                # RRF's fused scores tie (rank 2 + rank 5 = rank 5 + rank 2): ties in key order
                a, b = (
                    sorted(c.search(query, 40, mode), key=lambda h: (-round(h.score, 5), h.key))
                    for c in collections
                )
                assert [h.key for h in a] == [h.key for h in b], (query, mode)
                assert [h.score for h in a] == pytest.approx([h.score for h in b], rel=1e-4, abs=1e-6)
                assert [h.bm25_score for h in a] == pytest.approx(
                    [h.bm25_score for h in b], rel=1e-4, abs=1e-6
                )
    finally:
        edge.close()
        memory.close()


def test_replicas_on_one_qdrant_share_collections(tmp_path):
    """Two Retrievers (replicas, each with its own data dir) on one Qdrant (here the in-memory client,
    standing in for a server): what one writes, the other lists, finds and can delete."""
    a = make_retriever(tmp_path / "a", "memory")
    b = make_retriever(tmp_path / "b", "memory")
    b._pool = a.pool  # one Qdrant for both
    try:
        early = b.get("acme", "kb", create=True)  # opened before anything was written
        a.get("acme", "kb").ingest([DocumentInput(k, t) for k, t in CORPUS])
        assert b.names("acme") == ["kb"] and b.exists("acme", "kb") and not b.exists("globex", "kb")
        assert early.search("green tea leaves", 1, "bm25_dense")[0].document_id == "tea"
        assert early.document("tea").text == CORPUS[4][1]
        assert early.delete(["tea"]) == ["tea"]
        assert all(h.document_id != "tea" for h in a.get("acme", "kb").search("green tea leaves", 5, "bm25"))
        assert not list((tmp_path / "a").rglob("*.sqlite")) and not list((tmp_path / "b").rglob("shard"))
    finally:
        a.close()


def test_a_second_process_gets_a_clear_error_not_the_shard(tmp_path):
    import subprocess
    import sys

    from retrieval.engine import ShardLocked

    r = make_retriever(tmp_path)
    r.get("acme", "kb", create=True).ingest([DocumentInput("tea", CORPUS[4][1])])
    code = (
        "import sys; from pathlib import Path\n"
        "from retrieval import Retriever, RetrievalConfig\n"
        "from retrieval.engine import ShardLocked\n"
        "r = Retriever(RetrievalConfig(root=Path(sys.argv[1]), embedder='minilm-static'))\n"
        "try:\n    r.get('acme', 'kb')\nexcept ShardLocked as exc:\n    print('LOCKED', exc)\n"
        "else:\n    print('OPENED')\n"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", code, str(r.config.root)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert run.stdout.startswith("LOCKED"), run.stdout + run.stderr
    assert "held by another process" in run.stdout and "QDRANT_URL" in run.stdout
    assert r.get("acme", "kb").search("green tea", 1, "bm25")[0].document_id == "tea"  # untouched
    r.close()  # released: another process may open it now
    run = subprocess.run(
        [sys.executable, "-c", code, str(r.config.root)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert run.stdout.startswith("OPENED"), run.stdout + run.stderr
    with pytest.raises(ShardLocked):  # in one process too: one open collection per shard
        other = make_retriever(tmp_path)
        try:
            r2 = make_retriever(tmp_path)
            r2.get("acme", "kb")
            other.get("acme", "kb")
        finally:
            r2.close()
            other.close()


def test_an_uncommitted_version_stays_invisible(retriever):
    """Chunks written without their document record (a crash before the commit) are never shown."""
    from retrieval.engine import PointData, bm25_document, chunk_point_id

    collection = retriever.get("acme", "crash", create=True)
    collection.ingest([DocumentInput(k, t) for k, t in CORPUS])
    tokens = tokenize("tea tea tea oxidised leaves")
    vector = collection.embedder.encode(["tea tea tea oxidised leaves"])[0]
    collection.engine.upsert(
        [
            PointData(
                chunk_point_id("tea", "uncommitted", 0),
                {
                    "kind": "chunk",
                    "doc": "tea",
                    "ver": "uncommitted",
                    "idx": 0,
                    "text": "tea tea",
                    "title": "",
                },
                vector,
                bm25_document(tokens, collection.bm25_params),
            )
        ]
    )
    for mode in ("bm25", "dense", "bm25_dense", "rrf"):
        hits = collection.search("tea oxidised leaves", 5, mode)
        assert [h.text for h in hits if h.document_id == "tea"] == [CORPUS[4][1]], mode
    assert (
        collection.ingest([DocumentInput("tea", "Tea, re-ingested after the crash.")])[0].status == "updated"
    )
    assert collection.engine.count("chunk") == len(CORPUS)  # the orphan went with the old version


def _first_layout(directory: Path, docs: list[tuple[str, str, str]]) -> None:
    """A collection as the first layout left it: meta.json without a layout, docs.sqlite, BM25 files."""
    import sqlite3

    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(
        json.dumps({"name": directory.name, "tenant": "acme", "embedder": "minilm-static", "created": 1})
    )
    db = sqlite3.connect(directory / "docs.sqlite")
    db.executescript(
        "CREATE TABLE docs (id TEXT PRIMARY KEY, title TEXT, summary TEXT, text TEXT, hash TEXT, chunks INTEGER,"
        " metadata TEXT, updated REAL);"
        "CREATE TABLE chunks (key TEXT PRIMARY KEY, doc TEXT, idx INTEGER, text TEXT);"
    )
    for doc_id, title, text in docs:
        db.execute(
            "INSERT INTO docs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (doc_id, title, summarize(text), text, "old", 1, json.dumps({"source": doc_id}), 1.0),
        )
    db.commit()
    db.close()
    (directory / "bm25.npz").write_bytes(b"old snapshot")


@pytest.mark.parametrize("engine", ["edge", "memory"])
def test_first_layout_is_migrated_on_open_and_nothing_is_lost(tmp_path, engine):
    """Embedded: into the collection's shard. With QDRANT_URL (in-memory here): this replica's copy
    goes into the shared server collection."""
    import sqlite3

    docs = [(k, k.title(), t) for k, t in CORPUS]
    directory = tmp_path / "retrieval" / "tenants" / "acme" / "old"
    _first_layout(directory, docs)
    db = sqlite3.connect(directory / "docs.sqlite")  # rows a crash or a bug could have left
    db.execute("INSERT INTO docs VALUES ('blank', '', '', '   ', 'h', 0, '{}', 1.0)")
    db.execute(
        "INSERT INTO docs VALUES ('badmeta', 'Bad', '', 'Text about odd metadata.', 'h', 1, '{no', 1.0)"
    )
    db.commit()
    db.close()
    docs.append(("badmeta", "Bad", "Text about odd metadata."))
    seen: list[tuple[int, int]] = []
    r = make_retriever(tmp_path, engine, migration_progress=lambda done, total: seen.append((done, total)))
    try:
        assert r.names("acme") == ["old"]
        collection = r.get("acme", "old")
        assert seen[-1] == (len(docs), len(docs))
        assert collection.stats()["documents"] == len(docs)
        for doc_id, title, text in docs[:-1]:
            record = collection.document(doc_id)
            assert (record.title, record.text, record.metadata) == (title, text, {"source": doc_id})
        assert collection.document("badmeta").metadata == {"legacy_metadata": "{no"}  # kept, not dropped
        assert collection.document("blank") is None  # no text: listed, and still in the old files
        assert "blank" in (directory / "legacy-v1" / "skipped.json").read_text()
        assert collection.search("green tea leaves", 1, "bm25_dense")[0].document_id == "tea"
        assert (directory / "legacy-v1" / "docs.sqlite").exists() and not (directory / "docs.sqlite").exists()
        assert r.names("acme") == ["old"] and r.exists("acme", "old")
        if engine == "memory":  # the data lives in the client: check there is no second migration
            r._open.clear()
            assert r.get("acme", "old").stats()["documents"] == len(docs) and seen[-1] == (
                len(docs),
                len(docs),
            )
            assert len(seen) == len(set(seen))
            return
        assert json.loads((directory / "meta.json").read_text())["layout"] == 2
    finally:
        r.close()
    again = make_retriever(tmp_path, migration_progress=lambda done, total: seen.append((-1, -1)))
    try:
        assert again.get("acme", "old").stats()["documents"] == len(docs) and (-1, -1) not in seen
    finally:
        again.close()


def test_a_failed_migration_keeps_the_old_files_and_can_be_retried(tmp_path):
    import sqlite3

    directory = tmp_path / "retrieval" / "tenants" / "acme" / "old"
    _first_layout(directory, [("tea", "Tea", CORPUS[4][1])])
    (directory / "docs.sqlite").write_bytes(b"this is not a database")
    r = make_retriever(tmp_path)
    try:
        for _ in range(2):  # the second open fails the same way: the shard was released, not held
            with pytest.raises(sqlite3.DatabaseError):
                r.get("acme", "old")
        assert (directory / "docs.sqlite").read_bytes() == b"this is not a database"
        assert "layout" not in json.loads((directory / "meta.json").read_text())
    finally:
        r.close()


# ------------------------------------------------------------------------------ files
def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in Helvetica (built by hand: no PDF writer is a dependency)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return out


def test_extract_each_file_type():
    assert extract("a.txt", "plain ünïcode text".encode())[0] == "plain ünïcode text"
    assert extract("b.md", b"# Title\n\nbody")[0].startswith("# Title")
    text, title = extract(
        "c.html",
        b"<html><head><title>T</title><script>x()</script></head><body><p>Hello</p><p>World &amp; co</p></body></html>",
    )
    assert title == "T" and "Hello" in text and "World & co" in text and "x()" not in text
    assert "Solar panels" in extract("d.pdf", minimal_pdf("Solar panels convert light"))[0]
    for name, data in [
        ("e.exe", b"MZ"),
        ("f.txt", b"\x00\x01\x02binary"),
        ("g.txt", b"   "),
        ("h.pdf", b"%PDF-1.4 garbage"),
        ("i.txt", b"\xff\xfe\xfa bad"),
    ]:
        with pytest.raises(ExtractionError):
            extract(name, data)
    assert zlib  # (kept for readers: PDFs here are uncompressed on purpose)


# ------------------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def rgw(upstream, tmp_path_factory) -> Gateway:
    from policies import parse_catalog

    catalog = parse_catalog(catalog_yaml_for(upstream.url), "test catalog")
    gw = start_gateway(
        catalog,
        tmp_path_factory.mktemp("rgw"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=60,
        retrieval_chunk_overlap=10,
    )
    _, other = gw.state.auth.store.create("globex", "other tenant")
    gw.other_key = other  # type: ignore[attr-defined]
    yield gw
    gw.server.stop()


def test_http_ingest_search_delete(rgw: Gateway):
    docs = [{"id": k, "text": t, "title": k.title(), "metadata": {"n": i}} for i, (k, t) in enumerate(CORPUS)]
    with httpx.Client(base_url=rgw.url, headers=rgw.auth(), timeout=60) as http:
        r = http.post("/v1/collections/kb/documents", json={"documents": docs})
        assert r.status_code == 200, r.text
        assert {d["status"] for d in r.json()["data"]} == {"created"} and r.json()["errors"] == []
        again = http.post("/v1/collections/kb/documents", json={"documents": docs}).json()
        assert {d["status"] for d in again["data"]} == {"unchanged"}

        r = http.post(
            "/v1/collections/kb/search", json={"query": "routers exchanging reachability", "top_k": 3}
        )
        hits = r.json()["data"]
        assert r.status_code == 200 and hits[0]["document_id"] == "bgp"
        assert {"bm25_score", "dense_score", "score", "text", "title"} <= set(hits[0])
        assert hits[0]["bm25_score"] > 0 and -1 <= hits[0]["dense_score"] <= 1
        rrf = http.post("/v1/collections/kb/search", json={"query": "cat purrs", "mode": "rrf"}).json()[
            "data"
        ]
        assert rrf[0]["document_id"] == "cats" and rrf[0]["bm25_score"] is not None

        assert http.get("/v1/collections/kb").json()["documents"] == len(CORPUS)
        doc = http.get("/v1/collections/kb/documents/tea", params={"level": 0}).json()
        assert doc["title"] == "Tea" and doc["summary"] and "text" not in doc
        assert (
            "oxidised"
            in http.get("/v1/collections/kb/documents/tea", params={"level": 1, "query": "black tea"}).json()[
                "passage"
            ]
        )
        assert http.get("/v1/collections/kb/documents/tea").json()["metadata"] == {"n": 4}

        assert http.delete("/v1/collections/kb/documents/tea").status_code == 200
        assert http.delete("/v1/collections/kb/documents/tea").status_code == 404
        left = http.post("/v1/collections/kb/search", json={"query": "green tea", "mode": "bm25"}).json()[
            "data"
        ]
        assert all(h["document_id"] != "tea" for h in left)
        r = http.post("/v1/collections/kb/documents", json={"delete": ["cats"]})
        assert r.json()["deleted"] == ["cats"]

        assert http.post("/v1/collections/Bad Name!/search", json={"query": "x"}).status_code in (400, 404)
        assert (
            http.post("/v1/collections/BAD/search", json={"query": "x"}).json()["error"]["code"]
            == "invalid_collection_name"
        )
        assert http.post("/v1/collections/missing/search", json={"query": "x"}).status_code == 404
        assert http.post("/v1/collections/kb/search", json={"query": "x", "mode": "magic"}).status_code == 400
        assert http.post("/v1/collections/kb/search", json={"query": ""}).status_code == 400
        assert http.get("/v1/collections").json()["data"][0]["name"] == "kb"
        assert (
            http.post(
                "/v1/collections/kb/search", json={"query": "x"}, headers={"authorization": "Bearer nope"}
            ).status_code
            == 401
        )


def test_http_a_held_shard_is_a_clear_503(rgw: Gateway):
    """A collection whose embedded shard another owner holds: 503 naming the cause, nothing written."""
    holder = Retriever(RetrievalConfig(root=rgw.data_dir / "retrieval", embedder="minilm-static"))
    try:
        holder.get("acme", "held", create=True).ingest([DocumentInput("tea", CORPUS[4][1])])
        with httpx.Client(base_url=rgw.url, headers=rgw.auth(), timeout=60) as http:
            r = http.post("/v1/collections/held/documents", json={"documents": [{"id": "x", "text": "new"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "collection_locked", r.text
            assert "held by another process" in r.json()["error"]["message"]
        assert holder.get("acme", "held").stats()["documents"] == 1
    finally:
        holder.close()
    with httpx.Client(base_url=rgw.url, headers=rgw.auth(), timeout=60) as http:  # released: it opens
        assert http.get("/v1/collections/held").json()["documents"] == 1


def test_http_empty_collection_and_unicode(rgw: Gateway):
    with httpx.Client(base_url=rgw.url, headers=rgw.auth(), timeout=60) as http:
        http.post("/v1/collections/uni/documents", json={"documents": [{"id": "x", "text": "placeholder"}]})
        http.post("/v1/collections/uni/documents", json={"delete": ["x"]})
        r = http.post("/v1/collections/uni/search", json={"query": "anything"})
        assert r.status_code == 200 and r.json()["data"] == []
        text = "Ça va? Ελληνικά, русский, 中文检索, emoji 🚀 end."
        r = http.post(
            "/v1/collections/uni/documents",
            content=json.dumps({"documents": [{"id": "ünï/🚀", "text": text}]}),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
        hit = http.post("/v1/collections/uni/search", json={"query": "中文检索 русский"}).json()["data"][0]
        assert hit["document_id"] == "ünï/🚀"
        assert http.get("/v1/collections/uni/documents/ünï/🚀").json()["text"].startswith("Ça va?")


def test_http_files_bad_ones_reported_rest_ingested(rgw: Gateway):
    files = [
        ("files", ("guide/intro.md", b"# Intro\n\nKubernetes schedules pods onto nodes.", "text/markdown")),
        (
            "files",
            (
                "page.html",
                b"<html><body><h1>Billing</h1><p>Invoices are sent monthly.</p></body></html>",
                "text/html",
            ),
        ),
        ("files", ("paper.pdf", minimal_pdf("Solar panels convert light to power"), "application/pdf")),
        ("files", ("notes.txt", "Ünïcode notes about glaciers.".encode(), "text/plain")),
        ("files", ("broken.pdf", b"%PDF-1.4 this is not a pdf", "application/pdf")),
        ("files", ("image.png", b"\x89PNG\r\n", "image/png")),
        ("files", ("empty.txt", b"  \n ", "text/plain")),
    ]
    with httpx.Client(base_url=rgw.url, headers=rgw.auth(), timeout=60) as http:
        r = http.post("/v1/collections/files/documents", files=files)
        assert r.status_code == 200, r.text
        body = r.json()
        assert sorted(d["id"] for d in body["data"]) == [
            "guide/intro.md",
            "notes.txt",
            "page.html",
            "paper.pdf",
        ]
        errors = {e["file"]: e["message"] for e in body["errors"]}
        assert set(errors) == {"broken.pdf", "image.png", "empty.txt"}
        assert "not a readable PDF" in errors["broken.pdf"] and "unsupported" in errors["image.png"]
        listed = {d["id"] for d in http.get("/v1/collections/files/documents").json()["data"]}
        assert listed == {"guide/intro.md", "notes.txt", "page.html", "paper.pdf"}  # nothing half-written
        assert (
            http.post("/v1/collections/files/search", json={"query": "solar power"}).json()["data"][0][
                "document_id"
            ]
            == "paper.pdf"
        )
        only_bad = http.post("/v1/collections/files/documents", files=[files[4]])
        assert only_bad.status_code == 400 and only_bad.json()["error"]["code"] == "ingest_rejected"
        fresh = http.post("/v1/collections/fresh/documents", files=[files[5]])
        assert fresh.status_code == 400 and fresh.json()["errors"][0]["file"] == "image.png"
        assert http.get("/v1/collections/fresh").status_code == 404  # nothing created
        mixed = http.post(
            "/v1/collections/files/documents",
            json={"documents": [{"id": "ok", "text": "fine"}, {"id": "bad"}, {"text": "no id"}]},
        )
        assert [d["id"] for d in mixed.json()["data"]] == ["ok"] and len(mixed.json()["errors"]) == 2


def test_http_tenant_isolation(rgw: Gateway):
    other = rgw.auth(rgw.other_key)  # type: ignore[attr-defined]
    with httpx.Client(base_url=rgw.url, timeout=60) as http:
        http.post(
            "/v1/collections/private/documents",
            headers=rgw.auth(),
            json={"documents": [{"id": "plan", "text": "acme merger plan"}]},
        )
        assert (
            http.post("/v1/collections/private/search", headers=other, json={"query": "merger"}).status_code
            == 404
        )
        assert http.get("/v1/collections/private/documents/plan", headers=other).status_code == 404
        assert http.delete("/v1/collections/private", headers=other).status_code == 404
        assert "private" not in [c["name"] for c in http.get("/v1/collections", headers=other).json()["data"]]
        http.post(
            "/v1/collections/private/documents",
            headers=other,
            json={"documents": [{"id": "mine", "text": "globex merger memo"}]},
        )
        theirs = http.post(
            "/v1/collections/private/search", headers=other, json={"query": "merger", "mode": "rrf"}
        ).json()["data"]
        assert [h["document_id"] for h in theirs] == ["mine"]
        ours = http.post(
            "/v1/collections/private/search", headers=rgw.auth(), json={"query": "merger", "mode": "rrf"}
        ).json()["data"]
        assert [h["document_id"] for h in ours] == ["plan"]
        assert http.delete("/v1/collections/private", headers=other).status_code == 200
        assert (
            http.post(
                "/v1/collections/private/search", headers=rgw.auth(), json={"query": "merger"}
            ).status_code
            == 200
        )


def test_cli_ingest_with_progress(rgw: Gateway, tmp_path):
    from typer.testing import CliRunner

    from polyroute.cli import app

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("Alpha centauri is the nearest star system.")
    (tmp_path / "sub" / "b.md").write_text("# Beta\n\nBeta particles are electrons.")
    (tmp_path / "sub" / "bad.pdf").write_bytes(b"%PDF-1.4 nope")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    runner = CliRunner()
    args = ["ingest", str(tmp_path), "--collection", "cli", "--url", rgw.url, "--api-key", rgw.api_key]
    result = runner.invoke(app, args)
    assert result.exit_code == 1  # one file failed; the others are in
    assert "bad.pdf" in result.output and "2 created" in result.output
    again = runner.invoke(app, args)
    assert "2 unchanged" in again.output
    assert "(0 chunks written)" in again.output  # an unchanged document writes nothing again
    ids = [
        d["id"] for d in httpx.get(f"{rgw.v1}/collections/cli/documents", headers=rgw.auth()).json()["data"]
    ]
    assert ids == ["a.txt", "sub/b.md"]


def test_cli_ingest_finds_the_gateway_on_polyroute_port(rgw: Gateway, tmp_path, monkeypatch):
    """`POLYROUTE_PORT=... polyroute serve` then `polyroute ingest` with no --url (issue 15, item 8)."""
    from typer.testing import CliRunner

    from polyroute.cli import app

    (tmp_path / "c.txt").write_text("Gamma rays are the most energetic photons.")
    monkeypatch.delenv("POLYROUTE_BASE_URL", raising=False)
    monkeypatch.setenv("POLYROUTE_PORT", rgw.url.rsplit(":", 1)[1])
    result = CliRunner().invoke(
        app, ["ingest", str(tmp_path), "--collection", "port", "--api-key", rgw.api_key]
    )
    assert result.exit_code == 0, result.output
    assert "1 created" in result.output


def test_cli_eval_on_beir_fixture(tmp_path):
    from typer.testing import CliRunner

    from polyroute.cli import app

    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        [
            "retrieval",
            "eval",
            "--dataset",
            str(FIXTURES / "beir_tiny"),
            "--embedder",
            "minilm-static",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["ndcg_at_10"]) == {"bm25", "dense", "bm25_dense", "rrf"}
    assert report["queries"] == 6 and report["corpus_docs"] == 12
    assert report["ndcg_at_10"]["bm25"] > 0.3 and report["recall_at_100"]["rrf"] == 1.0
    first = report["disclosure"][0]  # the requested setting: the gateway's defaults
    assert (first["index_size"], first["snippets"], first["title_words"], first["summary_words"]) == (
        3,
        0,
        8,
        0,
    )
    assert 0 < first["gold_in_index"] <= first["gold_reachable"] <= 1
    fuller = next(d for d in report["disclosure"] if d["index_size"] == 10)
    assert first["tokens_injected_mean"] < min(fuller["tokens_injected_mean"], first["tokens_top5_full_mean"])
    assert fuller["gold_reachable"] >= first["gold_reachable"]


def test_cli_eval_split_defaults_and_choices(tmp_path):
    """--split: test when qrels/test.tsv exists, else train; a missing split or bad value is refused."""
    import shutil

    from typer.testing import CliRunner

    from polyroute.cli import app

    data = tmp_path / "beir"
    shutil.copytree(FIXTURES / "beir_tiny", data)
    (data / "qrels" / "test.tsv").rename(data / "qrels" / "train.tsv")
    base = [
        "retrieval",
        "eval",
        "--dataset",
        str(data),
        "--embedder",
        "minilm-static",
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, base + ["--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["split"] == "train" and report["queries"] == 6 and report["subset"] == "all"
    assert (
        report["ingest_embed_s"] >= 0 and report["ingest_index_s"] >= 0 and report["engine"] == "qdrant-edge"
    )

    result = CliRunner().invoke(app, base + ["--split", "test", "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "qrels/test.tsv" in result.output
    result = CliRunner().invoke(app, base + ["--split", "dev", "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "train or test" in result.output

    halves = []
    for subset in ("tune", "validation"):
        result = CliRunner().invoke(app, base + ["--split", "train", "--subset", subset, "--out", str(out)])
        assert result.exit_code == 0, result.output
        halves.append(json.loads(out.read_text())["queries"])
    assert sum(halves) == 6 and all(halves)


@pytest.mark.slow
def test_minilm_round_trip(tmp_path):
    """The real sentence-transformers model: paraphrases BM25 cannot match are found densely."""
    r = Retriever(RetrievalConfig(root=tmp_path / "r", embedder="minilm"))
    try:
        collection = r.get("acme", "kb", create=True)
        collection.ingest([DocumentInput(k, t) for k, t in CORPUS])
        assert collection.search("feline napping habits", 1, "dense")[0].document_id == "cats"
        assert (
            collection.search("which routers exchange reachability", 1, "bm25_dense")[0].document_id == "bgp"
        )
        assert collection.search("feline napping habits cat", 1, "rrf")[0].document_id == "cats"
        collection.delete(["cats"])
        assert all(h.document_id != "cats" for h in collection.search("feline", 5, "dense"))
    finally:
        r.close()


def test_settings_read_qdrant_url():
    from gateway.settings import Settings

    assert Settings.from_env({"QDRANT_URL": "http://qdrant:6333"}).qdrant_url == "http://qdrant:6333"
    assert Settings.from_env({}).qdrant_url is None
    assert (
        Settings.from_env({"POLYROUTE_RETRIEVAL_EMBEDDER": "minilm-static"}).retrieval_embedder
        == "minilm-static"
    )


def test_bm25_dense_falls_back_to_dense_without_lexical_match(retriever):
    collection = retriever.get("acme", "fallback", create=True)
    collection.ingest([DocumentInput(k, t) for k, t in CORPUS])
    hits = collection.search("zzzunknownword", 2, "bm25_dense")
    assert len(hits) == 2 and all(h.bm25_score == 0.0 for h in hits)


def test_memory_layers_and_more_pages(retriever):
    from retrieval import parse_directive, recall

    collection = retriever.get("acme", "mem", create=True)
    collection.ingest([DocumentInput(k, t, title=k.title()) for k, t in CORPUS])
    context = recall(
        retriever, "acme", [("mem", False)], "routers hunt tea cats fox", index_size=2, snippets=1, mode="rrf"
    )
    assert len(context.visible) == 2 and len(context.entries) == 4
    text = context.render()
    assert "[m1]" in text and "[m3]" not in text and "'more'" in text and "Best passages:" in text
    page = context.expand("more")
    assert page.startswith("[m3]") and "[m4]" in page and len(context.visible) == 4
    assert context.expand("more") == "No more memory entries."
    full = context.expand("m1", 2)
    assert full.startswith("[m1] ") and collection.document(context.entries[0].document_id).text in full
    assert context.expand("m1", "snippet").startswith("[m1] ")
    assert context.expand("m9").startswith("error: no memory entry")
    assert recall(retriever, "globex", [("mem", False)], "routers").entries == []  # another tenant: nothing
    assert parse_directive("MEMORY_EXPAND m3 2") == ("m3", "2")
    assert parse_directive("thinking...\nMEMORY_EXPAND(m1, full)") == ("m1", "full")
    assert parse_directive("MEMORY_EXPAND more") == ("more", "2")
    assert parse_directive("I will not MEMORY_EXPAND anything") is None


def test_memory_expansion_the_worker_steers(retriever):
    """'more' with the worker's own words lists new documents for them (numbered on, never one
    already listed or waiting behind 'more'); a level-1 read with words picks the passage about
    them from anywhere in the document; the text protocol carries the words after a colon."""
    from retrieval import directive_query, parse_directive, recall

    collection = retriever.get("acme", "steer", create=True)
    collection.ingest([DocumentInput(k, t, title=k.title()) for k, t in CORPUS])
    context = recall(retriever, "acme", [("steer", False)], "cats hunt", index_size=1, pages=2, mode="bm25")
    first = [e.document_id for e in context.entries]
    assert first[0] == "cats" and len(first) == 2 and "'more'" in context.render()
    listed = context.expand("more", query="green tea")
    assert listed.startswith("[m3] Tea") and len(context.visible) == 2
    assert context.entries[1].document_id == "tea" and context.entries[2].document_id == first[1]
    assert context.expand("m3", 2).startswith("[m3] Tea\n")  # a steered entry reads like any other
    assert context.expand("more", query="green tea").startswith("No further memory entries")
    assert context.expand("more").startswith("[m2] ")  # the first search's next page, as before
    long_doc = " ".join(["Nothing to see in this sentence."] * 30) + " Purring cats knead soft blankets."
    collection.ingest([DocumentInput("long", long_doc, title="Long")])
    context = recall(retriever, "acme", [("steer", False)], "nothing to see", index_size=1, mode="bm25")
    assert context.entries[0].document_id == "long" and "Purring" not in context.entries[0].passage
    assert "Purring cats knead" in context.expand("m1", 1, query="purring cats")
    assert parse_directive("MEMORY_EXPAND more: green tea") == ("more", "2")
    assert directive_query("MEMORY_EXPAND more: green tea") == "green tea"
    assert directive_query("MEMORY_EXPAND m2 1: the dosage") == "the dosage"
    assert directive_query("MEMORY_EXPAND m2 1") is None


@pytest.mark.parametrize(
    ("reply", "read"),
    [
        ("  memory_expand [m2]  \r\n", (("m2", "2"), None)),
        ("x\n\tMEMORY_EXPAND( m4 ,1 )\nmore text", (("m4", "1"), None)),
        ("MEMORY_EXPAND  m2 \t 1 :  the   dosage ", (("m2", "1"), "the dosage")),
        ("\r\n" * 20_000 + "MEMORY_EXPAND more: tea", (("more", "2"), "tea")),
        ("\r\n" * 20_000, (None, None)),
        ("MEMORY_EXPAND" + " " * 20_000 + "!", (None, None)),
    ],
)
def test_a_directive_is_read_line_by_line_whatever_the_whitespace(reply, read):
    """A worker's reply is untrusted: the directive is read one line at a time with its whitespace
    runs made one space, so blank lines by the thousand (a looping small model) or spaces after the
    keyword are read in linear time, where one pattern over the whole reply backtracked for seconds."""
    from retrieval import directive_query, parse_directive

    assert (parse_directive(reply), directive_query(reply)) == read


def test_a_stopped_gateway_releases_its_shards(upstream, tmp_path):
    """Shutdown closes the retriever: a gateway started after it on the same data dir (a restart in
    the same process, as here) opens the collection instead of getting 503 collection_locked."""
    from policies import parse_catalog

    catalog = parse_catalog(catalog_yaml_for(upstream.url), "test catalog")
    for round_ in range(2):
        gw = start_gateway(catalog, tmp_path, retrieval_embedder="minilm-static")
        try:
            with httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=60) as http:
                if round_ == 0:
                    body = {"documents": [{"id": "tea", "text": "Green tea is steamed or pan-fired."}]}
                    assert http.post("/v1/collections/kb/documents", json=body).status_code == 200
                found = http.post("/v1/collections/kb/search", json={"query": "green tea", "mode": "bm25"})
                assert found.status_code == 200, found.text
                assert found.json()["data"][0]["document_id"] == "tea"
        finally:
            gw.server.stop()


def test_one_collection_from_many_threads(tmp_path):
    """The gateway reaches a collection from several threads at once (searches, ingest, a session's
    drop). The embedded engine refused a call while another held it ("Already borrowed", seen in CI
    as a 500 on DELETE /v1/sessions): every call, and the close, must wait their turn."""
    import threading

    r = make_retriever(tmp_path)
    collection = r.get("acme", "busy", create=True)
    collection.ingest([DocumentInput(k, t) for k, t in CORPUS])
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def searcher() -> None:
        start.wait()
        try:
            for _ in range(200):
                collection.search("which routers exchange reachability", 3, "bm25_dense")
        except BaseException as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    def writer() -> None:
        start.wait()
        try:
            for i in range(60):
                collection.ingest([DocumentInput(f"extra-{i}", f"note {i} about gardening tomatoes")])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=searcher) for _ in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    assert errors == []
    assert collection.stats()["documents"] == len(CORPUS) + 60
    # a drop while searches run: the searches finish or see a clear "closed" error, never a borrow error
    closer_errors: list[BaseException] = []

    def late_searcher() -> None:
        for _ in range(40):
            try:
                collection.search("quick brown fox", 3, "bm25")
            except RuntimeError as exc:
                if "Already borrowed" in str(exc):
                    closer_errors.append(exc)
                return

    late = [threading.Thread(target=late_searcher) for _ in range(3)]
    for t in late:
        t.start()
    assert r.drop("acme", "busy")
    for t in late:
        t.join()
    assert closer_errors == []
    r.close()


def test_idle_shards_are_closed_beyond_the_limit_and_reopen_on_use(tmp_path):
    """A gateway with a collection per chat session cannot keep every shard open: beyond
    `max_open_shards` the least recently used is suspended (its process lock released, so the
    files are free), and a Collection object someone still holds reopens it on its next call."""
    from retrieval.engine import ShardLocked, _ProcessLock

    config = RetrievalConfig(root=tmp_path / "r", embedder="minilm-static", max_open_shards=2)
    retriever = Retriever(config)
    try:
        held = []
        for i in range(4):
            collection = retriever.get("acme", f"c{i}", create=True)
            collection.ingest([DocumentInput(f"d{i}", f"document number {i} about tea")])
            held.append(collection)
        is_open = [c.engine.is_open for c in held]
        assert is_open == [False, False, True, True], is_open
        lock = _ProcessLock(held[0].directory / "LOCK")  # a suspended shard's files are free
        lock.release()
        with pytest.raises(ShardLocked):  # an open one stays ours
            _ProcessLock(held[3].directory / "LOCK")
        # held[0] reopens on use and answers as before
        assert [h.document_id for h in held[0].search("tea", 5, "bm25")] == ["d0"]
        assert held[0].engine.is_open
        assert retriever.get("acme", "c0") is held[0]  # one object per collection, open or not
        assert sum(c.engine.is_open for c in held) == 2  # the get trimmed back to the limit
        assert retriever.get("acme", "c1").document("d1").text == "document number 1 about tea"
        assert [c.engine.is_open for c in held] == [True, True, False, False]
    finally:
        retriever.close()
    assert not any(c.engine.is_open for c in held)
    with pytest.raises(RuntimeError, match="closed"):  # close is final: no reopening behind it
        held[0].search("tea", 5, "bm25")
