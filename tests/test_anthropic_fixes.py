"""POST /v1/messages: fixes for defects an audit proved with the real `anthropic` SDK.

Each test drives the gateway with the SDK (or httpx where the SDK would refuse the body) against the
test upstream, and reads what the worker was sent: a tool_result without output, `is_error`, base64
and URL documents as OpenAI `file` parts, Files-API sources refused, `disable_parallel_tool_use`, and
cached-token counts on streams. Through litellm's Anthropic provider too, where it matters.
"""

from __future__ import annotations

import base64
from decimal import Decimal

import anthropic
import httpx
import pytest

from gateway.anthropic import ERROR_PREFIX, NO_OUTPUT, MessagesRequest, translate
from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import WorkerClient
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, ledger_record, start_gateway

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_USE = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}
PDF = base64.b64encode(b"%PDF-1.4\n%minimal\n").decode()
PDF_SOURCE = {"type": "base64", "media_type": "application/pdf", "data": PDF}
PDF_URL = "https://example.com/report.pdf"
CLAUDE_WORKER = """
  - name: claude
    model: anthropic/claude-fake
    api_base: {url}
    api_key_env: {key_env}
    context_window: 200000
    input_price_per_m: 3.00
    output_price_per_m: 15.00
    tier: frontier
    license: proprietary
    provider: anthropic
    jurisdiction: US
    capabilities: [general, tools]
"""


def client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0)


def after_tool_use(result: dict) -> list[dict]:
    """A conversation whose last user turn answers a tool_use with `result`."""
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [result]},
    ]


def tool_message(sent: dict) -> dict:
    [message] = [m for m in sent["messages"] if m["role"] == "tool"]
    return message


@pytest.fixture(scope="module")
def cgw(upstream, tmp_path_factory):
    """The test catalog plus a worker called through litellm's Anthropic provider (Anthropic's wire)."""
    yaml_text = catalog_yaml_for(upstream.url) + CLAUDE_WORKER.format(url=upstream.url, key_env=FAKE_KEY_ENV)
    gw = start_gateway(parse_catalog(yaml_text), tmp_path_factory.mktemp("anthropic-fixes"))
    yield gw
    gw.server.stop()


# ---- 1. a tool_result without output, and is_error -----------------------------------------------
@pytest.mark.parametrize(
    "content",
    [{}, {"content": ""}, {"content": "  \n"}, {"content": []}, {"content": [{"type": "text", "text": ""}]}],
    ids=["omitted", "empty string", "blank string", "empty list", "empty text block"],
)
def test_a_tool_result_without_output_reaches_the_worker_as_a_placeholder(cgw, upstream, content):
    upstream.behave("cheap-model", text="noted")
    result = {"type": "tool_result", "tool_use_id": "toolu_01", **content}
    message = client(cgw).messages.create(
        model="cheap", max_tokens=20, tools=[WEATHER_TOOL], messages=after_tool_use(result)
    )
    assert message.content[0].text == "noted"
    [sent] = upstream.requests_for("cheap-model")
    assert tool_message(sent) == {"role": "tool", "tool_call_id": "toolu_01", "content": NO_OUTPUT}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("city not found", ERROR_PREFIX + "city not found"),
        (None, ERROR_PREFIX + NO_OUTPUT),
        (
            [{"type": "text", "text": "timeout"}, {"type": "text", "text": "after 30 s"}],
            [{"type": "text", "text": ERROR_PREFIX + "timeout"}, {"type": "text", "text": "after 30 s"}],
        ),
    ],
    ids=["text", "no output", "blocks"],
)
def test_a_failed_tool_result_says_so_to_the_worker(cgw, upstream, content, expected):
    upstream.behave("cheap-model", text="sorry")
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True}
    if content is not None:
        result["content"] = content
    client(cgw).messages.create(
        model="cheap", max_tokens=20, tools=[WEATHER_TOOL], messages=after_tool_use(result)
    )
    [sent] = upstream.requests_for("cheap-model")
    assert tool_message(sent)["content"] == expected


