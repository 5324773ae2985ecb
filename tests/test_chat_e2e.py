"""End to end over HTTP: clients → gateway (uvicorn, random port) → test upstream (loopback)."""

from __future__ import annotations

from decimal import Decimal

import httpx
import openai
import pytest

from polyroute import Client, PolyrouteError

MESSAGES = [{"role": "user", "content": "Say hello in five words"}]


def openai_client(gateway, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.v1, api_key=gateway.api_key, max_retries=0, **kwargs)


def test_openai_sdk_non_streaming_auto_routes_to_cheapest(gateway, upstream):
    upstream.behave("cheap-model", text="hello there from cheap", prompt_tokens=1000, completion_tokens=500)
    raw = openai_client(gateway).chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    completion = raw.parse()
    assert completion.choices[0].message.content == "hello there from cheap"
    assert completion.model == "cheap"
    assert completion.usage.prompt_tokens == 1000 and completion.usage.completion_tokens == 500
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert raw.headers["x-polyroute-strategy"] == "fast"
    assert raw.headers["x-polyroute-request-id"].startswith("req_")
    # 1000 * $0.10/1M + 500 * $0.20/1M = $0.0002, computed by litellm from the catalog prices
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == Decimal("0.0002")
    assert upstream.requests_for("cheap-model")[0]["messages"] == MESSAGES


def test_openai_sdk_pinned_worker(gateway, upstream):
    raw = openai_client(gateway).chat.completions.with_raw_response.create(model="pricey", messages=MESSAGES)
    assert raw.headers["x-polyroute-worker"] == "pricey"
    assert raw.headers["x-polyroute-strategy"] == "pinned"
    assert len(upstream.requests_for("pricey-model")) == 1 and not upstream.requests_for("cheap-model")


def test_openai_sdk_streaming_with_usage(gateway, upstream):
    upstream.behave("cheap-model", text="one two three four", prompt_tokens=10, completion_tokens=4)
    stream = openai_client(gateway).chat.completions.create(
        model="auto", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four"
    usage_chunks = [c for c in chunks if c.usage]
    assert len(usage_chunks) == 1 and not usage_chunks[0].choices
    assert usage_chunks[0].usage.prompt_tokens == 10 and usage_chunks[0].usage.completion_tokens == 4
    assert usage_chunks[0].model_extra["polyroute"] == {
        "worker": "cheap",
        "cost_usd": "0.000001800",
        "usage": "reported",
    }
    assert chunks[-1].usage is not None  # usage comes last, after the finish chunk
    assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks)


def test_streamed_usage_the_provider_did_not_send_is_marked_estimated(gateway, upstream):
    """llama.cpp's server streams no usage: the counts are ours, and the answer and the ledger say so."""
    from tests.conftest import ledger_record

    upstream.behave("cheap-model", text="one two three four", stream_usage=False)
    raw = openai_client(gateway).chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    request_id = raw.headers["x-polyroute-request-id"]
    [usage_chunk] = [c for c in raw.parse() if c.usage]
    assert usage_chunk.usage.completion_tokens > 0  # counted here
    assert usage_chunk.model_extra["polyroute"]["usage"] == "estimated"
    record = ledger_record(gateway, request_id)  # settled in its own task once the stream is sent
    assert record["trace"] == {"usage": "estimated"}
    assert record["completion_tokens"] == usage_chunk.usage.completion_tokens


def test_streaming_without_include_usage_hides_usage(gateway, upstream):
    upstream.behave("cheap-model", text="a b c")
    chunks = list(
        openai_client(gateway).chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    )
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "a b c"
    # the gateway still asked the worker for usage, for its own accounting
    assert upstream.requests_for("cheap-model")[0]["stream_options"] == {"include_usage": True}


def test_tools_and_tool_choice_pass_through(gateway, upstream):
    upstream.behave("cheap-model", tool_call={"name": "get_weather", "arguments": '{"city": "Paris"}'})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    completion = openai_client(gateway).chat.completions.create(
        model="auto", messages=MESSAGES, tools=tools, tool_choice="required"
    )
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert completion.choices[0].finish_reason == "tool_calls"
    sent = upstream.requests_for("cheap-model")[0]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tool_choice"] == "required"


