"""The OpenAI-wire fast path of gateway/upstream.py against the real test upstream (loopback).

OpenAI-wire workers are called over our pooled HTTP client with litellm's provider transforms;
everything else still goes through litellm.acompletion. Both paths must send the same request,
give the same clean output, and fail the same way.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import Completion, OpenStream, WorkerClient, WorkerError, to_worker_error
from policies import Worker, parse_catalog
from tests.conftest import FAKE_KEY_ENV

pytestmark = pytest.mark.anyio

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello in five words"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")


def make_worker(model: str, api_base: str, timeout_s: float = 30.0) -> Worker:
    catalog = f"""
version: 1
workers:
  - name: w
    model: {model}
    api_base: {api_base}
    api_key_env: {FAKE_KEY_ENV}
    input_price_per_m: 1.0
    output_price_per_m: 2.0
    tier: open-moe
    license: MIT
    provider: fake
    jurisdiction: US
    context_window: 8192
    timeout_s: {timeout_s}
"""
    return parse_catalog(catalog, "fast path test").workers[0]


def client(fast_path: bool = True, retries: int = 2) -> WorkerClient:
    return WorkerClient(Metrics(), retries=retries, backoff_s=0.01, fast_path=fast_path)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="w", messages=fields.pop("messages", MESSAGES), **fields)


def normalised(value):
    """Ids and timestamps differ per call; everything else must match."""
    text = re.sub(r'"(chatcmpl|call)[-_][0-9a-f]+"', '"ID"', json.dumps(value, sort_keys=True))
    return json.loads(re.sub(r'"created": \d+', '"created": 0', text))


def content_chunks(chunks: list[dict]) -> list[dict]:
    """Drop litellm's no-op chunks (empty delta, no finish reason): its stream wrapper adds one."""
    return [
        c
        for c in chunks
        if not (
            c["choices"] and all(ch["delta"] == {} and ch["finish_reason"] is None for ch in c["choices"])
        )
    ]


async def collect(stream: OpenStream) -> list[dict]:
    return [chunk async for chunk in stream]


# ---- which path ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, provider, name",
    [
        ("openai/cheap-model", "openai", "cheap-model"),
        ("deepseek/deepseek-chat", "deepseek", "deepseek-chat"),
        (
            "together_ai/Qwen/Qwen3-235B-A22B-Instruct-2507-tput",
            "together_ai",
            "Qwen/Qwen3-235B-A22B-Instruct-2507-tput",
        ),
        ("mistral/codestral-latest", "mistral", "codestral-latest"),
        ("hosted_vllm/llama", "hosted_vllm", "llama"),
    ],
)
def test_openai_wire_workers_resolve_to_the_fast_path(upstream, model, provider, name):
    worker = make_worker(model, upstream.url + "/v1")
    route = client().wire_route(worker, worker.api_base)
    assert route is not None
    assert (route.provider, route.model, route.api_base) == (provider, name, upstream.url + "/v1")
    url, headers, body = route.request({}, [{"role": "user", "content": "hi"}], stream=False)
    assert url == upstream.url + "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer sk-test-upstream"
    assert json.loads(body) == {"model": name, "messages": [{"role": "user", "content": "hi"}]}


def test_non_openai_provider_and_the_switch_resolve_to_litellm(upstream):
    anthropic = make_worker("anthropic/claude-sonnet-4-20250514", upstream.url)
    assert client().wire_route(anthropic, anthropic.api_base) is None
    openai_worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    assert client(fast_path=False).wire_route(openai_worker, openai_worker.api_base) is None


async def test_fast_path_is_taken_for_an_openai_worker(upstream):
    upstream.behave("cheap-model", text="fast hello", prompt_tokens=1000, completion_tokens=500)
    fast = client()
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    result = await fast.complete(worker, worker.api_base, chat())
    assert isinstance(result, Completion)
    assert result.body["choices"][0]["message"]["content"] == "fast hello"
    assert str(result.cost_usd) == "0.002000000"  # 1000 * $1/1M + 500 * $2/1M, through litellm
    assert len(fast.pool._sessions) == 1  # the call went over our pooled client
    await fast.aclose()


