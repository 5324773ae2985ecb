"""`polyroute ingest` leftovers, each through the real path (the CLI via CliRunner, a real gateway):

- documents of files deleted or renamed in the folder stayed in the collection, searchable, forever:
  a rerun lists them, and `--prune` deletes them, but only when every file went in, and never a
  document sent as JSON (an id that is not a path of the folder's scheme, or one that is but was not
  uploaded as a file);
- a bad collection name was sent, and the gateway's refusal ended with "Rerun the same command": it
  is refused before anything is read, with the gateway's own rule, exit 2;
- a text file in Windows-1252 or Latin-1 was refused ("not valid UTF-8"): `--encoding` decodes such
  files and sends them as UTF-8; a file that fails is named, with --encoding suggested, and the
  others go in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from policies import parse_catalog
from polyroute.cli import app
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

UPLOAD_LIMIT = 64 * 1024  # small, so that one file can be too large to send (413)
WIDE = {"COLUMNS": "250", "POLYROUTE_API_KEY": None, "POLYROUTE_BASE_URL": None}


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    gateway = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("ingest_more"),
        retrieval_embedder="minilm-static",
        retrieval_max_upload_bytes=UPLOAD_LIMIT,
    )
    yield gateway
    gateway.server.stop()


def ingest(gw: Gateway, folder: Path, collection: str, *options: str):
    args = ["ingest", str(folder), "--collection", collection, "--url", gw.url, "--api-key", gw.api_key]
    return CliRunner().invoke(app, [*args, *options], env=WIDE)


def said(result) -> str:
    """The command's output on one line, however rich wrapped it."""
    return " ".join(result.output.split())


def http(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers=gw.auth(), timeout=120)


def ids(gw: Gateway, collection: str) -> list[str]:
    with http(gw) as h:
        response = h.get(f"/v1/collections/{collection}/documents", params={"limit": 1000})
    assert response.status_code == 200, response.text
    return [d["id"] for d in response.json()["data"]]


def text_of(gw: Gateway, collection: str, doc_id: str) -> str:
    with http(gw) as h:
        response = h.get(f"/v1/collections/{collection}/documents/{doc_id}", params={"level": 2})
    assert response.status_code == 200, response.text
    return response.json()["text"]


def found(gw: Gateway, collection: str, query: str) -> set[str]:
    with http(gw) as h:
        response = h.post(f"/v1/collections/{collection}/search", json={"query": query, "top_k": 20})
    assert response.status_code == 200, response.text
    return {hit["document_id"] for hit in response.json()["data"]}


