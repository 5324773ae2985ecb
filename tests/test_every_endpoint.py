"""Every endpoint, one pipeline: PII stays off the workers the policy excludes, budgets hold under
concurrency, and bad input is refused in the endpoint's own error format before any worker is called.

Endpoints: POST /v1/chat/completions (plain and streamed), /v1/messages (plain and streamed, Anthropic's
format), /v1/responses (plain and streamed), /v1/embeddings, and a compose:cascade chat request; for bad
input also /v1/messages/count_tokens. A real gateway on loopback in front of the test upstream; what
the upstream received, per model, is the oracle ("reached no worker" is an empty record, not a 4xx).

The policy: pii and secrets only in the EU or in-process. Of the test catalog's chat workers cheap is FR
(admissible), mid is CN and pricey US (excluded for pii); of the embedding workers defined here,
embed-eu is FR and embed-us US.

The property test runs 40 examples; EVERY_ENDPOINT_EXAMPLES=600 searches further.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from decimal import Decimal
from typing import Any

import httpx
import pytest
import redis as redis_lib
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.store import to_micros
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, start_gateway
from tests.test_pii_payload import PII

Body = dict[str, Any]

MAX_BODY = 64 * 1024
ADMISSIBLE = {"cheap", "embed-eu"}  # the only workers pii may reach
EXCLUDED_MODELS = ("mid-model", "pricey-model", "embed-us-model")  # upstream names of the others
CHAT_MODELS = {"cheap": "cheap-model", "mid": "mid-model", "pricey": "pricey-model"}
JUDGE = "How likely is the proposed answer"  # the cascade's judge prompt (router/compose)

ENDPOINTS = [
    "chat",
    "chat-stream",
    "messages",
    "messages-stream",
    "responses",
    "responses-stream",
    "embeddings",
    "compose",
]
PATHS = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "compose": "/v1/chat/completions",
    "count_tokens": "/v1/messages/count_tokens",
}


def family(endpoint: str) -> str:
    return endpoint.removesuffix("-stream")


def api_of(endpoint: str) -> str:
    return "anthropic" if family(endpoint) in ("messages", "count_tokens") else "openai"


# Budgets: one tenant per endpoint, so the endpoints' spends stay apart (micro-dollars).
BUDGET_MICROS = {endpoint: 20 for endpoint in ENDPOINTS}
COMPOSE_CEILING_USD = "0.002"  # metadata.max_cost_usd: what one workflow reserves up front
BUDGET_MICROS["compose"] = 2600  # one ceiling fits; less than 40 workflows' actual cost after it

POLICY = {
    "version": "every-endpoint",
    "rules": [
        {
            "id": "sensitive-eu-or-local",
            "when": {"data_classes": ["pii", "secret"]},
            "allow_jurisdictions": ["EU", "local"],
        }
    ],
    "tenants": {
        f"budget-{endpoint}": {"budget": {"daily_usd": str(Decimal(micros) / 1_000_000)}}
        for endpoint, micros in BUDGET_MICROS.items()
    },
}


def embedding_workers(upstream_url: str) -> str:
    def worker(name: str, jurisdiction: str) -> str:
        return f"""
  - name: {name}
    kind: embedding
    model: openai/{name}-model
    api_base: {upstream_url}/v1
    api_key_env: {FAKE_KEY_ENV}
    dimensions: 8
    input_price_per_m: 1.00
    tier: specialist
    license: proprietary
    provider: fake
    jurisdiction: {jurisdiction}
    context_window: 8192"""

    return worker("embed-eu", "FR") + worker("embed-us", "US") + "\n"


def every_endpoint_gateway(upstream, data_dir, **settings):
    data_dir.mkdir(parents=True, exist_ok=True)
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + embedding_workers(upstream.url), "test catalog")
    gw = start_gateway(catalog, data_dir, policy_file=policy_file, max_body_bytes=MAX_BODY, **settings)
    store = gw.state.auth.store
    gw.keys = {endpoint: store.create(f"budget-{endpoint}", "budget test")[1] for endpoint in ENDPOINTS}
    return gw


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory):
    gateway = every_endpoint_gateway(upstream, tmp_path_factory.mktemp("every-endpoint"))
    yield gateway
    gateway.server.stop()


@pytest.fixture(scope="module")
def redis_gw(upstream, tmp_path_factory, redis_server):
    redis_lib.Redis.from_url(redis_server.url).flushdb()
    gateway = every_endpoint_gateway(
        upstream, tmp_path_factory.mktemp("every-endpoint-redis"), redis_url=redis_server.url
    )
    yield gateway
    gateway.server.stop()


def headers_for(gw, endpoint: str, key: str | None = None) -> dict[str, str]:
    key = key or gw.api_key
    if api_of(endpoint) == "anthropic":  # as the anthropic SDK authenticates
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return gw.auth(key)


def post(gw, endpoint: str, body: Body | None = None, content: bytes | None = None) -> httpx.Response:
    headers = headers_for(gw, endpoint) | {"content-type": "application/json"}
    if body is not None:
        content = json.dumps(body).encode()
    return httpx.post(gw.url + PATHS[family(endpoint)], content=content, headers=headers, timeout=60)


# ---- the two error formats ---------------------------------------------------------------------------
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
}


def assert_error_format(endpoint: str, response: httpx.Response) -> dict:
    """The error in the endpoint's own API format; returns {"type", "message", "code"}."""
    assert response.headers["content-type"].startswith("application/json"), response.text[:300]
    body = response.json()
    if api_of(endpoint) == "anthropic":
        assert body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"}, body
        assert error["type"] == ANTHROPIC_TYPES[response.status_code], body
        assert isinstance(error["message"], str) and error["message"]
        return {**error, "code": (body.get("polyroute") or {}).get("code")}
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    return error


