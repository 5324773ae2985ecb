"""Bad input: every case is a 4xx in the OpenAI error format, and nothing reaches a worker."""

from __future__ import annotations

import httpx
import pytest

GOOD = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}


def post(gateway, content: bytes | None = None, json=None, headers=None):
    headers = {**gateway.auth(), "content-type": "application/json", **(headers or {})}
    return httpx.post(gateway.v1 + "/chat/completions", content=content, json=json, headers=headers)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    assert response.headers["x-polyroute-request-id"].startswith("req_")
    return error


@pytest.mark.parametrize(
    ("body", "status", "code", "fragment"),
    [
        (b"{not json", 400, "invalid_json", "not valid JSON"),
        (b"", 400, "invalid_json", "empty"),
        (b"[1, 2]", 400, "invalid_json", "JSON object"),
        (b'"just a string"', 400, "invalid_json", "JSON object"),
    ],
)
def test_malformed_json(gateway, upstream, body, status, code, fragment):
    error = assert_openai_error(post(gateway, content=body), status, code)
    assert fragment in error["message"]
    assert not upstream.requests


@pytest.mark.parametrize(
    ("payload", "param", "fragment"),
    [
        ({"model": "auto"}, "messages", "Missing required parameter"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model", "Missing required parameter"),
        ({"model": "auto", "messages": []}, "messages", "at least 1"),
        ({"model": "auto", "messages": "hello"}, "messages", "valid list"),
        ({"model": 42, "messages": [{"role": "user", "content": "hi"}]}, "model", "valid string"),
        ({"model": "auto", "messages": [{"role": "user", "content": ""}]}, "messages.0", "empty content"),
        ({"model": "auto", "messages": [{"role": "user", "content": "   "}]}, "messages.0", "empty content"),
        ({"model": "auto", "messages": [{"role": "user"}]}, "messages.0", "needs content"),
        (
            {"model": "auto", "messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role",
            "Invalid value",
        ),
        ({**GOOD, "temperature": "hot"}, "temperature", "valid number"),
        ({**GOOD, "temperature": 7}, "temperature", "less than or equal to 2"),
        ({**GOOD, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({**GOOD, "stream": "yes please"}, "stream", "valid boolean"),
        ({**GOOD, "tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({**GOOD, "frobnicate": True}, "frobnicate", "Unrecognized request argument"),
    ],
)
def test_wrong_types_and_missing_fields(gateway, upstream, payload, param, fragment):
    error = assert_openai_error(post(gateway, json=payload), 400)
    assert error["param"] == param
    assert fragment in error["message"]
    assert not upstream.requests


def test_oversized_body_is_413(gateway, upstream):
    limit = gateway.state.settings.max_body_bytes
    payload = {"model": "auto", "messages": [{"role": "user", "content": "x" * (limit + 1)}]}
    assert_openai_error(post(gateway, json=payload), 413, "body_too_large")
    assert not upstream.requests


def test_oversized_chunked_body_without_length_is_413(gateway, upstream):
    limit = gateway.state.settings.max_body_bytes

    def chunks():
        yield b'{"model": "auto", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 1024 + 2):
            yield b"y" * 1024
        yield b'"}]}'

    response = httpx.post(
        gateway.v1 + "/chat/completions",
        content=chunks(),
        headers={**gateway.auth(), "content-type": "application/json"},
    )
    assert_openai_error(response, 413, "body_too_large")
    assert not upstream.requests


def test_unknown_model_is_404(gateway, upstream):
    error = assert_openai_error(post(gateway, json={**GOOD, "model": "gpt-17"}), 404, "model_not_found")
    assert error["param"] == "model" and "cheap" in error["message"]
    assert not upstream.requests


def test_unknown_route_is_openai_404(gateway):
    response = httpx.get(gateway.url + "/v1/nothing-here", headers=gateway.auth())
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_wrong_method_is_openai_405(gateway):
    response = httpx.get(gateway.v1 + "/chat/completions", headers=gateway.auth())
    assert response.status_code == 405
    assert "error" in response.json()


def test_valid_request_after_bad_ones_still_works(gateway, upstream):
    post(gateway, content=b"{broken")
    response = post(gateway, json=GOOD)
    assert response.status_code == 200
    assert len(upstream.requests) == 1
