"""The /v1/collections HTTP API against a real gateway (embedded Qdrant Edge, minilm-static):

- `GET /v1/collections` lists the healthy collections and marks one whose shard another owner
  holds (it was an opaque 500 for the whole listing);
- `has_more` is false on the last page of a document listing;
- an integer beyond 64 bits (which the JSON parser would round to a float) is a 400 naming the
  field, in ingest bodies and every other JSON body; integers within 64 bits round-trip exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from retrieval import DocumentInput, RetrievalConfig, Retriever
from tests.conftest import Gateway, catalog_yaml_for, start_gateway


@pytest.fixture(scope="module")
def cgw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("collections"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=60,
        retrieval_chunk_overlap=10,
    )
    yield gw
    gw.server.stop()


def http(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=60)


def test_listing_marks_a_locked_collection_and_lists_the_healthy_ones(cgw: Gateway):
    with http(cgw) as h:
        r = h.post("/v1/collections/visible/documents", json={"documents": [{"id": "a", "text": "tea"}]})
        assert r.status_code == 200, r.text
    holder = Retriever(RetrievalConfig(root=cgw.data_dir / "retrieval", embedder="minilm-static"))
    try:  # another owner of the data dir holds this collection's shard
        holder.get("acme", "heldlist", create=True).ingest([DocumentInput("x", "green tea leaves")])
        with http(cgw) as h:
            single = h.get("/v1/collections/heldlist")
            assert single.status_code == 503 and single.json()["error"]["code"] == "collection_locked"
            listing = h.get("/v1/collections")
        assert listing.status_code == 200, listing.text  # the old code: 500 "internal error"
        by_name = {c["name"]: c for c in listing.json()["data"]}
        assert by_name["visible"]["documents"] == 1 and "status" not in by_name["visible"]
        held = by_name["heldlist"]
        assert held["status"] == "locked" and held["object"] == "collection"
        assert held["message"] == single.json()["error"]["message"]
    finally:
        holder.close()
    with http(cgw) as h:  # released: listed with its counts again
        by_name = {c["name"]: c for c in h.get("/v1/collections").json()["data"]}
    assert by_name["heldlist"]["documents"] == 1


def test_has_more_is_false_on_the_last_page(cgw: Gateway):
    with http(cgw) as h:
        docs = [{"id": f"d{i}", "text": f"document number {i}"} for i in range(3)]
        assert h.post("/v1/collections/pages/documents", json={"documents": docs}).status_code == 200

        def page(**params) -> dict:
            r = h.get("/v1/collections/pages/documents", params=params)
            assert r.status_code == 200, r.text
            return r.json()

        exact = page(limit=3)
        assert [d["id"] for d in exact["data"]] == ["d0", "d1", "d2"]
        assert exact["has_more"] is False  # the old code: true, and the next page is empty
        first = page(limit=2)
        assert [d["id"] for d in first["data"]] == ["d0", "d1"] and first["has_more"] is True
        last = page(limit=2, after="d1")
        assert [d["id"] for d in last["data"]] == ["d2"] and last["has_more"] is False
        assert page(limit=1, after="d2") == {"object": "list", "data": [], "has_more": False}


BIG = 2**70  # 1180591620717411303424: parsed as 1.1805916207174113e+21 by orjson


def test_an_integer_beyond_64_bits_is_refused_naming_the_field(cgw: Gateway):
    body = (
        '{"documents": [{"id": "ok", "text": "fine row"}, '
        f'{{"id": "big", "text": "ledger row", "metadata": {{"account": {BIG}}}}}]}}'
    )
    with http(cgw) as h:
        r = h.post(
            "/v1/collections/bigints/documents", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text  # the old code: 200, stored as 1.1805916207174112e+21
        error = r.json()["error"]
        assert error["param"] == "documents[1].metadata.account" and str(BIG) in error["message"]
        assert h.get("/v1/collections/bigints").status_code == 404  # nothing of the batch was written
        negative = f'{{"documents": [{{"id": "n", "text": "t", "metadata": {{"delta": -{2**63 + 1}}}}}]}}'
        r = h.post(
            "/v1/collections/bigints/documents",
            content=negative,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents[0].metadata.delta"


def test_integers_within_64_bits_round_trip_exactly(cgw: Gateway):
    edges = {"max_u64": 2**64 - 1, "min_i64": -(2**63), "id_like": 1234567890123456789}
    text = "digits in text stay text: 123456789012345678901234567890"
    with http(cgw) as h:
        r = h.post(
            "/v1/collections/edges/documents",
            json={"documents": [{"id": "e", "text": text, "metadata": edges}]},
        )
        assert r.status_code == 200, r.text
        stored = h.get("/v1/collections/edges/documents/e").json()
    assert stored["metadata"] == edges and stored["text"] == text


def test_other_json_bodies_refuse_an_integer_beyond_64_bits_too(cgw: Gateway, upstream):
    """A tool schema is forwarded to the worker as sent: rounded, the worker saw another bound."""
    schema = f'{{"type": "object", "properties": {{"n": {{"type": "integer", "maximum": {BIG}}}}}}}'
    tool = f'{{"type": "function", "function": {{"name": "pick", "parameters": {schema}}}}}'
    body = f'{{"model": "cheap", "messages": [{{"role": "user", "content": "hi"}}], "tools": [{tool}]}}'
    with http(cgw) as h:
        r = h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text  # the old code: 200, the worker got "maximum": 1.18e21
    assert r.json()["error"]["param"] == "tools[0].function.parameters.properties.n.maximum"
    assert not upstream.requests_for("cheap-model")