async def test_non_openai_provider_still_goes_through_litellm(upstream):
    """An anthropic worker is called by litellm (Messages API): the test upstream has no such route."""
    worker = make_worker("anthropic/claude-sonnet-4-20250514", upstream.url)
    calls = client(retries=0)
    with pytest.raises(WorkerError) as info:
        await calls.complete(worker, worker.api_base, chat())
    assert info.value.status == 404 and info.value.fallback
    assert not calls.pool._sessions  # our HTTP pool was never used
    assert not upstream.requests  # and nothing reached /chat/completions


# ---- same output as the litellm path --------------------------------------------------------------
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
async def test_plain_completion_is_identical_to_the_litellm_path(upstream, tools):
    upstream.behave(
        "cheap-model", text="identical words", tool_call={"name": "get_weather", "arguments": "{}"}
    )
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    request = chat(
        temperature=0.2,
        max_tokens=50,
        seed=7,
        stop=["\n\n"],
        **({"tools": TOOLS, "tool_choice": "auto"} if tools else {}),
    )
    results, sent = [], []
    for fast_path in (False, True):
        upstream.reset()
        upstream.behave(
            "cheap-model", text="identical words", tool_call={"name": "get_weather", "arguments": "{}"}
        )
        calls = client(fast_path=fast_path)
        result = await calls.complete(worker, worker.api_base, request)
        results.append(
            (normalised(result.body), result.prompt_tokens, result.completion_tokens, result.cost_usd)
        )
        sent.append(list(upstream.requests))
        await calls.aclose()
    assert sent[0] == sent[1]  # the same request body upstream
    assert results[0] == results[1]


async def test_streamed_completion_is_identical_to_the_litellm_path(upstream):
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    request = chat(stream=True, temperature=0.5)
    outputs, sent = [], []
    for fast_path in (False, True):
        upstream.reset()
        upstream.behave("cheap-model", text="one two three four", prompt_tokens=10, completion_tokens=4)
        calls = client(fast_path=fast_path)
        stream = await calls.open_stream(worker, worker.api_base, request)
        chunks = await collect(stream)
        outputs.append(
            (
                normalised(content_chunks(chunks)),
                stream.prompt_tokens,
                stream.completion_tokens,
                stream.cost_usd,
            )
        )
        sent.append(list(upstream.requests))
        await calls.aclose()
    assert sent[0] == sent[1]
    assert sent[1][0]["stream_options"] == {"include_usage": True}  # asked for, whatever the client wants
    assert outputs[0] == outputs[1]
    chunks = outputs[1][0]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == (
        "one two three four"
    )
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    assert not chunks[-1]["choices"]
    assert all(c["model"] == "w" for c in chunks)


# ---- failures -----------------------------------------------------------------------------------
async def test_5xx_is_retried_then_fails_over(upstream):
    upstream.behave("cheap-model", status=503)
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    with pytest.raises(WorkerError) as info:
        await client(retries=2).complete(worker, worker.api_base, chat())
    assert info.value.status == 503 and info.value.fallback
    assert "fake upstream error 503" in info.value.message
    assert len(upstream.requests_for("cheap-model")) == 3


async def test_transient_429_is_retried_and_succeeds(upstream):
    upstream.behave("cheap-model", status=429, fail_times=1, text="after a retry")
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    stream = await client().open_stream(worker, worker.api_base, chat(stream=True))
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in await collect(stream) if c["choices"]
    )
    assert text == "after a retry"
    assert len(upstream.requests_for("cheap-model")) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_400_is_a_client_fault_and_not_retried(upstream, stream):
    upstream.behave("cheap-model", status=400)
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    calls = client()
    with pytest.raises(WorkerError) as info:
        if stream:
            await calls.open_stream(worker, worker.api_base, chat(stream=True))
        else:
            await calls.complete(worker, worker.api_base, chat())
    assert info.value.status == 400 and not info.value.fallback
    assert len(upstream.requests_for("cheap-model")) == 1


