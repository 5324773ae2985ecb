"""Retrieval store fixes: collections dropped by another replica, text stored as sent, and deletes
ordered with the writes of the same collection.

The multi-replica tests run two Retrievers (replicas, each with its own data dir) on one
qdrant-client in its in-process mode (":memory:"), which stands in for the Qdrant server that
QDRANT_URL names: no Qdrant server binary exists on this machine, so the server path is exercised
through qdrant-client's local mode, as tests/test_retrieval.py does.

The races are made deterministic by holding the collection's write lock (the lock every real write
takes) from the test: a write "in flight" is the test itself, or a real ingest queued behind it.
Nothing sleeps to let a race happen; the only waits are for a condition, with a generous guard
against a hang.
"""

from __future__ import annotations

import logging
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.collections import retriever as app_retriever
from policies import parse_catalog
from retrieval import CollectionNotFound, DocumentInput, RetrievalConfig, Retriever, extract
from retrieval.engine import PointData, doc_point_id
from retrieval.store import CollectionDropped, session_collection
from tests.conftest import catalog_yaml_for, start_gateway

ORIGINAL = "Einstein: E = mc². Step ① of the ﬁnal ＡＢＣ recipe uses ½ cup, H₂O and 10⁻³ m."
HANG_GUARD_S = 120.0  # only against a hang: every wait below ends on a condition


def make_retriever(path: Path, engine: str = "edge") -> Retriever:
    """`edge`: an embedded Qdrant Edge shard; `memory`: qdrant-client's in-process mode standing in
    for a Qdrant server (the QDRANT_URL code path)."""
    return Retriever(
        RetrievalConfig(
            root=path / "retrieval",
            qdrant_url=":memory:" if engine == "memory" else None,
            embedder="minilm-static",
            chunk_words=40,
            chunk_overlap=8,
        )
    )


@pytest.fixture(params=["edge", "memory"])
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Retriever]:
    r = make_retriever(tmp_path, request.param)
    yield r
    r.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Retriever, Retriever]]:
    a, b = make_retriever(tmp_path / "a", "memory"), make_retriever(tmp_path / "b", "memory")
    b._pool = a.pool  # one Qdrant "server" for both replicas
    yield a, b
    a.close()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


# ------------------------------------------------------------------ 1. replicas on one server
def test_a_replica_recreates_a_collection_another_replica_dropped(replicas):
    a, b = replicas
    b.get("acme", "kb", create=True).ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    assert a.get("acme", "kb").search("green tea", 1, "bm25")[0].document_id == "tea"
    assert a.drop("acme", "kb") is True  # DELETE lands on replica A; B still has it open

    b.get("acme", "kb", create=True).ingest([DocumentInput("coffee", "Coffee beans are roasted.")])
    assert [h.document_id for h in a.get("acme", "kb").search("coffee beans", 3, "bm25")] == ["coffee"]
    assert b.get("acme", "kb").stats()["documents"] == 1


def test_a_replica_reports_a_collection_dropped_elsewhere_as_missing(replicas):
    a, b = replicas
    b.get("acme", "kb", create=True).ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    assert a.drop("acme", "kb") is True
    assert not b.exists("acme", "kb")
    with pytest.raises(CollectionNotFound):  # → 404 collection_not_found, not a 500
        b.get("acme", "kb")
    assert b.drop("acme", "kb") is False  # → 404, not a second "deleted"
    assert b.names("acme") == []


def test_a_session_turn_on_another_replica_after_a_forget_is_stored(replicas):
    a, b = replicas
    session = session_collection("user-1")
    b.get("acme", session, create=True, internal=True).ingest([DocumentInput("turn-1", "User: hi")])
    assert a.drop("acme", session, internal=True) is True  # DELETE /v1/sessions on replica A
    # a later turn on B (the write `gateway.memory._remember` makes): the session starts afresh
    turn = b.get("acme", session, create=True, internal=True)
    turn.ingest([DocumentInput("turn-2", "User: my PIN is 4711")])
    assert [d["id"] for d in a.get("acme", session, internal=True).list_documents()] == ["turn-2"]


