"""POST /v1/messages and /v1/messages/count_tokens, driven by the real `anthropic` SDK, unchanged.

The gateway translates Anthropic Messages to the internal chat-completions form and back (litellm's
adapter); every request runs the chat-completions pipeline: keys, rate limits, policy, router,
budgets, ledger. The test upstream speaks OpenAI's wire, so what it received shows the translation.
"""

from __future__ import annotations

import json
from decimal import Decimal

import anthropic
import httpx
import litellm
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import budget_gateway, catalog_yaml_for, ledger_record, start_gateway, stream_and_hang_up

HELLO = [{"role": "user", "content": "Say hello in five words"}]
PII = [{"role": "user", "content": "Please e-mail the summary to jane.doe@example.com"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
POLICY = {
    "version": "anthropic",
    "rules": [{"id": "pii-eu-only", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU"]}],
}


def client(gw, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def agw(upstream, tmp_path_factory):
    """A gateway with a policy: PII may go to EU workers only (cheap is FR, mid CN, pricey US)."""
    data_dir = tmp_path_factory.mktemp("anthropic-gw")
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), data_dir, policy_file=policy_file)
    yield gw
    gw.server.stop()


# ---- plain -----------------------------------------------------------------------------------------
def test_plain_message_auto_routes_through_the_pipeline(agw, upstream):
    upstream.behave("cheap-model", text="hello there from cheap", prompt_tokens=1000, completion_tokens=500)
    raw = client(agw).messages.with_raw_response.create(model="auto", max_tokens=600, messages=HELLO)
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "hello there from cheap"
    assert message.model == "cheap"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 1000 and message.usage.output_tokens == 500
    request_id = raw.headers["x-polyroute-request-id"]
    assert message.id == "msg_" + request_id.removeprefix("req_")
    assert raw.headers["request-id"] == request_id
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert raw.headers["x-polyroute-strategy"] == "fast"
    assert raw.headers["x-polyroute-policy-version"].startswith("anthropic")
    # 1000 * $0.10/1M + 500 * $0.20/1M, from the catalog's prices
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == Decimal("0.0002")
    sent = upstream.requests_for("cheap-model")
    assert len(sent) == 1
    assert sent[0]["messages"] == HELLO and sent[0]["max_tokens"] == 600
    record = ledger_record(agw, request_id)
    assert record["worker"] == "cheap" and record["status"] == 200 and record["model"] == "auto"
    assert record["cost_micros"] == 200 and record["prompt_tokens"] == 1000
    assert record["data_class"] == "public"


def test_system_prompt_string_and_blocks(agw, upstream):
    upstream.behave("cheap-model", text="ok")
    sdk = client(agw)
    sdk.messages.create(model="auto", max_tokens=16, system="Answer in French.", messages=HELLO)
    sdk.messages.create(
        model="auto",
        max_tokens=16,
        system=[
            {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief."},
        ],
        messages=HELLO,
        stop_sequences=["END"],
        extra_body={"temperature": 0.2},  # gone from this SDK's signature; older clients send it
    )
    first, second = upstream.requests_for("cheap-model")
    assert first["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert first["messages"][1:] == HELLO
    system = second["messages"][0]
    assert system["role"] == "system"
    assert [p["text"] for p in system["content"]] == ["Answer in French.", "Be brief."]
    # stop_sequences are forwarded as `stop` by default (tests/test_anthropic_stop_documents.py)
    assert second["temperature"] == 0.2 and second["stop"] == ["END"]


def test_pinned_worker_and_alias_free_model_names(agw, upstream):
    raw = client(agw).messages.with_raw_response.create(model="pricey", max_tokens=16, messages=HELLO)
    assert raw.parse().model == "pricey"
    assert raw.headers["x-polyroute-worker"] == "pricey" and raw.headers["x-polyroute-strategy"] == "pinned"
    assert len(upstream.requests_for("pricey-model")) == 1 and not upstream.requests_for("cheap-model")


def test_stop_reason_max_tokens(agw, upstream):
    upstream.behave("cheap-model", text="cut short", finish_reason="length")
    message = client(agw).messages.create(model="auto", max_tokens=2, messages=HELLO)
    assert message.stop_reason == "max_tokens"
    with client(agw).messages.stream(model="auto", max_tokens=2, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == "cut short"


# ---- streaming -------------------------------------------------------------------------------------
def test_streaming_with_the_sdk_stream_helper(agw, upstream):
    upstream.behave("cheap-model", text="one two three four", prompt_tokens=10, completion_tokens=4)
    with client(agw).messages.stream(model="auto", max_tokens=32, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-polyroute-request-id"]
        assert stream.response.headers["x-polyroute-worker"] == "cheap"
    assert text == "one two three four"
    assert final.content[0].text == "one two three four"
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 4
    assert final.id == "msg_" + request_id.removeprefix("req_")
    # the gateway asked the worker for usage, which closes Anthropic's message_delta
    assert upstream.requests_for("cheap-model")[0]["stream_options"] == {"include_usage": True}
    record = ledger_record(agw, request_id)
    assert record["worker"] == "cheap" and record["status"] == 200 and record["cost_micros"] == 2


def test_streaming_event_sequence_with_create_stream_true(agw, upstream):
    upstream.behave("cheap-model", text="a b c", prompt_tokens=3, completion_tokens=3)
    events = list(client(agw).messages.create(model="auto", max_tokens=32, messages=HELLO, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "a b c"
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn"
    assert delta.usage.output_tokens == 3 and delta.usage.input_tokens == 3
    # what the answer cost rides on message_delta, as on chat completions' usage chunk
    assert delta.model_extra["polyroute"]["worker"] == "cheap"
    assert delta.model_extra["polyroute"]["usage"] == "reported"


def test_raw_sse_is_anthropics_wire(agw, upstream):
    upstream.behave("cheap-model", text="x y")
    with httpx.stream(
        "POST",
        agw.url + "/v1/messages",
        headers={"x-api-key": agw.api_key, "anthropic-version": "2023-06-01"},
        json={"model": "auto", "max_tokens": 8, "messages": HELLO, "stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    frames = [f for f in body.split("\n\n") if f.strip()]
    assert all(f.startswith("event: ") and "\ndata: " in f for f in frames)
    assert frames[-1].startswith("event: message_stop")
    assert "[DONE]" not in body


def test_mid_stream_failure_ends_with_an_error_event_and_is_billed(agw, upstream):
    upstream.behave("cheap-model", text="one two three four five", drop_after_chunks=2)
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client(agw).messages.stream(model="auto", max_tokens=32, messages=HELLO) as stream:
            request_id = stream.response.headers["x-polyroute-request-id"]
            for _ in stream.text_stream:
                pass
    assert "failed mid-stream" in str(caught.value)
    record = ledger_record(agw, request_id)
    assert record["status"] == 502 and record["trace"]["stream"] == "mid_stream_error"


# ---- tools -----------------------------------------------------------------------------------------
def test_tool_use_then_tool_result_turn(agw, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}'})
    sdk = client(agw)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.messages.create(
        model="auto", max_tokens=64, messages=asked, tools=[WEATHER_TOOL], tool_choice={"type": "any"}
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    sent = upstream.requests_for("cheap-model")[0]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]
    assert sent["tool_choice"] == "required"

    upstream.behave("cheap-model", text="It is sunny in Paris.")
    second = sdk.messages.create(
        model="auto",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=[
            *asked,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}],
            },
        ],
    )
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is sunny in Paris."
    turn = upstream.requests_for("cheap-model")[1]["messages"]
    assert turn[1]["role"] == "assistant"
    assert turn[1]["tool_calls"][0]["id"] == use.id
    assert json.loads(turn[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert turn[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny, 24 C"}


def test_streamed_tool_use(agw, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    with client(agw).messages.stream(
        model="auto", max_tokens=64, messages=HELLO, tools=[WEATHER_TOOL]
    ) as stream:
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert final.stop_reason == "tool_use"


# ---- count_tokens ----------------------------------------------------------------------------------
def test_count_tokens_auto_uses_the_default_counter(agw, upstream):
    raw = client(agw).messages.with_raw_response.count_tokens(
        model="auto", system="Be brief.", messages=HELLO, tools=[WEATHER_TOOL]
    )
    counted = raw.parse().input_tokens
    openai_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER_TOOL["description"],
            "parameters": WEATHER_TOOL["input_schema"],
        },
    }
    expected = litellm.token_counter(
        messages=[{"role": "system", "content": "Be brief."}, *HELLO], tools=[openai_tool]
    )
    assert counted == expected > 0
    assert raw.headers["x-polyroute-token-counter"].startswith("litellm default")
    assert not upstream.requests  # counting calls no worker


def test_count_tokens_pinned_worker_uses_its_model(agw, upstream):
    raw = client(agw).messages.with_raw_response.count_tokens(model="cheap", messages=HELLO)
    assert raw.parse().input_tokens == litellm.token_counter(model="openai/cheap-model", messages=HELLO)
    assert raw.headers["x-polyroute-token-counter"] == "openai/cheap-model"


def test_count_tokens_errors_are_anthropic_errors(agw, upstream):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(agw).messages.count_tokens(model="claude-nonexistent", messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(agw).messages.count_tokens(model="auto", messages=[])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    response = httpx.post(agw.url + "/v1/messages/count_tokens", json={"model": "auto", "messages": HELLO})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"model": "auto", "messages": HELLO},  # max_tokens is required
        {"model": "auto", "max_tokens": 0, "messages": HELLO},
        {"model": "auto", "max_tokens": 8, "messages": []},
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "temprature": 0.5},  # a typo
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]},
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "   "}]},
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "stream": "yes"},
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "tool"}},
    ],
)
def test_bad_body_is_400_in_anthropic_format_and_reaches_no_worker(agw, upstream, body):
    response = httpx.post(agw.url + "/v1/messages", headers={"x-api-key": agw.api_key}, json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]
    assert not upstream.requests


