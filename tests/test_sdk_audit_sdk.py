"""The SDK as a newcomer meets it when something goes wrong (tests/test_sdk_audit_*):

- a gateway that is not running, or a connection a proxy cuts mid-stream, is a
  PolyrouteConnectionError (a PolyrouteError naming the URL and whether a retry is safe), not a
  bare httpx error, sync and async alike;
- an error answer that is not the gateway's own JSON (a proxy's `{"error": "Bad Gateway"}`,
  `{"message": ...}`, a JSON list, an HTML page) is a PolyrouteError with the proxy's words, not an
  AttributeError or a message of a whole HTML page;
- an error event in a stream carries the stream's request id, sync and async;
- a stream the caller stops reading (or never reads) can be closed, and the gateway sees the hang-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route as StarletteRoute

from polyroute import AsyncClient, Client, PolyrouteError
from polyroute.client import PolyrouteConnectionError
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.fakes.server import serve_in_thread

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def sgw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("sdk_audit"),
        retrieval_embedder="minilm-static",  # the README's snippet adds documents and searches
    )
    yield gw
    gw.server.stop()


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A loopback URL where nothing listens: the port is bound (so no one else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


# ---------------------------------------------------------------- the gateway is not there
def test_a_gateway_that_is_down_is_a_clear_polyroute_error(refused_url: str):
    with Client(refused_url, api_key="k") as client:
        with pytest.raises(PolyrouteConnectionError) as caught:
            client.models()
        with pytest.raises(PolyrouteConnectionError) as streamed:
            client.chat(MESSAGES, stream=True)
    error = caught.value
    assert isinstance(error, PolyrouteError) and error.status == 0 and error.code == "connection_error"
    assert error.sent is False and error.base_url == refused_url
    assert refused_url in str(error) and "retrying is safe" in str(error)
    assert "GET /v1/models" in str(error)
    assert streamed.value.sent is False


@pytest.mark.anyio
async def test_a_gateway_that_is_down_is_the_same_error_for_the_async_client(refused_url: str):
    async with AsyncClient(refused_url, api_key="k") as client:
        with pytest.raises(PolyrouteConnectionError) as caught:
            await client.models()
        with pytest.raises(PolyrouteConnectionError) as streamed:
            async for _ in client.chat_stream(MESSAGES):
                pass
    assert caught.value.sent is False and refused_url in str(caught.value)
    assert streamed.value.sent is False and "POST /v1/chat/completions" in str(streamed.value)


# ---------------------------------------------------------------- a proxy in front of the gateway
def _refusing_proxy(gateway_url: str):
    """A reverse proxy whose backend is unreachable, answering as various proxies do, by path; and
    one that passes a stream's first line through and then drops the connection."""

    def fixed(response: Response):
        async def answer(request: Request) -> Response:
            return response

        return answer

    async def cut_stream(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}

        async def first_line_then_drop():
            async with (
                httpx.AsyncClient(timeout=60) as http,
                http.stream(
                    "POST", gateway_url + "/v1/chat/completions", content=body, headers=headers
                ) as up,
            ):
                async for line in up.aiter_lines():
                    if line.startswith("data:"):
                        yield (line + "\n\n").encode()
                        break
            raise RuntimeError("the proxy's backend connection dropped")  # the server cuts the body

        return StreamingResponse(first_line_then_drop(), media_type="text/event-stream")

    async def garbled_stream(request: Request) -> Response:
        """A 200 event stream whose event is a proxy's HTML page, not the gateway's JSON."""
        return Response(
            b"data: <html><body>502 Bad Gateway</body></html>\n\n", media_type="text/event-stream"
        )

    routes = {
        "/a/v1/models": fixed(JSONResponse({"error": "Bad Gateway"}, status_code=502)),
        "/b/v1/models": fixed(JSONResponse({"message": "Internal server error"}, status_code=500)),
        "/c/v1/models": fixed(JSONResponse(["upstream", "down"], status_code=503)),
        "/d/v1/models": fixed(
            HTMLResponse("<html><body>" + "<p>502 Bad Gateway</p>" * 200 + "</body></html>", status_code=502)
        ),
        "/e/v1/models": fixed(JSONResponse({"detail": "backend unavailable"}, status_code=503)),
    }
    return serve_in_thread(
        Starlette(
            routes=[StarletteRoute(path, handler) for path, handler in routes.items()]
            + [StarletteRoute("/cut/v1/chat/completions", cut_stream, methods=["POST"])]
            + [StarletteRoute("/garbled/v1/chat/completions", garbled_stream, methods=["POST"])]
        )
    )