def test_context_window_400_may_fall_back(upstream):
    """litellm's exception mapping classifies the provider's message, as on its own path."""
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    route = client().wire_route(worker, worker.api_base)
    body = b'{"error": {"message": "This model\'s maximum context length is 8192 tokens. However, you requested 9000"}}'
    err = to_worker_error(worker, route.status_error(400, body, httpx.Headers()))
    assert err.status == 400 and err.fallback
    plain = to_worker_error(
        worker, route.status_error(400, b'{"error": {"message": "bad"}}', httpx.Headers())
    )
    assert plain.status == 400 and not plain.fallback


async def test_mid_stream_drop_raises_from_iteration_and_the_pool_recovers(upstream):
    upstream.behave("cheap-model", text="one two three four five six", drop_after_chunks=2)
    worker = make_worker("openai/cheap-model", upstream.url + "/v1")
    calls = client()
    stream = await calls.open_stream(worker, worker.api_base, chat(stream=True))
    received = []
    with pytest.raises(WorkerError) as info:
        async for chunk in stream:
            received.append(chunk)
    assert info.value.fallback
    assert "one " in "".join(c["choices"][0]["delta"].get("content") or "" for c in received if c["choices"])
    assert len(upstream.requests_for("cheap-model")) == 1  # no retry once the stream is open
    upstream.behave("cheap-model", text="fine again")
    result = await calls.complete(worker, worker.api_base, chat())
    assert result.body["choices"][0]["message"]["content"] == "fine again"
    await calls.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_timeout_is_504_after_retries(upstream, stream):
    upstream.behave("cheap-model", latency_s=2.0)
    worker = make_worker("openai/cheap-model", upstream.url + "/v1", timeout_s=0.3)
    calls = client(retries=1)
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        if stream:
            await calls.open_stream(worker, worker.api_base, chat(stream=True))
        else:
            await calls.complete(worker, worker.api_base, chat())
    assert info.value.status == 504 and info.value.fallback
    assert time.monotonic() - started < 1.5  # two attempts of 0.3 s, not the upstream's 2 s
    assert len(upstream.requests_for("cheap-model")) == 2


async def test_silence_mid_stream_times_out(upstream):
    """The first word arrives, then nothing: the stream is open (a silence before any content is a
    failed call, which falls back: tests/test_stream_cut_before_content.py), and the worker's timeout
    ends it mid-stream."""
    upstream.behave("cheap-model", text="slow words here", stall_after_chunks=1)
    worker = make_worker("openai/cheap-model", upstream.url + "/v1", timeout_s=0.3)
    stream = await client().open_stream(worker, worker.api_base, chat(stream=True))
    with pytest.raises(WorkerError) as info:
        await collect(stream)
    assert info.value.status == 504


async def test_connection_refused_is_retryable_and_may_fall_back():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = make_worker("openai/cheap-model", f"http://127.0.0.1:{port}/v1")
    with pytest.raises(WorkerError) as info:
        await client(retries=1).complete(worker, worker.api_base, chat())
    assert info.value.fallback and info.value.status >= 500


async def test_stream_without_provider_usage_is_counted_by_litellm(upstream):
    """Mistral's litellm config does not request stream usage: the token counter stands in."""
    upstream.behave("codestral-latest", text="Hello from the test upstream.")
    worker = make_worker("mistral/codestral-latest", upstream.url + "/v1")
    stream = await client().open_stream(worker, worker.api_base, chat(stream=True))
    chunks = await collect(stream)
    assert "stream_options" not in upstream.requests_for("codestral-latest")[0]
    assert chunks[-1]["usage"]["completion_tokens"] == stream.completion_tokens > 0
    assert stream.prompt_tokens > 0 and stream.cost_usd > 0