def test_http_two_replicas_delete_via_one_then_read_and_reingest_via_the_other(upstream, tmp_path):
    catalog = parse_catalog(catalog_yaml_for(upstream.url), "test catalog")
    options = dict(retrieval_embedder="minilm-static", qdrant_url=":memory:")
    gw_a = start_gateway(catalog, tmp_path / "a", **options)
    gw_b = start_gateway(catalog, tmp_path / "b", **options)
    app_retriever(gw_b.server.server.config.app)._pool = app_retriever(gw_a.server.server.config.app).pool
    doc = {"documents": [{"id": "tea", "text": "Green tea is brewed from leaves."}]}
    try:
        with (
            httpx.Client(base_url=gw_a.url, headers=gw_a.auth(), timeout=60) as A,
            httpx.Client(base_url=gw_b.url, headers=gw_b.auth(), timeout=60) as B,
        ):
            assert B.post("/v1/collections/kb/documents", json=doc).status_code == 200
            assert A.delete("/v1/collections/kb").status_code == 200
            missing = B.get("/v1/collections/kb")
            assert missing.status_code == 404, missing.text
            assert missing.json()["error"]["code"] == "collection_not_found"
            again = B.post("/v1/collections/kb/documents", json=doc)
            assert again.status_code == 200, again.text
            assert again.json()["data"] == [{"id": "tea", "status": "created", "chunks": 1}]
            assert A.get("/v1/collections/kb").json()["documents"] == 1
    finally:
        gw_a.server.stop()
        gw_b.server.stop()


# ------------------------------------------------------------------ 2. text stored as sent
def test_full_text_chunks_and_title_are_stored_as_sent(store):
    title = "Ｐhysics ﬁle"
    kb = store.get("acme", "kb", create=True)
    assert kb.ingest([DocumentInput("physics", ORIGINAL, title)])[0].status == "created"
    record = kb.document("physics")
    assert record is not None and record.text == ORIGINAL and record.title == title
    hit = kb.search("Einstein recipe", 1, "bm25")[0]
    assert (hit.text, hit.title) == (ORIGINAL, title)
    assert kb.all_documents()[0].text == ORIGINAL


def test_search_matches_the_normalised_form_of_the_text(store):
    """BM25 tokens and the embedding input are the NFKC form: a query in plain letters finds the
    document, and it scores exactly as the same document stored in NFKC form does."""
    normalised = unicodedata.normalize("NFKC", ORIGINAL)
    assert normalised != ORIGINAL
    others = [
        DocumentInput("tea", "Green tea is brewed from unoxidised leaves."),
        DocumentInput("bgp", "BGP routers exchange reachability information."),
    ]
    sent = store.get("acme", "sent", create=True)
    plain = store.get("acme", "plain", create=True)
    sent.ingest([DocumentInput("physics", ORIGINAL), *others])
    plain.ingest([DocumentInput("physics", normalised), *others])
    for query in ("final ABC recipe", "mc2 H2O"):  # only the NFKC form has these words
        for mode in ("bm25", "dense", "bm25_dense"):
            got, want = sent.search(query, 3, mode), plain.search(query, 3, mode)
            assert got[0].document_id == "physics", (query, mode)
            assert [h.document_id for h in got] == [h.document_id for h in want]
            for g, w in zip(got, want, strict=True):
                assert g.score == pytest.approx(w.score, abs=1e-5), (query, mode)
    assert sent.search("final ABC recipe", 1, "bm25")[0].text == ORIGINAL


def test_documents_stored_in_normalised_form_read_back_and_reingest_keeps_the_original(store):
    """What earlier versions stored (the NFKC form) still reads and searches as before; sending the
    original again replaces it (a new content hash), and an ASCII document stays unchanged."""
    normalised = unicodedata.normalize("NFKC", ORIGINAL)
    kb = store.get("acme", "kb", create=True)
    kb.ingest([DocumentInput("physics", normalised), DocumentInput("ascii", "Plain ASCII text here.")])
    assert kb.document("physics").text == normalised
    assert kb.search("final ABC recipe", 1, "bm25")[0].document_id == "physics"
    results = kb.ingest(
        [DocumentInput("physics", ORIGINAL), DocumentInput("ascii", "Plain ASCII text here.")]
    )
    assert [(r.id, r.status) for r in results] == [("physics", "updated"), ("ascii", "unchanged")]
    assert kb.document("physics").text == ORIGINAL
    assert kb.search("final ABC recipe", 1, "bm25")[0].text == ORIGINAL


def test_an_uploaded_file_keeps_its_text_as_sent():
    text, _ = extract("physics.txt", ("\ufeff" + ORIGINAL + "\n").encode())
    assert text == ORIGINAL


# ------------------------------------------------------------------ 3. deletes vs writes
def test_a_delete_waits_for_the_write_in_flight_and_then_removes_everything(store, tmp_path):
    kb = store.get("acme", "kb", create=True)
    kb.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    key = ("acme", "kb")
    outcome: list[bool] = []
    dropper = threading.Thread(target=lambda: outcome.append(store.drop("acme", "kb")))
    with kb._write:  # this test is a write in flight: it holds the lock every write takes
        dropper.start()
        # the drop has begun (the fix: it waits for this write) or is over (before the fix)
        wait_until(lambda: key in getattr(store, "_dropping", {}) or not dropper.is_alive(), "the drop began")
        # the rest of the write in flight: its points and the collection's meta (as `_fix_bm25`
        # writes them); a delete must not cut it off, nor may the write re-create the collection
        kb.engine.upsert([PointData(doc_point_id("late"), {"kind": "doc", "doc": "late", "ver": "x"})])
        store._save_meta(kb)
    dropper.join(HANG_GUARD_S)
    assert outcome == [True]
    assert not store.exists("acme", "kb") and store.names("acme") == []
    assert not (tmp_path / "retrieval" / "tenants" / "acme" / "kb").exists()
    with pytest.raises(CollectionNotFound):
        store.get("acme", "kb")