def test_bad_json_through_the_sdk(agw, upstream):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(agw).messages.create(model="auto", max_tokens=8, messages=HELLO, extra_body={"bogus": 1})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "bogus" in caught.value.body["error"]["message"]
    assert not upstream.requests


def test_unknown_model_is_404(agw, upstream):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(agw).messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "auto" in caught.value.body["error"]["message"]
    assert caught.value.response.headers["x-polyroute-policy-version"].startswith("anthropic")
    assert not upstream.requests


def test_missing_and_wrong_keys_are_401(agw, upstream):
    response = httpx.post(
        agw.url + "/v1/messages", json={"model": "auto", "max_tokens": 8, "messages": HELLO}
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=agw.url, api_key="pr-wrong", max_retries=0).messages.create(
            model="auto", max_tokens=8, messages=HELLO
        )
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert not upstream.requests


def test_pii_to_a_non_admissible_pinned_worker_is_403(agw, upstream):
    with pytest.raises(anthropic.PermissionDeniedError) as caught:
        client(agw).messages.create(model="mid", max_tokens=8, messages=PII)
    body = caught.value.body
    assert body["error"]["type"] == "permission_error"
    assert "pii-eu-only" in body["error"]["message"] and body["polyroute"]["code"] == "policy_denied"
    assert caught.value.response.headers["x-polyroute-data-class"] == "pii"
    assert not upstream.requests


