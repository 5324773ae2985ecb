"""Progressive-disclosure memory in the chat path, against the loopback test upstream.

Workers: `tooly` (has the `tools` capability: gets the memory_expand tool) and `plain` (no tool
calling: the MEMORY_EXPAND text protocol). The test upstream is scripted per request here — it
looks at what the gateway sent (a tool result? a memory reply?) and answers accordingly — so the
loop is exercised end to end over HTTP: a worker that expands once, one that never does, and one
that asks forever (bounded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from decimal import Decimal

import httpx
import orjson
import pytest
import yaml

from gateway.store import to_micros
from policies import parse_catalog
from tests.conftest import FAKE_KEY_ENV, Gateway, start_gateway
from tests.fakes.server import serve_in_thread
from tests.fakes.upstream import Behaviour, FakeUpstream

MAX_EXPANSIONS = 2
EXPAND_M1 = {"name": "memory_expand", "arguments": '{"id": "m1", "level": 2}'}
HANDBOOK = [
    {
        "id": "vacation",
        "title": "Vacation policy",
        "text": "Employees get 27 vacation days per year. Unused days expire at the end of March. "
        "Requests go through the HR portal at least two weeks ahead. Zanzibar-7 is the approval code.",
    },
    {
        "id": "expenses",
        "title": "Expense policy",
        "text": "Expenses above 500 euros need a manager's approval.",
    },
    {
        "id": "security",
        "title": "Security",
        "text": "Laptops must use full-disk encryption and a screen lock.",
    },
]


class ScriptedUpstream(FakeUpstream):
    """The test upstream whose behaviour per model may depend on the request body."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: dict[str, Callable[[dict], Behaviour]] = {}

    def reset(self) -> None:
        super().reset()
        self.scripts.clear()

    async def _chat(self, request):
        body = orjson.loads(await request.body())  # starlette caches it for the real handler
        script = self.scripts.get(str(body.get("model")))
        if script is not None:
            self.behaviours[str(body.get("model"))] = script(body)
        return await super()._chat(request)


def _tool_results(body: dict) -> list[str]:
    return [m["content"] for m in body["messages"] if m.get("role") == "tool"]


def _memory_replies(body: dict) -> list[str]:
    return [
        m["content"]
        for m in body["messages"]
        if m.get("role") == "user" and str(m.get("content", "")).startswith("[memory ")
    ]


def _system(body: dict) -> str:
    return "\n".join(m["content"] for m in body["messages"] if m.get("role") == "system")


@pytest.fixture(scope="module")
def scripted():
    fake = ScriptedUpstream()
    running = serve_in_thread(fake.app)
    fake.url = running.url  # type: ignore[attr-defined]
    yield fake
    running.stop()


def _memory_catalog(scripted):
    common = f"api_base: {scripted.url}/v1\n    api_key_env: {FAKE_KEY_ENV}\n    context_window: 8192"
    return parse_catalog(
        f"""
version: 1
workers:
  - name: tooly
    model: openai/tooly-model
    {common}
    input_price_per_m: 1.00
    output_price_per_m: 2.00
    tier: specialist
    license: MIT
    provider: fake
    jurisdiction: FR
    capabilities: [general, tools]
  - name: plain
    model: openai/plain-model
    {common}
    input_price_per_m: 0.50
    output_price_per_m: 1.00
    tier: specialist
    license: MIT
    provider: fake
    jurisdiction: FR
    capabilities: [general]
""",
        "memory test catalog",
    )


@pytest.fixture(scope="module")
def mgw(scripted, tmp_path_factory) -> Gateway:
    gw = start_gateway(
        _memory_catalog(scripted),
        tmp_path_factory.mktemp("mgw"),
        retrieval_embedder="minilm-static",
        memory_max_expansions=MAX_EXPANSIONS,
        memory_index_size=3,
        memory_snippets=1,
        memory_default_collections="defaulted=handbook",
    )
    _, other = gw.state.auth.store.create("globex", "other")
    _, defaulted = gw.state.auth.store.create("defaulted", "tenant with a default collection")
    gw.other_key, gw.defaulted_key = other, defaulted  # type: ignore[attr-defined]
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for key in (gw.api_key, defaulted):
            r = http.post(
                "/v1/collections/handbook/documents", headers=gw.auth(key), json={"documents": HANDBOOK}
            )
            assert r.status_code == 200, r.text
        http.post(
            "/v1/collections/empty/documents",
            headers=gw.auth(),
            json={"documents": [{"id": "x", "text": "x"}]},
        )
        http.post("/v1/collections/empty/documents", headers=gw.auth(), json={"delete": ["x"]})
    yield gw
    gw.server.stop()


