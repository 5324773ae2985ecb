"""The local worker's prompt template (issue 15: "the local worker's answers look like a gateway bug").

Gemma 3 270M is a base model; through llama.cpp's `gemma` chat format it rambled. The catalog now
gives it the `base-qa` chat template (a few answered questions and stop sequences, rendered by the
gateway's llama.cpp launcher) and says it is a base model on /v1/models and in the startup log.
Fast tests: the template's rendering (with the gateway's system fold), the catalog field's checks,
the /v1/models card. Slow: the real model behind the gateway.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from gateway.llama_server import main as launcher_main
from gateway.upstream import fold_system
from policies import CatalogError, load_catalog, parse_catalog
from policies.chat_template import ChatTemplateError, builtin_names, load_chat_template
from tests.conftest import start_gateway

LOCAL = "gemma-3-270m-local"
EXAMPLES = (
    "<bos>Question: What is the capital of Austria?\nAnswer: The capital of Austria is Vienna.\n\n"
    "Question: What is 3 + 6?\nAnswer: 3 + 6 = 9.\n\n"
    "Question: What is the opposite of tall?\nAnswer: The opposite of tall is short.\n\n"
)


@pytest.fixture(scope="module")
def base_qa():
    return load_chat_template("base-qa")


# ------------------------------------------------------------------------------ rendering
def test_a_question_is_rendered_after_the_examples(base_qa):
    prompt = base_qa.render(
        [{"role": "user", "content": "What is the capital of France?"}], bos_token="<bos>"
    )
    assert prompt == EXAMPLES + "Question: What is the capital of France?\nAnswer:"


def test_the_models_own_bos_is_used(base_qa):
    """The file names no BOS: the launcher passes the GGUF's, so another model's works as well."""
    prompt = base_qa.render([{"role": "user", "content": "Hi?"}], bos_token="<s>")
    assert prompt.startswith("<s>Question: What is the capital of Austria?")


def test_multi_turn_keeps_every_turn_in_order(base_qa):
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "  And 3 + 3?\n"},
    ]
    prompt = base_qa.render(messages, bos_token="<bos>")
    assert (
        prompt == EXAMPLES + "Question: What is 2 + 2?\nAnswer: 2 + 2 = 4.\n\nQuestion: And 3 + 3?\nAnswer:"
    )


def test_system_text_and_memory_arrive_through_the_gateways_fold(base_qa):
    """The template has no system section (system_role: false), so the catalog worker folds: the
    client's system prompt and the memory the gateway injects reach the model in the question."""
    worker = load_catalog().get(LOCAL)
    assert worker.folds_system and worker.local.drops_system
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "system", "content": "Memory:\n[vacation] Employees get 27 vacation days."},
        {"role": "user", "content": "How many vacation days do I get?"},
        {"role": "assistant", "content": "27."},
        {"role": "system", "content": "Answer now."},
    ]
    prompt = base_qa.render(fold_system(messages), bos_token="<bos>")
    assert prompt == EXAMPLES + (
        "Question: Answer in French.\n\nMemory:\n[vacation] Employees get 27 vacation days.\n\n"
        "How many vacation days do I get?\nAnswer: 27.\n\nQuestion: Answer now.\nAnswer:"
    )


def test_unfolded_system_messages_are_dropped_not_mangled(base_qa):
    """Sent to llama.cpp directly (no gateway) system text is left out, as llama.cpp's gemma format does."""
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert base_qa.render(with_system) == base_qa.render(with_system[1:])


