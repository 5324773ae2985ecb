"""A request larger than its key's tokens per minute is a 429 `request_too_large` that no wait can
help (docs/replicas.md): the official SDKs, which retry a 429 twice by default, are told not to
(`x-should-retry: false`) and raise at once, on chat and on Messages. They sent it three times."""

from __future__ import annotations

import anthropic
import openai
import pytest


def counting(sdk, sent: list[str]):
    """The SDK's own HTTP client, noting every request it sends (its retries included)."""
    return sdk.DefaultHttpxClient(event_hooks={"request": [lambda request: sent.append(request.url.path)]})


def test_openai_sdk_does_not_retry_a_request_too_large_for_the_tpm(gateway):
    _, key = gateway.state.auth.store.create("acme", "100 tokens a minute", tpm=100)
    sent: list[str] = []
    sdk = openai.OpenAI(base_url=gateway.v1, api_key=key, max_retries=2, http_client=counting(openai, sent))
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(
            model="cheap", max_tokens=500, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.code == "request_too_large"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert sent == ["/v1/chat/completions"]  # once, not three times


def test_anthropic_sdk_does_not_retry_a_request_too_large_for_the_tpm(gateway):
    _, key = gateway.state.auth.store.create("acme", "100 tokens a minute", tpm=100)
    sent: list[str] = []
    sdk = anthropic.Anthropic(
        base_url=gateway.url, api_key=key, max_retries=2, http_client=counting(anthropic, sent)
    )
    with pytest.raises(anthropic.RateLimitError) as caught:
        sdk.messages.create(model="cheap", max_tokens=500, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["polyroute"]["code"] == "request_too_large"
    assert sent == ["/v1/messages"]