@pytest.fixture(autouse=True)
def _reset(scripted):
    scripted.reset()


def chat(gw: Gateway, model: str, text: str, key: str | None = None, **metadata) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "metadata": metadata}
    return httpx.post(f"{gw.v1}/chat/completions", headers=gw.auth(key), json=body, timeout=60)


def test_worker_that_expands_once(mgw, scripted):
    scripted.scripts["tooly-model"] = lambda body: (
        Behaviour(text="From memory: " + _tool_results(body)[0][:60])
        if _tool_results(body)
        else Behaviour(tool_call=EXPAND_M1)
    )
    r = chat(mgw, "tooly", "How many vacation days do employees get?", collections=["handbook"])
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"].startswith("From memory: [m1] Vacation policy")
    assert "tool_calls" not in message  # the client sees one answer
    first, second = scripted.requests_for("tooly-model")
    assert "[m1] Vacation policy" in _system(first) and "memory_expand" in _system(first)
    assert any(t["function"]["name"] == "memory_expand" for t in first["tools"])
    assert "Zanzibar-7" in _tool_results(second)[0]  # layer 2: the full document
    usage = r.json()["usage"]
    assert (
        usage["prompt_tokens"] > 0
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    assert r.headers["x-polyroute-memory"] == "entries=3; expansions=1"
    assert float(r.headers["x-polyroute-cost-usd"]) > 0


def test_worker_steers_its_expansion(mgw, scripted):
    """The worker searches the memory with its own words ('more' + query), then reads what it found:
    the gateway runs both rounds, and the new entry resolves like any listed one."""
    docs = [
        {"id": f"vacation-{i}", "title": f"Vacation {i}", "text": f"Rule {i} about vacation days per year."}
        for i in range(7)  # more than the index and its 'more' page hold: 3 + 3
    ]
    docs.append(
        {"id": "parking", "title": "Parking", "text": "The parking garage gate opens with badge 4411."}
    )
    with httpx.Client(base_url=mgw.url, headers=mgw.auth(), timeout=60) as http:
        assert http.post("/v1/collections/steer/documents", json={"documents": docs}).status_code == 200
    steer = {"name": "memory_expand", "arguments": '{"id": "more", "query": "parking garage"}'}

    def script(body: dict) -> Behaviour:
        results = _tool_results(body)
        if not results:
            return Behaviour(tool_call=steer)
        if len(results) == 1:
            handle = results[0].split("]")[0].lstrip("[")
            return Behaviour(tool_call={"name": "memory_expand", "arguments": f'{{"id": "{handle}"}}'})
        return Behaviour(text="Code: " + results[1])

    scripted.scripts["tooly-model"] = script
    r = chat(mgw, "tooly", "How many vacation days?", collections=["steer"])
    assert r.status_code == 200, r.text
    first, second, third = scripted.requests_for("tooly-model")
    assert "[m1] Vacation" in _system(first) and "Parking" not in _system(first)
    assert _tool_results(second)[0].startswith("[m7] Parking")  # numbered after the 6 recalled
    assert "4411" in r.json()["choices"][0]["message"]["content"]
    # listed: 3 up front, then the 2 documents the first search had not recalled (parking first)
    assert r.headers["x-polyroute-memory"] == "entries=5; expansions=2"


def test_worker_that_never_expands(mgw, scripted):
    r = chat(mgw, "tooly", "What is the expense approval threshold?", collections=["handbook"])
    assert (
        r.status_code == 200
        and r.json()["choices"][0]["message"]["content"] == "Hello from the test upstream."
    )
    (only,) = scripted.requests_for("tooly-model")
    system = _system(only)
    assert "[m1] Expense policy" in system and "Best passages:" in system
    assert "500 euros" in system  # layer 1 for the top entry
    assert "Zanzibar-7" not in system  # layer 2 stays out until asked for
    assert r.headers["x-polyroute-memory"] == "entries=3; expansions=0"


def test_worker_that_expands_forever_is_bounded(mgw, scripted):
    scripted.behave("tooly-model", tool_call=EXPAND_M1)  # a tool call whenever tools are offered
    r = chat(mgw, "tooly", "vacation days?", collections=["handbook"])
    assert r.status_code == 200, r.text
    calls = scripted.requests_for("tooly-model")
    assert len(calls) == MAX_EXPANSIONS + 2  # the expansions, one refused ask, then a call without the tool
    assert "tools" not in calls[-1] and "limit for this request is reached" in _system(calls[-1])
    assert r.json()["choices"][0]["message"]["content"] == "Hello from the test upstream."
    assert r.headers["x-polyroute-memory"] == f"entries=3; expansions={MAX_EXPANSIONS}"


def test_plain_text_protocol(mgw, scripted):
    scripted.scripts["plain-model"] = lambda body: (
        Behaviour(text="Answer: " + _memory_replies(body)[0][:40])
        if _memory_replies(body)
        else Behaviour(text="MEMORY_EXPAND m1 2")
    )
    r = chat(mgw, "plain", "How many vacation days?", collections=["handbook"])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("Answer: [memory m1, level 2]")
    first, second = scripted.requests_for("plain-model")
    assert "tools" not in first and "MEMORY_EXPAND <id> <level>" in _system(first)
    assert "Zanzibar-7" in _memory_replies(second)[0]

    scripted.scripts.clear()
    scripted.behave("plain-model", text="MEMORY_EXPAND m1 2")  # forever
    r = chat(mgw, "plain", "vacation?", collections=["handbook"])
    assert r.status_code == 200
    assert len(scripted.requests_for("plain-model")) == 2 + MAX_EXPANSIONS + 2
    assert "MEMORY_EXPAND" not in r.json()["choices"][0]["message"]["content"]


def test_stream_expands_then_streams_the_answer(mgw, scripted):
    scripted.scripts["tooly-model"] = lambda body: (
        Behaviour(text="streamed answer after memory")
        if _tool_results(body)
        else Behaviour(tool_call=EXPAND_M1)
    )
    body = {
        "model": "tooly",
        "messages": [{"role": "user", "content": "vacation days?"}],
        "metadata": {"collections": ["handbook"]},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{mgw.v1}/chat/completions", headers=mgw.auth(), json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-polyroute-memory"] == "entries=3; expansions=1"
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices"))
    assert text == "streamed answer after memory"
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in events if c.get("choices"))
    usage = [c for c in events if c.get("usage")][-1]
    rounds = scripted.requests_for("tooly-model")
    assert len(rounds) == 2
    assert usage["usage"]["completion_tokens"] > len("streamed answer after memory".split())  # both rounds