def test_pii_in_a_tool_result_is_classified_and_confined(agw, upstream):
    """Detection reads the translated request: a tool_result's text counts as much as the prompt's."""
    upstream.behave("mid-model", status=500)
    upstream.behave("cheap-model", status=500)
    with pytest.raises(anthropic.InternalServerError) as caught:
        client(agw).messages.create(
            model="auto",
            max_tokens=8,
            messages=[
                {"role": "user", "content": "who wrote this?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "jane.doe@example.com"}
                    ],
                },
            ],
        )
    assert caught.value.response.headers["x-polyroute-data-class"] == "pii"
    assert caught.value.body["error"]["type"] == "api_error"
    assert upstream.requests_for("cheap-model")  # the EU worker was tried (and failed)...
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")  # ...only it


def test_an_unknown_messages_route_answers_in_anthropics_shape(agw):
    """The Anthropic SDK reads its own error shape on every /v1/messages path, unknown ones too
    (Message Batches, a GET): a 404 not_found_error and a 405, not OpenAI's {"error": {...}}."""
    batches = httpx.post(agw.url + "/v1/messages/batches", headers=agw.auth(), json={"requests": []})
    assert batches.status_code == 404
    assert batches.json()["type"] == "error" and batches.json()["error"]["type"] == "not_found_error"
    listed = httpx.get(agw.url + "/v1/messages", headers=agw.auth())
    assert listed.status_code == 405 and listed.json()["type"] == "error"
    assert "POST" in listed.headers["allow"]
    other = httpx.get(agw.url + "/v1/no-such-route", headers=agw.auth())  # other paths: OpenAI's shape
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"


