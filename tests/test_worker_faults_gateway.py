"""A worker that misbehaves, as a client of `auto` or of a pinned worker meets it through the SDKs.

Real parts only: a gateway on uvicorn in front of its own test upstream (tests/fakes/upstream.py),
which misbehaves on demand: a stream cut cleanly without [DONE], valid JSON of the wrong shape,
unreadable or missing usage, a 200 with no choices, a running usage count on every chunk, a
Retry-After longer than a retry waits, a JSON error body answering a stream request, a stream that
stalls. For each: what the client gets, whether `auto` falls back (inside the admissible pool only),
and whether the headers, the ledger, the budget and the metrics agree with what the worker billed.
No assertion depends on timing: a stalled stream waits for the client, not for a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from decimal import Decimal

import anthropic
import httpx
import openai
import orjson
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, Gateway, ledger_record, running_upstream, start_gateway
from tests.fakes.upstream import FakeUpstream

MESSAGES = [{"role": "user", "content": "hello there friend"}]
PRICES = {"cheap": ("0.10", "0.20", "FR"), "mid": ("1.00", "2.00", "FR"), "pricey": ("5.00", "15.00", "US")}


def _catalog(url: str):
    common = f"api_base: {url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192"
    workers = "\n".join(
        f"""  - name: {name}
    model: openai/{name}-model
    {common}
    input_price_per_m: {inp}
    output_price_per_m: {out}
    tier: specialist
    license: MIT
    provider: fake
    jurisdiction: {where}
    capabilities: [general, tools]"""
        for name, (inp, out, where) in PRICES.items()
    )
    return parse_catalog(f"version: 1\nworkers:\n{workers}\n", "worker faults catalog")


@pytest.fixture(scope="module")
def faulty() -> Iterator[FakeUpstream]:
    """Its own upstream: streams left stalled here must not hold up the session's shared one."""
    with running_upstream() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _reset_faulty(faulty: FakeUpstream) -> None:
    faulty.reset()


@pytest.fixture(scope="module")
def fgw(faulty, tmp_path_factory) -> Iterator[Gateway]:
    """A budget for acme (the test key's tenant), and `auto` may not use the US worker (pricey)."""
    data_dir = tmp_path_factory.mktemp("worker-faults")
    policy_file = data_dir / "policy.yaml"
    policy = {
        "version": "faults",
        "tenants": {"acme": {"budget": {"daily_usd": "5"}}},
        "rules": [{"id": "auto-not-us", "when": {"models": ["auto"]}, "deny_jurisdictions": ["US"]}],
    }
    policy_file.write_text(yaml.safe_dump(policy))
    gw = start_gateway(_catalog(faulty.url), data_dir / "data", policy_file=policy_file)
    yield gw
    gw.server.stop()


def openai_client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0, timeout=60)


def _cost(worker: str, prompt_tokens: int, completion_tokens: int) -> Decimal:
    inp, out, _ = PRICES[worker]
    return (prompt_tokens * Decimal(inp) + completion_tokens * Decimal(out)) / 1_000_000


def _spend(gw: Gateway) -> Decimal:
    books = httpx.get(f"{gw.url}/admin/spend/acme", headers=gw.auth(gw.admin_key), timeout=30).json()
    return Decimal(books["daily_usd"])


def _metric(gw: Gateway, name: str, **labels: str) -> float:
    return gw.state.metrics.registry.get_sample_value(name, labels) or 0.0


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _sse(gw: Gateway, body: dict) -> tuple[int, dict[str, str], list[str]]:
    """A raw streamed chat call: status, headers and the data lines."""
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=60
    ) as response:
        if response.status_code != 200:
            return response.status_code, dict(response.headers), [response.read().decode()]
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
        return response.status_code, dict(response.headers), lines


