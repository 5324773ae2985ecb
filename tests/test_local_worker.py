"""The real local worker: llama.cpp (llama-cpp-python) serving the packaged Gemma 3 270M GGUF.

Slow (assembles a 250 MB model and loads it), so marked `slow`; `make test` still runs it.
"""

from __future__ import annotations

import time
from decimal import Decimal

import httpx
import openai
import pytest

from policies import load_catalog, parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway

pytestmark = pytest.mark.slow


def wait_ready(gateway, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(gateway.url + "/readyz").json()
        local = body["workers"]["gemma-3-270m-local"]
        if local["ready"] or local["local"]["state"] == "failed":
            return body
        time.sleep(0.25)
    raise AssertionError("local worker never became ready")


@pytest.fixture(scope="module")
def local_gateway(tmp_path_factory, upstream):
    """The local Gemma worker, plus the test upstream's `pricey` worker for composed requests."""
    default = load_catalog()
    pricey = parse_catalog(catalog_yaml_for(upstream.url)).get("pricey")
    catalog = default.model_copy(update={"workers": (default.get("gemma-3-270m-local"), pricey)})
    gw = start_gateway(
        catalog, tmp_path_factory.mktemp("local"), local_workers=True, retrieval_embedder="minilm-static"
    )
    yield gw
    gw.server.stop()
    proc = gw.state.local["gemma-3-270m-local"]
    assert proc.state == "stopped" and proc._proc is None  # stopped with the gateway


def test_request_answered_by_real_llama_cpp(local_gateway):
    ready = wait_ready(local_gateway)
    assert ready["ready"] is True, ready
    client = openai.OpenAI(base_url=local_gateway.v1, api_key=local_gateway.api_key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=24,
        temperature=0,
        seed=7,
    )
    completion = raw.parse()
    assert raw.headers["x-polyroute-worker"] == "gemma-3-270m-local"
    assert completion.choices[0].message.content.strip(), "the model produced text"
    assert completion.usage.completion_tokens > 0 and completion.usage.prompt_tokens > 0
    assert Decimal(raw.headers["x-polyroute-cost-usd"]) == 0  # a local worker costs nothing


def test_streaming_from_real_llama_cpp(local_gateway):
    assert wait_ready(local_gateway)["ready"]
    client = openai.OpenAI(base_url=local_gateway.v1, api_key=local_gateway.api_key, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="gemma-3-270m-local",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    usage = [c for c in chunks if c.usage]
    assert usage and usage[-1].usage.completion_tokens > 0  # counted by us if llama.cpp sends none


def test_system_prompt_and_memory_reach_the_gemma_worker(local_gateway, capsys):
    """Issue 15: llama.cpp's `gemma` chat format drops system messages, so a system prompt and the
    memory the gateway injects added 0 prompt tokens. The gateway now folds them into the user turn."""
    assert wait_ready(local_gateway)["ready"]
    question = {"role": "user", "content": "How many vacation days do employees get?"}
    system = {
        "role": "system",
        "content": "You are the HR assistant of ACME Corporation. Answer in one short sentence, quote the "
        "policy you rely on, and say plainly when the staff handbook does not cover the question.",
    }
    assert len(system["content"]) >= 170

    def prompt_tokens(url: str, headers: dict, messages: list, **extra) -> int:
        body = {"model": "gemma-3-270m-local", "messages": messages, "max_tokens": 4, "temperature": 0}
        response = httpx.post(url, headers=headers, json={**body, **extra}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    gateway_url, auth = local_gateway.v1 + "/chat/completions", local_gateway.auth()
    direct_url = local_gateway.state.local["gemma-3-270m-local"].api_base + "/chat/completions"
    bare = prompt_tokens(gateway_url, auth, [question])
    direct = prompt_tokens(direct_url, {}, [system, question])  # llama.cpp itself, no gateway
    with_system = prompt_tokens(gateway_url, auth, [system, question])
    r = httpx.post(
        local_gateway.v1 + "/collections/handbook/documents",
        headers=auth,
        json={"documents": [{"id": "vacation", "title": "Vacation policy", "text": "27 days a year."}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    with_memory = prompt_tokens(gateway_url, auth, [question], metadata={"collections": ["handbook"]})
    with capsys.disabled():
        print(
            f"\nprompt_tokens: bare {bare}, system sent to llama.cpp directly {direct}, "
            f"system via gateway {with_system}, memory via gateway {with_memory}"
        )
    assert direct == bare  # what the issue measured: llama.cpp's gemma format drops the system message
    assert with_system >= bare + 25  # folded into the user turn: the ~35 tokens of the system prompt count
    assert with_memory >= bare + 10  # the memory index reaches the model too


@pytest.mark.parametrize("verdict, final", [("9", "gemma-3-270m-local"), ("1", "pricey")])
def test_cascade_from_the_local_worker(local_gateway, upstream, verdict, final):
    """The free local model answers first; the judge (pricey, on the test upstream) accepts or escalates."""
    assert wait_ready(local_gateway)["ready"]
    upstream.behave("pricey-model", text="Blue.", replies={"How likely is the proposed answer": verdict})
    response = httpx.post(
        local_gateway.v1 + "/chat/completions",
        headers={**local_gateway.auth(), "x-polyroute-trace": "1"},
        json={
            "model": "compose:cascade",
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-polyroute-worker"] == final
    steps = response.json()["polyroute"]["trace"]["steps"]
    assert steps[0]["worker"] == "gemma-3-270m-local" and steps[0]["completion_tokens"] > 0
    assert Decimal(steps[0]["cost_usd"]) == 0 and steps[1]["role"] == "judge"
    judged = upstream.requests_for("pricey-model")[0]["messages"][-1]["content"]
    assert "Name a colour." in judged  # the judge saw the question and the local model's answer
    assert response.json()["choices"][0]["message"]["content"].strip()


def local_catalog(name: str, local: str):
    """A catalog of one local worker `name` whose `local:` entry is `local` (YAML flow mapping)."""
    return parse_catalog(f"""
version: 1
workers:
  - name: {name}
    model: openai/{name}
    local: {local}
    input_price_per_m: 0
    output_price_per_m: 0
    tier: local
    license: gemma
    provider: local
    jurisdiction: local
    context_window: 2048
""")


def test_missing_model_file_is_reported_and_never_called(tmp_path):
    catalog = local_catalog("broken-local", f"{{gguf: {tmp_path}/missing.gguf, startup_timeout_s: 5}}")
    gw = start_gateway(catalog, tmp_path / "data", local_workers=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            body = httpx.get(gw.url + "/readyz").json()
            if body["workers"]["broken-local"]["local"]["state"] == "failed" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert body["ready"] is False
        assert "GGUF file not found" in body["workers"]["broken-local"]["reason"]
        response = httpx.post(
            gw.v1 + "/chat/completions",
            headers=gw.auth(),
            json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_admissible_worker"
        assert "GGUF file not found" in response.json()["error"]["message"]
    finally:
        gw.server.stop()


def test_a_port_another_server_holds_is_reported_not_taken_for_ours(tmp_path):
    """A fixed local.port that another server already holds (an orphaned llama.cpp server, say) is a
    clear failure: the readiness check would otherwise get that server's /v1/models and report ours
    ready while ours cannot bind."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from gateway.local_worker import free_port

    class Foreign(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "someone-else"}]}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    port = free_port()
    foreign = HTTPServer(("127.0.0.1", port), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    catalog = local_catalog("squatted", f"{{gguf: {gguf}, port: {port}, startup_timeout_s: 60}}")
    gw = start_gateway(catalog, tmp_path / "data", local_workers=True)
    try:
        seen = set()
        deadline = time.monotonic() + 120  # a hang guard only: the loop ends on the state
        while time.monotonic() < deadline:
            worker = httpx.get(gw.url + "/readyz").json()["workers"]["squatted"]
            seen.add(worker["local"]["state"])
            if worker["local"]["state"] in ("failed", "ready"):
                break
            time.sleep(0.05)
        assert "ready" not in seen, seen
        assert "already in use" in worker["reason"]
    finally:
        gw.server.stop()
        foreign.shutdown()
