"""Detection sees everything a worker is sent: PII in any string field of a chat request (message
names, tool-call arguments, tool schemas, extra keys, image URLs, stop, response_format,
tool_choice, user, logit_bias keys, seed...) keeps the request off a worker the policy rules out.

A real gateway on loopback in front of the test upstream; the upstream's record of what each worker
received is the oracle. The request is pinned to the CN worker ("mid"), which the policy closes to
pii and secrets: a request that is classified correctly is refused with 403 and never reaches it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway

POLICY = {
    "version": "pii-payload",
    "rules": [
        {
            "id": "sensitive-not-in-cn",
            "when": {"data_classes": ["pii", "secret"]},
            "deny_jurisdictions": ["CN"],
        }
    ],
}
PINNED, PINNED_MODEL = "mid", "mid-model"  # jurisdiction CN in the test catalog

# Personal data and credentials as people (or an evasive client) write them.
PII = [
    "jane.doe@example.com",
    "ja\u200bne.d\u200boe@exam\u00adple.org",  # zero-width space, soft hyphen
    "jane\uff20example.com",  # full-width @
    "jane.doe%40example.com",  # percent-encoded, as in a URL
    "jane.doe&#64;example.com",  # an HTML character reference
    "4111 1111 1111 1111",
    "4111.1111.1111.1111",
    "4111-1111 1111.1111",
    "\uff14\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11\uff11",
    "5555\u200b5555\u200b5555\u200b4444",
    "DE89 3704 0044 0532 0130 00",
    "de89-3704-0044-0532-0130-00",
    "123-45-6789",
    "SSN 078051120",
    "+33 6 12 34 56 78",
    "06 12 34 56 78",
    "(555) 123-4567",
    "07700 900123",
    "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc",
    "AKIA" + "IOSFODNN7EXAMPLE",
]

Body = dict[str, Any]


def base(*messages: Body, **params: Any) -> Body:
    return {"model": PINNED, "messages": list(messages) or [{"role": "user", "content": "hello"}], **params}


def nest(value: Any, depth: int) -> Body:
    """A JSON-schema property `depth` levels down (arrays of objects), holding `value`."""
    schema: Body = {"type": "string", "description": value}
    for level in range(depth):
        schema = {"type": "array", "items": {"type": "object", "properties": {f"f{level}": schema}}}
    return schema


def tool(description: str = "Look something up", param: Body | None = None) -> Body:
    properties = {"q": param or {"type": "string", "description": "the query"}}
    return {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": description,
            "parameters": {"type": "object", "properties": properties},
        },
    }


def tool_call_turn(arguments: str, name: str = "lookup") -> list[Body]:
    return [
        {"role": "user", "content": "find it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        {"role": "user", "content": "thanks"},
    ]


# Where the string goes: (name, build(string, depth) -> request body). Every slot is forwarded.
SLOTS: list[tuple[str, Callable[[str, int], Body]]] = [
    ("content", lambda s, d: base({"role": "user", "content": s})),
    ("content part", lambda s, d: base({"role": "user", "content": [{"type": "text", "text": s}]})),
    (
        "system message",
        lambda s, d: base({"role": "system", "content": s}, {"role": "user", "content": "hi"}),
    ),
    ("message name", lambda s, d: base({"role": "user", "content": "hi", "name": s})),
    ("message extra value", lambda s, d: base({"role": "user", "content": "hi", "x_note": s})),
    ("message extra key", lambda s, d: base({"role": "user", "content": "hi", s: "note"})),
    ("message extra nested", lambda s, d: base({"role": "user", "content": "hi", "x_meta": nest(s, d)})),
    (
        "content part extra",
        lambda s, d: base(
            {"role": "user", "content": [{"type": "text", "text": "hi", "x_meta": nest(s, d)}]}
        ),
    ),
    (
        "image_url",
        lambda s, d: base(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "https://img.example/p.png?who=" + s}},
                ],
            }
        ),
    ),
    ("tool call arguments", lambda s, d: base(*tool_call_turn(json.dumps({"q": s})))),
    ("tool call name", lambda s, d: base(*tool_call_turn("{}", name=s))),
    ("tool description", lambda s, d: base(tools=[tool(description=s)])),
    ("tool parameter description", lambda s, d: base(tools=[tool(param=nest(s, d))])),
    ("tool parameter enum", lambda s, d: base(tools=[tool(param={"type": "string", "enum": ["a", s]})])),
    ("stop", lambda s, d: base(stop=s)),
    ("stop list", lambda s, d: base(stop=["END", s])),
    (
        "response_format",
        lambda s, d: base(
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": nest(s, d)}}
        ),
    ),
    (
        "tool_choice",
        lambda s, d: base(tools=[tool()], tool_choice={"type": "function", "function": {"name": s}}),
    ),
    ("user", lambda s, d: base(user=s)),
    ("logit_bias key", lambda s, d: base(logit_bias={s: 1.0})),
]
SLOT_NAMES = [name for name, _ in SLOTS]


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pii-payload")
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    gateway = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), data_dir, policy_file=policy_file)
    yield gateway
    gateway.server.stop()


def post(gw, body: Body) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=30)


@pytest.mark.parametrize("slot", SLOT_NAMES)
def test_a_clean_request_in_every_slot_reaches_the_pinned_worker(gw, upstream, slot):
    """The control: without PII each shape is valid and served by the CN worker, so a 403 below
    is detection's doing, not a malformed request's."""
    build = dict(SLOTS)[slot]
    response = post(gw, build("nothing personal here 2024-11-15 v3.2.1", 2))
    assert response.status_code == 200, response.text
    assert response.headers["x-polyroute-data-class"] == "public"
    assert len(upstream.requests_for(PINNED_MODEL)) == 1


# Words around the PII: letters and spaces only, so they cannot make a valid number invalid.
FILLER = st.text(alphabet="abcdefghij ", max_size=12)


@st.composite
def requests_with_pii(draw: st.DrawFn) -> tuple[str, str, Body]:
    pii = draw(st.sampled_from(PII))
    name, build = draw(st.sampled_from(SLOTS))
    text = f"{draw(FILLER)} {pii} {draw(FILLER)}"
    return name, pii, build(text, draw(st.integers(0, 5)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=requests_with_pii())
def test_pii_in_any_forwarded_field_never_reaches_a_worker_the_policy_rules_out(gw, upstream, case):
    slot, pii, body = case
    before = len(upstream.requests_for(PINNED_MODEL))
    response = post(gw, body)
    assert response.status_code == 403, (slot, pii, response.status_code, response.text[:300])
    assert response.headers["x-polyroute-data-class"] in ("pii", "secret"), (slot, pii)
    assert len(upstream.requests_for(PINNED_MODEL)) == before, (slot, pii)


def test_a_card_number_as_the_seed_is_detected(gw, upstream):
    """Numbers are forwarded too: a card number in `seed` is personal data like any string."""
    response = post(gw, base(seed=4111111111111111))
    assert response.status_code == 403 and response.headers["x-polyroute-data-class"] == "pii"
    assert not upstream.requests_for(PINNED_MODEL)


@pytest.mark.parametrize(
    ("slot", "text"),
    [
        # json.dumps escapes the zero-width space and the soft hyphen: the worker's JSON parser
        # undoes that, so detection must read through it (found by the property test above).
        ("tool call arguments", "ja\u200bne.d\u200boe@exam\u00adple.org"),
        ("image_url", "jane.doe%40example.com"),
    ],
)
def test_escaped_pii_is_detected(gw, upstream, slot, text):
    response = post(gw, dict(SLOTS)[slot](text, 0))
    assert response.status_code == 403 and response.headers["x-polyroute-data-class"] == "pii"
    assert not upstream.requests_for(PINNED_MODEL)