def test_content_parts_become_one_question(base_qa):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [
        {"role": "system", "content": "Memory: the cat is called Tom."},
        {"role": "user", "content": [{"type": "text", "text": "What is the cat called?"}, image]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    prompt = base_qa.render(fold_system(messages), bos_token="<bos>", add_generation_prompt=False)
    assert (
        prompt
        == EXAMPLES + "Question: Memory: the cat is called Tom.\n\nWhat is the cat called?\nAnswer: \n\n"
    )


def test_stop_sequences_end_the_answer_at_the_next_turn(base_qa):
    assert base_qa.stops("<eos>") == ["<eos>", "\n\n", "\nQuestion:", "\nAnswer:"]
    assert base_qa.stops("") == ["\n\n", "\nQuestion:", "\nAnswer:"]  # never an empty stop
    assert base_qa.system_role is False and "base-qa" in builtin_names()


# ------------------------------------------------------------------------------ catalog field
def _catalog(local: str, extra: str = "") -> str:
    return f"""
version: 1
workers:
  - name: my-local
    model: openai/my-local
    local: {local}
    input_price_per_m: 0
    output_price_per_m: 0
    tier: local
    license: apache-2.0
    provider: local
    jurisdiction: local
    context_window: 4096
{extra}"""


def test_the_default_catalog_says_base_model_and_uses_the_template():
    local = load_catalog().get(LOCAL).local
    assert local.chat_template == "base-qa" and local.chat_format is None
    assert local.instruct is False and "docs/local-worker.md" in local.note
    assert local.template == load_chat_template("base-qa")


def test_a_template_file_of_ones_own(tmp_path):
    """An instruct model's tokenizer_config.json works as it is: its template, BOS/EOS, a system role."""
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(config))
    worker = parse_catalog(_catalog(f"{{gguf: /m.gguf, chat_template: {path}}}")).get("my-local")
    assert worker.folds_system is False  # the template says nothing about system: it takes them
    prompt = worker.local.template.render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    )
    assert prompt == "<s><|system|>S</s><|user|>U</s><|assistant|>"
    assert worker.local.template.stops() == ["</s>"]

    systemless = tmp_path / "qa.yaml"
    systemless.write_text("chat_template: '{{ messages[-1].content }}'\nsystem_role: false\nstop: \"\\n\"\n")
    worker = parse_catalog(_catalog(f"{{gguf: /m.gguf, chat_template: {systemless}}}")).get("my-local")
    assert worker.folds_system is True and worker.local.template.stop == ("\n",)


@pytest.mark.parametrize(
    "local, problem",
    [
        (
            "{gguf: /m.gguf, chat_template: base-chat}",
            "unknown built-in chat template 'base-chat' (built-in: base-qa",
        ),
        ("{gguf: /m.gguf, chat_template: /nowhere/t.yaml}", "chat template file not found: /nowhere/t.yaml"),
        (
            "{gguf: /m.gguf, chat_format: gemma, chat_template: base-qa}",
            "set chat_format ('gemma') or chat_template ('base-qa'), not both",
        ),
        ("{gguf: /m.gguf, instruct: maybe}", "local.instruct: Input should be a valid boolean"),
    ],
)
def test_a_bad_value_is_refused_with_a_clear_error(local, problem):
    with pytest.raises(CatalogError) as caught:
        parse_catalog(_catalog(local), "my catalog")
    assert problem in str(caught.value) and str(caught.value).startswith("my catalog: invalid catalog:")


@pytest.mark.parametrize(
    "content, problem",
    [
        ("chat_template: '{% for m in messages %}'", "chat_template is not valid Jinja"),
        ("stop: ['x']", "'chat_template' must be a non-empty Jinja string"),
        ("chat_template: 'x'\nstop: ['', 'y']", "'stop' must be a list of non-empty strings"),
        ("chat_template: 'x'\nsystem_role: sometimes", "'system_role' must be true or false"),
        ("- a list", "expected a mapping"),
    ],
)
def test_a_bad_template_file_is_refused(tmp_path, content, problem):
    path = tmp_path / "t.yaml"
    path.write_text(content)
    with pytest.raises(ChatTemplateError, match="t.yaml") as caught:
        load_chat_template(str(path))
    assert problem in str(caught.value)
    with pytest.raises(
        CatalogError, match="chat_template: .*" + problem.replace("(", r"\(").replace("[", r"\[")
    ):
        parse_catalog(_catalog(f"{{gguf: /m.gguf, chat_template: {path}}}"))


def test_the_launcher_takes_a_template_or_a_chat_format_not_both():
    with pytest.raises(SystemExit, match="usage"):
        launcher_main(["--model", "/m.gguf"])
    with pytest.raises(SystemExit, match="replaces --chat_format"):
        launcher_main(
            ["--polyroute_chat_template", "base-qa", "--chat_format", "gemma", "--model", "/m.gguf"]
        )
    with pytest.raises(ChatTemplateError, match="unknown built-in"):
        launcher_main(["--polyroute_chat_template", "nope", "--model", "/m.gguf"])


# ------------------------------------------------------------------------------ /v1/models
def test_the_models_card_says_base_model(tmp_path):
    """Where a newcomer first meets the model: its /v1/models card (the worker is not started here)."""
    catalog = load_catalog()
    catalog = catalog.model_copy(update={"workers": (catalog.get(LOCAL),)})
    gw = start_gateway(catalog, tmp_path)
    try:
        r = httpx.get(f"{gw.v1}/models", headers=gw.auth())
        assert r.status_code == 200, r.text
        card = next(m for m in r.json()["data"] if m["id"] == LOCAL)["polyroute"]
        assert card["local"] == {
            "instruct": False,
            "note": catalog.get(LOCAL).local.note,
            "chat_format": None,
            "chat_template": "base-qa",
        }
        assert "instruct GGUF" in card["local"]["note"] and "docs/local-worker.md" in card["local"]["note"]
    finally:
        gw.server.stop()