def stream_failed(endpoint: str, text: str) -> bool:
    """Whether an event stream that started with 200 carried an error event."""
    if family(endpoint) == "messages":
        return "event: error" in text or "message_stop" not in text
    if family(endpoint) == "responses":
        return "response.failed" in text or "response.completed" not in text
    return '"error"' in text or "data: [DONE]" not in text


# ---- requests, with a text placed where each API can carry it ------------------------------------------
def text_file(text: str) -> str:
    """A plain-text file as a data URL, as clients attach files (OpenAI's file_data)."""
    return "data:text/plain;base64," + base64.b64encode(text.encode()).decode()


def chat_slots(text: str) -> dict[str, list[Body]]:
    return {
        "user text": [{"role": "user", "content": text}],
        "content part": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "look at this"}, {"type": "text", "text": text}],
            }
        ],
        "system prompt": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}],
        "tool result": [
            {"role": "user", "content": "find it"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": text},
            {"role": "user", "content": "thanks"},
        ],
        "earlier turn": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "noted"},
            {"role": "user", "content": "thanks"},
        ],
        "attached file": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "summarise the file"},
                    {"type": "file", "file": {"filename": "notes.txt", "file_data": text_file(text)}},
                ],
            }
        ],
    }


def messages_slots(text: str) -> dict[str, Body]:
    hi = [{"role": "user", "content": "hi"}]
    tool_turn = [
        {"role": "user", "content": "who wrote this?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}],
        },
    ]
    return {
        "user text": {"messages": [{"role": "user", "content": text}]},
        "user block": {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        "system string": {"system": text, "messages": hi},
        "system blocks": {
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": text}],
            "messages": hi,
        },
        "tool result": {
            "messages": [
                *tool_turn,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": text}],
                },
            ]
        },
        "tool result blocks": {
            "messages": [
                *tool_turn,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": text}],
                        }
                    ],
                },
            ]
        },
        "earlier turn": {
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "noted"},
                {"role": "user", "content": "thanks"},
            ]
        },
        "tool_use input": {
            "messages": [
                {"role": "user", "content": "who wrote this?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": text}}
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}],
                },
            ]
        },
        "document": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "text/plain",
                                "data": base64.b64encode(text.encode()).decode(),
                            },
                        },
                        {"type": "text", "text": "summarise the document"},
                    ],
                }
            ]
        },
        "tool description": {
            "messages": hi,
            "tools": [{"name": "lookup", "description": text, "input_schema": {"type": "object"}}],
        },
        "metadata user_id": {"messages": hi, "metadata": {"user_id": text}},
        "stop_sequences": {"messages": hi, "stop_sequences": ["END", text]},
    }


