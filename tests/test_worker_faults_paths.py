"""The same worker faults on both ways a worker is reached: the OpenAI-wire fast path and
`litellm.acompletion` (gateway/upstream.py). A 200 with no choices, an answer without usage and a
long Retry-After must be told apart, billed and retried the same way whichever path called.

Real parts only: WorkerClient in-process against the loopback test upstream (tests/fakes/upstream.py).
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from gateway.metrics import Metrics
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import WorkerClient, WorkerError, litellm_cost
from policies import Worker
from tests.conftest import FAKE_KEY_ENV
from tests.test_upstream_fastpath import make_worker as fast_path_worker

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Say hello in five words"}]


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, "sk-test-upstream")


def make_worker(api_base: str, timeout_s: float = 60.0) -> Worker:
    """The fast-path tests' worker "w" (openai/cheap-model) at `api_base`; 60 s is the catalog's
    default timeout."""
    return fast_path_worker("openai/cheap-model", api_base, timeout_s)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="w", messages=MESSAGES, **fields)


def tokens(metrics: Metrics, kind: str) -> float:
    return metrics.registry.get_sample_value("polyroute_tokens_total", {"worker": "w", "kind": kind}) or 0.0


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])
async def test_a_plain_answer_with_no_choices_comes_back_with_its_bill(upstream, fast_path):
    """Each caller judges an empty answer (the chat pipeline falls back, tests/test_worker_faults_
    gateway.py; a workflow step counts it an empty answer): it comes back once, with what it cost."""
    upstream.behave("cheap-model", empty_choices=True, prompt_tokens=1000, completion_tokens=500)
    worker = make_worker(upstream.url + "/v1")
    metrics = Metrics()
    result = await WorkerClient(metrics, retries=2, backoff_s=0.01, fast_path=fast_path).complete(
        worker, worker.api_base, chat()
    )
    assert result.body["choices"] == []
    assert (result.prompt_tokens, result.completion_tokens) == (1000, 500)
    assert result.cost_usd == litellm_cost(worker, 1000, 500) > 0
    assert len(upstream.requests_for("cheap-model")) == 1
    assert tokens(metrics, "prompt") == 1000


async def test_a_stream_of_no_choices_fails_before_its_first_byte(upstream):
    """The fast path only: litellm's stream wrapper makes up a finish chunk for such a stream (an
    empty answer that says "stop"), which cannot be told from a model that chose to say nothing."""
    upstream.behave("cheap-model", empty_choices=True, prompt_tokens=1000, completion_tokens=500)
    worker = make_worker(upstream.url + "/v1")
    calls = WorkerClient(Metrics(), retries=2, backoff_s=0.01)
    with pytest.raises(WorkerError) as info:
        await calls.open_stream(worker, worker.api_base, chat(stream=True))
    err = info.value
    assert err.fallback and "no choices" in err.message
    assert (err.prompt_tokens, err.completion_tokens) == (1000, 500)
    assert err.cost_usd == litellm_cost(worker, 1000, 500)
    assert len(upstream.requests_for("cheap-model")) == 1  # it answered: asking again bills again
    assert tokens(calls.metrics, "prompt") == 1000  # the metrics count what the provider billed


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])
async def test_an_answer_without_usage_is_counted_here(upstream, fast_path):
    """litellm's path fills in zeros for a provider's missing usage; ours left none: both were $0."""
    upstream.behave(
        "cheap-model",
        raw_body='{"id": "c1", "object": "chat.completion", "created": 1, "model": "m", '
        '"choices": [{"index": 0, "message": {"role": "assistant", "content": "four words of answer"}, '
        '"finish_reason": "stop"}]}',
    )
    worker = make_worker(upstream.url + "/v1")
    result = await WorkerClient(Metrics(), retries=0, fast_path=fast_path).complete(
        worker, worker.api_base, chat()
    )
    assert result.usage_estimated
    assert result.prompt_tokens > 0 and result.completion_tokens > 0
    assert result.cost_usd == litellm_cost(worker, result.prompt_tokens, result.completion_tokens) > 0
    usage = result.body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        result.prompt_tokens,
        result.completion_tokens,
    )


async def test_reported_usage_is_not_marked_estimated(upstream):
    upstream.behave("cheap-model", prompt_tokens=7, completion_tokens=3)
    worker = make_worker(upstream.url + "/v1")
    result = await WorkerClient(Metrics(), retries=0).complete(worker, worker.api_base, chat())
    assert not result.usage_estimated and (result.prompt_tokens, result.completion_tokens) == (7, 3)
    assert result.cost_usd == Decimal("0.000013")


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_retry_after_beyond_the_backoff_is_given_up_at_once(upstream, fast_path, stream):
    upstream.behave("cheap-model", status=429, retry_after_s=30)
    worker = make_worker(upstream.url + "/v1")
    calls = WorkerClient(Metrics(), retries=2, backoff_s=0.01, fast_path=fast_path)
    with pytest.raises(WorkerError) as info:
        if stream:
            await calls.open_stream(worker, worker.api_base, chat(stream=True))
        else:
            await calls.complete(worker, worker.api_base, chat())
    assert info.value.status == 429 and info.value.retry_after_s == 30
    assert len(upstream.requests_for("cheap-model")) == 1
