"""POST /v1/responses, GET/DELETE /v1/responses/{id}, driven by the real `openai` package, unchanged.

The gateway translates a Responses request (its previous_response_id conversation included) into the
internal chat-completions form and back (litellm's Responses bridge); every request runs the chat
pipeline: keys, rate limits, policy, router, budgets, ledger. The test upstream speaks OpenAI's chat
wire, so what it received shows the translation. Stored responses live in the in-process store, or
in a real redis-server when the gateway has REDIS_URL.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_lib
import yaml

from gateway.store.health import Breaker
from gateway.store.responses import MemoryResponses, RedisResponses
from policies import parse_catalog
from tests.conftest import budget_gateway, catalog_yaml_for, ledger_record, start_gateway, stream_and_hang_up

PII = "Please e-mail the summary to jane.doe@example.com"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
POLICY = {
    "version": "responses",
    "rules": [{"id": "pii-eu-only", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU"]}],
}


def client(gw, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key or gw.api_key, max_retries=0)


def policy_gateway(upstream, data_dir: Path, **settings):
    """A gateway with a policy: PII may go to EU workers only (cheap is FR, mid CN, pricey US)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    return start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)), data_dir, policy_file=policy_file, **settings
    )


@pytest.fixture(scope="module")
def rgw(upstream, tmp_path_factory):
    gw = policy_gateway(upstream, tmp_path_factory.mktemp("responses-gw"))
    yield gw
    gw.server.stop()


@pytest.fixture(scope="module")
def redis_gw(upstream, tmp_path_factory, redis_server):
    """The same gateway on Redis (REDIS_URL): keys, budgets, limits, ledger and stored responses."""
    redis_lib.Redis.from_url(redis_server.url).flushdb()
    gw = policy_gateway(upstream, tmp_path_factory.mktemp("responses-redis-gw"), redis_url=redis_server.url)
    yield gw
    gw.server.stop()


def total_requests(upstream) -> int:
    return len(upstream.requests)


# ---- plain -----------------------------------------------------------------------------------------
def test_plain_response_auto_routes_through_the_pipeline(rgw, upstream):
    upstream.behave("cheap-model", text="hello there from cheap", prompt_tokens=1000, completion_tokens=500)
    raw = client(rgw).responses.with_raw_response.create(model="auto", input="Say hello in five words")
    response = raw.parse()
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == "hello there from cheap"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant"
    assert response.model == "cheap"
    assert response.usage.input_tokens == 1000 and response.usage.output_tokens == 500
    assert response.usage.total_tokens == 1500
    request_id = raw.headers["x-polyroute-request-id"]
    assert response.id == "resp_" + request_id.removeprefix("req_")
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert raw.headers["x-polyroute-strategy"] == "fast"
    assert raw.headers["x-polyroute-policy-version"].startswith("responses")
    assert raw.headers["x-polyroute-response-stored"] == "true"
    # 1000 * $0.10/1M + 500 * $0.20/1M, from the catalog's prices
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == Decimal("0.0002")
    sent = upstream.requests_for("cheap-model")
    assert len(sent) == 1
    assert sent[0]["messages"] == [{"role": "user", "content": "Say hello in five words"}]
    record = ledger_record(rgw, request_id)
    assert record["worker"] == "cheap" and record["status"] == 200 and record["model"] == "auto"
    assert record["cost_micros"] == 200 and record["prompt_tokens"] == 1000
    assert record["data_class"] == "public"