def test_an_anthropic_worker_gets_the_placeholder_as_its_tool_result(cgw, upstream):
    upstream.behave("claude-fake", text="noted")
    result = {"type": "tool_result", "tool_use_id": "toolu_01"}
    message = client(cgw).messages.create(
        model="claude", max_tokens=20, tools=[WEATHER_TOOL], messages=after_tool_use(result)
    )
    assert message.content[0].text == "noted"
    [sent] = upstream.requests_for("claude-fake")
    [block] = [b for b in sent["messages"][-1]["content"] if b["type"] == "tool_result"]
    content = block["content"]
    assert (content if isinstance(content, str) else content[0]["text"]) == NO_OUTPUT


# ---- 2. base64 and URL documents go as files -------------------------------------------------------
@pytest.mark.parametrize(
    ("document", "part"),
    [
        (
            {"type": "document", "source": PDF_SOURCE},
            {
                "type": "file",
                "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "document.pdf"},
            },
        ),
        (
            {"type": "document", "source": PDF_SOURCE, "title": "q3.pdf"},
            {
                "type": "file",
                "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "q3.pdf"},
            },
        ),
    ],
    ids=["base64", "base64 with a title"],
)
def test_a_pdf_document_reaches_an_openai_wire_worker_as_a_file_part(cgw, upstream, document, part):
    upstream.behave("cheap-model", text="a summary")
    content = [document, {"type": "text", "text": "Summarise it"}]
    client(cgw).messages.create(model="cheap", max_tokens=20, messages=[{"role": "user", "content": content}])
    [sent] = upstream.requests_for("cheap-model")
    parts = sent["messages"][-1]["content"]
    assert part in parts and parts[-1] == {"type": "text", "text": "Summarise it"}
    assert not [p for p in parts if p["type"] == "image_url"]


def test_a_document_s_context_and_one_inside_a_tool_result_reach_the_worker(cgw, upstream):
    upstream.behave("cheap-model", text="read")
    document = {"type": "document", "source": PDF_SOURCE, "title": "q3.pdf", "context": "Quarterly report"}
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": [document]}
    client(cgw).messages.create(
        model="cheap", max_tokens=20, tools=[WEATHER_TOOL], messages=after_tool_use(result)
    )
    [sent] = upstream.requests_for("cheap-model")
    file = {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "q3.pdf"}
    assert tool_message(sent)["content"] == [
        {"type": "text", "text": "q3.pdf\n\nQuarterly report"},
        {"type": "file", "file": file},
    ]


def test_a_url_document_is_a_file_part_by_url():
    """litellm's form, as its Responses bridge writes an input_file's file_url: the URL as file_id. For
    an OpenAI-wire worker litellm then fetches it (its URL policy applies) and sends it inline, since
    OpenAI's chat wire takes no file URL; loopback tests cannot fetch it, so the form is read here."""
    document = {"type": "document", "source": {"type": "url", "url": PDF_URL}}
    body = MessagesRequest.model_validate(
        {"model": "cheap", "max_tokens": 20, "messages": [{"role": "user", "content": [document]}]}
    )
    chat, _, _ = translate(body)
    assert chat["messages"] == [{"role": "user", "content": [{"type": "file", "file": {"file_id": PDF_URL}}]}]


@pytest.mark.parametrize("source", [PDF_SOURCE, {"type": "url", "url": PDF_URL}], ids=["base64", "url"])
def test_an_anthropic_worker_gets_the_pdf_back_as_a_document(cgw, upstream, source):
    upstream.behave("claude-fake", text="a summary")
    content = [{"type": "document", "source": source}, {"type": "text", "text": "Summarise it"}]
    client(cgw).messages.create(
        model="claude", max_tokens=20, messages=[{"role": "user", "content": content}]
    )
    [sent] = upstream.requests_for("claude-fake")
    [document] = [b for b in sent["messages"][-1]["content"] if b["type"] == "document"]
    assert document["source"] == source