def test_rate_limit_is_429_rate_limit_error(agw, upstream):
    _, key = agw.state.auth.store.create("acme", "one a minute", rpm=1)
    sdk = anthropic.Anthropic(base_url=agw.url, api_key=key, max_retries=0)
    sdk.messages.create(model="auto", max_tokens=8, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as caught:
        sdk.messages.create(model="auto", max_tokens=8, messages=HELLO)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert len(upstream.requests) == 1


def test_all_workers_failing_is_api_error(agw, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    with pytest.raises(anthropic.InternalServerError) as caught:
        client(agw).messages.create(model="auto", max_tokens=8, messages=HELLO)
    assert caught.value.status_code == 502
    assert caught.value.body["error"]["type"] == "api_error"
    assert caught.value.body["polyroute"]["code"] == "upstream_failed"


def test_context_length_is_400(agw, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, context_window=5)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(agw).messages.create(model="auto", max_tokens=100, messages=HELLO)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["polyroute"]["code"] == "context_length_exceeded"


def test_budget_holds_on_messages(upstream, tmp_path):
    gw = budget_gateway(upstream, tmp_path, "0.0000025")
    try:
        upstream.behave("cheap-model", prompt_tokens=10, completion_tokens=5)  # $0.000002 at cheap's prices
        first = client(gw).messages.with_raw_response.create(model="auto", max_tokens=5, messages=HELLO)
        assert first.headers["x-polyroute-worker"] == "cheap"
        with pytest.raises(anthropic.PermissionDeniedError) as caught:
            client(gw).messages.create(model="auto", max_tokens=5, messages=HELLO)
        assert "budget:daily" in caught.value.body["error"]["message"]  # as on chat completions
        assert len(upstream.requests_for("cheap-model")) == 1
        spend = httpx.get(f"{gw.url}/admin/spend/acme", headers=gw.auth(gw.admin_key)).json()
        assert Decimal(spend["daily_usd"]) == Decimal("0.000002")
    finally:
        gw.server.stop()


# ---- configured as Claude Code configures a gateway --------------------------------------------------
def test_claude_code_style_configuration(agw, upstream, monkeypatch):
    """Claude Code reads ANTHROPIC_BASE_URL and ANTHROPIC_AUTH_TOKEN (sent as Bearer), sends
    anthropic-version / anthropic-beta headers, a model name from ANTHROPIC_MODEL, a system prompt,
    tools, metadata.user_id and streams."""
    monkeypatch.setenv("ANTHROPIC_BASE_URL", agw.url)
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", agw.api_key)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("ANTHROPIC_MODEL", "auto")
    import os

    sdk = anthropic.Anthropic(max_retries=0, default_headers={"anthropic-beta": "claude-code-20250219"})
    assert sdk.auth_token == agw.api_key and sdk.api_key is None  # Bearer, not x-api-key
    upstream.behave("cheap-model", text="Done.", prompt_tokens=7, completion_tokens=1)
    with sdk.messages.stream(
        model=os.environ["ANTHROPIC_MODEL"],
        max_tokens=1024,
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "list the files"}]}],
        tools=[WEATHER_TOOL],
        metadata={"user_id": "user_abc"},
    ) as stream:
        final = stream.get_final_message()
        request_id = stream.response.headers["x-polyroute-request-id"]
    assert final.content[0].text == "Done." and final.usage.output_tokens == 1
    sent = upstream.requests_for("cheap-model")[0]
    assert sent["messages"][0]["role"] == "system"
    assert ledger_record(agw, request_id)["worker"] == "cheap"
    counted = sdk.messages.count_tokens(model="auto", messages=HELLO)
    assert counted.input_tokens > 0