def test_instructions_items_and_sampling_parameters_are_translated(rgw, upstream):
    upstream.behave("cheap-model", text="ok")
    response = client(rgw).responses.create(
        model="auto",
        instructions="Answer in French.",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        ],
        max_output_tokens=64,
        temperature=0.2,
        top_p=0.9,
        metadata={"team": "a"},
    )
    assert response.instructions == "Answer in French."
    assert response.max_output_tokens == 64 and response.temperature == 0.2 and response.top_p == 0.9
    assert response.metadata == {"team": "a"}
    (sent,) = upstream.requests_for("cheap-model")
    assert sent["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert sent["messages"][1]["role"] in ("developer", "system")  # a worker may take system only
    assert "Be brief." in json.dumps(sent["messages"][1]["content"])
    assert sent["messages"][2]["role"] == "user"
    assert sent["messages"][2]["content"] == [{"type": "text", "text": "Hello"}]
    assert sent["max_tokens"] == 64 and sent["temperature"] == 0.2 and sent["top_p"] == 0.9
    assert "metadata" not in sent  # polyroute's, not the worker's


def test_pinned_worker(rgw, upstream):
    raw = client(rgw).responses.with_raw_response.create(model="pricey", input="hi")
    assert raw.parse().model == "pricey"
    assert raw.headers["x-polyroute-worker"] == "pricey" and raw.headers["x-polyroute-strategy"] == "pinned"
    assert len(upstream.requests_for("pricey-model")) == 1 and not upstream.requests_for("cheap-model")


def test_max_output_tokens_cut_is_incomplete(rgw, upstream):
    upstream.behave("cheap-model", text="cut short", finish_reason="length")
    response = client(rgw).responses.create(model="auto", input="hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut short"


# ---- streaming -------------------------------------------------------------------------------------
EXPECTED_TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def test_streaming_with_create_stream_true(rgw, upstream):
    upstream.behave("cheap-model", text="one two three four", prompt_tokens=10, completion_tokens=4)
    events = list(client(rgw).responses.create(model="auto", input="count", stream=True))
    kinds = [e.type for e in events]
    deduped = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert deduped == EXPECTED_TEXT_EVENTS
    assert kinds.count("response.output_text.delta") == 4
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    created, completed = events[0].response, events[-1].response
    assert created.id == completed.id and created.status == "in_progress"
    assert completed.status == "completed" and completed.output_text == "one two three four"
    assert completed.usage.input_tokens == 10 and completed.usage.output_tokens == 4
    assert completed.usage.total_tokens == 14
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "one two three four"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {completed.output[0].id}
    (sent,) = upstream.requests_for("cheap-model")
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_streaming_with_the_sdk_stream_helper_is_billed_and_stored(rgw, upstream):
    upstream.behave("cheap-model", text="streamed words here", prompt_tokens=100, completion_tokens=3)
    sdk = client(rgw)
    with sdk.responses.stream(model="auto", input="stream please") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "streamed words here" == final.output_text
    stored = sdk.responses.retrieve(final.id)
    assert stored.output_text == "streamed words here" and stored.usage.output_tokens == 3
    request_id = "req_" + final.id.removeprefix("resp_")
    record = ledger_record(rgw, request_id)
    assert record["worker"] == "cheap" and record["status"] == 200
    assert record["prompt_tokens"] == 100 and record["completion_tokens"] == 3


def test_raw_sse_is_the_responses_wire(rgw, upstream):
    upstream.behave("cheap-model", text="a b")
    with httpx.stream(
        "POST",
        rgw.v1 + "/responses",
        headers=rgw.auth(),
        json={"model": "auto", "input": "hi", "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    for block in blocks:  # every event is named, and its data says the same type
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    assert "[DONE]" not in raw


def test_mid_stream_failure_ends_with_error_and_failed_events_and_is_billed(rgw, upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=2)
    events = list(client(rgw).responses.create(model="auto", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2].code == "upstream_stream_error"
    assert events[-1].response.status == "failed"
    # the SDK's ResponseError allows a fixed list of codes: polyroute's own rides under `polyroute`
    assert events[-1].response.error.code == "server_error"
    assert (events[-1].response.model_extra or {})["polyroute"]["error_code"] == "upstream_stream_error"
    request_id = "req_" + events[0].response.id.removeprefix("resp_")
    record = ledger_record(rgw, request_id)
    assert record["status"] == 502 and record["completion_tokens"] > 0
    with pytest.raises(openai.NotFoundError):  # a failed stream is not stored
        client(rgw).responses.retrieve(events[0].response.id)


# ---- function tools ------------------------------------------------------------------------------
def test_function_call_then_output_with_previous_response_id(rgw, upstream):
    upstream.behave(
        "cheap-model",
        text="It is sunny in Paris.",
        tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}'},
    )
    sdk = client(rgw)
    first = sdk.responses.create(
        model="auto", input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto"
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    sent_first = upstream.requests_for("cheap-model")[0]
    assert sent_first["tools"][0]["function"]["name"] == "get_weather"
    assert sent_first["tools"][0]["function"]["parameters"] == WEATHER_TOOL["parameters"]
    assert sent_first["tool_choice"] == "auto"

    upstream.behave("cheap-model", text="It is sunny in Paris.")  # no more tool calls
    second = sdk.responses.create(
        model="auto",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}],
        tools=[WEATHER_TOOL],
    )
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    sent = upstream.requests_for("cheap-model")[-1]["messages"]
    assert sent[0] == {"role": "user", "content": "What is the weather in Paris?"}
    assert sent[1]["role"] == "assistant"
    assert sent[1]["tool_calls"] == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments},
        }
    ]
    assert sent[2] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": call.call_id}


