"""Responses API parameters through the official `openai` SDK: each one honoured, refused with a 400
naming it, or named in `x-polyroute-ignored` — never dropped without a word.

`text` was taken as any object and handed to litellm's bridge, which reads only a format it knows:
`text.verbosity` (GPT-5 clients send it), a misspelt key or an unknown format type were dropped and
the worker answered in free text; a json_schema format without its schema reached the worker as an
empty schema. An `input_file` part given by `file_id` (OpenAI's Files API, which polyroute has not)
reached an OpenAI-wire worker as a file id it cannot open and an Anthropic worker as a
`container_upload` block, where an `input_image` by `file_id` was already a 400.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import (
    Gateway,
    gateway_with,
)
from tests.fakes.upstream import FakeUpstream
from tests.test_params_audit_unsupported import CLAUDE  # the same Anthropic worker

# the model name each worker's calls reach the test upstream under
UPSTREAM_MODEL = {"cheap": "cheap-model", "claude": "claude-fake"}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(up, tmp_path_factory.mktemp("params_dialects_responses"), CLAUDE) as gateway:
        yield gateway


@pytest.fixture
def sdk(gw: Gateway, up: FakeUpstream) -> openai.OpenAI:
    up.reset()
    up.behave("claude-fake")  # Anthropic's wire on the test upstream answers only models set up
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=120)


def _nothing_sent(up: FakeUpstream) -> None:
    assert not up.requests, "a refused request reached a worker"


@pytest.mark.parametrize("worker", ["cheap", "claude"])
def test_verbosity_is_named_as_ignored_and_the_format_still_sent(
    sdk: openai.OpenAI, up: FakeUpstream, worker: str
) -> None:
    raw = sdk.responses.with_raw_response.create(
        model=worker,
        input="Where?",
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA}, "verbosity": "low"},
    )
    response = raw.parse()
    assert raw.headers["x-polyroute-ignored"] == "text.verbosity"
    assert response.text.verbosity == "low"  # echoed as sent, as OpenAI does
    assert response.text.format.type == "json_schema"
    (sent,) = up.requests_for(UPSTREAM_MODEL[worker])
    if worker == "cheap":  # OpenAI's wire: response_format with the schema
        assert sent["response_format"]["json_schema"]["schema"] == SCHEMA
    else:  # Anthropic's wire: litellm forces a tool whose input is the schema
        assert sent["tools"][0]["input_schema"] == SCHEMA
    assert "verbosity" not in str(sent)


def test_a_format_without_verbosity_names_nothing(sdk: openai.OpenAI, up: FakeUpstream) -> None:
    raw = sdk.responses.with_raw_response.create(
        model="cheap", input="Where?", text={"format": {"type": "json_object"}}
    )
    assert raw.headers.get("x-polyroute-ignored") is None
    assert raw.parse().text.format.type == "json_object"
    assert up.requests_for("cheap-model")[0]["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("text", "param", "words"),
    [
        ({"format": {"type": "yaml"}}, "text.format.type", "json_schema"),
        ({"fmt": {"type": "json_object"}}, "text.fmt", "Unrecognized request argument"),
        ({"format": {"type": "json_schema", "name": "place"}}, "text.format", "needs schema"),
        ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format", "needs name"),
        ({"verbosity": "terse"}, "text.verbosity", "low"),
    ],
)
def test_a_text_the_workers_cannot_be_sent_is_a_400_naming_it(
    sdk: openai.OpenAI, up: FakeUpstream, text: dict, param: str, words: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="auto", input="Where?", text=text, stream=stream)  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert words in error["message"], error
    _nothing_sent(up)


@pytest.mark.parametrize("worker", ["cheap", "claude"])
@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "input_file", "file_id": "file-abc123"}, "file_id is not supported"),
        ({"type": "input_file", "filename": "a.pdf"}, "needs file_data"),
    ],
)
def test_an_input_file_no_worker_can_open_is_a_400(
    sdk: openai.OpenAI, up: FakeUpstream, worker: str, part: dict, words: str
) -> None:
    item = {"role": "user", "content": [{"type": "input_text", "text": "Summarise it."}, part]}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=worker, input=[item])  # type: ignore[list-item]
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "input.0.content.1", error
    assert words in error["message"], error
    _nothing_sent(up)


def test_an_input_file_with_its_data_still_reaches_the_worker(sdk: openai.OpenAI, up: FakeUpstream) -> None:
    data = "data:application/pdf;base64,JVBERi0xLjQK"
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Summarise it."},
            {"type": "input_file", "filename": "a.pdf", "file_data": data},
        ],
    }
    sdk.responses.create(model="cheap", input=[item])  # type: ignore[list-item]
    (sent,) = up.requests_for("cheap-model")
    parts = sent["messages"][-1]["content"]
    assert {"type": "file", "file": {"file_data": data, "filename": "a.pdf"}} in parts