def folder_with(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


# ---- 1. documents of files no longer in the folder ---------------------------------------------------
def test_a_rerun_lists_documents_of_removed_files_and_prune_deletes_only_those(gw: Gateway, tmp_path: Path):
    folder = folder_with(
        tmp_path / "docs",
        {
            "vacation.md": "Employees get 27 vacation days a year.",
            "sub/canteen.txt": "The canteen opens at noon.",
            "parking.txt": "Zeppelin parking is behind building four.",
        },
    )
    first = ingest(gw, folder, "prune")
    assert first.exit_code == 0, said(first)
    with http(gw) as h:  # documents sent as JSON: never the CLI's to delete
        sent = h.post(
            "/v1/collections/prune/documents",
            json={
                "documents": [
                    {"id": "policy", "text": "Zeppelin policy: no airships on the roof."},
                    {"id": "faq.md", "text": "Zeppelin questions, answered through the API."},
                ]
            },
        )
        assert sent.status_code == 200, sent.text
    (folder / "parking.txt").unlink()  # deleted
    (folder / "vacation.md").rename(folder / "leave.md")  # renamed

    kept = ingest(gw, folder, "prune")  # without --prune: nothing looked up, nothing deleted
    assert kept.exit_code == 0, said(kept)
    assert "pruned" not in said(kept), said(kept)
    assert ids(gw, "prune") == [
        "faq.md",
        "leave.md",
        "parking.txt",
        "policy",
        "sub/canteen.txt",
        "vacation.md",
    ]

    pruned = ingest(gw, folder, "prune", "--prune")
    output = said(pruned)
    assert pruned.exit_code == 0, output  # the old code: exit 2, no such option
    assert "pruned parking.txt" in output and "pruned vacation.md" in output
    assert "0 created, 0 updated, 2 unchanged (0 chunks written); 0 failed; 2 pruned" in output
    assert ids(gw, "prune") == ["faq.md", "leave.md", "policy", "sub/canteen.txt"]
    assert "parking.txt" not in found(gw, "prune", "zeppelin parking")  # no longer searchable
    assert {"policy", "faq.md"} <= found(gw, "prune", "zeppelin")

    again = ingest(gw, folder, "prune", "--prune")  # nothing left to prune: said as 0
    assert again.exit_code == 0 and "; 0 pruned" in said(again), said(again)


def test_prune_deletes_nothing_when_a_file_failed(gw: Gateway, tmp_path: Path):
    folder = folder_with(tmp_path, {"a.txt": "Alpha notes.", "b.txt": "Beta notes."})
    assert ingest(gw, folder, "prunefail").exit_code == 0
    (folder / "b.txt").unlink()
    (folder / "b.pdf").write_bytes(b"%PDF-1.4 not a pdf")  # b's new form, which the gateway cannot read
    result = ingest(gw, folder, "prunefail", "--prune")
    output = said(result)
    assert result.exit_code == 1, output
    assert "✗ b.pdf:" in output and "nothing pruned: not every file was ingested" in output
    assert "1 failed; 0 pruned" in output
    assert ids(gw, "prunefail") == ["a.txt", "b.txt"]  # nothing lost while b's new form is not in


def test_prune_deletes_nothing_when_a_file_was_not_sent(gw: Gateway, tmp_path: Path):
    folder = folder_with(tmp_path, {"a.txt": "Alpha notes.", "b.txt": "Beta notes."})
    assert ingest(gw, folder, "prunebig").exit_code == 0
    (folder / "b.txt").unlink()
    (folder / "b_long.md").write_text("Beta notes. " * (UPLOAD_LIMIT // 8))  # too large to send (413)
    result = ingest(gw, folder, "prunebig", "--prune")
    output = said(result)
    assert result.exit_code == 1, output
    assert "HTTP 413" in output and "nothing pruned" in output and "1 not ingested; 0 pruned" in output
    assert ids(gw, "prunebig") == ["a.txt", "b.txt"]


def test_prune_needs_a_folder(gw: Gateway, tmp_path: Path):
    (tmp_path / "a.txt").write_text("Alpha notes.")
    result = ingest(gw, tmp_path / "a.txt", "prunefile", "--prune")
    assert result.exit_code == 2, said(result)
    assert "--prune needs a folder" in said(result)


# ---- 2. a bad collection name ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Hand Book", "[/x]", "-lead", "x" * 65])
def test_a_bad_collection_name_is_refused_before_anything_is_sent(gw: Gateway, tmp_path: Path, name: str):
    (tmp_path / "a.txt").write_text("Alpha notes.")
    result = ingest(gw, tmp_path, name)
    output = said(result)
    assert result.exit_code == 2, output  # the old code: exit 1 after sending, "Rerun the same command"
    assert f"invalid collection name {name!r}" in output  # the gateway's own words, markup and all
    assert "1-64 characters of a-z, 0-9, '_' and '-', starting with a letter or digit" in output
    assert "Nothing was read or sent" in output and "Rerun" not in output
    with http(gw) as h:
        listed = h.get("/v1/collections").json()["data"]
    assert name not in {c.get("name") for c in listed}


# ---- 3. text files that are not UTF-8 ----------------------------------------------------------------
WINDOWS_TEXT = "Café menu – naïve “quotes”, 5 €"  # the dash, quotes and euro sign are cp1252-only bytes


def test_a_windows_1252_file_is_named_with_advice_then_ingested_with_encoding(gw: Gateway, tmp_path: Path):
    (tmp_path / "menu.txt").write_bytes(WINDOWS_TEXT.encode("cp1252"))
    (tmp_path / "page.html").write_bytes(f"<title>Menü</title><p>{WINDOWS_TEXT}</p>".encode("cp1252"))
    (tmp_path / "greeting.md").write_text("Grüße aus Köln", encoding="utf-8")  # a UTF-8 file beside them
    (tmp_path / "wide.txt").write_bytes("\ufeffZürich in UTF-16".encode("utf-16-le"))  # with its mark

    plain = ingest(gw, tmp_path, "windows")
    output = said(plain)
    assert plain.exit_code == 1, output
    assert "✗ menu.txt: not valid UTF-8 text (byte 0xe9 at offset 3)" in output
    assert "name it with --encoding (e.g. --encoding cp1252" in output  # the old code: no advice
    assert "✗ page.html: not valid UTF-8 text" in output
    assert "2 created" in output and "2 failed" in output  # the others went in
    assert ids(gw, "windows") == ["greeting.md", "wide.txt"]

    decoded = ingest(gw, tmp_path, "windows", "--encoding", "cp1252")
    output = said(decoded)
    assert decoded.exit_code == 0, output  # the old code: exit 2, no such option
    assert "2 created, 0 updated, 2 unchanged" in output
    assert text_of(gw, "windows", "menu.txt") == WINDOWS_TEXT
    assert WINDOWS_TEXT in text_of(gw, "windows", "page.html")
    assert text_of(gw, "windows", "greeting.md") == "Grüße aus Köln"  # read as UTF-8, not as cp1252
    assert text_of(gw, "windows", "wide.txt") == "Zürich in UTF-16"


def test_other_encodings_and_a_file_that_is_not_in_the_one_named(gw: Gateway, tmp_path: Path):
    (tmp_path / "tokyo.txt").write_bytes("東京は日本の首都です。".encode("shift_jis"))
    (tmp_path / "latin.txt").write_bytes("Ça coûte 10 £".encode("latin-1"))
    result = ingest(gw, tmp_path, "sjis", "--encoding", "shift_jis")
    output = said(result)
    assert result.exit_code == 1, output
    # "Ç" (0xc7) is a half-width katakana in Shift-JIS; "û" (0xfb) is no Shift-JIS byte at all
    assert "✗ latin.txt: neither UTF-8 nor shift_jis text (byte 0xfb at offset 5)" in output
    assert "name the file's encoding with --encoding" in output and "1 created" in output
    assert text_of(gw, "sjis", "tokyo.txt") == "東京は日本の首都です。"

    latin = ingest(gw, tmp_path / "latin.txt", "sjis", "--encoding", "latin-1")  # one file, its own encoding
    assert latin.exit_code == 0, said(latin)
    assert text_of(gw, "sjis", "latin.txt") == "Ça coûte 10 £"


def test_an_unknown_encoding_is_refused_before_anything_is_sent(gw: Gateway, tmp_path: Path):
    (tmp_path / "a.txt").write_text("Alpha notes.")
    for name in ("klingon", "base64"):  # base64 is a codec, but not a text encoding
        result = ingest(gw, tmp_path, "unknownenc", "--encoding", name)
        assert result.exit_code == 2, said(result)
        assert f"--encoding '{name}' is not a text encoding Python knows" in said(result)
    with http(gw) as h:
        assert h.get("/v1/collections/unknownenc").status_code == 404


def _post_only_proxy(gateway_url: str):
    """A reverse proxy that passes the documents POST (ingest) and answers anything else 405, like
    a proxy in front of the gateway that allows only uploads."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.fakes.server import serve_in_thread

    async def forward(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=120) as client:
            answer = await client.post(
                gateway_url + request.url.path, content=await request.body(), headers=headers
            )
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    return serve_in_thread(
        Starlette(routes=[Route("/v1/collections/{name}/documents", forward, methods=["POST"])])
    )


def test_prune_that_cannot_list_the_collection_deletes_nothing_and_says_so(gw: Gateway, tmp_path: Path):
    folder = folder_with(tmp_path, {"a.txt": "Alpha notes.", "b.txt": "Beta notes."})
    assert ingest(gw, folder, "pruneproxy").exit_code == 0
    (folder / "b.txt").unlink()
    proxy = _post_only_proxy(gw.url)
    try:
        args = ["ingest", str(folder), "-c", "pruneproxy", "--url", proxy.url, "--api-key", gw.api_key]
        listed = CliRunner().invoke(app, args, env=WIDE)
        pruned = CliRunner().invoke(app, [*args, "--prune"], env=WIDE)
    finally:
        proxy.stop()
    assert listed.exit_code == 0, said(listed)  # without --prune the collection is not listed at all
    assert pruned.exit_code == 1, said(pruned)  # asked to prune and could not: said, and the status says so
    assert "nothing pruned: listing" in said(pruned) and "HTTP 405" in said(pruned)
    assert "1 unchanged (0 chunks written); 0 failed; 0 pruned" in said(pruned)
    assert ids(gw, "pruneproxy") == ["a.txt", "b.txt"]
