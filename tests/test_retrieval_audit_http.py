"""Retrieval as its users meet it, through a real gateway (embedded Qdrant Edge, minilm-static):

- a document refused for its id is named where the client wrote it ("documents[0].id"): the
  message was garbled ("Invaldocuments[0].id value for id") for a numeric or over-long id, and an
  item that is not an object was reported as a bad id;
- a Chinese or Japanese document is chunked, and its title and summary are clipped: split at
  whitespace only, it was one chunk of any length (a hit returned the whole document, the embedding
  model read only its start) and its first line, the whole text, was its title and its summary;
- `polyroute ingest` sends a batch that the gateway (or a proxy) refuses as too large (413) again
  in halves and skips a file too large on its own: the whole batch was lost, and a big file
  stopped every file after it, on every rerun.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from polyroute.cli import app as cli
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

UPLOAD_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def agw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("retrieval_audit"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=60,
        retrieval_chunk_overlap=10,
        retrieval_max_upload_bytes=UPLOAD_LIMIT,
    )
    yield gw
    gw.server.stop()


def http(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=120)


def said(result) -> str:
    return " ".join(result.output.split())  # as one line: rich wraps at the terminal's width


# ---- errors name the document and field -------------------------------------------------------------
def test_a_refused_document_is_named_where_the_client_wrote_it(agw: Gateway):
    documents = [
        {"id": 42, "text": "a numeric id"},
        {"text": "no id at all"},
        "just a string",
        {"id": "x" * 513, "text": "an id too long"},
        {"id": "fine", "text": "green tea leaves"},
    ]
    with http(agw) as h:
        r = h.post("/v1/collections/named/documents", json={"documents": documents})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["id"] for d in body["data"]] == ["fine"]  # the good one is in
    messages = {e["index"]: e["message"] for e in body["errors"]}
    assert messages[0] == "Invalid value for documents[0].id: Input should be a valid string"
    assert messages[1] == "Missing required parameter: documents[1].id"
    assert messages[2] == "documents[2] must be an object with an id and a text, not a string"
    assert messages[3].startswith("Invalid value for documents[3].id: String should have at most 512")
    assert all("Inval" + "documents" not in m for m in messages.values())


# ---- text without spaces is chunked ----------------------------------------------------------------
def test_a_japanese_document_is_chunked_and_a_hit_is_one_passage(agw: Gateway):
    clause = "火星の首都は大阪です"  # one BM25 token (a clause without spaces), found only near the end
    text = "東京は日本の首都です。" * 300 + clause + "。" + "京都は古い都です。" * 20
    with http(agw) as h:
        r = h.post("/v1/collections/nihongo/documents", json={"documents": [{"id": "jp", "text": text}]})
        assert r.status_code == 200, r.text
        chunks = r.json()["data"][0]["chunks"]
        hits = h.post("/v1/collections/nihongo/search", json={"query": clause, "mode": "bm25", "top_k": 1})
        full = h.get("/v1/collections/nihongo/documents/jp", params={"level": 2}).json()
    assert chunks > 20, chunks  # 3,500 characters in chunks of 60; the old code: 1 chunk
    assert hits.status_code == 200, hits.text
    top = hits.json()["data"][0]
    assert clause in top["text"] and len(top["text"]) <= 80, len(top["text"])  # not the whole document
    assert full["text"] == text and full["chunks"] == chunks  # stored as sent
    # neither the title (a first line of at most 12 words) nor the summary (16) is the whole text:
    # the old code counted whitespace words, so the one long line was both, and every chunk was
    # embedded and indexed behind a "title" of the whole document
    assert full["title"] == "jp" and top["title"] == "jp"
    assert full["summary"] == "東京は日本の首都です。東京は日本 …"


# ---- polyroute ingest and the upload limit -----------------------------------------------------------
def _ingest(gw: Gateway, folder: Path, collection: str):
    args = ["ingest", str(folder), "--collection", collection, "--url", gw.url, "--api-key", gw.api_key]
    return CliRunner().invoke(cli, args, env={"COLUMNS": "250"})


def _ids(gw: Gateway, collection: str) -> list[str]:
    with http(gw) as h:
        r = h.get(f"/v1/collections/{collection}/documents", params={"limit": 100})
    return [d["id"] for d in r.json()["data"]] if r.status_code == 200 else []


def test_ingest_sends_a_batch_too_large_for_the_gateway_in_halves(agw: Gateway, tmp_path: Path):
    for name in ("a.md", "b.md", "c.md"):  # each within the limit, together over it
        (tmp_path / name).write_text(f"# {name}\n\n" + "Employees get 27 vacation days. " * 800)
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) > UPLOAD_LIMIT
    result = _ingest(agw, tmp_path, "halves")
    assert result.exit_code == 0, said(result)  # the old code: exit 1, the batch refused whole
    assert "3 created" in said(result)
    assert _ids(agw, "halves") == ["a.md", "b.md", "c.md"]


def test_ingest_skips_a_file_too_large_and_ingests_the_rest(agw: Gateway, tmp_path: Path):
    (tmp_path / "a_huge.md").write_text("# Huge\n\n" + "Employees get 27 vacation days. " * 4000)
    (tmp_path / "b.txt").write_text("The canteen opens at noon.")
    (tmp_path / "c.txt").write_text("The library closes at six.")
    result = _ingest(agw, tmp_path, "toolarge")
    output = said(result)
    assert result.exit_code == 1, output  # one file is not in: said, and the exit status says so
    assert "HTTP 413" in output and "a_huge.md is too large" in output
    assert "2 created" in output and "1 not ingested" in output
    assert "a_huge.md" in output.split("not ingested:")[-1]
    assert _ids(agw, "toolarge") == ["b.txt", "c.txt"]  # the old code: none (the batch was refused)


# ---- ids with a newline -----------------------------------------------------------------------------
def test_an_id_with_a_newline_is_read_and_deleted_as_itself(agw: Gateway):
    from polyroute.client import Client

    docs = [
        {"id": "a", "text": "the plain document"},
        {"id": "a\n", "text": "an id read from a file, newline kept"},
        {"id": "x\ny", "text": "a newline inside the id"},
    ]
    with Client(base_url=agw.url, api_key=agw.api_key, timeout=60) as client:
        assert [d["status"] for d in client.add_documents("newlines", docs)["data"]] == ["created"] * 3
        assert client.get_document("newlines", "a\n", level=2)["text"] == docs[1]["text"]  # old: a's text
        assert client.get_document("newlines", "x\ny", level=0)["id"] == "x\ny"  # old: 404 Not Found
        assert client.delete_document("newlines", "a\n")["deleted"] is True
        assert client.delete_document("newlines", "x\ny")["deleted"] is True
        remaining = [d["id"] for d in client.list_documents("newlines")["data"]]
    assert remaining == ["a"]  # the old code deleted "a" for "a\n", and could not delete "x\ny"


def test_forgetting_a_session_id_with_a_newline_forgets_only_that_session(agw: Gateway):
    from retrieval import session_collection

    stored = agw.data_dir / "retrieval" / "tenants" / "acme" / session_collection("user-7") / "meta.json"
    with http(agw) as h:
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": "My locker code is 4711."}],
            "metadata": {"session_id": "user-7"},
        }
        assert h.post("/v1/chat/completions", json=body).status_code == 200
        deadline = time.monotonic() + 60  # the turn is written in the background after the answer
        while not stored.exists():
            assert time.monotonic() < deadline, "the session turn was never stored"
            time.sleep(0.05)
        other = h.delete("/v1/sessions/user-7%0A")  # another session: "user-7\n"
        assert other.status_code == 404, other.text  # the old code: 200, and it forgot "user-7"
        assert other.json()["error"]["code"] == "session_not_found"
        assert stored.exists()
        assert h.delete("/v1/sessions/user-7").json()["deleted"] is True


# ---- memory: a long document does not crowd out the others -------------------------------------------
def test_memory_lists_other_documents_beside_a_long_one(agw: Gateway, upstream):
    rule = "Vacation rule {i}: vacation days accrue monthly and vacation requests go to your manager."
    handbook = {
        "id": "handbook",
        "title": "Employee handbook",
        "text": " ".join(rule.format(i=i) for i in range(200)),
    }
    memos = [
        {
            "id": f"memo{i}",
            "title": f"Memo {i}",
            "text": f"Memo {i}: vacation days for team {i} are in the plan.",
        }
        for i in range(5)
    ]
    with http(agw) as h:
        r = h.post("/v1/collections/longdocs/documents", json={"documents": [handbook, *memos]})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["chunks"] > 40  # the handbook's chunks outnumber the search's first reach
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": "How many vacation days do I get?"}],
            "metadata": {"collections": ["longdocs"]},
        }
        answer = h.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-memory"] == "entries=3; expansions=0"  # the old code: entries=1
    system = upstream.requests[-1]["messages"][0]["content"]
    listed = [line for line in system.splitlines() if line.startswith("[m")]
    assert len(listed) == 3 and sum("Memo" in line for line in listed) >= 2, system