@pytest.fixture(scope="module")
def proxy(sgw: Gateway):
    running = _refusing_proxy(sgw.url)
    yield running.url
    running.stop()


@pytest.mark.parametrize(
    ("prefix", "status", "words"),
    [
        ("a", 502, "Bad Gateway"),
        ("b", 500, "Internal server error"),
        ("c", 503, "upstream"),
        ("d", 502, "502 Bad Gateway"),
        ("e", 503, "backend unavailable"),
    ],
)
def test_an_error_answer_that_is_not_the_gateways_keeps_its_words(proxy: str, prefix, status, words):
    with Client(f"{proxy}/{prefix}", api_key="k") as client:
        with pytest.raises(PolyrouteError) as caught:
            client.models()
    assert caught.value.status == status
    assert words in caught.value.message
    assert len(caught.value.message) < 500  # an HTML page is quoted, not pasted whole


@pytest.mark.anyio
async def test_the_async_client_reads_a_proxys_error_the_same_way(proxy: str):
    async with AsyncClient(f"{proxy}/a", api_key="k") as client:
        with pytest.raises(PolyrouteError) as caught:
            await client.models()
    assert caught.value.status == 502 and caught.value.message == "Bad Gateway"


def test_a_stream_cut_by_a_proxy_is_a_connection_error(proxy: str, sgw: Gateway, upstream):
    upstream.behave("cheap-model", text=" ".join(f"w{i}" for i in range(50)))
    with Client(f"{proxy}/cut", api_key=sgw.api_key) as client:
        stream = client.chat(MESSAGES, stream=True)
        with pytest.raises(PolyrouteConnectionError) as caught:
            for _ in stream:
                pass
    assert caught.value.sent is True and "may still finish" in str(caught.value)


def test_an_event_that_is_not_json_is_a_polyroute_error(proxy: str):
    with Client(f"{proxy}/garbled", api_key="k") as client:
        stream = client.chat(MESSAGES, stream=True)
        with pytest.raises(PolyrouteError) as caught:
            stream.text()
    assert caught.value.code == "invalid_stream_event" and "502 Bad Gateway" in caught.value.message


# ---------------------------------------------------------------- errors inside a stream
def test_a_deadline_passing_mid_stream_is_a_504_as_the_ledger_says(upstream, tmp_path):
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"), tmp_path, request_timeout_s=3
    )
    try:
        _long_stream(upstream)  # far longer than the 3 s deadline
        with Client(gw.url, api_key=gw.api_key) as client:
            stream = client.chat(MESSAGES, stream=True)
            with pytest.raises(PolyrouteError) as caught:
                stream.text()
        assert caught.value.status == 504 and caught.value.code == "request_timeout"
        assert ledger_record(gw, stream.route.request_id)["status"] == 504
    finally:
        gw.server.stop()


def test_an_error_event_in_a_stream_carries_the_request_id(sgw: Gateway, upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=2)
    with Client(sgw.url, api_key=sgw.api_key) as client:
        stream = client.chat(MESSAGES, stream=True)
        with pytest.raises(PolyrouteError) as caught:
            stream.text()
    assert caught.value.code == "upstream_stream_error"
    assert caught.value.request_id == stream.route.request_id and stream.route.request_id.startswith("req_")
    assert stream.closed


@pytest.mark.anyio
async def test_an_error_event_in_an_async_stream_carries_the_request_id(sgw: Gateway, upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=2)
    routes = []
    async with AsyncClient(sgw.url, api_key=sgw.api_key) as client:
        with pytest.raises(PolyrouteError) as caught:
            async for _, route in client.chat_stream(MESSAGES):
                routes.append(route)
    assert routes and caught.value.code == "upstream_stream_error"
    assert caught.value.request_id == routes[0].request_id


# ---------------------------------------------------------------- a stream the caller leaves
def _long_stream(upstream) -> None:
    """An answer that takes far longer to stream than any test waits, so only a hang-up ends it early."""
    upstream.behave("cheap-model", text=" ".join(f"w{i}" for i in range(2000)), chunk_delay_s=0.05)


def test_a_stream_left_after_one_chunk_is_closed_and_the_gateway_sees_the_hang_up(sgw: Gateway, upstream):
    _long_stream(upstream)
    with Client(sgw.url, api_key=sgw.api_key) as client:
        with client.chat(MESSAGES, stream=True) as stream:
            for chunk in stream:
                assert chunk["choices"]
                break
        assert stream.closed
        assert client.models()  # the client still works after the hang-up
    assert ledger_record(sgw, stream.route.request_id)["status"] == 499