# ---- the rest of the pipeline: workflows, the response cache, memory ---------------------------------
QUESTION = "What is six times seven?"
JUDGE = "How likely is the proposed answer"


def test_a_composed_workflow_answers_in_anthropic_shape(agw, upstream):
    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", text="The answer is 42.", replies={JUDGE: "9"})
    question = [{"role": "user", "content": QUESTION}]
    raw = client(agw).messages.with_raw_response.create(
        model="compose:cascade", max_tokens=50, messages=question, extra_headers={"x-polyroute-trace": "1"}
    )
    message = raw.parse()
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert message.content[0].text == "42" and message.stop_reason == "end_turn"
    steps = message.model_extra["polyroute"]["trace"]["steps"]
    assert [(s["role"], s["worker"]) for s in steps] == [("answer", "cheap"), ("judge", "pricey")]
    with client(agw).messages.stream(model="compose:cascade", max_tokens=50, messages=question) as stream:
        assert "".join(stream.text_stream) == "42"
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_a_cached_answer_is_written_in_anthropic_shape(agw, upstream):
    upstream.behave("cheap-model", text="cached words", prompt_tokens=5, completion_tokens=2)
    sdk = client(agw, default_headers={"x-polyroute-cache": "on"})
    question = [{"role": "user", "content": "a question worth caching"}]
    first = sdk.messages.with_raw_response.create(model="auto", max_tokens=8, messages=question)
    second = sdk.messages.with_raw_response.create(model="auto", max_tokens=8, messages=question)
    assert first.headers["x-polyroute-cache"] == "miss" and second.headers["x-polyroute-cache"] == "hit"
    assert second.parse().content[0].text == "cached words" == first.parse().content[0].text
    assert second.parse().usage.output_tokens == 2
    assert len(upstream.requests_for("cheap-model")) == 1


def test_polyroute_metadata_keys_work_on_messages(agw, upstream):
    """metadata carries polyroute's keys (data_class, collections...) besides Anthropic's user_id."""
    raw = client(agw).messages.with_raw_response.create(
        model="auto", max_tokens=8, messages=HELLO, metadata={"user_id": "u1", "data_class": "pii"}
    )
    assert raw.headers["x-polyroute-data-class"] == "pii" and raw.headers["x-polyroute-worker"] == "cheap"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(agw).messages.create(
            model="auto", max_tokens=8, messages=HELLO, metadata={"collections": ["no-such-collection"]}
        )
    assert caught.value.body["polyroute"]["code"] == "collection_not_found"
    assert len(upstream.requests) == 1


# ---- a worker whose provider is Anthropic ----------------------------------------------------------
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


@pytest.fixture(scope="module")
def cgw(upstream, tmp_path_factory):
    """The test catalog plus a worker called through litellm's Anthropic provider (Anthropic's wire)."""
    from tests.conftest import FAKE_KEY_ENV

    yaml_text = catalog_yaml_for(upstream.url) + CLAUDE_WORKER.format(url=upstream.url, key_env=FAKE_KEY_ENV)
    gw = start_gateway(parse_catalog(yaml_text), tmp_path_factory.mktemp("claude-gw"))
    yield gw
    gw.server.stop()


