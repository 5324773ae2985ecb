"""Booleans are strict, as OpenAI's are: "yes", "true", 1 are refused with a 400 naming the
parameter, not read as true (a client that sends "false" as a string would otherwise stream)."""

from __future__ import annotations

import pytest

from tests.test_bad_input import GOOD, assert_openai_error, post


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": "true"}, "stream"),
        ({"stream": "false"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream": 0}, "stream"),
        ({"logprobs": "true"}, "logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_a_non_boolean_is_refused(gateway, upstream, extra, param):
    error = assert_openai_error(post(gateway, json={**GOOD, **extra}), 400, "invalid_value")
    assert error["param"] == param
    assert "valid boolean" in error["message"]
    assert not upstream.requests


@pytest.mark.parametrize("extra", [{"stream": False}, {"logprobs": False}, {"parallel_tool_calls": True}])
def test_real_booleans_are_accepted(gateway, upstream, extra):
    response = post(gateway, json={**GOOD, **extra})
    assert response.status_code == 200, response.text