def test_streamed_function_call_events(rgw, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}'})
    with client(rgw).responses.stream(
        model="auto", input="weather?", tools=[WEATHER_TOOL], tool_choice="required"
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert upstream.requests_for("cheap-model")[0]["tool_choice"] == "required"


def test_named_tool_choice(rgw, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": "{}"})
    client(rgw).responses.create(
        model="auto", input="x", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"}
    )
    sent = upstream.requests_for("cheap-model")[0]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


# ---- the store: previous_response_id, retrieve, delete, tenants, store: false, TTL ------------------
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_previous_response_id_continues_the_conversation(backend, rgw, redis_gw, upstream):
    gw = rgw if backend == "memory" else redis_gw
    upstream.behave(
        "cheap-model", replies={"name is": "Nice to meet you, Ada.", "my name": "Your name is Ada."}
    )
    sdk = client(gw)
    first = sdk.responses.create(model="auto", instructions="Be kind.", input="Hello, my name is Ada.")
    second = sdk.responses.create(model="auto", previous_response_id=first.id, input="What is my name?")
    assert second.output_text == "Your name is Ada."
    sent = upstream.requests_for("cheap-model")[-1]["messages"]
    # the conversation (not the earlier instructions: OpenAI does not carry them over)
    assert sent == [
        {"role": "user", "content": "Hello, my name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
        {"role": "user", "content": "What is my name?"},
    ]
    third = sdk.responses.create(model="auto", previous_response_id=second.id, input="And again?")
    assert len(upstream.requests_for("cheap-model")[-1]["messages"]) == 5
    stored = sdk.responses.retrieve(second.id)
    assert stored.id == second.id and stored.output_text == "Your name is Ada."
    assert stored.previous_response_id == first.id
    deleted = sdk.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    raw = httpx.get(f"{gw.v1}/responses/{first.id}", headers=gw.auth(), timeout=30)
    assert raw.status_code == 404 and raw.json()["error"]["code"] == "response_not_found"
    # a later response keeps its whole conversation: deleting an earlier one does not break it
    sdk.responses.create(model="auto", previous_response_id=third.id, input="Once more")
    assert len(upstream.requests_for("cheap-model")[-1]["messages"]) == 7


def test_delete_answers_openais_deleted_object(rgw, upstream):
    response = client(rgw).responses.create(model="auto", input="hi")
    r = httpx.delete(f"{rgw.v1}/responses/{response.id}", headers=rgw.auth(), timeout=30)
    assert r.status_code == 200
    assert r.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    again = httpx.delete(f"{rgw.v1}/responses/{response.id}", headers=rgw.auth(), timeout=30)
    assert again.status_code == 404 and again.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as caught:
        client(rgw).responses.create(model="auto", input="more", previous_response_id=response.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_another_tenants_response_is_not_found(backend, rgw, redis_gw, upstream):
    gw = rgw if backend == "memory" else redis_gw
    _, other_key = gw.state.auth.store.create("globex", "other tenant")
    mine = client(gw).responses.create(model="auto", input="secret plans")
    before = total_requests(upstream)
    theirs = client(gw, other_key)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.create(model="auto", input="continue", previous_response_id=mine.id)
    assert total_requests(upstream) == before  # no worker saw the attempt
    assert client(gw).responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_store_false_stores_nothing(rgw, upstream):
    sdk = client(rgw)
    raw = sdk.responses.with_raw_response.create(model="auto", input="ephemeral", store=False)
    response = raw.parse()
    assert response.store is False and raw.headers["x-polyroute-response-stored"] == "false"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="auto", input="next", previous_response_id=response.id)
    events = list(sdk.responses.create(model="auto", input="ephemeral", store=False, stream=True))
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(events[-1].response.id)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_stored_responses_expire_after_the_ttl(backend, upstream, tmp_path, redis_server):
    settings = {"responses_ttl_s": 1.0}
    if backend == "redis":  # the module's Redis gateway shares this server: nothing is flushed
        settings["redis_url"] = redis_server.url
    gw = policy_gateway(upstream, tmp_path / "gw", **settings)
    try:
        response = client(gw).responses.create(model="auto", input="short-lived")
        deadline = time.monotonic() + 60  # generous: only "eventually gone" is asserted
        while True:
            r = httpx.get(f"{gw.v1}/responses/{response.id}", headers=gw.auth(), timeout=30)
            if r.status_code == 404:
                break
            assert r.status_code == 200 and time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(openai.NotFoundError):
            client(gw).responses.create(model="auto", input="next", previous_response_id=response.id)
    finally:
        gw.server.stop()


@pytest.mark.anyio
async def test_memory_store_expiry_on_its_clock():
    now = [1000.0]
    store = MemoryResponses(clock=lambda: now[0])
    await store.put("acme", "resp_1", {"response": {"id": "resp_1"}, "context": []}, ttl_s=30)
    assert (await store.get("acme", "resp_1"))["response"]["id"] == "resp_1"
    assert await store.get("globex", "resp_1") is None
    now[0] += 29.9
    assert await store.get("acme", "resp_1") is not None
    now[0] += 0.2
    assert await store.get("acme", "resp_1") is None
    assert await store.delete("acme", "resp_1") is False


@pytest.mark.anyio
async def test_redis_store_sets_the_ttl_and_scopes_keys(redis_server):
    import redis.asyncio

    client_ = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        store = RedisResponses(client_, Breaker("Redis"))
        await store.put("acme", "resp_ttl", {"response": {"id": "resp_ttl"}, "context": []}, ttl_s=86_400)
        key = store._key("acme", "resp_ttl")
        assert key == "polyroute:responses:{acme}:resp_ttl"
        ttl_ms = await client_.pttl(key)
        assert 86_000_000 < ttl_ms <= 86_400_000
        assert await store.get("globex", "resp_ttl") is None
        assert await store.delete("acme", "resp_ttl") is True
        assert await store.get("acme", "resp_ttl") is None
    finally:
        await client_.aclose()


# ---- errors ----------------------------------------------------------------------------------------
BAD_BODIES = [
    {"input": "no model"},
    {"model": "auto", "input": "x", "unknown_field": 1},
    {"model": "auto"},
    {"model": "auto", "input": ""},
    {"model": "auto", "input": [{"role": "user"}]},
    {"model": "auto", "input": [{"role": "robot", "content": "hi"}]},
    {"model": "auto", "input": [{"type": "function_call", "name": "f"}]},
    {"model": "auto", "input": [{"type": "function_call_output", "output": "x"}]},
    {"model": "auto", "input": [{"type": "item_reference", "id": "msg_1"}]},
    {"model": "auto", "input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
    {"model": "auto", "input": "x", "tools": [{"type": "web_search"}]},
    {"model": "auto", "input": "x", "tools": [{"type": "function"}]},
    {"model": "auto", "input": "x", "tool_choice": "sometimes"},
    {"model": "auto", "input": "x", "temperature": 3},
    {"model": "auto", "input": "x", "max_output_tokens": 0},
    {"model": "auto", "input": "x", "stream": "yes"},
    {"model": "auto", "input": "x", "background": True},
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_bad_body_is_400_in_openai_format_and_reaches_no_worker(rgw, upstream, body):
    before = total_requests(upstream)
    r = httpx.post(rgw.v1 + "/responses", headers=rgw.auth(), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert total_requests(upstream) == before


def test_bad_json_through_the_sdk(rgw, upstream):
    with pytest.raises(openai.BadRequestError):
        client(rgw).responses.create(model="auto", input="x", extra_body={"temperature": "hot"})


def test_unknown_model_is_404(rgw, upstream):
    before = total_requests(upstream)
    with pytest.raises(openai.NotFoundError) as caught:
        client(rgw).responses.create(model="no-such-model", input="hi")
    assert caught.value.body["code"] == "model_not_found"
    assert total_requests(upstream) == before


def test_no_key_and_wrong_key_are_401(rgw, upstream):
    r = httpx.post(rgw.v1 + "/responses", json={"model": "auto", "input": "hi"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(rgw, "pr-wrong-key").responses.create(model="auto", input="hi")
    with pytest.raises(openai.AuthenticationError):
        client(rgw, "pr-wrong-key").responses.retrieve("resp_x")
    r = httpx.delete(rgw.v1 + "/responses/resp_x", timeout=30)
    assert r.status_code == 401


def test_pii_to_a_non_admissible_pinned_worker_is_403(rgw, upstream):
    before = total_requests(upstream)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client(rgw).responses.create(model="mid", input=PII)
    assert caught.value.body["code"] == "policy_denied" and "pii-eu-only" in caught.value.body["message"]
    assert caught.value.response.headers["x-polyroute-data-class"] == "pii"
    assert total_requests(upstream) == before


def test_pii_in_an_earlier_turn_confines_the_follow_up(rgw, upstream):
    sdk = client(rgw)
    first = sdk.responses.create(model="cheap", input=PII)  # cheap is FR: admitted
    before = total_requests(upstream)
    with pytest.raises(openai.PermissionDeniedError):
        sdk.responses.create(model="mid", input="and now summarise", previous_response_id=first.id)
    assert total_requests(upstream) == before
    raw = sdk.responses.with_raw_response.create(
        model="auto", input="summarise", previous_response_id=first.id
    )
    assert raw.headers["x-polyroute-data-class"] == "pii" and raw.headers["x-polyroute-worker"] == "cheap"


def test_pii_in_a_function_call_output_is_classified(rgw, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": "{}"})
    sdk = client(rgw)
    first = sdk.responses.create(model="auto", input="weather?", tools=[WEATHER_TOOL])
    before = total_requests(upstream)
    with pytest.raises(openai.PermissionDeniedError):
        sdk.responses.create(
            model="pricey",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": first.output[0].call_id, "output": PII}],
        )
    assert total_requests(upstream) == before


def test_all_workers_failing_is_502(rgw, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    with pytest.raises(openai.InternalServerError) as caught:
        client(rgw).responses.create(model="auto", input="hi")
    assert caught.value.status_code == 502 and caught.value.body["code"] == "upstream_failed"


def test_budget_holds_on_responses(upstream, tmp_path):
    gw = budget_gateway(upstream, tmp_path, "0.0000025")
    try:
        upstream.behave("cheap-model", prompt_tokens=10, completion_tokens=5)  # $0.000002 at cheap's prices
        first = client(gw).responses.with_raw_response.create(model="auto", input="hi", max_output_tokens=5)
        assert first.headers["x-polyroute-worker"] == "cheap"
        with pytest.raises(openai.PermissionDeniedError) as caught:
            client(gw).responses.create(model="auto", input="hi", max_output_tokens=5)
        assert "budget:daily" in caught.value.body["message"]  # as on chat completions
        assert len(upstream.requests_for("cheap-model")) == 1
        spend = httpx.get(f"{gw.url}/admin/spend/acme", headers=gw.auth(gw.admin_key)).json()
        assert Decimal(spend["daily_usd"]) == Decimal("0.000002")
    finally:
        gw.server.stop()


# ---- the rest of the pipeline ----------------------------------------------------------------------
def test_polyroute_metadata_keys_work_on_responses(rgw, upstream):
    raw = client(rgw).responses.with_raw_response.create(
        model="auto", input="hi", metadata={"data_class": "pii"}
    )
    assert raw.headers["x-polyroute-data-class"] == "pii" and raw.headers["x-polyroute-worker"] == "cheap"


def test_ignored_parameters_are_named(rgw, upstream):
    raw = client(rgw).responses.with_raw_response.create(
        model="auto", input="hi", reasoning={"effort": "low"}, truncation="auto", include=[]
    )
    assert set(raw.headers["x-polyroute-ignored"].split(",")) >= {"reasoning", "truncation", "include"}


def test_a_cached_answer_is_written_in_responses_shape(rgw, upstream):
    upstream.behave("cheap-model", text="cached answer")
    sdk = openai.OpenAI(
        base_url=rgw.v1, api_key=rgw.api_key, max_retries=0, default_headers={"x-polyroute-cache": "on"}
    )
    first = sdk.responses.with_raw_response.create(model="auto", input="cache me", store=False)
    second = sdk.responses.with_raw_response.create(model="auto", input="cache me")
    assert first.headers["x-polyroute-cache"] == "miss" and second.headers["x-polyroute-cache"] == "hit"
    assert second.parse().output_text == "cached answer"
    assert len(upstream.requests_for("cheap-model")) == 1
    assert sdk.responses.retrieve(second.parse().id).output_text == "cached answer"


def test_rate_limit_is_429(rgw, upstream):
    _, key = rgw.state.auth.store.create("acme", "one a minute", rpm=1)
    sdk = client(rgw, key)
    sdk.responses.create(model="auto", input="hi")
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.responses.create(model="auto", input="hi")
    assert caught.value.body["type"] == "rate_limit_error"
    assert len(upstream.requests) == 1


QUESTION = "What is six times seven?"
JUDGE = "How likely is the proposed answer"


def test_a_composed_workflow_answers_in_responses_shape(rgw, upstream):
    upstream.behave("cheap-model", text="42")
    upstream.behave("pricey-model", text="The answer is 42.", replies={JUDGE: "9"})
    sdk = client(rgw)
    raw = sdk.responses.with_raw_response.create(
        model="compose:cascade", input=QUESTION, extra_headers={"x-polyroute-trace": "1"}
    )
    response = raw.parse()
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert response.output_text == "42" and response.status == "completed"
    steps = response.model_extra["polyroute"]["trace"]["steps"]
    assert [(s["role"], s["worker"]) for s in steps] == [("answer", "cheap"), ("judge", "pricey")]
    assert sdk.responses.retrieve(response.id).output_text == "42"
    with sdk.responses.stream(model="compose:cascade", input=QUESTION) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == "42"
        final = stream.get_final_response()
    assert final.status == "completed" and final.usage.output_tokens > 0


def test_a_client_that_hangs_up_mid_stream_pays_for_what_was_streamed(rgw, upstream):
    """The pipeline's streamed billing holds on the Responses event stream too: 499, counted here."""
    long_text = " ".join(f"word{i}" for i in range(100))
    upstream.behave("cheap-model", text=long_text, chunk_delay_s=0.05, stream_usage=False)
    request_id, received = stream_and_hang_up(
        rgw.v1 + "/responses",
        rgw.auth(),
        {"model": "auto", "input": "count to a hundred", "stream": True},
        '"response.output_text.delta"',
    )
    record = ledger_record(rgw, request_id)
    assert record["status"] == 499 and record["trace"]["stream"] == "client_disconnected"
    assert received <= record["completion_tokens"]
    assert record["cost_micros"] > 0
    r = httpx.get(
        f"{rgw.v1}/responses/resp_{request_id.removeprefix('req_')}", headers=rgw.auth(), timeout=30
    )
    assert r.status_code == 404  # an unfinished stream is not stored


def test_redis_down_continuing_is_503_and_an_answer_says_it_was_not_stored(upstream, tmp_path):
    """A conversation is never continued without its context: with Redis down, previous_response_id
    is a 503 that reaches no worker; a new response is still answered, marked as not stored."""
    from tests.conftest import RedisServer

    server = RedisServer()
    gw = policy_gateway(upstream, tmp_path / "gw", redis_url=server.url)
    try:
        sdk = client(gw)
        first = sdk.responses.create(model="auto", input="remember me")  # the key is verified while up
        server.stop()
        before = total_requests(upstream)
        r = httpx.post(
            gw.v1 + "/responses",
            headers=gw.auth(),
            json={"model": "auto", "input": "next", "previous_response_id": first.id},
            timeout=60,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert total_requests(upstream) == before
        answered = sdk.responses.with_raw_response.create(model="auto", input="still served")
        assert answered.parse().output_text and answered.headers["x-polyroute-response-stored"] == "false"
        r = httpx.get(f"{gw.v1}/responses/{first.id}", headers=gw.auth(), timeout=60)
        assert r.status_code == 503
    finally:
        gw.server.stop()
        server.stop()


@pytest.mark.anyio
async def test_memory_store_evicts_the_oldest_past_its_bounds():
    store = MemoryResponses(max_entries=3, max_bytes=10_000)
    for i in range(4):
        await store.put("acme", f"resp_{i}", {"i": i}, ttl_s=60)
    assert await store.get("acme", "resp_0") is None and await store.get("acme", "resp_3") == {"i": 3}
    await store.put("acme", "big", {"text": "x" * 9_000}, ttl_s=60)
    assert store.status()["bytes"] <= 10_000
    assert await store.get("acme", "big") is not None and await store.get("acme", "resp_1") is None


def test_input_of_reasoning_items_only_is_400_naming_input(rgw, upstream):
    before = total_requests(upstream)
    r = httpx.post(
        rgw.v1 + "/responses",
        headers=rgw.auth(),
        json={"model": "auto", "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert total_requests(upstream) == before


def test_client_managed_history_with_store_false(rgw, upstream):
    """The stateless pattern (Codex-style agents): store false, and the client sends the whole
    history back, the earlier output items as the SDK returned them."""
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    sdk = client(rgw)
    history: list = [{"role": "user", "content": "Weather in Oslo?"}]
    first = sdk.responses.create(model="auto", input=history, tools=[WEATHER_TOOL], store=False)
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": first.output[0].call_id, "output": "snow"})
    upstream.behave("cheap-model", text="It snows in Oslo.")
    second = sdk.responses.create(
        model="auto",
        input=history,
        tools=[WEATHER_TOOL],
        store=False,
        include=["reasoning.encrypted_content"],
    )
    assert second.output_text == "It snows in Oslo."
    history += [item.model_dump(exclude_none=True) for item in second.output]
    history.append({"role": "user", "content": "Thanks"})
    sdk.responses.create(model="auto", input=history, store=False)
    sent = upstream.requests_for("cheap-model")[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "user"]
    assert sent[3]["content"] == [{"type": "text", "text": "It snows in Oslo."}]
