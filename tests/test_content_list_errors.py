"""A wrong block deep in a content list is named where the client wrote it, on every API.

A message's `content` is a string or a list, and pydantic reports a wrong list against both members,
the string first. The generic 400 (gateway/body.py) said "Invalid value for messages.0.content.str:
Input should be a valid string" for a bad block deep in the list; only /v1/responses read through
the union. gateway/body.py's `validate` now does, for every endpoint.
"""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/chat/completions",
            {"model": "cheap", "messages": [{"role": "user", "content": [{"text": "a"}]}]},
            "messages.0.content.0.type",
        ),
        (
            "/messages",
            {
                "model": "cheap",
                "max_tokens": 50,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}],
            },
            "messages.0.content.1",
        ),
    ],
)
def test_a_bad_block_in_a_content_list_is_named_by_its_place(gateway, upstream, path, body, param):
    """pydantic reports a wrong list against both members of `str | list`, the string first: the 400
    said "Invalid value for messages.0.content.str: Input should be a valid string" (gateway/body.py
    now reads through the union, as the Responses endpoint did alone)."""
    r = httpx.post(gateway.v1 + path, headers=gateway.auth(), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json().get("error") or {}
    text = error.get("message", "")
    assert ".str" not in text and "valid string" not in text, text
    assert error.get("param", param).startswith(param) or param in text, r.text
    assert upstream.requests_for("cheap-model") == []