def responses_slots(text: str) -> dict[str, Body]:
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
    return {
        "input string": {"input": text},
        "instructions": {"instructions": text, "input": "hi"},
        "input_text part": {"input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]},
        "developer item": {
            "input": [{"role": "developer", "content": text}, {"role": "user", "content": "hi"}]
        },
        "function_call_output": {
            "input": [
                {"role": "user", "content": "look it up"},
                call,
                {"type": "function_call_output", "call_id": "call_1", "output": text},
            ]
        },
        "function_call arguments": {
            "input": [
                {"role": "user", "content": "look it up"},
                {**call, "arguments": json.dumps({"q": text})},
                {"type": "function_call_output", "call_id": "call_1", "output": "done"},
            ]
        },
        "earlier turn": {
            "input": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": [{"type": "output_text", "text": "noted"}]},
                {"role": "user", "content": "thanks"},
            ]
        },
        "tool description": {
            "input": "hi",
            "tools": [
                {"type": "function", "name": "lookup", "description": text, "parameters": {"type": "object"}}
            ],
        },
        "user": {"input": "hi", "user": text},
        "input_file": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "summarise the file"},
                        {"type": "input_file", "filename": "notes.txt", "file_data": text_file(text)},
                    ],
                }
            ]
        },
    }


SLOTS = {
    "chat": list(chat_slots("x")),
    "messages": list(messages_slots("x")),
    "responses": list(responses_slots("x")),
    "embeddings": ["single input", "batch item", "user"],
    "compose": ["user text", "system prompt", "earlier turn"],
}
MODELS = {
    "chat": ["auto", "cheap", "mid", "pricey"],
    "messages": ["auto", "cheap", "mid", "pricey"],
    "responses": ["auto", "cheap", "mid", "pricey"],
    "embeddings": ["embed-eu", "embed-us"],
    "compose": ["compose:cascade"],
}


def build(endpoint: str, model: str, slot: str, text: str, batch: tuple[int, int] = (1, 0)) -> Body:
    """The request body of `endpoint` with `text` in `slot` (for a batch: (size, position of text))."""
    kind, stream = family(endpoint), endpoint.endswith("-stream")
    if kind in ("chat", "compose"):
        body: Body = {"model": model, "messages": chat_slots(text)[slot], "max_tokens": 16}
    elif kind == "messages":
        body = {"model": model, "max_tokens": 16, **messages_slots(text)[slot]}
    elif kind == "responses":
        body = {"model": model, "max_output_tokens": 16, "store": False, **responses_slots(text)[slot]}
    else:
        size, position = batch
        if slot == "single input":
            body = {"model": model, "input": text}
        elif slot == "user":
            body = {"model": model, "input": ["clean document"] * size, "user": text}
        else:
            items = [f"clean document number {i}" for i in range(size)]
            items[position] = text
            body = {"model": model, "input": items}
    if stream:
        body["stream"] = True
    return body


def upstream_model(endpoint: str, model: str) -> str:
    if family(endpoint) == "embeddings":
        return model + "-model"
    return CHAT_MODELS.get(model, "cheap-model")  # auto and the cascade's one-worker pool: cheap