def test_an_anthropic_worker_answers_messages(cgw, upstream):
    upstream.behave("claude-fake", text="Bonjour from Claude", prompt_tokens=12, completion_tokens=4)
    raw = client(cgw).messages.with_raw_response.create(
        model="claude", max_tokens=32, system="Answer in French.", messages=HELLO
    )
    message = raw.parse()
    assert raw.headers["x-polyroute-worker"] == "claude"
    assert message.content[0].text == "Bonjour from Claude" and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 12 and message.usage.output_tokens == 4
    # 12 * $3/1M + 4 * $15/1M
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == Decimal("0.000096")
    [sent] = upstream.requests_for("claude-fake")  # Anthropic's wire, built by litellm
    assert sent["max_tokens"] == 32 and sent["messages"][-1]["role"] == "user"
    system = sent["system"]
    assert (system if isinstance(system, str) else system[0]["text"]) == "Answer in French."


def test_an_anthropic_worker_streams_and_calls_tools(cgw, upstream):
    upstream.behave("claude-fake", text="one two three", prompt_tokens=5, completion_tokens=3)
    with client(cgw).messages.stream(model="claude", max_tokens=32, messages=HELLO) as stream:
        assert "".join(stream.text_stream) == "one two three"
        final = stream.get_final_message()
    assert final.usage.output_tokens == 3 and final.stop_reason == "end_turn"
    upstream.behave("claude-fake", tool_call={"name": "get_weather", "arguments": '{"city": "Rome"}'})
    answer = client(cgw).messages.create(model="claude", max_tokens=32, messages=HELLO, tools=[WEATHER_TOOL])
    [use] = [b for b in answer.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Rome"} and answer.stop_reason == "tool_use"
    assert (
        upstream.requests_for("claude-fake")[-1]["tools"][0]["input_schema"] == WEATHER_TOOL["input_schema"]
    )


def test_parameters_without_an_openai_form_are_named_not_forwarded(agw, upstream):
    raw = client(agw).messages.with_raw_response.create(
        model="auto",
        max_tokens=8,
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "let me think", "signature": "sig"},
                    {"type": "text", "text": "hello"},
                ],
            },
            {"role": "user", "content": "and now?"},
        ],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"top_k": 5},
    )
    assert raw.headers["x-polyroute-ignored"] == "top_k,thinking"
    [sent] = upstream.requests_for("cheap-model")
    assert "top_k" not in sent and "thinking" not in sent and "reasoning_effort" not in sent
    assert sent["messages"][1] == {"role": "assistant", "content": "hello"}


def test_a_body_over_the_limit_is_413_request_too_large(gateway, upstream):
    big = "x" * (70 * 1024)  # the session gateway takes 64 KiB
    response = httpx.post(
        gateway.url + "/v1/messages",
        headers={"x-api-key": gateway.api_key},
        json={"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": big}]},
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert not upstream.requests


def test_a_client_that_hangs_up_mid_stream_pays_for_what_was_streamed(agw, upstream):
    """The pipeline's streamed billing holds on Anthropic's event stream too: 499, counted here."""
    long_text = " ".join(f"word{i}" for i in range(100))
    upstream.behave("cheap-model", text=long_text, chunk_delay_s=0.05, stream_usage=False)
    request_id, received = stream_and_hang_up(
        agw.url + "/v1/messages",
        {"x-api-key": agw.api_key},
        {"model": "auto", "max_tokens": 200, "messages": HELLO, "stream": True},
        '"text_delta"',
    )
    record = ledger_record(agw, request_id)
    assert record["status"] == 499 and record["trace"]["stream"] == "client_disconnected"
    assert record["trace"]["usage"] == "estimated"
    whole = litellm.token_counter(model="openai/cheap-model", text=long_text)
    assert received <= record["completion_tokens"] < whole  # what was streamed, not the whole answer
    assert record["cost_micros"] > 0
