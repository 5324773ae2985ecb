"""Two Messages features litellm's adapter does not carry, through the real `anthropic` SDK:

- stop_sequences: the answer ends before the first sequence the worker writes and says which
  (stop_reason "stop_sequence", stop_sequence), plain and streamed, as Anthropic does. The gateway
  applies them (gateway/stop_sequences.py): the test upstream, like OpenAI, would otherwise cut the
  text and say only finish_reason "stop".
- document blocks whose source is plain text: their text reaches the worker and the data-class
  detection (a PII document keeps the request off the workers the policy excludes).
"""

from __future__ import annotations

import anthropic
import httpx
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway

POLICY = {
    "version": "stops-docs",
    "rules": [{"id": "pii-eu-only", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU"]}],
}
ASK = [{"role": "user", "content": "What is the answer?"}]
ANSWER = "The answer is 42. END and then more text the worker wrote on"
WEATHER_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def sgw(upstream, tmp_path_factory):
    """Policy: PII to EU workers only (of the test catalog, cheap is FR, mid CN, pricey US)."""
    data_dir = tmp_path_factory.mktemp("stops-docs-gw")
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        data_dir,
        policy_file=policy_file,
        messages_stop_sequences="gateway",  # Anthropic's semantics exactly; "forward" is tested below
    )
    yield gw
    gw.server.stop()


def client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=120)


# ---- stop sequences ----------------------------------------------------------------------------------
def test_the_test_upstream_honours_stop_as_openai_does(sgw, upstream):
    """Why the gateway applies them: a worker that honours `stop` cuts the text and says only "stop"."""
    upstream.behave("cheap-model", text=ANSWER)
    response = httpx.post(
        sgw.v1 + "/chat/completions",
        headers=sgw.auth(),
        json={"model": "cheap", "messages": ASK, "stop": ["END"]},
        timeout=60,
    )
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "The answer is 42. " and choice["finish_reason"] == "stop"
    assert upstream.requests_for("cheap-model")[0]["stop"] == ["END"]


def test_plain_message_stops_on_a_sequence_and_names_it(sgw, upstream):
    upstream.behave("cheap-model", text=ANSWER)
    message = client(sgw).messages.create(
        model="cheap", max_tokens=64, messages=ASK, stop_sequences=["never", "END", "then"]
    )
    assert message.content[0].text == "The answer is 42. "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    # kept by the gateway: the worker wrote on, and was billed for what it wrote
    assert "stop" not in upstream.requests_for("cheap-model")[0]
    assert message.usage.output_tokens == len(ANSWER.split())


def test_no_sequence_in_the_text_is_end_turn(sgw, upstream):
    upstream.behave("cheap-model", text="nothing to stop here")
    for stream in (False, True):
        if stream:
            with client(sgw).messages.stream(
                model="cheap", max_tokens=64, messages=ASK, stop_sequences=["END"]
            ) as events:
                message = events.get_final_message()
        else:
            message = client(sgw).messages.create(
                model="cheap", max_tokens=64, messages=ASK, stop_sequences=["END"]
            )
        assert message.content[0].text == "nothing to stop here"
        assert message.stop_reason == "end_turn" and message.stop_sequence is None


@pytest.mark.parametrize(
    ("sequence", "text"),
    [
        ("END", "The answer is 42. "),
        ("is 42", "The answer "),
        ("The", ""),
        ("more text the w", ANSWER[: ANSWER.index("more")]),
    ],
    ids=["in one chunk", "across chunks", "at the start", "across several chunks"],
)
def test_streamed_message_stops_on_a_sequence_and_names_it(sgw, upstream, sequence, text):
    upstream.behave("cheap-model", text=ANSWER, prompt_tokens=5)
    with client(sgw).messages.stream(
        model="cheap", max_tokens=64, messages=ASK, stop_sequences=[sequence]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-polyroute-request-id"]
    streamed = "".join(
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert streamed == text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == sequence
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == sequence
    assert events[-1].type == "message_stop"
    # the usage is the worker's, for all it wrote; the ledger bills that
    assert final.usage.output_tokens == len(ANSWER.split())
    record = ledger_record(sgw, request_id)
    assert record["status"] == 200 and record["completion_tokens"] == len(ANSWER.split())


def test_a_stop_sequence_before_a_tool_call_ends_the_answer_there(sgw, upstream):
    tool = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    upstream.behave("cheap-model", tool_call=tool, preamble="Let me check. STOP then call it")
    sdk = client(sgw)
    kwargs = {"model": "cheap", "max_tokens": 64, "messages": ASK, "tools": [WEATHER_TOOL]}
    plain = sdk.messages.create(**kwargs, stop_sequences=["STOP"])
    with sdk.messages.stream(**kwargs, stop_sequences=["STOP"]) as stream:
        streamed = stream.get_final_message()
    for message in (plain, streamed):
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == "Let me check. "
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    without = sdk.messages.create(**kwargs)  # the control: the same answer, no stop sequence
    assert [b.type for b in without.content] == ["text", "tool_use"] and without.stop_reason == "tool_use"


def test_pii_in_a_stop_sequence_is_still_classified(sgw, upstream):
    """Kept by the gateway rather than sent, a stop sequence is still part of the request's data class."""
    with pytest.raises(anthropic.PermissionDeniedError):
        client(sgw).messages.create(
            model="mid", max_tokens=16, messages=ASK, stop_sequences=["jane.doe@example.com"]
        )
    assert not upstream.requests


# ---- plain-text documents ------------------------------------------------------------------------------
def text_document(data: str, **extra) -> dict:
    return {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": data}, **extra}


def user_parts(sent: dict) -> list[str]:
    content = sent["messages"][-1]["content"]
    return [p["text"] for p in content] if isinstance(content, list) else [content]


def test_a_plain_text_document_reaches_the_worker(sgw, upstream):
    upstream.behave("cheap-model", text="summarised")
    document = text_document("Quarterly revenue rose by 12 percent.", title="Q3 report", context="internal")
    message = client(sgw).messages.create(
        model="cheap",
        max_tokens=32,
        messages=[{"role": "user", "content": [document, {"type": "text", "text": "Summarise it."}]}],
    )
    assert message.content[0].text == "summarised"
    parts = user_parts(upstream.requests_for("cheap-model")[0])
    assert parts == ["Q3 report\n\ninternal\n\nQuarterly revenue rose by 12 percent.", "Summarise it."]


def test_inline_content_documents_and_documents_in_tool_results_reach_the_worker(sgw, upstream):
    upstream.behave("cheap-model", text="ok")
    inline = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "first page"}]},
    }
    messages = [
        {"role": "user", "content": [inline, {"type": "text", "text": "look this up"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "fetch", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text_document("fetched text")]}
            ],
        },
    ]
    client(sgw).messages.create(model="cheap", max_tokens=16, messages=messages)
    sent = upstream.requests_for("cheap-model")[0]["messages"]
    assert sent[0]["content"][0] == {"type": "text", "text": "first page"}
    tool = [m for m in sent if m["role"] == "tool"][0]
    assert "fetched text" in str(tool["content"])


