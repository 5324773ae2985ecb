"""What stop 31 left open on naming parameters a worker's request went without (x-polyroute-ignored).

1. /v1/messages and /v1/responses recorded litellm's silent drops in the ledger trace only
   (`ignored_params`), not in their own header: now named there too, in the client's field names
   (a Messages `metadata.user_id`, sent as chat's `user` and dropped, is `metadata.user_id`; a
   Responses `text.format` sent as `response_format` is `text.format`), merged with what the header
   named already, plain and streamed.
2. A composed answer (compose:<workflow>) named nothing its steps' workers dropped: now named once,
   whichever steps dropped it, on chat and the other APIs, and in the ledger trace.
3. A function tool's `strict: true` is lost by an Anthropic worker (litellm's mapping keeps the
   tool, not the flag; vLLM's strips it too): named as `tools.N.strict` (the client's tool's index).
4. A Responses function tool without `strict` reached OpenAI-wire workers as `strict: false` (an
   explicit opt-out the client did not ask for): now sent without it.

Through the official `openai` and `anthropic` SDKs against the test upstream, whose records show
what each worker received.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.conftest import FAKE_KEY_ENV, Gateway, gateway_with, ledger_record
from tests.fakes.upstream import FakeUpstream
from tests.test_params_audit_unsupported import CLAUDE

IGNORED = "x-polyroute-ignored"
QUESTION = "What is six times seven?"
JUDGE = "How likely is the proposed answer"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look a city up.", "parameters": SCHEMA},
}
PLAIN_TOOL = {
    "type": "function",
    "function": {"name": "other", "description": "Another tool.", "parameters": SCHEMA},
}


@pytest.fixture(scope="module")
def up(fake: FakeUpstream) -> FakeUpstream:
    return fake  # conftest's: this module's own test upstream


@pytest.fixture(scope="module")
def gw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway_with(up, tmp_path_factory.mktemp("params_gaps_ignored"), CLAUDE) as gateway:
        yield gateway


@pytest.fixture
def fresh(up: FakeUpstream) -> FakeUpstream:
    up.reset()
    up.behave("claude-fake")  # Anthropic's wire on the test upstream answers only models set up
    return up


@pytest.fixture
def oai(gw: Gateway, fresh: FakeUpstream) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=120)


@pytest.fixture
def claude_sdk(gw: Gateway, fresh: FakeUpstream) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key, max_retries=0, timeout=120)


def _drain(parsed, stream: bool) -> None:
    """A stream read to its end: its ledger record is written then."""
    if stream:
        for _ in parsed:
            pass


# ---- 1. the Messages and Responses APIs name a worker's drops in their own header ---------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_names_a_dropped_user_id_in_its_own_words_beside_its_own_fields(
    gw: Gateway, claude_sdk: anthropic.Anthropic, fresh: FakeUpstream, stream: bool
) -> None:
    """`cheap` is an OpenAI-wire model outside OpenAI's catalog: litellm drops `user`, which is
    what `metadata.user_id` became; `top_k` the Messages API names itself."""
    raw = claude_sdk.messages.with_raw_response.create(
        model="cheap",
        max_tokens=50,
        messages=[{"role": "user", "content": "Say hello"}],
        metadata={"user_id": "end-user-7"},
        extra_body={"top_k": 5},
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert raw.headers[IGNORED] == "top_k,metadata.user_id"
    (sent,) = fresh.requests_for("cheap-model")
    assert "user" not in sent and "metadata" not in sent  # what it names is what was left out
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["ignored_params"] == ["user"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_names_nothing_more_when_the_worker_keeps_it(
    claude_sdk: anthropic.Anthropic, fresh: FakeUpstream, stream: bool
) -> None:
    """An Anthropic worker gets `metadata.user_id` back: nothing of it is named."""
    raw = claude_sdk.messages.with_raw_response.create(
        model="claude",
        max_tokens=50,
        messages=[{"role": "user", "content": "Say hello"}],
        metadata={"user_id": "end-user-7"},
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert IGNORED not in raw.headers
    (sent,) = fresh.requests_for("claude-fake")
    assert sent["metadata"] == {"user_id": "end-user-7"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_names_a_dropped_text_format_and_user_in_its_own_words(
    gw: Gateway, oai: openai.OpenAI, fresh: FakeUpstream, stream: bool
) -> None:
    """`json_object` is dropped by an Anthropic worker (chat's `response_format`: the client's
    `text.format`); `include` the Responses API names itself; `user` reaches Anthropic as metadata."""
    raw = oai.responses.with_raw_response.create(
        model="claude",
        input="Say hello in JSON.",
        text={"format": {"type": "json_object"}},
        include=["message.output_text.logprobs"],
        user="end-user-7",
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert raw.headers[IGNORED] == "include,text.format"
    (sent,) = fresh.requests_for("claude-fake")
    assert "tools" not in sent and "output_format" not in sent
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["ignored_params"] == ["response_format"]


def test_responses_names_a_dropped_user_once_with_nothing_of_its_own(
    oai: openai.OpenAI, fresh: FakeUpstream
) -> None:
    raw = oai.responses.with_raw_response.create(model="cheap", input="Say hello", user="end-user-7")
    raw.parse()
    assert raw.headers[IGNORED] == "user"
    (sent,) = fresh.requests_for("cheap-model")
    assert "user" not in sent


# ---- 3. a tool's `strict`, which an Anthropic worker's request goes without ----------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_names_the_strict_an_anthropic_worker_went_without(
    gw: Gateway, oai: openai.OpenAI, fresh: FakeUpstream, stream: bool
) -> None:
    strict = {**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "strict": True}}
    raw = oai.chat.completions.with_raw_response.create(
        model="claude",
        messages=[{"role": "user", "content": "Where is Paris?"}],
        tools=[PLAIN_TOOL, strict],  # type: ignore[list-item]
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert raw.headers[IGNORED] == "tools.1.strict"
    (sent,) = fresh.requests_for("claude-fake")
    assert [t["name"] for t in sent["tools"]] == ["other", "lookup"]  # the tool went, not its flag
    assert all("strict" not in t for t in sent["tools"])
    record = ledger_record(gw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["ignored_params"] == ["tools.1.strict"]


def test_chat_names_no_strict_a_worker_received(oai: openai.OpenAI, fresh: FakeUpstream) -> None:
    strict = {**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "strict": True}}
    raw = oai.chat.completions.with_raw_response.create(
        model="cheap",
        messages=[{"role": "user", "content": "Where is Paris?"}],
        tools=[strict],  # type: ignore[list-item]
    )
    raw.parse()
    assert IGNORED not in raw.headers
    (sent,) = fresh.requests_for("cheap-model")
    assert sent["tools"][0]["function"]["strict"] is True


def test_messages_names_a_dropped_strict_at_its_own_tools_index(
    claude_sdk: anthropic.Anthropic, fresh: FakeUpstream
) -> None:
    raw = claude_sdk.messages.with_raw_response.create(
        model="claude",
        max_tokens=50,
        messages=[{"role": "user", "content": "Where is Paris?"}],
        tools=[
            {"name": "other", "input_schema": SCHEMA},
            {"name": "lookup", "input_schema": SCHEMA, "strict": True},  # type: ignore[typeddict-unknown-key]
        ],
    )
    raw.parse()
    assert raw.headers[IGNORED] == "tools.1.strict"
    (sent,) = fresh.requests_for("claude-fake")
    assert all("strict" not in t for t in sent["tools"])


def test_responses_names_a_dropped_strict_at_its_own_tools_index(
    oai: openai.OpenAI, fresh: FakeUpstream
) -> None:
    raw = oai.responses.with_raw_response.create(
        model="claude",
        input="Where is Paris?",
        tools=[
            {"type": "function", "name": "other", "parameters": SCHEMA, "strict": False},
            {"type": "function", "name": "lookup", "parameters": SCHEMA, "strict": True},
        ],
    )
    raw.parse()
    assert raw.headers[IGNORED] == "tools.1.strict"


# ---- 4. a Responses tool without `strict` is sent without it --------------------------------------
def test_a_responses_tool_without_strict_is_sent_without_it(oai: openai.OpenAI, fresh: FakeUpstream) -> None:
    raw = oai.responses.with_raw_response.create(
        model="cheap",
        input="Where is Paris?",
        tools=[
            {"type": "function", "name": "unset", "parameters": SCHEMA},  # type: ignore[typeddict-item]
            {"type": "function", "name": "strict", "parameters": SCHEMA, "strict": True},
            {"type": "function", "name": "loose", "parameters": SCHEMA, "strict": False},
        ],
    )
    raw.parse()
    assert IGNORED not in raw.headers
    (sent,) = fresh.requests_for("cheap-model")
    functions = {t["function"]["name"]: t["function"] for t in sent["tools"]}
    assert "strict" not in functions["unset"]  # the worker's own default, not an opt-out
    assert functions["strict"]["strict"] is True and functions["loose"]["strict"] is False


# ---- 2. a composed answer names what its steps' workers went without -------------------------------
# claude answers (the cheapest), pricey judges; both on the test upstream
COMPOSED_CATALOG = f"""
version: 1
workers:
  - name: claude
    model: anthropic/claude-fake
    api_base: {{url}}
    api_key_env: {FAKE_KEY_ENV}
    context_window: 8192
    input_price_per_m: 0.10
    output_price_per_m: 0.20
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
  - name: pricey
    model: openai/pricey-model
    api_base: {{url}}/v1
    api_key_env: {FAKE_KEY_ENV}
    context_window: 8192
    input_price_per_m: 5.00
    output_price_per_m: 15.00
    tier: frontier
    license: Apache-2.0
    provider: fake
    jurisdiction: FR
    capabilities: [general, tools]