# ---- 1. PII never reaches an excluded worker, on any endpoint -------------------------------------------
@pytest.mark.parametrize(
    ("endpoint", "slot"),
    [(e, s) for e in ENDPOINTS for s in SLOTS[family(e)]],
)
def test_the_clean_control_reaches_the_excluded_worker(gw, upstream, endpoint, slot):
    """Without PII every generated shape is valid and served by an excluded worker (mid, embed-us; the
    cascade by its pool), so a 403 in the property test below is the policy's doing."""
    model = {"embeddings": "embed-us", "compose": "compose:cascade"}.get(family(endpoint), "mid")
    upstream.behave("pricey-model", replies={JUDGE: "9"})
    response = post(
        gw, endpoint, build(endpoint, model, slot, "nothing personal here 2024-11-15 v3.2.1", (3, 1))
    )
    assert response.status_code == 200, response.text[:500]
    assert response.headers["x-polyroute-data-class"] == "public"
    assert not endpoint.endswith("-stream") or not stream_failed(endpoint, response.text), response.text
    if family(endpoint) == "compose":
        assert response.headers["x-polyroute-strategy"] == "compose:cascade"
        assert upstream.requests_for("pricey-model")  # the judge: an excluded worker, reached when public
    else:
        assert len(upstream.requests_for(upstream_model(endpoint, model))) == 1


FILLER = st.text(alphabet="abcdefghij ", max_size=12)  # letters and spaces: cannot make a number invalid


@st.composite
def pii_requests(draw: st.DrawFn) -> tuple[str, str, str, str, bool, Body]:
    endpoint = draw(st.sampled_from(ENDPOINTS))
    kind = family(endpoint)
    slot = draw(st.sampled_from(SLOTS[kind]))
    model = draw(st.sampled_from(MODELS[kind]))
    pii = draw(st.sampled_from(PII))
    text = f"{draw(FILLER)} {pii} {draw(FILLER)}"
    size = draw(st.integers(1, 5))
    position = draw(st.integers(0, size - 1))
    admissible_fails = draw(st.booleans())  # the one admissible worker answers 500: no escape elsewhere
    return endpoint, slot, model, pii, admissible_fails, build(endpoint, model, slot, text, (size, position))