def test_a_pii_plain_text_document_stays_off_excluded_workers(sgw, upstream):
    """As tests/test_every_endpoint.py checks for other inputs: with the one admissible worker (cheap, FR)
    failing, the request must not fall back to mid (CN) or pricey (US); pinned to mid, it is refused."""
    upstream.behave("cheap-model", status=500)
    for model in ("mid", "pricey"):
        upstream.behave(f"{model}-model", text="would answer")
    content = [
        text_document("Invoice for jane.doe@example.com, due Friday."),
        {"type": "text", "text": "Sum up"},
    ]
    body = {"model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    headers = {"x-api-key": sgw.api_key, "anthropic-version": "2023-06-01"}
    response = httpx.post(sgw.url + "/v1/messages", headers=headers, json=body, timeout=60)
    assert response.status_code == 502, response.text
    assert response.headers["x-polyroute-data-class"] == "pii"
    assert response.json()["type"] == "error"
    assert upstream.requests_for("cheap-model")
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")

    pinned = httpx.post(sgw.url + "/v1/messages", headers=headers, json={**body, "model": "mid"}, timeout=60)
    assert pinned.status_code == 403 and pinned.json()["error"]["type"] == "permission_error"
    assert not upstream.requests_for("mid-model")


def test_count_tokens_counts_a_plain_text_document(sgw):
    headers = {"x-api-key": sgw.api_key, "anthropic-version": "2023-06-01"}

    def count(content) -> int:
        body = {"model": "cheap", "messages": [{"role": "user", "content": content}]}
        response = httpx.post(sgw.url + "/v1/messages/count_tokens", headers=headers, json=body, timeout=60)
        return response.json()["input_tokens"]

    ask = {"type": "text", "text": "Summarise it."}
    assert count([text_document("word " * 200), ask]) > count([ask]) + 150


# ---- the default mode: forwarded to the worker --------------------------------------------------------
@pytest.fixture(scope="module")
def fgw(upstream, tmp_path_factory):
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path_factory.mktemp("stops-fwd"))
    assert gw.state.settings.messages_stop_sequences == "forward"
    yield gw
    gw.server.stop()


def test_forwarded_sequences_stop_the_worker_and_nothing_past_them_is_billed(fgw, upstream):
    """The worker honours `stop`: it writes (and bills) only up to the sequence; OpenAI's wire cannot
    say a sequence stopped it, so the answer reads end_turn."""
    upstream.behave("cheap-model", text=ANSWER)
    message = client(fgw).messages.create(model="cheap", max_tokens=64, messages=ASK, stop_sequences=["END"])
    assert upstream.requests_for("cheap-model")[0]["stop"] == ["END"]
    assert message.content[0].text == "The answer is 42. "
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == len("The answer is 42. ".split())


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_that_ignores_forwarded_sequences_is_cut_by_the_gateway(fgw, upstream, stream):
    upstream.behave("cheap-model", text=ANSWER, ignore_stop=True)
    sdk = client(fgw)
    if stream:
        with sdk.messages.stream(
            model="cheap", max_tokens=64, messages=ASK, stop_sequences=["END"]
        ) as events:
            message = events.get_final_message()
    else:
        message = sdk.messages.create(model="cheap", max_tokens=64, messages=ASK, stop_sequences=["END"])
    assert upstream.requests_for("cheap-model")[0]["stop"] == ["END"]
    assert message.content[0].text == "The answer is 42. "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
