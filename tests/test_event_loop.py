"""CPU-heavy request work stays off the event loop (issue 12, item 3).

A large body's JSON parsing and pydantic validation run in the heavy-work threads
(gateway/body.py), so one tenant's megabytes do not stall everyone else's requests; a small body is
still parsed in place (cheaper than a thread hop). How much this buys under load is measured by
bench/noisy_neighbour.py; here we check where the work runs and that nothing changes for the client.
"""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.requests import Request

from gateway.body import LARGE_BODY_BYTES, read_model
from gateway.errors import APIError
from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway

pytestmark = pytest.mark.anyio

_seen: list[threading.Thread] = []


class Probe(BaseModel):
    """A request model that notes which thread validates it."""

    model_config = ConfigDict(extra="forbid")

    text: str

    @field_validator("text")
    @classmethod
    def _where(cls, value: str) -> str:
        _seen.append(threading.current_thread())
        return value


def _request(body: bytes) -> Request:
    """A real Starlette request whose body arrives in 64 KiB chunks, as from a socket."""
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]

    async def receive() -> dict:
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", str(len(body)).encode())],
        "query_string": b"",
    }
    return Request(scope, receive)


async def test_a_large_body_is_parsed_and_validated_off_the_event_loop():
    loop_thread = threading.current_thread()
    small = orjson.dumps({"text": "4111 1111 1111 1111"})
    large = orjson.dumps({"text": "4111 1111 1111 1111 " * (LARGE_BODY_BYTES // 10)})
    _seen.clear()
    assert (await read_model(_request(small), Probe, 8 << 20)).text == "4111 1111 1111 1111"
    assert len((await read_model(_request(large), Probe, 8 << 20)).text) > LARGE_BODY_BYTES
    assert _seen[0] is loop_thread  # small: in place
    assert _seen[1] is not loop_thread and _seen[1].name.startswith("polyroute-heavy")


async def test_errors_in_a_large_body_are_still_openai_errors():
    pad = "x" * (2 * LARGE_BODY_BYTES)
    with pytest.raises(APIError) as bad_json:
        await read_model(_request(b'{"text": "' + pad.encode()), Probe, 8 << 20)
    assert bad_json.value.status == 400 and bad_json.value.code == "invalid_json"
    with pytest.raises(APIError) as extra:
        await read_model(_request(orjson.dumps({"text": "hi", "pad": pad})), Probe, 8 << 20)
    assert extra.value.status == 400 and extra.value.param == "pad"
    with pytest.raises(APIError) as too_big:
        await read_model(_request(orjson.dumps({"text": pad})), Probe, LARGE_BODY_BYTES)
    assert too_big.value.status == 413


def test_a_large_request_is_classified_like_a_small_one(upstream, tmp_path):
    """Detection moved off the loop for large requests: it still sees everything."""
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "data")
    try:
        filler = "for i in range(10): total += i * 3\n" * (4 * LARGE_BODY_BYTES // 35)  # 256 KiB of code

        def ask(content: str) -> httpx.Response:
            body = {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 5}
            return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60)

        for content in ("mail me at jo@example.com", "what is a monad?"):
            small, large = ask(content), ask(filler + content)
            assert small.status_code == large.status_code == 200, large.text
            assert small.headers["x-polyroute-data-class"] == large.headers["x-polyroute-data-class"]
    finally:
        gw.server.stop()