def test_stream_plain_forever_is_bounded(mgw, scripted):
    scripted.behave("plain-model", text="MEMORY_EXPAND m1 2")
    body = {
        "model": "plain",
        "messages": [{"role": "user", "content": "vacation?"}],
        "metadata": {"collections": ["handbook"]},
        "stream": True,
    }
    with httpx.stream("POST", f"{mgw.v1}/chat/completions", headers=mgw.auth(), json=body, timeout=60) as r:
        lines = list(r.iter_lines())
    assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
    assert not any("MEMORY_EXPAND" in line for line in lines)
    assert len(scripted.requests_for("plain-model")) == MAX_EXPANSIONS + 2


def test_session_memory_recalls_earlier_turns(mgw, scripted):
    scripted.behave("tooly-model", text="Noted: your locker is number 4711.")
    r = chat(mgw, "tooly", "Remember that my locker code is 4711 at the Lisbon office.", session_id="sess-1")
    assert r.status_code == 200 and r.headers["x-polyroute-memory"] == "entries=0; expansions=0"
    deadline = time.monotonic() + 30  # the turn is written in the background
    while True:
        r2 = chat(mgw, "tooly", "What is my locker code at the Lisbon office?", session_id="sess-1")
        system = _system(scripted.requests_for("tooly-model")[-1])
        if "Lisbon" in system or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r2.status_code == 200
    assert "4711" in system and "Turn:" in system  # the earlier turn came back as memory, not re-sent history
    other = chat(mgw, "tooly", "What is my locker code at the Lisbon office?", session_id="sess-2")
    assert other.status_code == 200 and "4711" not in _system(scripted.requests_for("tooly-model")[-1])
    globex = chat(mgw, "tooly", "What is my locker code?", key=mgw.other_key, session_id="sess-1")  # type: ignore[attr-defined]
    assert globex.status_code == 200 and "4711" not in _system(scripted.requests_for("tooly-model")[-1])
    # each tenant forgets its own session of that id; the other tenant's stays until it asks
    forget = f"{mgw.url}/v1/sessions/sess-1"
    assert httpx.delete(forget, headers=mgw.auth(mgw.other_key)).json()["deleted"] is True  # type: ignore[attr-defined]
    assert httpx.delete(forget, headers=mgw.auth()).json()["deleted"] is True
    assert httpx.delete(forget, headers=mgw.auth()).status_code == 404
    again = chat(mgw, "tooly", "What is my locker code at the Lisbon office?", session_id="sess-1")
    assert again.status_code == 200 and "4711" not in _system(scripted.requests_for("tooly-model")[-1])