# ---- a stream cut cleanly: no finish_reason, no [DONE] ---------------------------------------------
def test_a_stream_that_ends_without_finishing_is_an_error_not_an_answer(fgw, faulty):
    """A proxy or a crashed server that closes the body cleanly part-way used to pass for a finished
    answer: 200 in the ledger, [DONE] to the client, the half answer graded as a whole one."""
    faulty.behave("cheap-model", text="one two three four five", end_after_chunks=2)
    status, headers, lines = _sse(
        fgw,
        {"model": "auto", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200 and headers["x-polyroute-worker"] == "cheap"
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][5:])["error"]
    assert error["code"] == "upstream_stream_error" and "ended before the answer did" in error["message"]
    assert "one " in "".join(lines[:-2])
    record = ledger_record(fgw, headers["x-polyroute-request-id"])
    assert record["status"] == 502 and record["trace"]["stream"] == "mid_stream_error"
    assert record["completion_tokens"] > 0 and record["cost_micros"] > 0  # what was streamed is billed
    assert not faulty.requests_for("mid-model")  # bytes went out: no fallback


def test_the_sdk_raises_on_a_stream_cut_cleanly(fgw, faulty):
    faulty.behave("pricey-model", text="one two three four five", end_after_chunks=3)
    stream = openai_client(fgw).chat.completions.create(model="pricey", messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in stream:
            received.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == "one two three "


def test_a_stream_with_a_finish_reason_but_no_done_is_still_whole(fgw, faulty):
    """Lenient where it is safe: the answer said it finished, only the [DONE] line is missing."""
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "whole"}}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    faulty.behave("cheap-model", raw_body="".join(f"data: {orjson.dumps(e).decode()}\n\n" for e in events))
    stream = openai_client(fgw).chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "whole"


@pytest.mark.parametrize("media_type", [None, "application/json"], ids=["sse", "mislabelled"])
def test_events_without_blank_lines_or_under_a_json_type_are_still_read(fgw, faulty, media_type):
    """The last event without its newline, and events sent as application/json, are read as events."""
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    first = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "read"}}]}
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    body = f"data: {orjson.dumps(first).decode()}\n\ndata: {orjson.dumps(last).decode()}\n\ndata: [DONE]"
    faulty.behave("cheap-model", raw_body=body, raw_media_type=media_type)
    stream = openai_client(fgw).chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "read"


def test_anthropic_and_responses_clients_see_the_cut_as_a_failure(fgw, faulty):
    faulty.behave("cheap-model", text="one two three four five", end_after_chunks=2)
    messages = anthropic.Anthropic(base_url=fgw.url, api_key=fgw.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError, match="mid-stream"):
        with messages.messages.stream(model="auto", max_tokens=32, messages=MESSAGES) as stream:
            for _ in stream.text_stream:
                pass
    events = list(openai_client(fgw).responses.create(model="auto", input="hi", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "upstream_stream_error"


# ---- valid JSON of the wrong shape ------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    ['{"choices": "x"}', '{"choices": [{"message": "hi"}]}', '{"choices": [], "usage": "lots"}'],
)
def test_a_completion_of_the_wrong_shape_falls_back_and_is_recorded(fgw, faulty, body):
    """It used to escape as a gateway crash: a bare 500 'internal error', no x-polyroute headers,
    no ledger record, no fallback."""
    faulty.behave("cheap-model", raw_body=body)
    faulty.behave("mid-model", text="mid answered")
    raw = openai_client(fgw).chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "mid answered"
    assert raw.headers["x-polyroute-worker"] == "mid" and raw.headers["x-polyroute-fallbacks"] == "cheap"
    record = ledger_record(fgw, raw.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["fallbacks"] == ["cheap"]
    assert not faulty.requests_for("pricey-model")  # the fallback stays inside auto's pool

    with pytest.raises(openai.APIStatusError) as caught:  # pinned: an OpenAI error, on the books
        openai_client(fgw).chat.completions.create(model="cheap", messages=MESSAGES)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "upstream_failed" and "malformed" in caught.value.body["message"]
    record = ledger_record(fgw, caught.value.response.headers["x-polyroute-request-id"])
    assert record["status"] == 502


# ---- usage the worker did not report, or reported unreadably ---------------------------------------
def _completion(usage: object = None) -> str:
    body: dict = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "four words of answer"}}],
    }
    if usage is not None:
        body["usage"] = usage
    return orjson.dumps(body).decode()


