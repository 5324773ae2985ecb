"""Messages API parameters through the official `anthropic` SDK: each one honoured, refused with a
400 naming it, or named in `x-polyroute-ignored` — never dropped without a word.

A `document` block's `citations: {"enabled": true}` asks for an answer with citation blocks. Neither
OpenAI's wire nor litellm's adapter carries the flag, so the document reached the worker (OpenAI-wire
or Anthropic) without it and the answer cited nothing, with no word to the client. It is now named
in `x-polyroute-ignored` as `citations`; the document's text is still sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.conftest import (
    Gateway,
    gateway_with,
)
from tests.fakes.upstream import FakeUpstream
from tests.test_params_dialects_responses import CLAUDE, UPSTREAM_MODEL

DOCUMENT = {
    "type": "document",
    "source": {"type": "text", "media_type": "text/plain", "data": "The sky is green on Tuesdays."},
    "citations": {"enabled": True},
}


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(up, tmp_path_factory.mktemp("params_dialects_messages"), CLAUDE) as gateway:
        yield gateway


@pytest.fixture
def sdk(gw: Gateway, up: FakeUpstream) -> anthropic.Anthropic:
    up.reset()
    up.behave("claude-fake")  # Anthropic's wire on the test upstream answers only models set up
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=120)


def _sent_text(request: dict) -> str:
    return str(request["messages"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("worker", ["cheap", "claude"])
def test_document_citations_are_named_as_ignored(
    sdk: anthropic.Anthropic, up: FakeUpstream, worker: str, stream: bool
) -> None:
    content = [DOCUMENT, {"type": "text", "text": "What colour is the sky on Tuesdays?"}]
    raw = sdk.messages.with_raw_response.create(
        model=worker,
        max_tokens=50,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        stream=stream,
    )
    assert raw.headers["x-polyroute-ignored"] == "citations"
    parsed = raw.parse()
    if stream:
        assert [event.type for event in parsed][-1] == "message_stop"  # type: ignore[union-attr]
    (sent,) = up.requests_for(UPSTREAM_MODEL[worker])
    assert "The sky is green on Tuesdays." in _sent_text(sent)  # the document itself still goes
    assert "citations" not in str(sent)


def test_citations_inside_a_tool_result_are_named_too(sdk: anthropic.Anthropic, up: FakeUpstream) -> None:
    messages = [
        {"role": "user", "content": "Read the page."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [DOCUMENT]}],
        },
    ]
    tools = [{"name": "read", "description": "reads the page", "input_schema": {"type": "object"}}]
    raw = sdk.messages.with_raw_response.create(
        model="cheap",
        max_tokens=50,
        messages=messages,
        tools=tools,  # type: ignore[arg-type]
    )
    assert raw.headers["x-polyroute-ignored"] == "citations"
    assert "The sky is green on Tuesdays." in _sent_text(up.requests_for("cheap-model")[0])


def test_a_document_without_citations_names_nothing(sdk: anthropic.Anthropic, up: FakeUpstream) -> None:
    plain = {k: v for k, v in DOCUMENT.items() if k != "citations"}
    content = [plain, {"type": "text", "text": "What colour is the sky on Tuesdays?"}]
    raw = sdk.messages.with_raw_response.create(
        model="cheap",
        max_tokens=50,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
    )
    assert raw.headers.get("x-polyroute-ignored") is None
    assert "The sky is green on Tuesdays." in _sent_text(up.requests_for("cheap-model")[0])