def test_a_write_queued_behind_a_delete_writes_nothing_and_resurrects_nothing(store, tmp_path):
    kb = store.get("acme", "kb", create=True)  # opened, nothing written yet (BM25 not fixed)
    key = ("acme", "kb")
    errors: list[BaseException] = []
    results: list[object] = []

    def ingest() -> None:
        try:
            results.append(kb.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")]))
        except BaseException as exc:  # noqa: BLE001 - the test inspects what a racing write raises
            errors.append(exc)

    writer = threading.Thread(target=ingest)
    dropper = threading.Thread(target=lambda: store.drop("acme", "kb"))
    with kb._write:  # hold both at the lock; the drop and the ingest may then go in either order
        writer.start()
        dropper.start()
        wait_until(lambda: key in getattr(store, "_dropping", {}) or not dropper.is_alive(), "the drop began")
    writer.join(HANG_GUARD_S)
    dropper.join(HANG_GUARD_S)
    # either the ingest went first and the drop then removed it, or the drop went first and the
    # ingest wrote nothing: never a half-failed write on a closed shard, never a ghost collection
    assert all(isinstance(e, CollectionDropped) for e in errors), errors
    assert len(errors) + len(results) == 1
    assert not store.exists("acme", "kb")
    assert not (tmp_path / "retrieval" / "tenants" / "acme" / "kb").exists()


def test_a_stale_handle_after_a_delete_writes_nothing_and_a_new_one_recreates(store, tmp_path):
    kb = store.get("acme", "kb", create=True)
    assert store.drop("acme", "kb") is True
    with pytest.raises(CollectionNotFound, match="kb"):  # → a clear error, not a closed-shard crash
        kb.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    with pytest.raises(CollectionNotFound):
        kb.delete(["tea"])
    assert not store.exists("acme", "kb")
    assert not (tmp_path / "retrieval" / "tenants" / "acme" / "kb" / "meta.json").exists()
    fresh = store.get("acme", "kb", create=True)  # a write after the delete creates it again
    assert fresh.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])[0].status == "created"
    assert fresh.search("green tea", 1, "bm25")[0].document_id == "tea"


def test_a_forget_discards_a_turn_answered_before_it(store, tmp_path):
    """The session turn's background write reads the generation when its request begins; a forget
    before the write (even of a session not stored yet) means the turn is not stored."""
    session = session_collection("user-1")
    before = store.generation("acme", session)
    assert store.drop("acme", session, internal=True) is False  # nothing stored yet: 404
    with pytest.raises(CollectionDropped):
        store.get("acme", session, create=True, internal=True, generation=before)
    assert not store.exists("acme", session)
    assert not (tmp_path / "retrieval" / "tenants" / "acme" / session).exists()
    after = store.generation("acme", session)  # a turn that begins after the forget is stored
    turn = store.get("acme", session, create=True, internal=True, generation=after)
    assert turn.ingest([DocumentInput("turn-1", "User: hello")])[0].status == "created"


def test_the_drops_remembered_for_later_writes_stay_bounded(store, monkeypatch):
    """Forgetting a session a second must not grow the store for ever: drops older than
    DROPS_REMEMBERED_S are forgotten once more than DROPS_PRUNE_ABOVE are remembered, and a write
    planned before the latest drops is still refused."""
    import retrieval.store as store_module

    monkeypatch.setattr(store_module, "DROPS_PRUNE_ABOVE", 8)
    monkeypatch.setattr(store_module, "DROPS_REMEMBERED_S", 0.0)  # every earlier drop is old
    session = session_collection("user-last")
    for n in range(50):
        store.drop("acme", session_collection(f"user-{n}"), internal=True)
        assert len(store._drops) <= 9
    for _ in range(9):  # whatever the count, the latest drop is remembered
        before = store.generation("acme", session)
        store.drop("acme", session, internal=True)
        with pytest.raises(CollectionDropped):
            store.get("acme", session, create=True, internal=True, generation=before)
        store.drop("acme", session_collection("user-other"), internal=True)


