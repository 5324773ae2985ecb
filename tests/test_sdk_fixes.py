"""The SDK and `polyroute ingest` against a real gateway (the test upstream behind it):

- `polyroute ingest` behind a proxy that refuses a batch (nginx's HTML 413, a load balancer's 502)
  fails with the status, the proxy's words and the files not ingested; what went in stays in and a
  rerun ingests the rest;
- the SDK's default timeout outlasts the gateway's request deadline, and a timeout is a
  PolyrouteTimeout (a PolyrouteError) that warns the gateway may still finish and bill the call;
- the SDK calls DESIGN.md promises (feedback, collections, documents, sessions), sync and async,
  against the server's own routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route as StarletteRoute
from typer.testing import CliRunner

from gateway import Settings
from gateway.collections import retriever
from polyroute import AsyncClient, Client, PolyrouteError, PolyrouteTimeout
from polyroute.cli import app as cli
from polyroute.client import DEFAULT_TIMEOUT_S, GATEWAY_REQUEST_TIMEOUT_S
from retrieval import DocumentInput
from retrieval.store import session_collection
from tests.conftest import Gateway, catalog_yaml_for, start_gateway
from tests.fakes.server import serve_in_thread

NGINX_413 = (
    "<html><head><title>413 Request Entity Too Large</title></head><body><center><h1>413 Request "
    "Entity Too Large</h1></center><hr><center>nginx</center></body></html>"
)


@pytest.fixture(scope="module")
def sgw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("sdk"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=60,
        retrieval_chunk_overlap=10,
    )
    yield gw
    gw.server.stop()


# ---------------------------------------------------------------- polyroute ingest behind a proxy
def _proxy(gateway_url: str, refuse: str):
    """A reverse proxy in front of the gateway. refuse="413": like nginx's default
    client_max_body_size (1 MB), an HTML 413 for a larger body; refuse="502": passes the first
    request, then an HTML 502 like a load balancer whose backend went away."""
    seen = []

    async def forward(request: Request) -> Response:
        body = await request.body()
        seen.append(len(body))
        if refuse == "413" and len(body) > 1024 * 1024:
            return HTMLResponse(NGINX_413, status_code=413)
        if refuse == "502" and len(seen) > 1:
            return HTMLResponse("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502)
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=120) as http:
            answer = await http.post(gateway_url + request.url.path, content=body, headers=headers)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    return serve_in_thread(
        Starlette(routes=[StarletteRoute("/v1/collections/{name}/documents", forward, methods=["POST"])])
    )


@pytest.mark.parametrize("refuse", ["413", "502"])
def test_ingest_refused_by_a_proxy_fails_names_the_files_and_a_rerun_finishes(
    sgw: Gateway, tmp_path: Path, refuse: str
):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(32):  # the first batch: 32 small files
        (folder / f"a{i:02}.txt").write_text(f"Note {i}: the canteen opens at {i % 12 + 1} o'clock.")
    (folder / "z_handbook.md").write_text("# Handbook\n\n" + "Employees get 27 vacation days. " * 50_000)
    collection = f"proxied{refuse}"
    proxy = _proxy(sgw.url, refuse)
    try:
        args = ["ingest", str(folder), "--collection", collection, "--api-key", sgw.api_key]
        result = CliRunner().invoke(cli, [*args, "--url", proxy.url])
    finally:
        proxy.stop()
    output = " ".join(result.output.split())  # as one line: rich wraps at the terminal's width
    assert result.exit_code == 1, output  # the old code: exit 0, "0 failed"
    assert f"HTTP {refuse}" in output and "batch 2 of 2" in output
    assert ("Request Entity Too Large" if refuse == "413" else "Bad Gateway") in output
    assert "32 created" in output and "1 not ingested" in output
    assert "z_handbook.md" in output.split("not ingested:")[-1]
    with httpx.Client(base_url=sgw.url, headers=sgw.auth(), timeout=60) as http:
        page = http.get(f"/v1/collections/{collection}/documents", params={"limit": 100}).json()
    assert len(page["data"]) == 32  # what went in before the refusal stays in
    rerun = CliRunner().invoke(cli, [*args, "--url", sgw.url])  # straight to the gateway
    assert rerun.exit_code == 0, rerun.output
    assert "1 created" in " ".join(rerun.output.split()) and "32 unchanged" in " ".join(rerun.output.split())


def test_ingest_fails_on_an_answer_that_is_not_the_gateways(sgw: Gateway, tmp_path: Path):
    """A 200 HTML page (a login portal in front of the gateway) is not an ingest answer."""

    async def portal(request: Request) -> Response:
        await request.body()
        return HTMLResponse("<html><body>Please sign in</body></html>")

    (tmp_path / "a.txt").write_text("Alpha.")
    proxy = serve_in_thread(
        Starlette(routes=[StarletteRoute("/v1/collections/{name}/documents", portal, methods=["POST"])])
    )
    try:
        result = CliRunner().invoke(
            cli, ["ingest", str(tmp_path), "-c", "portal", "--url", proxy.url, "--api-key", "k"]
        )
    finally:
        proxy.stop()
    output = " ".join(result.output.split())
    assert result.exit_code == 1, output
    assert "HTTP 200" in output and "Please sign in" in output and "a.txt" in output


# ---------------------------------------------------------------- timeouts
def test_the_sdk_default_timeout_outlasts_the_gateway_deadline():
    """The SDK repeats the gateway's default deadline (it imports no server code): they agree, and
    the SDK waits longer, so the gateway's answer (or its own 504) reaches the client."""
    assert GATEWAY_REQUEST_TIMEOUT_S == Settings.model_fields["request_timeout_s"].default
    assert GATEWAY_REQUEST_TIMEOUT_S == Settings().request_timeout_s
    assert DEFAULT_TIMEOUT_S > GATEWAY_REQUEST_TIMEOUT_S
    with Client("http://127.0.0.1:1", api_key="k") as client:
        assert client._http.timeout.read == DEFAULT_TIMEOUT_S  # the old default: 120 s
    assert AsyncClient("http://127.0.0.1:1", api_key="k")._http.timeout.read == DEFAULT_TIMEOUT_S


