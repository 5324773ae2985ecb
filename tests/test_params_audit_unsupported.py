"""OpenAI parameters a worker's provider has no equivalent for, through the official `openai` SDK.

litellm refuses to build a request whose parameter the provider lacks (an Anthropic worker has no
`seed`, no `frequency_penalty`, no `logprobs`; a Mistral one no penalties), before anything is
sent. That says nothing about the request: on `auto` another admissible worker may take it, so the
gateway falls back past that worker, and the next one gets the same parameters. A pinned worker's
client is told, with a 400 `unsupported_parameter` whose `param` names what to leave out — not
litellm's advice to set `drop_params`, which a client cannot do.
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

# Priced between mid (1.00) and pricey (5.00): `auto` (cheapest first) tries cheap, mid, claude, pricey.
CLAUDE = """
  - name: claude
    model: anthropic/claude-fake
    api_base: {url}
    api_key_env: {key_env}
    context_window: 8192
    input_price_per_m: 3.00
    output_price_per_m: 4.00
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
"""
# An OpenAI-wire provider (the aiohttp fast path) whose litellm config has no penalties; the
# dearest, so `auto` reaches it last.
MISTRAL = """
  - name: mistral
    model: mistral/mistral-fake
    api_base: {url}/v1
    api_key_env: {key_env}
    context_window: 8192
    input_price_per_m: 8.00
    output_price_per_m: 20.00
    tier: open-moe
    license: Apache-2.0
    provider: fake
    jurisdiction: FR
"""
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(up, tmp_path_factory.mktemp("params_audit_unsupported"), (CLAUDE + MISTRAL)) as gateway:
        yield gateway


@pytest.fixture
def sdk(gw: Gateway, up: FakeUpstream) -> openai.OpenAI:
    up.reset()
    up.behave("claude-fake")  # Anthropic's wire on the test upstream answers only models set up
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=120)


def _sent(up: FakeUpstream, model: str) -> list[dict]:
    """What `model` received, without the model name and messages (the parameters alone)."""
    return [{k: v for k, v in r.items() if k not in ("model", "messages")} for r in up.requests_for(model)]


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 7},
        {"frequency_penalty": 0.5, "presence_penalty": 0.25},
        {"logprobs": True, "top_logprobs": 2},
    ],
    ids=["seed", "penalties", "logprobs"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_auto_falls_back_past_a_worker_without_the_parameter(sdk, up, params, stream):
    """cheap and mid fail; claude (next) has no such parameter; pricey gets the very same ones."""
    up.behave("cheap-model", status=503)
    up.behave("mid-model", status=503)
    raw = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, stream=stream, **params
    )
    assert raw.headers["x-polyroute-worker"] == "pricey"
    assert raw.headers["x-polyroute-fallbacks"] == "cheap,mid,claude"
    # claude's request was never built, so never sent, and cannot be billed
    assert "claude:not_sent" in raw.headers["x-polyroute-attempts"].split(",")
    assert not up.requests_for("claude-fake")
    answer = raw.parse()
    text = (
        "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        if stream
        else answer.choices[0].message.content
    )
    assert text == "Hello from the test upstream."
    # the retried workers all got the client's parameters, unchanged
    first = _sent(up, "cheap-model")[0]
    for key, value in params.items():
        assert first[key] == value
    assert _sent(up, "pricey-model")[0] == first


@pytest.mark.parametrize(
    ("model", "params", "param"),
    [
        ("claude", {"seed": 7}, "seed"),
        ("claude", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("claude", {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("mistral", {"presence_penalty": 0.5}, "presence_penalty"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_pinned_worker_without_the_parameter_is_a_clear_400(sdk, up, model, params, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MESSAGES, stream=stream, **params)
    error = info.value.body
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == param
    assert error["message"].startswith(f"The worker {model} cannot take {param}: leave it out")
    assert "drop_params" not in error["message"]  # litellm's configuration is not the client's
    assert not up.requests  # nothing was sent to any worker


def test_every_parameter_the_worker_lacks_is_named(sdk, up):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="claude", messages=MESSAGES, seed=1, frequency_penalty=0.1)
    error = info.value.body
    assert error["param"] in ("seed", "frequency_penalty")
    assert "seed" in error["message"] and "frequency_penalty" in error["message"]
    assert "leave them out" in error["message"]


def test_the_pinned_worker_answers_what_it_can_take(sdk, up):
    """The same worker answers when the request holds only parameters its provider has."""
    raw = sdk.chat.completions.with_raw_response.create(
        model="claude", messages=MESSAGES, temperature=0.2, stop=["END"], max_completion_tokens=40
    )
    assert raw.headers["x-polyroute-worker"] == "claude"
    (sent,) = _sent(up, "claude-fake")
    assert sent["temperature"] == 0.2 and sent["stop_sequences"] == ["END"] and sent["max_tokens"] == 40