@pytest.mark.parametrize(
    "usage",
    [None, {"prompt_tokens": -1_000_000, "completion_tokens": 4}, {"prompt_tokens": "many"}],
    ids=["missing", "negative", "not-a-number"],
)
def test_a_plain_answer_without_readable_usage_is_billed_as_estimated(fgw, faulty, usage):
    """A stream without usage was counted (and marked estimated); a plain answer was free — $0 on
    the budget and the ledger — and a negative or non-numeric count crashed the request."""
    faulty.behave("cheap-model", raw_body=_completion(usage))
    before = _spend(fgw)
    raw = openai_client(fgw).chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    completion = raw.parse()
    assert completion.choices[0].message.content == "four words of answer"
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0
    cost = Decimal(raw.headers["x-polyroute-cost-usd"])
    assert cost == _cost("cheap", completion.usage.prompt_tokens, completion.usage.completion_tokens)
    record = ledger_record(fgw, raw.headers["x-polyroute-request-id"])
    assert record["trace"]["usage"] == "estimated"
    assert record["prompt_tokens"] == completion.usage.prompt_tokens
    assert record["cost_micros"] > 0
    _wait_for(lambda: _spend(fgw) > before, "the estimate to reach the budget")


# ---- a 200 with no choices ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_with_no_choices_falls_back_and_its_bill_is_kept(fgw, faulty, stream):
    """A 200 with empty `choices` was passed on as the answer (an SDK user's `choices[0]` fails) and
    recorded as a success of that worker. Now `auto` falls back; what the empty call cost is on the
    budget, in the cost header and in the ledger with the answer's, and it is not asked twice."""
    faulty.behave("cheap-model", empty_choices=True, prompt_tokens=1000, completion_tokens=500)
    faulty.behave("mid-model", text="mid answered", prompt_tokens=10, completion_tokens=2)
    before = _spend(fgw)
    prompt_before = _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="prompt")
    empty_cost, answer_cost = _cost("cheap", 1000, 500), _cost("mid", 10, 2)
    create = openai_client(fgw).chat.completions.with_raw_response.create
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    raw = create(model="auto", messages=MESSAGES, **options)
    if stream:
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = raw.parse().choices[0].message.content
    assert text == "mid answered"
    assert raw.headers["x-polyroute-worker"] == "mid" and raw.headers["x-polyroute-fallbacks"] == "cheap"
    assert len(faulty.requests_for("cheap-model")) == 1  # answered (and billed): not asked again
    if not stream:
        assert Decimal(raw.headers["x-polyroute-cost-usd"]) == empty_cost + answer_cost
    record = ledger_record(fgw, raw.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["fallbacks"] == ["cheap"]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (1010, 502)
    assert Decimal(record["cost_micros"]) / 1_000_000 >= empty_cost + answer_cost
    _wait_for(lambda: _spend(fgw) - before == Decimal(record["cost_micros"]) / 1_000_000, "the settle")
    assert _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="prompt") - prompt_before == 1000


def test_a_pinned_worker_with_no_choices_is_a_502_that_is_billed(fgw, faulty):
    faulty.behave("cheap-model", empty_choices=True, prompt_tokens=1000, completion_tokens=500)
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client(fgw).chat.completions.create(model="cheap", messages=MESSAGES)
    assert caught.value.status_code == 502 and caught.value.body["code"] == "upstream_failed"
    assert "no choices" in caught.value.body["message"]
    headers = caught.value.response.headers
    assert Decimal(headers["x-polyroute-cost-usd"]) == _cost("cheap", 1000, 500)
    record = ledger_record(fgw, headers["x-polyroute-request-id"])
    assert record["status"] == 502 and (record["prompt_tokens"], record["completion_tokens"]) == (1000, 500)