# ------------------------------------------------------------------------------ the real model
def _wait_ready(gw, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        local = httpx.get(gw.url + "/readyz").json()["workers"][LOCAL]
        if local["ready"]:
            return
        assert local["local"]["state"] != "failed", local
        time.sleep(0.25)
    raise AssertionError("local worker never became ready")


@pytest.fixture(scope="module")
def gemma_gateway(tmp_path_factory):
    catalog = load_catalog()
    catalog = catalog.model_copy(update={"workers": (catalog.get(LOCAL),)})
    gw = start_gateway(
        catalog, tmp_path_factory.mktemp("template"), local_workers=True, retrieval_embedder="minilm-static"
    )
    yield gw
    gw.server.stop()


def _ask(gw, messages: list, **extra) -> httpx.Response:
    body = {"model": LOCAL, "messages": messages, "max_tokens": 32, "temperature": 0, **extra}
    return httpx.post(f"{gw.v1}/chat/completions", headers=gw.auth(), json=body, timeout=120)


@pytest.mark.slow
def test_the_real_model_answers_and_stops(gemma_gateway, caplog):
    with caplog.at_level(logging.INFO, logger="polyroute.local"):
        _wait_ready(gemma_gateway)
    started = [r.getMessage() for r in caplog.records if r.name == "polyroute.local"]
    assert any("chat template 'base-qa'" in m for m in started), started
    (line,) = [m for m in started if "base model" in m]  # one clear line, at WARNING
    assert "is a base model, not instruction-tuned" in line and "instruct GGUF" in line

    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = _ask(gemma_gateway, question)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer  # before the template: 'What is the capital of France? mendatang\n...'
    assert "\n" not in answer.strip() and "Question" not in answer and "Answer" not in answer
    assert r.json()["choices"][0]["finish_reason"] == "stop"

    streamed = httpx.post(
        f"{gemma_gateway.v1}/chat/completions",
        headers=gemma_gateway.auth(),
        json={"model": LOCAL, "messages": question, "max_tokens": 32, "temperature": 0, "stream": True},
        timeout=120,
    )
    text = ""
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice["delta"].get("content") or ""
    assert text == answer  # no stop sequence leaks out of a stream either


@pytest.mark.slow
def test_multi_turn_system_and_memory_reach_the_real_model(gemma_gateway):
    _wait_ready(gemma_gateway)
    r = httpx.post(
        f"{gemma_gateway.v1}/collections/handbook/documents",
        headers=gemma_gateway.auth(),
        json={
            "documents": [{"id": "vacation", "title": "Vacation policy", "text": "Staff get 27 days a year."}]
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    question = {"role": "user", "content": "How many vacation days do employees get?"}
    system = {
        "role": "system",
        "content": "You are the HR assistant of ACME Corporation. Answer in one sentence.",
    }
    turns = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ]

    def prompt_tokens(messages: list, **extra) -> int:
        r = _ask(gemma_gateway, messages, max_tokens=4, **extra)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    bare = prompt_tokens([question])
    assert prompt_tokens([system, question]) >= bare + 15  # the system prompt is in the prompt
    assert prompt_tokens([question], metadata={"collections": ["handbook"]}) >= bare + 10  # and memory
    assert prompt_tokens([*turns, question]) >= bare + 15  # and earlier turns

    r = _ask(gemma_gateway, [system, *turns, question], metadata={"collections": ["handbook"]})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer.strip() and "\nQuestion:" not in answer and "\n\n" not in answer


# ------------------------------------------------------------------------------ the supervisor
def test_the_supervisor_notices_an_exit_without_holding_a_thread(tmp_path):
    """Found running bench/local_model.py's candidate servers side by side: each supervisor sat in
    asyncio.to_thread(proc.wait), and the 7th local worker on this 2-core box waited forever for a
    default-executor thread (the one the gateway's routing and key checks use too)."""
    import asyncio
    import subprocess
    import sys
    import threading

    from gateway.local_worker import LocalWorkerProcess

    proc = LocalWorkerProcess(load_catalog().get(LOCAL), tmp_path / "models", tmp_path / "logs")
    proc._proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])

    async def watch() -> tuple[int, int]:
        task = asyncio.create_task(proc._wait_exit(interval=0.02))
        await asyncio.sleep(0.1)
        threads_while_waiting = threading.active_count()
        return await task, threads_while_waiting

    before = threading.active_count()
    code, during = asyncio.run(watch())
    assert code == 3 and during == before