def _check_timeout(error: PolyrouteTimeout) -> None:
    assert isinstance(error, PolyrouteError)
    assert error.sent is True and error.status == 0 and error.code == "client_timeout"
    assert "may still finish this request and bill it" in error.message
    assert "ledger" in error.message and error.started_at.tzinfo is not None


def test_a_timeout_is_a_polyroute_timeout_that_warns_of_billing(sgw: Gateway, upstream):
    """SDK timeout 1 s, worker answers after 30 s: the wait is the SDK's, whatever the load."""
    upstream.behave("cheap-model", latency_s=30, text="slow answer")
    with Client(sgw.url, api_key=sgw.api_key, timeout=1.0) as client:
        with pytest.raises(PolyrouteTimeout) as caught:  # the old code: a raw httpx.ReadTimeout
            client.chat([{"role": "user", "content": "please answer slowly"}], model="cheap")
        _check_timeout(caught.value)
        with pytest.raises(PolyrouteTimeout) as streamed:
            client.chat([{"role": "user", "content": "slowly, streamed"}], model="cheap", stream=True)
        _check_timeout(streamed.value)


@pytest.mark.anyio
async def test_an_async_timeout_is_a_polyroute_timeout(sgw: Gateway, upstream):
    upstream.behave("cheap-model", latency_s=30, text="slow answer")
    async with AsyncClient(sgw.url, api_key=sgw.api_key, timeout=1.0) as client:
        with pytest.raises(PolyrouteTimeout) as caught:
            await client.chat([{"role": "user", "content": "please answer slowly"}], model="cheap")
        _check_timeout(caught.value)
        with pytest.raises(PolyrouteTimeout) as streamed:
            async for _ in client.chat_stream([{"role": "user", "content": "streamed"}], model="cheap"):
                pass
        _check_timeout(streamed.value)


# ---------------------------------------------------------------- the calls DESIGN.md promises
DOCS = [
    {
        "id": "vacation",
        "title": "Vacation",
        "text": "Employees get 27 vacation days a year.",
        "metadata": {"n": 1},
    },
    {"id": "guides/parking lot?.md", "text": "Visitors park on level -2 of the garage."},
    {"id": "../escape", "text": "A document whose id has dot segments."},
]


def test_sdk_collections_and_documents(sgw: Gateway):
    with Client(sgw.url, api_key=sgw.api_key) as client:
        assert client.add_documents("sdkdocs", DOCS)["errors"] == []
        listed = {c["name"]: c for c in client.list_collections()}
        assert listed["sdkdocs"]["documents"] == 3
        assert client.get_collection("sdkdocs")["documents"] == 3
        first = client.list_documents("sdkdocs", limit=2)
        assert [d["id"] for d in first["data"]] == ["../escape", "guides/parking lot?.md"]
        assert first["has_more"] is True
        rest = client.list_documents("sdkdocs", limit=2, after=first["data"][-1]["id"])
        assert [d["id"] for d in rest["data"]] == ["vacation"] and rest["has_more"] is False
        full = client.get_document("sdkdocs", "vacation")
        assert full["text"] == DOCS[0]["text"] and full["metadata"] == {"n": 1} and full["level"] == 2
        assert client.get_document("sdkdocs", "vacation", level=0)["title"] == "Vacation"
        assert "27" in client.get_document("sdkdocs", "vacation", level=1, query="vacation days")["passage"]
        for doc_id in (
            "guides/parking lot?.md",
            "../escape",
        ):  # '/', '?', ' ' and '..' reach the server as sent
            assert client.get_document("sdkdocs", doc_id)["id"] == doc_id
            assert client.delete_document("sdkdocs", doc_id) == {
                "object": "document.deleted",
                "id": doc_id,
                "deleted": True,
            }
            with pytest.raises(PolyrouteError) as gone:
                client.get_document("sdkdocs", doc_id)
            assert gone.value.status == 404 and gone.value.code == "document_not_found"
        with pytest.raises(PolyrouteError) as again:
            client.delete_document("sdkdocs", "../escape")
        assert again.value.status == 404 and again.value.code == "document_not_found"
        assert client.delete_collection("sdkdocs")["deleted"] is True
        assert "sdkdocs" not in {c["name"] for c in client.list_collections()}
        with pytest.raises(PolyrouteError) as missing:
            client.get_collection("sdkdocs")
        assert missing.value.status == 404 and missing.value.code == "collection_not_found"


