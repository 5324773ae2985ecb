"""`stream_options` without `stream: true`, through the official `openai` SDK: refused with a 400
naming it, as OpenAI refuses it, not ignored (the client asked for a usage chunk a plain answer
never has)."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("model", ["auto", "cheap"])
def test_stream_options_without_stream_is_refused(sdk, upstream, model):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MESSAGES, stream_options={"include_usage": True})
    error = info.value.body
    assert error["param"] == "stream_options"
    assert "only allowed when stream is true" in error["message"]
    assert not upstream.requests  # refused before any worker


def test_stream_options_with_stream_still_brings_the_usage_chunk(sdk, upstream):
    chunks = list(
        sdk.chat.completions.create(
            model="cheap", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