@settings(
    max_examples=int(os.environ.get("EVERY_ENDPOINT_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=pii_requests())
def test_pii_on_any_endpoint_never_reaches_an_excluded_worker(gw, upstream, case):
    endpoint, slot, model, pii, admissible_fails, body = case
    where = (endpoint, slot, model, pii, admissible_fails)
    upstream.reset()  # per example (the autouse reset is per test)
    admissible_model = "embed-eu-model" if family(endpoint) == "embeddings" else "cheap-model"
    if admissible_fails:
        upstream.behave(admissible_model, status=500)
    for excluded in EXCLUDED_MODELS:
        upstream.behave(excluded, replies={JUDGE: "9"})  # would answer, and well, if asked

    response = post(gw, endpoint, body)

    for excluded in EXCLUDED_MODELS:
        assert not upstream.requests_for(excluded), (where, excluded, upstream.requests_for(excluded))
    assert response.headers["x-polyroute-data-class"] in ("pii", "secret"), where
    pinned_out = model in ("mid", "pricey", "embed-us")
    if pinned_out:
        assert response.status_code == 403, (where, response.status_code, response.text[:300])
        error = assert_error_format(endpoint, response)
        assert error["code"] == "policy_denied", (where, error)
        assert not upstream.requests, where
    elif admissible_fails:
        assert response.status_code == 502, (where, response.status_code, response.text[:300])
        assert_error_format(endpoint, response)
        assert upstream.requests_for(admissible_model), where  # tried, failed, and nothing else was
    else:
        assert response.status_code == 200, (where, response.status_code, response.text[:300])
        assert response.headers["x-polyroute-worker"] in ADMISSIBLE, where
        assert not endpoint.endswith("-stream") or not stream_failed(endpoint, response.text), where
        assert upstream.requests_for(admissible_model), where


@pytest.mark.parametrize(
    ("endpoint", "slot"),
    [("chat", "attached file"), ("chat-stream", "attached file"), ("messages", "document")]
    + [("responses", "input_file"), ("responses-stream", "input_file")],
)
def test_pii_in_an_attached_text_file_stays_off_excluded_workers(gw, upstream, endpoint, slot):
    """Found by the property test: a base64 text file (file_data, input_file, an Anthropic document) was
    classed public, so with the EU worker failing the request fell back to the CN and US workers."""
    upstream.behave("cheap-model", status=500)
    response = post(gw, endpoint, build(endpoint, "auto", slot, "invoice for jane.doe@example.com"))
    assert response.status_code == 502 and response.headers["x-polyroute-data-class"] == "pii"
    assert_error_format(endpoint, response)
    assert upstream.requests_for("cheap-model")
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")


# ---- 2. budgets hold on every endpoint under 40 concurrent requests --------------------------------------
CONCURRENCY = 40
COMPOSE_QUESTION = "What is six times seven?"


def budget_body(endpoint: str) -> Body:
    kind = family(endpoint)
    hello = [{"role": "user", "content": "hello there"}]
    if kind == "chat":
        body: Body = {"model": "auto", "messages": hello, "max_tokens": 5}
    elif kind == "messages":
        body = {"model": "auto", "messages": hello, "max_tokens": 5}
    elif kind == "responses":
        body = {"model": "auto", "input": "hello there", "max_output_tokens": 5}
    elif kind == "embeddings":
        body = {"model": "embed-eu", "input": "hello world"}
    else:
        body = {
            "model": "compose:cascade",
            "messages": [{"role": "user", "content": COMPOSE_QUESTION}],
            "max_tokens": 5,
            "metadata": {"max_cost_usd": COMPOSE_CEILING_USD},
        }
    if endpoint.endswith("-stream"):
        body["stream"] = True
    return body


async def _concurrently(gw, endpoint: str, key: str, count: int) -> list[httpx.Response]:
    headers = headers_for(gw, endpoint, key)
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=gw.url, timeout=120, limits=limits) as client:
        path, body = PATHS[family(endpoint)], budget_body(endpoint)
        return await asyncio.gather(*(client.post(path, json=body, headers=headers) for _ in range(count)))


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_budget_holds_under_40_concurrent_requests(request, upstream, backend, endpoint):
    gw = request.getfixturevalue("gw" if backend == "memory" else "redis_gw")
    tenant, budget = f"budget-{endpoint}", BUDGET_MICROS[endpoint]
    for model in CHAT_MODELS.values():  # every completion: 1 prompt token, 5 completion tokens (≤ max_tokens)
        upstream.behave(model, prompt_tokens=1, completion_tokens=5, text="42", replies={JUDGE: "9"})

    responses = asyncio.run(_concurrently(gw, endpoint, gw.keys[endpoint], CONCURRENCY))

    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 403}, [
        (r.status_code, r.text[:300]) for r in responses if r.status_code not in (200, 403)
    ]
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 403]
    assert ok, "the budget fits one request"
    assert refused, f"{CONCURRENCY} requests cost more than the budget: some must be refused"
    for r in refused:
        error = assert_error_format(endpoint, r)
        # refused by the reservation (budget_exceeded) or, seeing spend + holds, by the policy's budget rule
        assert error["code"] in ("budget_exceeded", "policy_denied"), error
        assert "budget:daily" in error["message"], error
    if endpoint.endswith("-stream"):
        assert not [r.text for r in ok if stream_failed(endpoint, r.text)]

    spend = httpx.get(f"{gw.url}/admin/spend/{tenant}", headers=gw.auth(gw.admin_key)).json()
    assert to_micros(Decimal(spend["daily_usd"])) <= budget, (spend, budget)
    # What the workers were actually asked to do, priced as the catalog prices it (rounded up per call).
    worker_micros = 0
    for worker in gw.state.catalog.workers:
        upstream_name = worker.model.split("/", 1)[1]
        for sent in upstream.requests_for(upstream_name):
            tokens = (2, 0) if worker.name.startswith("embed") else (1, 5)  # "hello world": 2 words
            assert worker.name != "embed-eu" or sent["input"] == ["hello world"]
            worker_micros += to_micros(worker.cost_usd(*tokens))
    assert 0 < worker_micros <= budget, (worker_micros, budget)


# ---- 3. bad input: a 4xx in the endpoint's own format, and no worker called --------------------------------
HELLO = [{"role": "user", "content": "hi"}]
BIG = "x" * (MAX_BODY + 1)