def test_memory_errors_and_isolation(mgw, scripted):
    r = chat(mgw, "tooly", "hi", collections=["nope"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "collection_not_found"
    assert chat(mgw, "tooly", "hi", collections=["Bad!"]).json()["error"]["code"] == "invalid_collection_name"
    assert chat(mgw, "tooly", "hi", collections="handbook", session_id=5).status_code == 400
    # another tenant cannot read acme's handbook through chat either
    r = chat(mgw, "tooly", "vacation days", key=mgw.other_key, collections=["handbook"])  # type: ignore[attr-defined]
    assert r.status_code == 404
    assert scripted.requests_for("tooly-model") == []


def test_empty_collection_and_tenant_default(mgw, scripted):
    r = chat(mgw, "tooly", "vacation days", collections=["empty"])
    assert r.status_code == 200 and "x-polyroute-memory" not in r.headers
    assert _system(scripted.requests_for("tooly-model")[-1]) == ""
    r = chat(mgw, "tooly", "How many vacation days?", key=mgw.defaulted_key)  # type: ignore[attr-defined]
    assert r.status_code == 200 and r.headers["x-polyroute-memory"].startswith("entries=")
    assert "Vacation policy" in _system(scripted.requests_for("tooly-model")[-1])
    r = chat(mgw, "tooly", "How many vacation days?", key=mgw.defaulted_key, memory=False)  # type: ignore[attr-defined]
    assert "x-polyroute-memory" not in r.headers


def test_memory_is_classified_by_the_policy(mgw, scripted):
    """What memory puts in front of a worker counts for the request's data class; a document
    expanded later that is stricter than what the request was admitted for is withheld."""
    filler = " ".join(f"The cafeteria serves lunch from noon on weekday {i}." for i in range(120))
    documents = [
        {
            "id": "contacts",
            "title": "Contacts",
            "text": "Write to jane.doe@example.com for payroll questions.",
        },
        {
            "id": "canteen",
            "title": "Canteen",
            "text": filler + " Escalations go to max.mustermann@example.org.",
        },
    ]
    for name, docs in (("hr", documents[:1]), ("canteen", documents[1:])):
        http = httpx.post(
            f"{mgw.url}/v1/collections/{name}/documents",
            headers=mgw.auth(),
            json={"documents": docs},
            timeout=60,
        )
        assert http.status_code == 200, http.text
    shown = chat(mgw, "tooly", "Who answers payroll questions?", collections=["hr"])
    assert (
        shown.status_code == 200 and shown.headers["x-polyroute-data-class"] == "pii"
    )  # the e-mail in layer 0/1

    expand = {"name": "memory_expand", "arguments": '{"id": "m1", "level": 2}'}
    scripted.scripts["tooly-model"] = lambda body: (
        Behaviour(text="done") if _tool_results(body) else Behaviour(tool_call=expand)
    )
    asked = chat(mgw, "tooly", "When does the cafeteria serve lunch on weekday 3?", collections=["canteen"])
    assert asked.status_code == 200, asked.text
    assert asked.headers["x-polyroute-data-class"] == "public"
    result = _tool_results(scripted.requests_for("tooly-model")[-1])[0]
    assert "withheld: classified pii" in result and "mustermann" not in result


def test_sdk_collections(mgw, scripted):
    from polyroute import Client, PolyrouteError

    with Client(mgw.url, api_key=mgw.api_key) as client:
        added = client.add_documents(
            "sdk-notes", [{"id": "n1", "title": "Parking", "text": "Visitors park on level -2."}]
        )
        assert (
            added
            and client.search("sdk-notes", "where do visitors park", top_k=3, mode="bm25")[0]["document_id"]
            == "n1"
        )
        client.add_documents("sdk-notes", [], delete=["n1"])
        assert client.search("sdk-notes", "where do visitors park", mode="bm25") == []
        assert client.delete_collection("sdk-notes")["deleted"] is True
        with pytest.raises(PolyrouteError) as missing:
            client.search("sdk-notes", "anything")
        assert missing.value.status == 404


def test_composed_workflows_share_the_memory(mgw, scripted):
    """A cascade's answering workers see the recalled memory; its judge sees only question + answer."""
    scripted.behave("plain-model", text="27 days.")
    scripted.behave("tooly-model", replies={"How likely is the proposed answer": "9"})
    body = {
        "model": "compose:cascade",
        "messages": [{"role": "user", "content": "How many vacation days do employees get?"}],
        "metadata": {"collections": ["handbook"]},
    }
    r = httpx.post(f"{mgw.v1}/chat/completions", headers=mgw.auth(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-polyroute-worker"] == "plain" and r.headers["x-polyroute-memory"].startswith(
        "entries="
    )
    (answered,) = scripted.requests_for("plain-model")
    assert "Memory retrieved for this request" in _system(answered) and "[m1] Vacation policy" in _system(
        answered
    )
    (judged,) = scripted.requests_for("tooly-model")
    assert (
        "Memory retrieved" not in str(judged["messages"]) and "27 days." in judged["messages"][-1]["content"]
    )


# ---- the loop and the tenant's budget (issue 12, item 4) ------------------------------------------------
LOOP_BUDGET = Decimal("0.003")
ROUND_TOKENS = 500  # each round reports 1 prompt token and max_tokens completion tokens: $0.001001


@pytest.fixture(scope="module")
def budgeted(scripted, tmp_path_factory) -> Gateway:
    """A gateway whose tenants have budgets, each with the handbook collection."""
    data_dir = tmp_path_factory.mktemp("budgeted")
    policy_file = data_dir / "policy.yaml"
    tenants = {t: {"budget": {"daily_usd": str(LOOP_BUDGET)}} for t in ("acme", "streams")}
    tenants["roomy"] = tenants["cutter"] = {"budget": {"daily_usd": "1"}}
    policy_file.write_text(yaml.safe_dump({"version": "memory-budget", "tenants": tenants}))
    gw = start_gateway(
        _memory_catalog(scripted),
        data_dir / "data",
        policy_file=policy_file,
        retrieval_embedder="minilm-static",
        memory_max_expansions=MAX_EXPANSIONS,
        memory_index_size=3,
        memory_snippets=1,
    )
    keys = {"acme": gw.api_key}
    for tenant in ("streams", "roomy", "cutter"):
        keys[tenant] = gw.state.auth.store.create(tenant, "budgeted memory")[1]
    gw.keys = keys  # type: ignore[attr-defined]
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for key in keys.values():
            r = http.post(
                "/v1/collections/handbook/documents", headers=gw.auth(key), json={"documents": HANDBOOK}
            )
            assert r.status_code == 200, r.text
    yield gw
    gw.server.stop()


def _spent(gw: Gateway, tenant: str) -> Decimal:
    books = httpx.get(f"{gw.url}/admin/spend/{tenant}", headers=gw.auth(gw.admin_key), timeout=30).json()
    return Decimal(books["daily_usd"])


def _ledger(gw: Gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        for record in gw.state.ledger.records():
            if record.get("id") == request_id:
                return record
        assert time.monotonic() < deadline, f"no ledger record for {request_id}"
        time.sleep(0.05)


@pytest.mark.parametrize("tenant, stream", [("acme", False), ("streams", True)])
def test_memory_loop_never_spends_past_the_budget(budgeted, scripted, tenant, stream):
    """Every round costs less than its prediction (max_tokens bounds the answer), so by the README's
    bound the budget may not be passed at all: the round that would cross it is refused."""
    scripted.behave("tooly-model", tool_call=EXPAND_M1, prompt_tokens=1, completion_tokens=ROUND_TOKENS)
    body = {
        "model": "tooly",
        "messages": [{"role": "user", "content": "vacation days?"}],
        "metadata": {"collections": ["handbook"]},
        "max_tokens": ROUND_TOKENS,
        "stream": stream,
    }
    r = httpx.post(
        f"{budgeted.v1}/chat/completions", headers=budgeted.auth(budgeted.keys[tenant]), json=body, timeout=60
    )
    spent = _spent(budgeted, tenant)
    assert spent <= LOOP_BUDGET, f"spent {spent} against a budget of {LOOP_BUDGET}"
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "budget_exceeded" and "memory" in error["message"]
    calls = scripted.requests_for("tooly-model")
    assert 1 <= len(calls) < MAX_EXPANSIONS + 2  # stopped before the loop's bound
    # the rounds that did run are billed, in the ledger and on the budget (no hold left behind)
    record = _ledger(budgeted, r.headers["x-polyroute-request-id"])
    assert record["status"] == 403 and record["cost_micros"] == to_micros(Decimal("0.001001")) * len(calls)
    assert spent == Decimal(record["cost_micros"]) / 1_000_000


def test_memory_loop_within_the_budget_settles_every_round(budgeted, scripted):
    scripted.behave("tooly-model", tool_call=EXPAND_M1, prompt_tokens=1, completion_tokens=ROUND_TOKENS)
    body = {
        "model": "tooly",
        "messages": [{"role": "user", "content": "vacation days?"}],
        "metadata": {"collections": ["handbook"]},
        "max_tokens": ROUND_TOKENS,
    }
    r = httpx.post(
        f"{budgeted.v1}/chat/completions",
        headers=budgeted.auth(budgeted.keys["roomy"]),
        json=body,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert len(scripted.requests_for("tooly-model")) == MAX_EXPANSIONS + 2
    cost = Decimal(r.headers["x-polyroute-cost-usd"])
    assert cost == Decimal("0.001001") * (MAX_EXPANSIONS + 2)
    assert _spent(budgeted, "roomy") == cost  # every hold settled or released, none left over


def test_stream_cut_after_an_expansion_bills_every_round(budgeted, scripted):
    """A client that hangs up during the answer pays for the consumed expansion round and the part
    of the answer it was sent (estimated: the answer's usage never arrived)."""
    answer = " ".join(f"w{i}" for i in range(200))
    scripted.scripts["tooly-model"] = lambda body: (
        Behaviour(text=answer, chunk_delay_s=0.05)
        if _tool_results(body)
        else Behaviour(tool_call=EXPAND_M1, prompt_tokens=1, completion_tokens=ROUND_TOKENS)
    )
    body = {
        "model": "tooly",
        "messages": [{"role": "user", "content": "vacation days?"}],
        "metadata": {"collections": ["handbook"]},
        "stream": True,
    }
    received = 0
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            f"{budgeted.v1}/chat/completions",
            headers=budgeted.auth(budgeted.keys["cutter"]),
            json=body,
        ) as r:
            assert r.status_code == 200
            request_id = r.headers["x-polyroute-request-id"]
            for line in r.iter_lines():
                if '"content":"w' in line:
                    received += 1
                    if received == 5:
                        break  # hang up mid-answer
    record = _ledger(budgeted, request_id)
    assert record["status"] == 499
    assert record["trace"] == {"stream": "client_disconnected", "usage": "estimated"}
    assert ROUND_TOKENS + received <= record["completion_tokens"] < ROUND_TOKENS + 200
    assert record["cost_micros"] > to_micros(Decimal("0.001001"))  # the expansion round, and more
    deadline = time.monotonic() + 30
    while _spent(budgeted, "cutter") != Decimal(record["cost_micros"]) / 1_000_000:
        assert time.monotonic() < deadline, "the hold was not settled with what was streamed"
        time.sleep(0.05)