# ---- usage on every chunk ---------------------------------------------------------------------------
def test_a_running_usage_count_on_every_chunk_is_counted_once(fgw, faulty):
    """Some providers put the running usage on every chunk: the client got a usage chunk after each
    content chunk, and the token and cost metrics summed them all (5x the real prompt here)."""
    faulty.behave("cheap-model", text="one two three four", prompt_tokens=10, usage_every_chunk=True)
    prompt_before = _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="prompt")
    completion_before = _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="completion")
    cost_before = _metric(fgw, "polyroute_cost_usd_total", worker="cheap")
    stream = openai_client(fgw).chat.completions.create(
        model="auto", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three four"
    usage_chunks = [c for c in chunks if c.usage]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and not usage_chunks[0].choices
    assert (usage_chunks[0].usage.prompt_tokens, usage_chunks[0].usage.completion_tokens) == (10, 4)
    assert _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="prompt") - prompt_before == 10
    assert _metric(fgw, "polyroute_tokens_total", worker="cheap", kind="completion") - completion_before == 4
    cost = _metric(fgw, "polyroute_cost_usd_total", worker="cheap") - cost_before
    assert cost == pytest.approx(float(_cost("cheap", 10, 4)))


# ---- Retry-After --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_long_retry_after_is_not_retried_and_reaches_the_client(fgw, faulty, stream):
    """The worker said 'wait 30 s': the gateway asked again twice within a second (each refusal
    counting against its limit) and told the client `retry-after: 1`, which the OpenAI SDK obeys."""
    faulty.behave("cheap-model", status=429, retry_after_s=30)
    with pytest.raises(openai.RateLimitError) as caught:
        openai_client(fgw).chat.completions.create(model="cheap", messages=MESSAGES, stream=stream)
    assert caught.value.response.headers["retry-after"] == "30"
    assert caught.value.body["code"] == "upstream_rate_limited"
    assert len(faulty.requests_for("cheap-model")) == 1


def test_auto_falls_back_at_once_and_names_the_soonest_retry(fgw, faulty):
    faulty.behave("cheap-model", status=429, retry_after_s=30)
    faulty.behave("mid-model", status=429, retry_after_s=20)
    with pytest.raises(openai.RateLimitError) as caught:
        openai_client(fgw).chat.completions.create(model="auto", messages=MESSAGES)
    assert caught.value.response.headers["retry-after"] == "20"
    assert len(faulty.requests_for("cheap-model")) == len(faulty.requests_for("mid-model")) == 1
    assert not faulty.requests_for("pricey-model")


def test_a_short_retry_after_is_still_retried(fgw, faulty):
    faulty.behave("cheap-model", status=429, retry_after_s=0, fail_times=1, text="after the pause")
    raw = openai_client(fgw).chat.completions.with_raw_response.create(model="cheap", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "after the pause"
    assert len(faulty.requests_for("cheap-model")) == 2


# ---- a JSON error body for a stream request ----------------------------------------------------------
def test_a_json_error_answering_a_stream_request_is_read(fgw, faulty):
    """Some servers answer an overloaded stream request 200 with a JSON error: the client was told
    'the stream ended before its first chunk', the worker's own words lost."""
    faulty.behave(
        "cheap-model",
        raw_body='{"error": {"message": "model is overloaded, try later", "code": 503}}',
        raw_media_type="application/json",
    )
    status, _, lines = _sse(fgw, {"model": "cheap", "messages": MESSAGES, "stream": True})
    assert status == 502
    error = orjson.loads(lines[0])["error"]
    assert error["code"] == "upstream_failed" and "model is overloaded, try later" in error["message"]


# ---- verified sound: a stall, and a client that hangs up ---------------------------------------------
def test_a_client_that_hangs_up_on_a_stalled_stream_cancels_the_worker_call(fgw, faulty):
    faulty.behave("cheap-model", text="one two three four five six", stall_after_chunks=3)
    with httpx.stream(
        "POST",
        fgw.v1 + "/chat/completions",
        headers=fgw.auth(),
        json={"model": "auto", "messages": MESSAGES, "stream": True},
        timeout=60,
    ) as response:
        request_id = response.headers["x-polyroute-request-id"]
        seen = ""
        for line in response.iter_lines():
            seen += line
            if "three" in line:
                break  # hang up while the worker stalls
    _wait_for(lambda: list(faulty.abandoned) == ["cheap-model"], "the worker call to be cancelled")
    record = ledger_record(fgw, request_id)
    assert record["status"] == 499 and record["trace"]["stream"] == "client_disconnected"
    assert record["trace"]["usage"] == "estimated" and record["cost_micros"] > 0
