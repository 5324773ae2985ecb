"""Collections' parameters through a real gateway (embedded Qdrant Edge, minilm-static):

- `GET …/documents?limit=` out of 1-1000 was clamped silently (limit=0 gave one document, 5000 gave
  a page of 1000): a 400 naming `limit` and its range;
- `GET …/documents/{id}?level=7` of a missing document was a 404: the level was checked after the
  lookup, though the bad parameter is the client's error whatever exists; a 400 first;
- one request that ingests and deletes the same id answered "created" for it and then deleted it:
  refused whole with a 400 naming the id, nothing written and nothing deleted.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Gateway, catalog_yaml_for, start_gateway


@pytest.fixture(scope="module")
def pgw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("retrieval_audit2"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=60,
        retrieval_chunk_overlap=10,
    )
    yield gw
    gw.server.stop()


def http(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=120)


def ingest(h: httpx.Client, collection: str, body: dict) -> httpx.Response:
    return h.post(f"/v1/collections/{collection}/documents", json=body)


def listed_ids(h: httpx.Client, collection: str) -> list[str]:
    r = h.get(f"/v1/collections/{collection}/documents", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return [d["id"] for d in r.json()["data"]]


# ---- ?limit out of range ---------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [0, -1, 1001, 5000])
def test_a_document_listing_limit_out_of_range_is_a_400_naming_it(pgw: Gateway, limit: int):
    with http(pgw) as h:
        assert ingest(
            h, "paged", {"documents": [{"id": "a", "text": "alpha"}, {"id": "b", "text": "beta"}]}
        ).is_success
        r = h.get("/v1/collections/paged/documents", params={"limit": limit})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "limit" and error["code"] == "invalid_value"
        assert "1 to 1000" in error["message"] and str(limit) in error["message"]
        # the edges of the range are served
        for edge, expected in ((1, ["a"]), (1000, ["a", "b"])):
            page = h.get("/v1/collections/paged/documents", params={"limit": edge})
            assert page.status_code == 200, page.text
            assert [d["id"] for d in page.json()["data"]] == expected


def test_a_bad_limit_on_a_missing_collection_is_still_the_clients_400(pgw: Gateway):
    with http(pgw) as h:
        r = h.get("/v1/collections/never-made/documents", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


# ---- ?level checked before the lookup --------------------------------------------------------------
@pytest.mark.parametrize("where", ["missing document", "missing collection", "existing document"])
def test_a_bad_level_is_a_400_whatever_exists(pgw: Gateway, where: str):
    with http(pgw) as h:
        assert ingest(h, "levels", {"documents": [{"id": "here", "text": "present text"}]}).is_success
        path = {
            "missing document": "/v1/collections/levels/documents/not-here",
            "missing collection": "/v1/collections/no-such-collection/documents/here",
            "existing document": "/v1/collections/levels/documents/here",
        }[where]
        r = h.get(path, params={"level": 7})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "level" and "0 (index), 1 (passage) or 2 (full)" in error["message"]
        # a good level still tells a missing document (or collection) from a present one
        good = h.get(path, params={"level": 0})
        assert good.status_code == (200 if where == "existing document" else 404), good.text


# ---- ingest and delete of one id in one request -----------------------------------------------------
def test_ingesting_and_deleting_one_id_in_one_request_is_refused_whole(pgw: Gateway):
    with http(pgw) as h:
        assert ingest(h, "both", {"documents": [{"id": "keep", "text": "kept before"}]}).is_success
        r = ingest(
            h,
            "both",
            {
                "documents": [{"id": "new", "text": "a new one"}, {"id": "twice", "text": "sent to ingest"}],
                "delete": ["keep", "twice"],
            },
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "delete" and "'twice'" in error["message"]
        assert "Nothing was written or deleted" in error["message"]
        # atomic: neither the other document nor the other delete was applied
        assert listed_ids(h, "both") == ["keep"]
        # the same documents and deletes sent apart are applied as asked
        r = ingest(h, "both", {"documents": [{"id": "new", "text": "a new one"}], "delete": ["keep"]})
        assert r.status_code == 200, r.text
        assert [d["status"] for d in r.json()["data"]] == ["created"] and r.json()["deleted"] == ["keep"]
        assert listed_ids(h, "both") == ["new"]


def test_the_refusal_names_the_id_even_when_the_collection_does_not_exist_yet(pgw: Gateway):
    with http(pgw) as h:
        r = ingest(h, "not-yet", {"documents": [{"id": "x", "text": "t"}], "delete": ["x", "x"]})
        assert r.status_code == 400 and "'x'" in r.json()["error"]["message"], r.text
        assert "(and" not in r.json()["error"]["message"]  # a repeated id is one id
        assert h.get("/v1/collections/not-yet").status_code == 404  # nothing was created either
