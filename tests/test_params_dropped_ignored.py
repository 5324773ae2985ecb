"""Parameters litellm's mapping leaves out of a worker's request without an error, named back.

litellm refuses some parameters outright (tests/test_params_audit_unsupported.py); two others it
drops in silence: `user` for an OpenAI-wire model outside OpenAI's own catalog (a vLLM, llama.cpp,
Together, DeepSeek or Mistral worker: `user` is not validated, and such a model's config does not
list it), and `response_format: {"type": "json_object"}` for an Anthropic worker. The answering
worker's request is what decides: the response names in `x-polyroute-ignored` each parameter the
client sent that it went without (as /v1/messages names the fields it does not forward), and the
ledger's trace says so (`ignored_params`). Nothing is forced on the worker: a provider that refuses
unknown fields would fail the request instead. Through the official `openai` SDK against the test
upstream, whose records show what each worker received.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import (
    Gateway,
    gateway_with,
    ledger_record,
)
from tests.fakes.upstream import FakeUpstream
from tests.test_params_audit_unsupported import CLAUDE, MISTRAL

# An OpenAI model litellm's catalog lists (its config keeps `user`), on the test upstream; the dearest.
CATALOGUED = """
  - name: catalogued
    model: openai/gpt-4o-mini
    api_base: {url}/v1
    api_key_env: {key_env}
    context_window: 8192
    input_price_per_m: 9.00
    output_price_per_m: 30.00
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
"""
MESSAGES = [{"role": "user", "content": "Say hello"}]
IGNORED = "x-polyroute-ignored"
MODEL_OF = {"cheap": "cheap-model", "mistral": "mistral-fake", "claude": "claude-fake"}


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(
        up, tmp_path_factory.mktemp("params_dropped_ignored"), (CLAUDE + MISTRAL + CATALOGUED)
    ) as gateway:
        yield gateway


@pytest.fixture
def sdk(gw: Gateway, up: FakeUpstream) -> openai.OpenAI:
    up.reset()
    up.behave("claude-fake")  # Anthropic's wire on the test upstream answers only models set up
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=120)


def _ask(sdk: openai.OpenAI, stream: bool, **request):
    """The raw response, its body read to the end (a stream's ledger record is written at its end)."""
    raw = sdk.chat.completions.with_raw_response.create(messages=MESSAGES, stream=stream, **request)
    answer = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content
    assert text
    return raw


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("worker", ["cheap", "mistral"])
def test_user_an_openai_wire_worker_outside_openais_catalog_went_without_is_named(
    gw, sdk, up, worker, stream
):
    raw = _ask(sdk, stream, model=worker, user="end-user-7", temperature=0.3)
    assert raw.headers["x-polyroute-worker"] == worker
    assert raw.headers[IGNORED] == "user"
    (sent,) = up.requests_for(MODEL_OF[worker])
    assert "user" not in sent and sent["temperature"] == 0.3  # what it names is what was left out
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["ignored_params"] == ["user"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_json_object_an_anthropic_worker_went_without_is_named(gw, sdk, up, stream):
    raw = _ask(sdk, stream, model="claude", response_format={"type": "json_object"}, user="end-user-7")
    assert raw.headers[IGNORED] == "response_format"
    (sent,) = up.requests_for("claude-fake")
    assert "tools" not in sent and "tool_choice" not in sent  # no forced JSON tool either
    assert sent["metadata"] == {"user_id": "end-user-7"}  # `user` reached it: not named
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["ignored_params"] == ["response_format"]


@pytest.mark.parametrize(
    ("worker", "params"),
    [
        ("catalogued", {"user": "end-user-7", "seed": 3}),  # OpenAI's own model: `user` is sent
        ("cheap", {"response_format": {"type": "json_object"}, "seed": 3, "stop": ["END"]}),
        ("claude", {"user": "end-user-7", "temperature": 0.2, "stop": ["END"]}),
        (
            "claude",  # json_schema reaches Anthropic as a forced tool call
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "greeting", "schema": {"type": "object", "properties": {}}},
                }
            },
        ),
    ],
    ids=["catalogued-user", "openai-wire-json", "claude-user", "claude-json-schema"],
)
def test_parameters_the_worker_received_are_not_named(gw, sdk, up, worker, params):
    raw = sdk.chat.completions.with_raw_response.create(model=worker, messages=MESSAGES, **params)
    assert raw.headers["x-polyroute-worker"] == worker
    assert IGNORED not in raw.headers
    model = MODEL_OF.get(worker, "gpt-4o-mini")
    (sent,) = up.requests_for(model)
    if worker != "claude":
        assert {k: sent[k] for k in params} == params  # the OpenAI wire: sent as they came
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert "ignored_params" not in (record.get("trace") or {})


def test_auto_names_what_the_worker_that_answered_went_without(gw, sdk, up):
    """cheap and mid fail; claude (next by price) answers and keeps `user` as metadata; the header
    speaks of claude's request, not of the failed workers' (which dropped `user`)."""
    for model in ("cheap-model", "mid-model"):
        up.behave(model, status=503)
    raw = _ask(sdk, False, model="auto", user="end-user-7", response_format={"type": "json_object"})
    assert raw.headers["x-polyroute-worker"] == "claude"
    assert raw.headers[IGNORED] == "response_format"
    assert "user" not in up.requests_for("cheap-model")[0]  # what the failed one went without


def test_what_is_named_follows_the_request_not_the_first_one_of_its_shape(sdk, up):
    """The check is cached per provider, model and kind of parameters: another end user's id, or
    `json_object` after `json_schema`, is judged on its own."""
    schema = {"type": "json_schema", "json_schema": {"name": "g", "schema": {"type": "object"}}}
    first = sdk.chat.completions.with_raw_response.create(
        model="claude", messages=MESSAGES, user="a", response_format=schema
    )
    second = sdk.chat.completions.with_raw_response.create(
        model="claude", messages=MESSAGES, user="b", response_format={"type": "json_object"}
    )
    third = sdk.chat.completions.with_raw_response.create(model="cheap", messages=MESSAGES, user="c")
    assert IGNORED not in first.headers
    assert second.headers[IGNORED] == "response_format"
    assert third.headers[IGNORED] == "user"