def test_streamed_tool_call(gateway, upstream):
    upstream.behave("cheap-model", tool_call={"name": "lookup", "arguments": '{"q": 1}'})
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chunks = list(
        openai_client(gateway).chat.completions.create(
            model="auto", messages=MESSAGES, tools=tools, stream=True
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "lookup"


def test_polyroute_client_non_streaming_and_route(gateway, upstream):
    upstream.behave("cheap-model", text="sdk answer", prompt_tokens=100, completion_tokens=50)
    with Client(gateway.url, api_key=gateway.api_key) as client:
        result = client.chat(MESSAGES)
    assert result.text == "sdk answer"
    assert result.route.worker == "cheap"
    assert result.route.strategy == "fast"
    assert result.route.cost_usd == Decimal("0.00002")
    assert result.route.request_id.startswith("req_")
    assert "cheapest" in result.route.reason


def test_polyroute_client_streaming(gateway, upstream):
    upstream.behave("cheap-model", text="streamed by the sdk", prompt_tokens=8, completion_tokens=4)
    with Client(gateway.url, api_key=gateway.api_key) as client:
        stream = client.chat(MESSAGES, stream=True)
        assert stream.route.worker == "cheap" and stream.route.cost_is_estimate
        assert stream.text() == "streamed by the sdk"
    assert stream.usage["completion_tokens"] == 4
    assert stream.cost_usd == Decimal("0.0000016")


@pytest.mark.anyio
async def test_polyroute_async_client(gateway, upstream):
    from polyroute import AsyncClient

    upstream.behave("mid-model", text="async words here")
    async with AsyncClient(gateway.url, api_key=gateway.api_key) as client:
        result = await client.chat(MESSAGES, model="mid")
        assert result.route.worker == "mid" and result.text == "async words here"
        pieces = [chunk async for chunk, route in client.chat_stream(MESSAGES, model="mid")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in pieces if c.get("choices"))
    assert text == "async words here"


def test_fallback_after_500(gateway, upstream):
    upstream.behave("cheap-model", status=500)
    upstream.behave("mid-model", text="mid saved the day")
    raw = openai_client(gateway).chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "mid saved the day"
    assert raw.headers["x-polyroute-worker"] == "mid"
    assert raw.headers["x-polyroute-fallbacks"] == "cheap"
    retries = gateway.state.settings.retries
    assert len(upstream.requests_for("cheap-model")) == 1 + retries  # retried, then fell back
    assert not upstream.requests_for("pricey-model")


def test_transient_429_is_retried_on_the_same_worker(gateway, upstream):
    upstream.behave("cheap-model", status=429, fail_times=1, text="after one retry")
    raw = openai_client(gateway).chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.headers["x-polyroute-worker"] == "cheap"
    assert "x-polyroute-fallbacks" not in raw.headers
    assert len(upstream.requests_for("cheap-model")) == 2


def test_streaming_falls_back_before_first_byte(gateway, upstream):
    upstream.behave("cheap-model", status=503)
    upstream.behave("mid-model", text="streamed fallback")
    with httpx.stream(
        "POST",
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        json={"model": "auto", "messages": MESSAGES, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-polyroute-worker"] == "mid"
        assert response.headers["x-polyroute-fallbacks"] == "cheap"
        body = response.read().decode()
    assert "streamed" in body and body.rstrip().endswith("data: [DONE]")


def test_all_workers_failing_gives_502_naming_each(gateway, upstream):
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, status=500)
    response = httpx.post(
        gateway.v1 + "/chat/completions", headers=gateway.auth(), json={"model": "auto", "messages": MESSAGES}
    )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed" and error["type"] == "server_error"
    for name in ("cheap", "mid", "pricey"):
        assert f"{name}: 500" in error["message"]
    assert "nokey" not in error["message"]  # an unavailable worker is never called


def test_pinned_worker_does_not_fall_back(gateway, upstream):
    upstream.behave("mid-model", status=500)
    with pytest.raises(openai.InternalServerError):
        openai_client(gateway).chat.completions.create(model="mid", messages=MESSAGES)
    assert not upstream.requests_for("cheap-model") and not upstream.requests_for("pricey-model")


def test_upstream_400_is_not_fallen_back(gateway, upstream):
    upstream.behave("cheap-model", status=400)
    response = httpx.post(
        gateway.v1 + "/chat/completions", headers=gateway.auth(), json={"model": "auto", "messages": MESSAGES}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "upstream_rejected"
    assert not upstream.requests_for("mid-model")


def test_mid_stream_drop_ends_with_error_event(gateway, upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=2)
    with httpx.stream(
        "POST",
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        timeout=30,
        json={"model": "auto", "messages": MESSAGES, "stream": True},
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert '"code":"upstream_stream_error"' in lines[-2]
    assert "one " in "".join(lines[:-2])
    assert not upstream.requests_for("mid-model")  # no fallback once bytes went out


def test_mid_stream_drop_raises_in_openai_sdk(gateway, upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=3)
    stream = openai_client(gateway).chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in stream:
            received.append(chunk)
    assert received, "the chunks before the drop reached the client"


def test_unavailable_pinned_worker_is_503_and_never_called(gateway, upstream):
    response = httpx.post(
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        json={"model": "nokey", "messages": MESSAGES},
    )
    assert response.status_code == 503
    assert "POLYROUTE_TEST_UNSET_KEY" in response.json()["error"]["message"]
    assert not upstream.requests


def test_models_lists_catalog_with_availability(gateway):
    with Client(gateway.url, api_key=gateway.api_key) as client:
        models = {m["id"]: m for m in client.models()}
    assert set(models) == {"auto", "batch", "cheap", "mid", "pricey", "nokey"}  # batch: the policy's alias
    assert models["batch"]["polyroute"]["alias"] is True
    assert models["cheap"]["polyroute"]["available"] is True
    assert models["nokey"]["polyroute"]["available"] is False
    assert "POLYROUTE_TEST_UNSET_KEY" in models["nokey"]["polyroute"]["unavailable_reason"]
    assert models["mid"]["polyroute"]["jurisdiction"] == "CN"
    ids = [m.id for m in openai_client(gateway).models.list()]
    assert "auto" in ids and "pricey" in ids


def test_sdk_raises_polyroute_error(gateway):
    with Client(gateway.url, api_key=gateway.api_key) as client, pytest.raises(PolyrouteError) as info:
        client.chat(MESSAGES, model="no-such-worker")
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_sdk_costs_print_as_plain_numbers():
    """A free worker's cost header "0.000000000" used to print as 0E-9 (issue 15)."""
    from polyroute.client import Route, usd

    assert [str(usd(v)) for v in ("0.000000000", "0.000012300", "100.000", "1.250000000")] == [
        "0",
        "0.0000123",
        "100",
        "1.25",
    ]
    route = Route.from_headers(httpx.Headers({"x-polyroute-cost-usd": "0.000000000"}))
    assert str(route.cost_usd) == "0" and route.cost_usd == 0


def test_one_access_line_per_request_names_the_worker(gateway, upstream, caplog):
    """The log says which worker served each request, how it ended and what it cost (issue 15)."""
    import logging

    caplog.set_level(logging.INFO, logger="polyroute.access")
    with Client(gateway.url, api_key=gateway.api_key) as client:
        served = client.chat(MESSAGES, model="pricey")
        with pytest.raises(PolyrouteError):
            client.chat(MESSAGES, model="no-such-worker")
    request_id = served.route.request_id
    lines = [r.getMessage() for r in caplog.records if r.name == "polyroute.access"]
    line = next(m for m in lines if m.startswith(request_id))
    assert "tenant=acme" in line and "worker=pricey" in line and "status=200" in line
    assert "latency_ms=" in line and "cost_usd=0.0" in line
    assert any("refused status=404 code=model_not_found" in m for m in lines)


def test_litellm_logs_no_line_per_call(gateway, upstream, caplog):
    """Issue 15: every call logged two LiteLLM INFO lines (its handler and the root's), none naming the worker."""
    import logging

    caplog.set_level(logging.INFO)
    with Client(gateway.url, api_key=gateway.api_key) as client:
        client.chat(MESSAGES, model="cheap")
    assert [r for r in caplog.records if r.name == "polyroute.access"]
    assert not [r for r in caplog.records if r.name.startswith("LiteLLM") and r.levelno < logging.WARNING]
    assert not logging.getLogger("LiteLLM").handlers  # what it does log appears once, in our format


def test_a_prompt_over_every_window_is_400_context_length_exceeded(gateway, upstream):
    """Issue 15: it was a 502 after trying every worker; a worker with the same window cannot fit it either."""
    for model in ("cheap-model", "mid-model", "pricey-model"):
        upstream.behave(model, context_window=50)  # the catalog says 8192 for all three: same window
    long_prompt = [{"role": "user", "content": "word " * 200}]
    response = httpx.post(
        gateway.v1 + "/chat/completions",
        headers=gateway.auth(),
        json={"model": "auto", "messages": long_prompt},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == "messages" and "maximum context length is 50" in error["message"]
    assert len(upstream.requests_for("cheap-model")) == 1  # not retried: a client fault
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")
    with pytest.raises(openai.BadRequestError) as info:  # what the openai package makes of it
        openai_client(gateway).chat.completions.create(model="auto", messages=long_prompt, stream=True)
    assert info.value.code == "context_length_exceeded"


def test_a_larger_window_is_still_tried(upstream, tmp_path):
    import yaml

    from policies import parse_catalog
    from tests.conftest import catalog_yaml_for, start_gateway

    config = yaml.safe_load(catalog_yaml_for(upstream.url))
    for worker in config["workers"]:
        if worker["name"] == "pricey":
            worker["context_window"] = 131072  # cheap and mid keep 8192
    text = yaml.safe_dump(config)
    gw = start_gateway(parse_catalog(text), tmp_path)
    try:
        upstream.behave("cheap-model", context_window=50)
        upstream.behave("mid-model", context_window=50)
        upstream.behave("pricey-model", text="the long context fits here")
        raw = openai_client(gw).chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "word " * 200}]
        )
        assert raw.parse().choices[0].message.content == "the long context fits here"
        assert raw.headers["x-polyroute-fallbacks"] == "cheap"  # mid (same 8192 window) was skipped
        assert not upstream.requests_for("mid-model")
    finally:
        gw.server.stop()