@pytest.mark.anyio
async def test_async_sdk_collections_and_documents(sgw: Gateway):
    async with AsyncClient(sgw.url, api_key=sgw.api_key) as client:
        assert (await client.add_documents("asyncdocs", DOCS))["errors"] == []
        assert "asyncdocs" in {c["name"] for c in await client.list_collections()}
        assert (await client.get_collection("asyncdocs"))["documents"] == 3
        page = await client.list_documents("asyncdocs", limit=3)
        assert len(page["data"]) == 3 and page["has_more"] is False
        assert (await client.get_document("asyncdocs", "guides/parking lot?.md"))["text"] == DOCS[1]["text"]
        assert (await client.search("asyncdocs", "vacation days", mode="bm25"))[0][
            "document_id"
        ] == "vacation"
        assert (await client.delete_document("asyncdocs", "vacation"))["deleted"] is True
        with pytest.raises(PolyrouteError) as gone:
            await client.get_document("asyncdocs", "vacation", level=0)
        assert gone.value.code == "document_not_found"
        assert (await client.add_documents("asyncdocs", [], delete=["../escape"]))["deleted"] == ["../escape"]
        assert (await client.delete_collection("asyncdocs"))["deleted"] is True
        assert len(await client.models()) > 1


def test_sdk_feedback(sgw: Gateway):
    with Client(sgw.url, api_key=sgw.api_key) as client:
        result = client.chat([{"role": "user", "content": "Hello"}], model="cheap")
        request_id = result.route.request_id
        assert request_id
        assert client.feedback(request_id, thumbs="up") == {
            "request_id": request_id,
            "worker": "cheap",
            "score": 1.0,
        }
        assert client.feedback(request_id, score=0.25, comment="too short")["score"] == 0.25
        with pytest.raises(PolyrouteError) as unknown:
            client.feedback("req_unknown", score=1)
        assert unknown.value.status == 404 and unknown.value.code == "request_not_found"
        with pytest.raises(PolyrouteError) as both:
            client.feedback(request_id, score=1, thumbs="up")
        assert both.value.status == 400 and "exactly one" in both.value.message


@pytest.mark.anyio
async def test_async_sdk_feedback(sgw: Gateway):
    async with AsyncClient(sgw.url, api_key=sgw.api_key) as client:
        result = await client.chat([{"role": "user", "content": "Hello"}], model="cheap")
        answer = await client.feedback(result.route.request_id or "", thumbs="down")
        assert answer == {"request_id": result.route.request_id, "worker": "cheap", "score": 0.0}


def _stored_turn(gw: Gateway, session_id: str) -> None:
    """A stored turn of the session, written by the gateway's own Retriever as a chat turn's
    background write does (tests/test_memory.py covers the chat path)."""
    app = gw.server.server.config.app
    session = retriever(app).get("acme", session_collection(session_id), create=True, internal=True)
    session.ingest([DocumentInput("turn-1", "User: my locker is 4711. Assistant: noted.")])


@pytest.mark.parametrize("session_id", ["user-42", "team/alpha 7?", ".."])
def test_sdk_forget_session(sgw: Gateway, session_id: str):
    _stored_turn(sgw, session_id)
    with Client(sgw.url, api_key=sgw.api_key) as client:
        assert client.forget_session(session_id) == {"object": "session.deleted", "deleted": True}
        with pytest.raises(PolyrouteError) as again:
            client.forget_session(session_id)
        assert again.value.status == 404 and again.value.code == "session_not_found"


@pytest.mark.anyio
async def test_async_sdk_forget_session(sgw: Gateway):
    _stored_turn(sgw, "async-session")
    async with AsyncClient(sgw.url, api_key=sgw.api_key) as client:
        assert (await client.forget_session("async-session"))["deleted"] is True
        with pytest.raises(PolyrouteError) as again:
            await client.forget_session("async-session")
        assert again.value.code == "session_not_found"


def test_sdk_admin_calls_on_the_async_client(sgw: Gateway):
    import anyio

    async def run() -> None:
        async with AsyncClient(sgw.url, admin_key=sgw.admin_key) as admin:
            created = await admin.create_key("sdk-tenant", "async")
            assert created["tenant"] == "sdk-tenant" and created["key"]
            assert (await admin.revoke_key(created["id"]))["revoked_at"] is not None

    anyio.run(run)