def test_a_stream_never_read_can_be_closed(sgw: Gateway, upstream):
    _long_stream(upstream)
    with Client(sgw.url, api_key=sgw.api_key) as client:
        stream = client.chat(MESSAGES, stream=True)
        assert stream.route.worker == "cheap" and not stream.closed
        stream.close()
        assert stream.closed
    assert ledger_record(sgw, stream.route.request_id)["status"] == 499


@pytest.mark.anyio
async def test_an_async_stream_left_early_hangs_up(sgw: Gateway, upstream):
    _long_stream(upstream)
    async with AsyncClient(sgw.url, api_key=sgw.api_key) as client:
        chunks = client.chat_stream(MESSAGES)
        request_id = None
        async for _, route in chunks:
            request_id = route.request_id
            break
        await chunks.aclose()
    record = await asyncio.to_thread(ledger_record, sgw, request_id)
    assert record["status"] == 499


# ---------------------------------------------------------------- newcomers' slips
@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_a_base_url_copied_from_an_openai_client_says_what_to_give(sgw: Gateway, suffix: str):
    with Client(sgw.url + suffix, api_key=sgw.api_key) as client:
        with pytest.raises(PolyrouteError) as caught:
            client.chat(MESSAGES)
    assert caught.value.status == 404
    assert (
        "base URL ends in /v1" in caught.value.message and "the SDK adds /v1 itself" in caught.value.message
    )


@pytest.mark.anyio
async def test_the_async_client_gives_the_same_hint(sgw: Gateway):
    async with AsyncClient(sgw.url + "/v1", api_key=sgw.api_key) as client:
        with pytest.raises(PolyrouteError, match="base URL ends in /v1"):
            async for _ in client.chat_stream(MESSAGES):
                pass


def test_a_streams_text_can_be_asked_for_again_and_a_second_read_is_refused_clearly(sgw: Gateway, upstream):
    upstream.behave("cheap-model", text="said once only")
    with Client(sgw.url, api_key=sgw.api_key) as client:
        stream = client.chat(MESSAGES, stream=True)
        assert stream.text() == "said once only"
        assert stream.text() == "said once only"  # the stream has ended: its text, not a second read
        with pytest.raises(RuntimeError, match="read already"):
            list(stream)


# ---------------------------------------------------------------- the README's snippet, as written
def readme_sdk_snippet() -> str:
    """The README's `from polyroute import Client` example, exactly as a newcomer copies it."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (snippet,) = [block for block in blocks if "from polyroute import Client" in block]
    return snippet


def test_the_readmes_sdk_snippet_runs_as_written(sgw: Gateway, upstream, monkeypatch):
    snippet = readme_sdk_snippet()
    assert 'Client("http://127.0.0.1:8400")' in snippet
    monkeypatch.setenv("POLYROUTE_API_KEY", sgw.api_key)  # "key from $POLYROUTE_API_KEY"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet.replace("http://127.0.0.1:8400", sgw.url), "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("Hello from the test upstream. cheap ")  # text, worker, cost, reason
    assert lines[1] == "cheap"  # the stream's worker, before its first token
    assert lines[2].startswith("Hello from the test upstream. {'prompt_tokens'")  # text, usage, cost
    assert lines[3].startswith("answered at level") or lines[3].startswith("accepted at level")
    assert "'document_id': 'vacation'" in lines[4]  # the search found the document just added


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_a_missing_key_says_where_the_client_looks_for_one(
    sgw: Gateway, monkeypatch, client_class: type[Client] | type[AsyncClient]
):
    monkeypatch.delenv("POLYROUTE_API_KEY", raising=False)
    monkeypatch.delenv("POLYROUTE_ADMIN_KEY", raising=False)
    client = client_class(sgw.url)

    async def call(method, *args):
        result = method(*args)
        return await result if asyncio.iscoroutine(result) else result

    with pytest.raises(PolyrouteError, match="pass api_key= or set POLYROUTE_API_KEY") as caught:
        asyncio.run(call(client.models))
    assert caught.value.status == 401
    with pytest.raises(PolyrouteError, match="pass admin_key= or set POLYROUTE_ADMIN_KEY"):
        asyncio.run(call(client.create_key, "acme"))
    asyncio.run(call(getattr(client, "aclose", None) or client.close))