def test_http_forget_during_a_turns_background_write_leaves_nothing_and_logs_no_error(
    upstream, tmp_path, caplog
):
    """DELETE /v1/sessions while the chat turn's background write waits at the session's write
    lock (held here): the session is gone afterwards and no background task failed."""
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), tmp_path, retrieval_embedder="minilm-static"
    )
    app = gw.server.server.config.app
    store = app_retriever(app)
    session = session_collection("user-1")
    key = ("acme", session)

    def turn(text: str) -> None:
        body = {
            "model": "cheap",
            "messages": [{"role": "user", "content": text}],
            "metadata": {"session_id": "user-1"},
        }
        assert h.post("/v1/chat/completions", json=body).status_code == 200

    caplog.set_level(logging.INFO)
    try:
        with httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=60) as h:
            turn("My locker is number 12.")
            wait_until(lambda: not gw.state.background, "the first turn's write")
            held = store.get("acme", session, internal=True)
            assert held.stats()["documents"] == 1
            forgot: list[int] = []
            with held._write:  # the second turn's write will wait here
                turn("My PIN is 9811, remember it.")
                forget = threading.Thread(
                    target=lambda: forgot.append(h.delete("/v1/sessions/user-1").status_code)
                )
                forget.start()
                wait_until(
                    lambda: key in getattr(store, "_dropping", {}) or not forget.is_alive(),
                    "the forget began",
                )
            forget.join(HANG_GUARD_S)
            wait_until(lambda: not gw.state.background, "the second turn's write")
            assert forgot == [200]
            assert not store.exists("acme", session)
            assert not (tmp_path / "retrieval" / "tenants" / "acme" / session).exists()
            assert h.delete("/v1/sessions/user-1").status_code == 404
        failures = [r for r in caplog.records if "background bookkeeping failed" in r.getMessage()]
        assert not failures, failures[0].exc_info
    finally:
        gw.server.stop()


# ------------------------------------------------------------------ 4. the HTTP routes around a delete
def test_a_read_on_a_collection_deleted_under_it_is_a_404(store):
    """A search, a listing or a document read that holds the collection when a DELETE removes it
    answers as for a collection never there (404), not with the closed shard's error (500)."""
    import asyncio

    from gateway.collections import _on
    from gateway.errors import APIError

    kb = store.get("acme", "kb", create=True)
    kb.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    assert store.drop("acme", "kb") is True
    reads = (
        (kb.search, ("green tea", 1, "bm25")),
        (kb.list_documents, (10, "")),
        (kb.document, ("tea",)),
        (kb.delete, (["tea"],)),
    )
    for read, args in reads:
        with pytest.raises(APIError) as refused:
            asyncio.run(_on(kb, "kb", read, *args))
        assert (refused.value.status, refused.value.code) == (404, "collection_not_found"), read
    # a write that finds it deleted (the ingest route's): nothing written, a 409 that says so
    write = [DocumentInput("tea", "Green tea is brewed from leaves.")]
    with pytest.raises(APIError) as refused:
        asyncio.run(_on(kb, "kb", kb.ingest, write, writing=True))
    assert (refused.value.status, refused.value.code) == (409, "collection_deleted")
    assert not store.exists("acme", "kb")


def test_a_listing_leaves_out_a_collection_deleted_while_its_stats_are_read(store):
    """GET /v1/collections opens each collection and reads its stats; a DELETE that lands between the
    two closes the collection under the read. That collection is left out of the list (it is gone),
    where the closed shard's error made the whole listing a 500."""
    from gateway.collections import _stats_unless_dropped

    kept = store.get("acme", "kept", create=True)
    gone = store.get("acme", "gone", create=True)
    gone.ingest([DocumentInput("tea", "Green tea is brewed from leaves.")])
    assert store.drop("acme", "gone") is True  # the DELETE, after the listing opened `gone`
    assert _stats_unless_dropped(gone) is None
    assert _stats_unless_dropped(kept)["name"] == "kept"


def test_memory_recall_skips_a_collection_dropped_while_it_is_searched(store):
    """Recall opens the request's collections, then searches them; a forget of the session (or a
    DELETE) that lands in between closes one under the search. That collection holds no memory any
    more: recall answers from the others, where the closed shard's error made the chat a 503
    memory_unavailable."""
    from retrieval.memory import _ranked_entries

    kept = store.get("acme", "notes", create=True)
    kept.ingest([DocumentInput("tea", "Green tea is brewed from leaves at 80 degrees.")])
    gone = store.get("acme", "session-1", create=True)
    gone.ingest([DocumentInput("turn", "The user asked about green tea yesterday.")])
    sources = {"notes": kept, "session-1": gone}  # what recall opened
    assert store.drop("acme", "session-1") is True  # the forget, before the search
    entries = _ranked_entries(sources, {"session-1"}, "green tea", 5, "bm25", 40, set(), 1)
    assert [(e.collection, e.document_id) for e in entries] == [("notes", "tea")]