def test_count_tokens_takes_a_pdf_document(cgw, upstream):
    content = [{"type": "document", "source": PDF_SOURCE}, {"type": "text", "text": "Summarise it"}]
    counted = client(cgw).messages.count_tokens(
        model="cheap", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens > 0
    assert not upstream.requests


# ---- 3. a source no worker can be sent is refused, not dropped ------------------------------------
FILE_SOURCE = {"type": "file", "file_id": "file_011abc"}


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (
            [{"type": "image", "source": FILE_SOURCE}, {"type": "text", "text": "Describe it"}],
            "messages.0.content.0.source",
        ),
        (
            [{"type": "text", "text": "Describe it"}, {"type": "document", "source": FILE_SOURCE}],
            "messages.0.content.1.source",
        ),
        ([{"type": "image", "source": FILE_SOURCE}], "messages.0.content.0.source"),
        (
            [
                {"type": "text", "text": "see"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "content": [{"type": "image", "source": FILE_SOURCE}],
                },
            ],
            "messages.0.content.1.content.0.source",
        ),
        (
            [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png"}},
                {"type": "text", "text": "?"},
            ],
            "messages.0.content.0.source",
        ),
        (
            [{"type": "image", "source": {"type": "text", "data": "x"}}, {"type": "text", "text": "?"}],
            "messages.0.content.0.source",
        ),
    ],
    ids=["image", "document", "the only block", "inside a tool_result", "base64 without data", "text image"],
)
def test_an_attachment_no_worker_can_be_sent_is_a_400(cgw, upstream, content, param):
    body = {"model": "cheap", "messages": [{"role": "user", "content": content}]}
    for path, extra in (("/v1/messages", {"max_tokens": 20}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(cgw.url + path, headers=cgw.auth(), json={**body, **extra})
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["polyroute"]["param"] == param and param in error["error"]["message"]
    assert not upstream.requests


def test_the_sdk_sees_a_files_api_source_refused(cgw, upstream):
    content = [{"type": "document", "source": FILE_SOURCE}, {"type": "text", "text": "Summarise it"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(cgw).messages.create(
            model="auto", max_tokens=20, messages=[{"role": "user", "content": content}]
        )
    assert "Files API" in caught.value.body["error"]["message"]
    assert not upstream.requests


# ---- 5. disable_parallel_tool_use ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ({"type": "auto", "disable_parallel_tool_use": True}, False),
        ({"type": "any", "disable_parallel_tool_use": True}, False),
        ({"type": "auto", "disable_parallel_tool_use": False}, None),
        ({"type": "auto"}, None),
    ],
    ids=["auto, disabled", "any, disabled", "auto, not disabled", "auto"],
)
def test_disable_parallel_tool_use_reaches_an_openai_wire_worker(cgw, upstream, choice, parallel):
    upstream.behave("cheap-model", text="ok")
    raw = client(cgw).messages.with_raw_response.create(
        model="cheap",
        max_tokens=20,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
    )
    [sent] = upstream.requests_for("cheap-model")
    assert sent.get("parallel_tool_calls") is parallel
    assert "disable_parallel_tool_use" not in (raw.headers.get("x-polyroute-ignored") or "")


def test_disable_parallel_tool_use_is_not_sent_without_tools(cgw, upstream):
    upstream.behave("cheap-model", text="ok")
    client(cgw).messages.create(
        model="cheap",
        max_tokens=20,
        tool_choice={"type": "none", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Hi"}],
    )
    [sent] = upstream.requests_for("cheap-model")
    assert "parallel_tool_calls" not in sent


def test_disable_parallel_tool_use_reaches_an_anthropic_worker(cgw, upstream):
    upstream.behave("claude-fake", text="ok")
    client(cgw).messages.create(
        model="claude",
        max_tokens=20,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
    )
    [sent] = upstream.requests_for("claude-fake")
    assert sent["tool_choice"].get("disable_parallel_tool_use") is True


# ---- 6. cached tokens on streams ---------------------------------------------------------------------
def test_a_stream_reports_cached_input_as_the_plain_answer_does(cgw, upstream):
    upstream.behave("cheap-model", text="hi there", prompt_tokens=100, completion_tokens=3, cached_tokens=40)
    body = {"model": "cheap", "max_tokens": 20, "messages": [{"role": "user", "content": "Hello"}]}
    raw = client(cgw).messages.with_raw_response.create(**body)
    plain = raw.parse()
    assert (plain.usage.input_tokens, plain.usage.cache_read_input_tokens) == (60, 40)
    with client(cgw).messages.stream(**body) as stream:
        final = stream.get_final_message()
        streamed_id = stream.response.headers["x-polyroute-request-id"]
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (60, 40)
    assert final.usage.output_tokens == plain.usage.output_tokens == 3
    # billing is the worker's totals either way: 100 prompt tokens (cached ones included) and 3 out
    plain_record = ledger_record(cgw, raw.headers["x-polyroute-request-id"])
    streamed_record = ledger_record(cgw, streamed_id)
    for record in (plain_record, streamed_record):
        assert (record["prompt_tokens"], record["completion_tokens"]) == (100, 3)
    assert streamed_record["cost_micros"] == plain_record["cost_micros"]
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == Decimal(
        "0.0000106"
    )  # 100 * $0.10/1M + 3 * $0.20/1M


def test_a_chat_completions_stream_keeps_openai_s_usage_details(cgw, upstream):
    upstream.behave(
        "cheap-model",
        text="hi",
        prompt_tokens=100,
        completion_tokens=30,
        cached_tokens=40,
        reasoning_tokens=20,
    )
    body = {"model": "cheap", "messages": [{"role": "user", "content": "Hello"}]}
    plain = httpx.post(cgw.v1 + "/chat/completions", headers=cgw.auth(), json=body).json()
    chunks = []
    with httpx.stream(
        "POST",
        cgw.v1 + "/chat/completions",
        headers=cgw.auth(),
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 40} == plain["usage"]["prompt_tokens_details"]
    assert (
        usage["completion_tokens_details"]
        == {"reasoning_tokens": 20}
        == plain["usage"]["completion_tokens_details"]
    )
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (100, 30)


@pytest.mark.anyio
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast path", "litellm.acompletion"])
async def test_a_stream_s_usage_chunk_keeps_the_details_on_either_worker_path(
    upstream, monkeypatch, fast_path
):
    """The same worker output gives the same usage chunk whichever way the worker is called; litellm's
    made-up details (text_tokens, zeros, None) are not passed on."""
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")
    worker = parse_catalog(catalog_yaml_for(upstream.url), "fixes").workers[0]  # cheap: openai/cheap-model
    calls = WorkerClient(Metrics(), retries=0, fast_path=fast_path)
    request = ChatCompletionRequest(
        model="cheap", messages=[{"role": "user", "content": "Hello"}], stream=True
    )
    try:
        upstream.behave("cheap-model", text="one two", prompt_tokens=10, completion_tokens=4, cached_tokens=6)
        stream = await calls.open_stream(worker, worker.api_base, request)
        [usage] = [chunk["usage"] async for chunk in stream if chunk.get("usage")]
        assert usage == {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 6},
        }
        assert (stream.prompt_tokens, stream.completion_tokens) == (10, 4)  # billed as before
        upstream.behave("cheap-model", text="one two", prompt_tokens=10, completion_tokens=4)
        stream = await calls.open_stream(worker, worker.api_base, request)
        [usage] = [chunk["usage"] async for chunk in stream if chunk.get("usage")]
        assert usage == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    finally:
        await calls.aclose()