BAD_INPUT: list[tuple[str, str, Any, int]] = [
    # (endpoint, case, body (dict, or raw bytes), expected status)
    ("chat", "not json", b"{not json", 400),
    ("chat", "a JSON array", b"[1, 2]", 400),
    ("chat", "missing messages", {"model": "auto"}, 400),
    ("chat", "missing model", {"messages": HELLO}, 400),
    ("chat", "messages not a list", {"model": "auto", "messages": "hello"}, 400),
    ("chat", "empty messages", {"model": "auto", "messages": []}, 400),
    ("chat", "empty content", {"model": "auto", "messages": [{"role": "user", "content": " "}]}, 400),
    ("chat", "unknown role", {"model": "auto", "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat", "model not a string", {"model": 42, "messages": HELLO}, 400),
    ("chat", "temperature a string", {"model": "auto", "messages": HELLO, "temperature": "hot"}, 400),
    ("chat", "unknown field", {"model": "auto", "messages": HELLO, "frobnicate": True}, 400),
    ("chat", "stream not a boolean", {"model": "auto", "messages": HELLO, "stream": "yes"}, 400),
    ("chat", "unknown model", {"model": "gpt-17", "messages": HELLO}, 404),
    ("chat", "oversize", {"model": "auto", "messages": [{"role": "user", "content": BIG}]}, 413),
    ("compose", "unknown workflow", {"model": "compose:nonesuch", "messages": HELLO}, 404),
    (
        "compose",
        "bad max_cost_usd",
        {"model": "compose:cascade", "messages": HELLO, "metadata": {"max_cost_usd": "-1"}},
        400,
    ),
    ("messages", "not json", b"{not json", 400),
    ("messages", "a JSON string", b'"hello"', 400),
    ("messages", "missing max_tokens", {"model": "auto", "messages": HELLO}, 400),
    ("messages", "missing messages", {"model": "auto", "max_tokens": 8}, 400),
    ("messages", "empty messages", {"model": "auto", "max_tokens": 8, "messages": []}, 400),
    ("messages", "max_tokens zero", {"model": "auto", "max_tokens": 0, "messages": HELLO}, 400),
    ("messages", "max_tokens a string", {"model": "auto", "max_tokens": "many", "messages": HELLO}, 400),
    ("messages", "system a number", {"model": "auto", "max_tokens": 8, "messages": HELLO, "system": 5}, 400),
    (
        "messages",
        "system role in messages",
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]},
        400,
    ),
    (
        "messages",
        "unknown block",
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
        400,
    ),
    (
        "messages",
        "blank text",
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "  "}]},
        400,
    ),
    (
        "messages",
        "unknown field",
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "temprature": 0.5},
        400,
    ),
    (
        "messages",
        "stream not a boolean",
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "stream": "yes"},
        400,
    ),
    (
        "messages",
        "temperature above 1",
        {"model": "auto", "max_tokens": 8, "messages": HELLO, "temperature": 1.5},
        400,
    ),
    ("messages", "unknown model", {"model": "claude-nonesuch", "max_tokens": 8, "messages": HELLO}, 404),
    (
        "messages",
        "oversize",
        {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": BIG}]},
        413,
    ),
    ("count_tokens", "not json", b"{not json", 400),
    ("count_tokens", "empty messages", {"model": "auto", "messages": []}, 400),
    ("count_tokens", "unknown field", {"model": "auto", "messages": HELLO, "max_tokenz": 3}, 400),
    ("count_tokens", "model not a string", {"model": ["auto"], "messages": HELLO}, 400),
    ("count_tokens", "unknown model", {"model": "claude-nonesuch", "messages": HELLO}, 404),
    ("count_tokens", "oversize", {"model": "auto", "messages": [{"role": "user", "content": BIG}]}, 413),
    ("responses", "not json", b"{not json", 400),
    ("responses", "a JSON array", b"[]", 400),
    ("responses", "missing model", {"input": "hi"}, 400),
    ("responses", "empty input", {"model": "auto", "input": "   "}, 400),
    ("responses", "empty input list", {"model": "auto", "input": []}, 400),
    ("responses", "input a number", {"model": "auto", "input": 7}, 400),
    (
        "responses",
        "item without role",
        {"model": "auto", "input": [{"type": "message", "content": "hi"}]},
        400,
    ),
    ("responses", "hosted tool", {"model": "auto", "input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("responses", "temperature too high", {"model": "auto", "input": "hi", "temperature": 3}, 400),
    ("responses", "unknown field", {"model": "auto", "input": "hi", "frobnicate": 1}, 400),
    ("responses", "stream not a boolean", {"model": "auto", "input": "hi", "stream": "yes"}, 400),
    ("responses", "unknown model", {"model": "gpt-17", "input": "hi"}, 404),
    (
        "responses",
        "unknown previous_response_id",
        {"model": "auto", "input": "hi", "previous_response_id": "resp_nonesuch"},
        404,
    ),
    ("responses", "oversize", {"model": "auto", "input": BIG}, 413),
    ("embeddings", "not json", b"{not json", 400),
    ("embeddings", "missing input", {"model": "embed-eu"}, 400),
    ("embeddings", "missing model", {"input": "hi"}, 400),
    ("embeddings", "empty input list", {"model": "embed-eu", "input": []}, 400),
    ("embeddings", "empty string item", {"model": "embed-eu", "input": ["hi", ""]}, 400),
    ("embeddings", "input a number", {"model": "embed-eu", "input": 5}, 400),
    ("embeddings", "mixed token array", {"model": "embed-eu", "input": [[1, "two"]]}, 400),
    ("embeddings", "token id out of range", {"model": "embed-eu", "input": [[10**9]]}, 400),
    (
        "embeddings",
        "bad encoding_format",
        {"model": "embed-eu", "input": "hi", "encoding_format": "hex"},
        400,
    ),
    ("embeddings", "dimensions a string", {"model": "embed-eu", "input": "hi", "dimensions": "8"}, 400),
    ("embeddings", "dimensions it cannot make", {"model": "embed-eu", "input": "hi", "dimensions": 4}, 400),
    ("embeddings", "unknown field", {"model": "embed-eu", "input": "hi", "frobnicate": 1}, 400),
    ("embeddings", "auto", {"model": "auto", "input": "hi"}, 400),
    ("embeddings", "a chat model", {"model": "mid", "input": "hi"}, 400),
    ("embeddings", "unknown model", {"model": "text-embedding-17", "input": "hi"}, 404),
    ("embeddings", "oversize", {"model": "embed-eu", "input": BIG}, 413),
]


@pytest.mark.parametrize(
    ("endpoint", "case", "body", "status"), BAD_INPUT, ids=[f"{e}: {c}" for e, c, _, _ in BAD_INPUT]
)
def test_bad_input_is_a_4xx_in_the_endpoints_format_and_reaches_no_worker(
    gw, upstream, endpoint, case, body, status
):
    if isinstance(body, bytes):
        response = post(gw, endpoint, content=body)
    else:
        response = post(gw, endpoint, body)
    assert response.status_code == status, (case, response.status_code, response.text[:300])
    assert_error_format(endpoint, response)
    assert response.headers.get("x-polyroute-request-id", "req_").startswith("req_")
    assert not upstream.requests, (case, list(upstream.requests))


@pytest.mark.parametrize("endpoint", ["chat", "messages", "count_tokens", "responses", "embeddings"])
def test_no_key_is_401_in_the_endpoints_format_and_reaches_no_worker(gw, upstream, endpoint):
    body = {
        "chat": {"model": "auto", "messages": HELLO},
        "messages": {"model": "auto", "max_tokens": 8, "messages": HELLO},
        "count_tokens": {"model": "auto", "messages": HELLO},
        "responses": {"model": "auto", "input": "hi"},
        "embeddings": {"model": "embed-eu", "input": "hi"},
    }[endpoint]
    response = httpx.post(gw.url + PATHS[endpoint], json=body, timeout=60)
    assert response.status_code == 401, response.text
    assert_error_format(endpoint, response)
    assert not upstream.requests
