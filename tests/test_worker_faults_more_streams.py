"""Streams reached through `litellm.acompletion` (gateway/upstream.py): an Anthropic worker's stream
cut before `message_stop`, and usage litellm makes up for a worker that streamed none.

litellm's stream wrapper ends a provider stream that stopped without a finish reason with a finish
chunk of its own ("stop"), and, asked for stream usage, sends a usage chunk whether or not the
provider did, counted by its tokenizer over the bare messages. So an Anthropic stream closed after
some content_block_delta events passed for a whole answer (200, [DONE], a made-up "stop"), and a
local worker's stream without usage (llama.cpp's server sends none) was billed on litellm's count and
reported as the provider's, when POLYROUTE_FAST_PATH=false. The OpenAI-wire fast path already saw
both (tests/test_worker_faults_gateway.py, tests/test_accounting_local_stream.py).

Real parts only: gateways on uvicorn and WorkerClient in-process, in front of the loopback test
upstream, which speaks Anthropic's Messages wire on /v1/messages and cuts streams on demand.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import litellm
import orjson
import pytest

from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import WorkerClient, WorkerError
from policies import load_catalog, parse_catalog
from tests.conftest import (
    FAKE_KEY_ENV,
    Gateway,
    catalog_yaml_for,
    ledger_record,
    start_gateway,
)
from tests.fakes.upstream import FakeUpstream
from tests.test_anthropic_fixes import CLAUDE_WORKER
from tests.test_worker_faults_paths import make_worker

MESSAGES = [{"role": "user", "content": "hello there friend"}]
TEXT = "one two three four five"
LOCAL = "gemma-3-270m-local"


pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


def _gateway(fake: FakeUpstream, data_dir, **settings) -> Gateway:
    catalog = catalog_yaml_for(fake.url) + CLAUDE_WORKER.format(url=fake.url, key_env=FAKE_KEY_ENV)
    return start_gateway(parse_catalog(catalog, "litellm streams"), data_dir, **settings)


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory) -> Iterator[Gateway]:
    """The fast path on (the default): an anthropic worker goes through litellm all the same."""
    gateway = _gateway(fake, tmp_path_factory.mktemp("litellm-streams"))
    yield gateway
    gateway.server.stop()


@pytest.fixture(scope="module")
def slow_gw(fake, tmp_path_factory) -> Iterator[Gateway]:
    """POLYROUTE_FAST_PATH=false: every worker through litellm.acompletion."""
    gateway = _gateway(fake, tmp_path_factory.mktemp("litellm-only"), fast_path=False)
    yield gateway
    gateway.server.stop()


def _sse(gw: Gateway, model: str) -> tuple[dict[str, str], list[str]]:
    """A streamed chat call (usage asked for): its headers and data lines."""
    body = {"model": model, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
        return dict(response.headers), lines


def _text(lines: list[str]) -> str:
    chunks = [orjson.loads(line[5:]) for line in lines if line != "data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


# ---- 1. an Anthropic worker's stream cut before message_stop ---------------------------------------
@pytest.mark.parametrize(
    "cut",
    [{"end_after_chunks": 2}, {"drop_after_chunks": 2}],
    ids=["closed-cleanly", "connection-reset"],
)
def test_an_anthropic_stream_cut_before_message_stop_is_an_error_and_a_billed_502(gw, fake, cut):
    """Closed cleanly after two content_block_delta events, litellm's wrapper made up a "stop": the
    client got [DONE] after half an answer, the ledger a 200. A reset was already a failure."""
    fake.behave("claude-fake", text=TEXT, **cut)
    headers, lines = _sse(gw, "claude")
    assert headers["x-polyroute-worker"] == "claude"
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][5:])["error"]
    assert error["code"] == "upstream_stream_error" and "mid-stream" in error["message"]
    assert _text(lines[:-2]) == "one two "
    assert not any('"finish_reason":"stop"' in line for line in lines)  # no made-up end
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 502 and record["worker"] == "claude"
    assert record["trace"]["stream"] == "mid_stream_error"
    assert record["trace"]["usage"] == "estimated"  # Anthropic's final usage never came
    assert record["completion_tokens"] > 0 and record["cost_micros"] > 0  # what was streamed is billed
    assert len(fake.requests_for("claude-fake")) == 1  # bytes went out: no retry, no fallback


def test_the_anthropic_sdk_raises_on_an_anthropic_workers_cut_stream(gw, fake):
    """The same cut seen through the Messages API (gateway/anthropic_stream.py writes the error)."""
    fake.behave("claude-fake", text=TEXT, end_after_chunks=3)
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=60)
    received = []
    with pytest.raises(anthropic.APIStatusError, match="mid-stream"):
        with client.messages.stream(model="claude", max_tokens=32, messages=MESSAGES) as stream:
            for text in stream.text_stream:
                received.append(text)
    assert "".join(received) == "one two three "


def test_a_whole_anthropic_stream_is_still_whole_with_the_providers_usage(gw, fake):
    """No false alarm: message_delta brings the stop reason and the usage, message_stop the end."""
    fake.behave("claude-fake", text=TEXT, prompt_tokens=11, completion_tokens=5)
    headers, lines = _sse(gw, "claude")
    assert lines[-1] == "data: [DONE]" and _text(lines) == TEXT
    assert not any('"error"' in line for line in lines)
    final = orjson.loads(lines[-2][5:])
    assert final["usage"]["prompt_tokens"] == 11 and final["usage"]["completion_tokens"] == 5
    assert final["polyroute"]["usage"] == "reported"
    record = ledger_record(gw, headers["x-polyroute-request-id"])
    assert record["status"] == 200 and (record["trace"] or {}).get("usage") is None


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])
@pytest.mark.anyio
async def test_an_openai_wire_stream_cut_cleanly_fails_on_both_paths(fake, fast_path, monkeypatch):
    """The litellm path made up the same "stop" for an OpenAI-wire worker (POLYROUTE_FAST_PATH=false)."""
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")
    fake.behave("cheap-model", text=TEXT, end_after_chunks=2)
    worker = make_worker(fake.url + "/v1")
    client = WorkerClient(Metrics(), retries=0, fast_path=fast_path)
    stream = await client.open_stream(
        worker, worker.api_base, ChatCompletionRequest(model="w", messages=MESSAGES, stream=True)
    )
    texts = []
    with pytest.raises(WorkerError, match="ended before the answer did"):
        async for chunk in stream:
            texts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    assert "".join(texts) == "one two " and "stop" not in stream.finish_reasons
    await client.aclose()


# ---- 4. usage litellm makes up for a worker that streamed none -------------------------------------
def _template_count(messages: list[dict]) -> int:
    worker = load_catalog().get(LOCAL)
    return litellm.token_counter(model=worker.model, text=worker.local.template.render(messages))


@pytest.mark.anyio
async def test_a_local_workers_stream_without_usage_is_estimated_on_litellms_path_too(fake):
    """The catalog's local worker (a chat template, OpenAI wire) in front of the test upstream, which
    streams no usage as llama.cpp's server does. litellm's made-up count was of the bare message
    (8 tokens for "Hi") and passed for the provider's; the fast path's counts the rendered template."""
    worker = load_catalog().get(LOCAL)
    hi = [{"role": "user", "content": "Hi"}]
    fake.behave("gemma-3-270m", text="Hello.", stream_usage=False)
    counts = {}
    for fast_path in (True, False):
        client = WorkerClient(Metrics(), retries=0, fast_path=fast_path)
        chat = ChatCompletionRequest(model=LOCAL, messages=hi, stream=True)
        stream = await client.open_stream(worker, fake.url + "/v1", chat)
        chunks = [chunk async for chunk in stream]
        await client.aclose()
        assert stream.usage_estimated, fast_path
        assert chunks[-1]["usage"]["prompt_tokens"] == stream.prompt_tokens
        assert [c for c in chunks if c.get("usage")] == [chunks[-1]]  # one usage chunk, litellm's gone
        counts[fast_path] = (stream.prompt_tokens, stream.completion_tokens)
    assert counts[False] == counts[True]
    assert counts[False][0] == _template_count(hi) > 50


def test_a_stream_without_usage_says_estimated_with_the_fast_path_off(slow_gw, fake):
    fake.behave("cheap-model", text=TEXT, stream_usage=False)
    headers, lines = _sse(slow_gw, "cheap")
    final = orjson.loads(lines[-2][5:])
    assert final["polyroute"]["usage"] == "estimated"
    record = ledger_record(slow_gw, headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["trace"]["usage"] == "estimated"
    assert record["prompt_tokens"] == final["usage"]["prompt_tokens"] > 0


def test_usage_the_worker_streamed_is_still_reported_with_the_fast_path_off(slow_gw, fake):
    fake.behave("cheap-model", text=TEXT, prompt_tokens=40, completion_tokens=5)
    headers, lines = _sse(slow_gw, "cheap")
    final = orjson.loads(lines[-2][5:])
    assert final["polyroute"]["usage"] == "reported"
    assert (final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"]) == (40, 5)
    record = ledger_record(slow_gw, headers["x-polyroute-request-id"])
    assert record["status"] == 200 and (record["trace"] or {}).get("usage") is None
    assert (record["prompt_tokens"], record["completion_tokens"]) == (40, 5)
