"""System messages for workers whose chat template has none (issue 15: memory never reached Gemma).

llama-cpp-python's `gemma` chat format drops system messages, so a client's system prompt and the
memory the gateway injects as a system message never reached the embedded default worker. For such
workers (`system_role: false`, or a local worker with a system-less `chat_format`) the gateway folds
system and developer text into the user turn. Unit tests of the fold, then end to end against the
loopback test upstream: what the worker receives.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.upstream import fold_system
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, start_gateway

SYSTEM = "You are Polly, the assistant of ACME. Always answer in one sentence and sign with '-- Polly'."
HANDBOOK = [
    {
        "id": "vacation",
        "title": "Vacation policy",
        "text": "Employees get 27 vacation days per year. Zanzibar-7 is the approval code.",
    },
    {"id": "expenses", "title": "Expense policy", "text": "Expenses above 500 euros need approval."},
]


# ------------------------------------------------------------------------------ fold_system
def test_nothing_to_fold_is_unchanged():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    assert fold_system(messages) is messages


def test_system_goes_into_the_first_user_turn():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?", "name": "ann"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert fold_system(messages) == [
        {"role": "user", "content": "Be brief.\n\nWhat is 2+2?", "name": "ann"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert messages[0] == {"role": "system", "content": "Be brief."}  # the input is not modified


def test_several_system_and_developer_messages_in_order():
    messages = [
        {"role": "system", "content": "First."},
        {"role": "developer", "content": "Second."},
        {"role": "system", "content": [{"type": "text", "text": "Third"}, {"type": "text", "text": "part."}]},
        {"role": "user", "content": "Question?"},
    ]
    assert fold_system(messages) == [
        {"role": "user", "content": "First.\n\nSecond.\n\nThird\npart.\n\nQuestion?"},
    ]


def test_user_content_parts_get_a_text_part_in_front():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [
        {"role": "system", "content": "Describe images tersely."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]},
    ]
    assert fold_system(messages) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe images tersely."},
                {"type": "text", "text": "What is this?"},
                image,
            ],
        }
    ]


def test_no_user_turn_creates_one():
    assert fold_system([{"role": "system", "content": "Say hello."}]) == [
        {"role": "user", "content": "Say hello."}
    ]


def test_later_system_messages_stay_where_they_were_said():
    """A system note after the conversation started goes into the next user turn, not the first; one
    after the last user turn (the memory loop's 'answer now') becomes a user turn at the end."""
    messages = [
        {"role": "system", "content": "Memory: A."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "MEMORY_EXPAND m1"},
        {"role": "system", "content": "Now in French."},
        {"role": "user", "content": "Q2"},
        {"role": "tool", "tool_call_id": "c1", "content": "result"},
        {"role": "system", "content": "Answer now."},
    ]
    assert fold_system(messages) == [
        {"role": "user", "content": "Memory: A.\n\nQ1"},
        {"role": "assistant", "content": "MEMORY_EXPAND m1"},
        {"role": "user", "content": "Now in French.\n\nQ2"},
        {"role": "tool", "tool_call_id": "c1", "content": "result"},
        {"role": "user", "content": "Answer now."},
    ]


def _worker_yaml(name: str, extra: str = "", base: str = "http://127.0.0.1:9/v1") -> str:
    return f"""
  - name: {name}
    model: openai/{name}-model
    api_base: {base}
    api_key_env: {FAKE_KEY_ENV}
    context_window: 8192
    input_price_per_m: 0.10
    output_price_per_m: 0.20
    tier: specialist
    license: MIT
    provider: fake
    jurisdiction: FR
{extra}"""


def test_catalog_says_which_workers_fold():
    catalog = parse_catalog(
        "version: 1\nworkers:"
        + _worker_yaml("native")
        + _worker_yaml("systemless", "    system_role: false\n")
        + _worker_yaml("gemma-local", "    local: {gguf: /x.gguf, chat_format: gemma}\n")
        + _worker_yaml("chatml-local", "    local: {gguf: /x.gguf, chat_format: chatml}\n")
        + _worker_yaml(
            "gemma-forced", "    local: {gguf: /x.gguf, chat_format: gemma}\n    system_role: true\n"
        )
    )
    folds = {w.name: w.folds_system for w in catalog.workers}
    assert folds == {
        "native": False,
        "systemless": True,
        "gemma-local": True,  # from the llama.cpp chat format
        "chatml-local": False,
        "gemma-forced": False,  # an explicit system_role wins
    }
    from policies import load_catalog

    assert load_catalog().get("gemma-3-270m-local").folds_system  # the embedded default worker


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def fgw(upstream, tmp_path_factory):
    base = f"{upstream.url}/v1"
    catalog = parse_catalog(
        "version: 1\nworkers:"
        + _worker_yaml("systemless", "    system_role: false\n", base)
        + _worker_yaml("native", "", base),
        "folding test catalog",
    )
    gw = start_gateway(catalog, tmp_path_factory.mktemp("fold"), retrieval_embedder="minilm-static")
    r = httpx.post(
        f"{gw.v1}/collections/handbook/documents", headers=gw.auth(), json={"documents": HANDBOOK}, timeout=60
    )
    assert r.status_code == 200, r.text
    yield gw
    gw.server.stop()


def _chat(gw, model: str, messages: list, **extra) -> httpx.Response:
    body = {"model": model, "messages": messages, **extra}
    return httpx.post(f"{gw.v1}/chat/completions", headers=gw.auth(), json=body, timeout=60)


QUESTION = "How many vacation days do employees get?"


@pytest.mark.parametrize("stream", [False, True])
def test_system_prompt_and_memory_reach_a_systemless_worker(fgw, upstream, stream):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = _chat(fgw, "systemless", messages, metadata={"collections": ["handbook"]}, stream=stream)
    assert r.status_code == 200, r.text
    assert r.headers["x-polyroute-memory"].startswith("entries=")
    assert r.headers["x-polyroute-memory"] != "entries=0"
    (sent,) = upstream.requests_for("systemless-model")
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["user"], sent["messages"]
    first = sent["messages"][0]["content"]
    assert first.startswith(SYSTEM + "\n\n")  # the client's system prompt first
    assert "Vacation policy" in first  # then the memory the gateway retrieved
    assert first.endswith("\n\n" + QUESTION)  # then the question itself


def test_a_worker_with_a_system_role_gets_system_messages(fgw, upstream):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = _chat(fgw, "native", messages, metadata={"collections": ["handbook"]})
    assert r.status_code == 200, r.text
    (sent,) = upstream.requests_for("native-model")
    assert [m["role"] for m in sent["messages"]] == ["system", "system", "user"]
    assert sent["messages"][0]["content"] == SYSTEM and "Vacation policy" in sent["messages"][1]["content"]
    assert sent["messages"][2]["content"] == QUESTION


def test_content_parts_survive_the_fold_end_to_end(fgw, upstream):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
    ]
    r = _chat(fgw, "systemless", messages)
    assert r.status_code == 200, r.text
    (sent,) = upstream.requests_for("systemless-model")
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Hello?"}]}
    ]