"""


@pytest.fixture(scope="module")
def cgw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = COMPOSED_CATALOG.format(url=up.url)
    with gateway_with(up, tmp_path_factory.mktemp("params_gaps_composed"), "", base=base) as gateway:
        yield gateway


@pytest.fixture
def cascade(up: FakeUpstream) -> FakeUpstream:
    """claude's answer is accepted by a confident judge (pricey): one answer step, one judge step."""
    up.reset()
    up.behave("claude-fake", text="42")
    up.behave("pricey-model", text="The answer is 42.", replies={JUDGE: "9"})
    return up


def _steps(cgw: Gateway, request_id: str) -> list[tuple[str, str]]:
    record = ledger_record(cgw, request_id)
    return [(s["role"], s["worker"]) for s in record["trace"]["steps"]]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_composed_chat_answer_names_what_a_step_went_without(
    cgw: Gateway, cascade: FakeUpstream, stream: bool
) -> None:
    sdk = openai.OpenAI(base_url=cgw.v1, api_key=cgw.api_key, max_retries=0, timeout=120)
    raw = sdk.chat.completions.with_raw_response.create(
        model="compose:cascade",
        messages=[{"role": "user", "content": QUESTION}],
        response_format={"type": "json_object"},
        max_tokens=50,
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert raw.headers[IGNORED] == "response_format"
    request_id = raw.headers["x-polyroute-request-id"]
    assert _steps(cgw, request_id) == [("answer", "claude"), ("judge", "pricey")]
    (answered,) = cascade.requests_for("claude-fake")
    assert "output_format" not in answered and "tools" not in answered  # no JSON mode reached it
    assert ledger_record(cgw, request_id)["trace"]["ignored_params"] == ["response_format"]


def test_every_step_of_a_workflow_gets_the_clients_user(cgw: Gateway, cascade: FakeUpstream) -> None:
    """`user` (the end user's id, for the providers' abuse monitoring) reached no step: it was not
    among the parameters a workflow forwards. Claude keeps it (as metadata.user_id): nothing named."""
    sdk = openai.OpenAI(base_url=cgw.v1, api_key=cgw.api_key, max_retries=0, timeout=120)
    raw = sdk.chat.completions.with_raw_response.create(
        model="compose:cascade", messages=[{"role": "user", "content": QUESTION}], max_tokens=50, user="u-77"
    )
    raw.parse()
    assert _steps(cgw, raw.headers["x-polyroute-request-id"]) == [("answer", "claude"), ("judge", "pricey")]
    (answered,) = cascade.requests_for("claude-fake")
    assert answered["metadata"] == {"user_id": "u-77"}
    (judged,) = cascade.requests_for("pricey-model")
    # the judge's worker (OpenAI's wire, a model outside OpenAI's catalog) is sent it and drops it
    assert "user" not in judged and raw.headers[IGNORED] == "user"


def test_a_composed_answer_names_nothing_when_no_step_went_without(
    cgw: Gateway, cascade: FakeUpstream
) -> None:
    sdk = openai.OpenAI(base_url=cgw.v1, api_key=cgw.api_key, max_retries=0, timeout=120)
    raw = sdk.chat.completions.with_raw_response.create(
        model="compose:cascade", messages=[{"role": "user", "content": QUESTION}], max_tokens=50
    )
    raw.parse()
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert IGNORED not in raw.headers
    assert "ignored_params" not in ledger_record(cgw, raw.headers["x-polyroute-request-id"])["trace"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_composed_responses_answer_names_it_in_its_own_words(
    cgw: Gateway, cascade: FakeUpstream, stream: bool
) -> None:
    sdk = openai.OpenAI(base_url=cgw.v1, api_key=cgw.api_key, max_retries=0, timeout=120)
    raw = sdk.responses.with_raw_response.create(
        model="compose:cascade",
        input=QUESTION,
        text={"format": {"type": "json_object"}},
        max_output_tokens=50,
        stream=stream,
    )
    _drain(raw.parse(), stream)
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert raw.headers[IGNORED] == "text.format"
    assert _steps(cgw, raw.headers["x-polyroute-request-id"]) == [("answer", "claude"), ("judge", "pricey")]


def test_a_composed_messages_answer_names_its_own_fields(cgw: Gateway, cascade: FakeUpstream) -> None:
    """A composed Messages answer whose steps dropped nothing names the Messages API's own fields."""
    sdk = anthropic.Anthropic(base_url=cgw.url, api_key=cgw.api_key, max_retries=0, timeout=120)
    raw = sdk.messages.with_raw_response.create(
        model="compose:cascade",
        max_tokens=50,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"top_k": 5},
    )
    raw.parse()
    assert raw.headers["x-polyroute-strategy"] == "compose:cascade"
    assert raw.headers[IGNORED] == "top_k"


# two Anthropic workers and an OpenAI-wire one: an ensemble's members and its fuser
CLAUDE2 = """
  - name: claude2
    model: anthropic/claude-fake2
    api_base: {url}
    api_key_env: {key_env}
    context_window: 8192
    input_price_per_m: 0.20
    output_price_per_m: 0.40
    tier: frontier
    license: proprietary
    provider: fake
    jurisdiction: US
    capabilities: [general, tools]
"""


@pytest.fixture(scope="module")
def egw(up: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = COMPOSED_CATALOG.format(url=up.url)
    with gateway_with(up, tmp_path_factory.mktemp("params_gaps_ensemble"), CLAUDE2, base=base) as gateway:
        yield gateway


def test_what_several_steps_went_without_is_named_once(egw: Gateway, up: FakeUpstream) -> None:
    up.reset()
    for model in ("claude-fake", "claude-fake2", "pricey-model"):
        up.behave(model, text="42")
    sdk = openai.OpenAI(base_url=egw.v1, api_key=egw.api_key, max_retries=0, timeout=120)
    raw = sdk.chat.completions.with_raw_response.create(
        model="compose:ensemble",
        messages=[{"role": "user", "content": QUESTION}],
        response_format={"type": "json_object"},
        max_tokens=50,
    )
    raw.parse()
    assert raw.headers["x-polyroute-strategy"] == "compose:ensemble"
    request_id = raw.headers["x-polyroute-request-id"]
    workers = {worker for _, worker in _steps(egw, request_id)}
    assert {"claude", "claude2"} <= workers  # two steps on Anthropic workers, each without JSON mode
    for model in ("claude-fake", "claude-fake2"):
        sent = up.requests_for(model)
        assert sent and all("output_format" not in body and "tools" not in body for body in sent)
    assert raw.headers[IGNORED] == "response_format"
    assert ledger_record(egw, request_id)["trace"]["ignored_params"] == ["response_format"]
