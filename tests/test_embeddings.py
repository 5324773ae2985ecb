"""POST /v1/embeddings end to end: the `openai` SDK → the gateway (uvicorn, loopback) → an embedding
worker, either the test upstream's OpenAI-wire /v1/embeddings (through litellm.aembedding) or
retrieval's MiniLM embedder in the gateway's own process.

Fast tests embed in-process with the `minilm-static` backend (MiniLM's word-piece table, no forward
pass); the test that loads the real sentence-transformers model (the default catalog's
`minilm-local`) is marked slow, as retrieval's is. The upstream's record of what it received is the
oracle for "reached no worker".
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from decimal import Decimal

import httpx
import numpy as np
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import CatalogError, Kind, PolicyRequest, load_catalog, parse_catalog, parse_policy
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for, start_gateway
from tests.fakes.upstream import fake_embedding
from tests.test_auth_admin_metrics import _sample
from tests.test_pii_payload import PII

REMOTE, REMOTE_MODEL = "embed-remote", "embed-model"  # on the test upstream, jurisdiction US
STATIC = "embed-static"  # in-process, minilm-static, jurisdiction local

POLICY = {
    "version": "emb",
    "rules": [
        {
            "id": "sensitive-eu-or-local",
            "when": {"data_classes": ["pii", "secret"]},
            "allow_jurisdictions": ["EU", "local"],
        }
    ],
    "aliases": {
        "batch": "bulk jobs",  # a chat alias: auto narrowed by rules
        "house": {"worker": STATIC, "description": "the house vector space"},
        "vectors": {"worker": REMOTE},
    },
    "tenants": {
        "tight": {"budget": {"daily_usd": 0.00005}},  # 50 micro-dollars
        "limited": {"rate_limit": {"rpm": 1}},
        "broke": {"budget": {"daily_usd": 0}},
    },
}


def embedding_workers(upstream_url: str) -> str:
    return f"""
  - name: {REMOTE}
    kind: embedding
    model: openai/{REMOTE_MODEL}
    api_base: {upstream_url}/v1
    api_key_env: {FAKE_KEY_ENV}
    dimensions: 8
    supports_dimensions: true
    input_price_per_m: 1.00
    tier: specialist
    license: proprietary
    provider: fake
    jurisdiction: US
    context_window: 8192
  - name: {STATIC}
    kind: embedding
    model: local/minilm-static
    embedder: minilm-static
    dimensions: 384
    input_price_per_m: 0
    tier: local
    license: Apache-2.0
    provider: local
    jurisdiction: local
    context_window: 256
  - name: embed-nokey
    kind: embedding
    model: openai/nokey-embed
    api_base: {upstream_url}/v1
    api_key_env: POLYROUTE_TEST_UNSET_KEY
    dimensions: 8
    input_price_per_m: 0.01
    tier: specialist
    license: proprietary
    provider: fake
    jurisdiction: FR
    context_window: 8192
"""


@pytest.fixture(scope="module")
def egw(upstream, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("embeddings")
    policy_file = data_dir / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    catalog = parse_catalog(catalog_yaml_for(upstream.url) + embedding_workers(upstream.url), "test catalog")
    gw = start_gateway(catalog, data_dir, policy_file=policy_file)
    store = gw.state.auth.store
    gw.keys = {tenant: store.create(tenant, "test key")[1] for tenant in ("tight", "limited", "broke")}
    yield gw
    gw.server.stop()


def client(gw, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key or gw.api_key, max_retries=0)


def post(gw, body, key: str | None = None, **headers) -> httpx.Response:
    return httpx.post(gw.v1 + "/embeddings", json=body, headers=gw.auth(key) | headers, timeout=60)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def ledger(gw, request_id: str) -> dict:
    lines = (gw.data_dir / "ledger.jsonl").read_text().splitlines()
    return next(json.loads(line) for line in lines if request_id in line)


def static_vectors(texts: list[str]) -> np.ndarray:
    from retrieval.embed import shared_embedder

    return shared_embedder("minilm-static").encode(texts)


# ------------------------------------------------------------------------------ the openai SDK
def test_openai_sdk_default_request_is_base64_and_decoded_by_the_sdk(egw, upstream):
    """The SDK asks for base64 unless told otherwise and decodes it itself: the vectors must survive."""
    raw = client(egw).embeddings.with_raw_response.create(model=REMOTE, input="hello world")
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)  # the SDK asked for base64
    result = raw.parse()
    assert result.model == REMOTE and result.object == "list"
    assert [d.index for d in result.data] == [0]
    assert np.array_equal(f32(result.data[0].embedding), f32(fake_embedding("hello world", 8)))
    assert result.usage.prompt_tokens == 2 and result.usage.total_tokens == 2
    headers = raw.headers
    assert headers["x-polyroute-worker"] == REMOTE
    assert headers["x-polyroute-request-id"].startswith("req_")
    assert headers["x-polyroute-policy-version"].startswith("emb+")
    assert headers["x-polyroute-data-class"] == "public"
    assert Decimal(headers["x-polyroute-cost-usd"]) == Decimal("0.000002")  # 2 tokens at $1/1M
    assert upstream.requests_for(REMOTE_MODEL)[0]["input"] == ["hello world"]


def test_float_and_base64_formats_carry_the_same_little_endian_float32_vectors(egw):
    sdk = client(egw)
    floats = sdk.embeddings.create(model=REMOTE, input="tea leaves", encoding_format="float")
    b64 = sdk.embeddings.create(model=REMOTE, input="tea leaves", encoding_format="base64")
    assert isinstance(floats.data[0].embedding, list)
    encoded = b64.data[0].embedding
    assert isinstance(encoded, str)  # asked explicitly: the SDK leaves it to the caller, as OpenAI's
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.array_equal(decoded, f32(floats.data[0].embedding))
    assert np.array_equal(decoded, f32(fake_embedding("tea leaves", 8)))


def test_a_batch_keeps_its_order_in_one_upstream_call(egw, upstream):
    texts = ["first text", "the second one", "third"]
    result = client(egw).embeddings.create(model=REMOTE, input=texts)
    assert [d.index for d in result.data] == [0, 1, 2]
    for text, item in zip(texts, result.data, strict=True):
        assert np.array_equal(f32(item.embedding), f32(fake_embedding(text, 8)))
    assert result.usage.prompt_tokens == 2 + 3 + 1  # the upstream counts words
    assert [r["input"] for r in upstream.requests_for(REMOTE_MODEL)] == [texts]


def test_dimensions_are_passed_to_a_worker_that_can_shorten(egw, upstream):
    result = client(egw).embeddings.create(model=REMOTE, input="short", dimensions=4)
    assert np.array_equal(f32(result.data[0].embedding), f32(fake_embedding("short", 4)))
    assert upstream.requests_for(REMOTE_MODEL)[0]["dimensions"] == 4
    same = client(egw).embeddings.create(model=STATIC, input="native size asked", dimensions=384)
    assert len(same.data[0].embedding) == 384


@pytest.mark.parametrize(
    ("model", "dimensions", "fragment"),
    [(STATIC, 128, "makes 384-dimensional vectors and cannot shorten"), (REMOTE, 16, "at most that")],
)
def test_dimensions_a_worker_cannot_make_are_a_400_naming_its_size(
    egw, upstream, model, dimensions, fragment
):
    with pytest.raises(openai.BadRequestError) as info:
        client(egw).embeddings.create(model=model, input="x", dimensions=dimensions)
    assert fragment in info.value.message and info.value.body["param"] == "dimensions"
    assert not upstream.requests


def test_token_arrays_go_to_the_provider_as_sent_and_are_decoded_for_in_process_workers(egw, upstream):
    """LangChain's OpenAIEmbeddings sends cl100k_base token arrays: a provider gets them unchanged, an
    in-process worker embeds their text (and detection reads that text)."""
    hello_world = [15339, 1917]  # cl100k_base for "hello world"
    remote = client(egw).embeddings.create(model=REMOTE, input=[hello_world])
    assert upstream.requests_for(REMOTE_MODEL)[0]["input"] == [hello_world]
    assert np.array_equal(f32(remote.data[0].embedding), f32(fake_embedding(hello_world, 8)))
    local = client(egw).embeddings.create(model=STATIC, input=[hello_world, "hello world"])
    assert np.array_equal(f32(local.data[0].embedding), f32(local.data[1].embedding))


def test_the_in_process_worker_returns_the_retrieval_embedders_own_vectors(egw, upstream):
    texts = ["The quick brown fox jumps over the lazy dog.", "Green tea is brewed from leaves."]
    result = client(egw).embeddings.create(model=STATIC, input=texts, encoding_format="float")
    vectors = f32([d.embedding for d in result.data])
    assert np.array_equal(vectors, static_vectors(texts))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert result.usage.prompt_tokens > len(" ".join(texts).split())  # word pieces, [CLS]/[SEP] included
    assert not upstream.requests  # in-process: nothing left the gateway


# ------------------------------------------------------------------------------ models and aliases
def test_auto_is_refused_and_says_why(egw, upstream):
    for model in ("auto", "compose:plan"):
        with pytest.raises(openai.BadRequestError) as info:
            client(egw).embeddings.create(model=model, input="hello")
        assert "vector space" in info.value.message and STATIC in info.value.message
        assert info.value.code == "model_not_supported" and info.value.body["param"] == "model"
    assert not upstream.requests


def test_an_alias_the_policy_maps_names_its_worker(egw, upstream):
    house = client(egw).embeddings.with_raw_response.create(model="house", input="kept at home")
    assert house.headers["x-polyroute-worker"] == STATIC and house.parse().model == STATIC
    vectors = client(egw).embeddings.create(model="vectors", input="sent out")
    assert vectors.model == REMOTE and len(upstream.requests_for(REMOTE_MODEL)) == 1
    record = ledger(egw, house.headers["x-polyroute-request-id"])
    assert record["model"] == "house" and record["worker"] == STATIC


def test_chat_models_and_chat_aliases_do_not_embed(egw, upstream):
    for model in ("cheap", "batch"):
        response = post(egw, {"model": model, "input": "hello"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_embedding"
    for model in ("house", STATIC):  # and chat does not know embeddings aliases or workers
        chat = httpx.post(
            egw.v1 + "/chat/completions",
            headers=egw.auth(),
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    missing = post(egw, {"model": "no-such-model", "input": "hello"})
    assert missing.status_code == 404 and STATIC in missing.json()["error"]["message"]
    assert not upstream.requests


def test_models_lists_embedding_workers_and_aliases_apart_from_chat(egw):
    data = httpx.get(egw.v1 + "/models", headers=egw.auth()).json()["data"]
    cards = {m["id"]: m for m in data}
    assert cards[REMOTE]["polyroute"]["kind"] == "embedding"
    assert cards[REMOTE]["polyroute"]["dimensions"] == 8 and cards[REMOTE]["polyroute"]["supports_dimensions"]
    assert cards[STATIC]["polyroute"]["in_process"] is True
    assert cards["embed-nokey"]["polyroute"]["available"] is False
    assert cards["house"]["polyroute"] == {
        "kind": "embedding",
        "alias": True,
        "worker": STATIC,
        "description": "the house vector space",
        "available": True,
    }
    assert "kind" not in cards["cheap"]["polyroute"] and cards["batch"]["polyroute"]["alias"] is True


def test_an_unavailable_worker_is_a_503_that_says_why(egw, upstream):
    response = post(egw, {"model": "embed-nokey", "input": "hello"})
    assert response.status_code == 503
    assert "POLYROUTE_TEST_UNSET_KEY" in response.json()["error"]["message"]
    assert not upstream.requests


# ------------------------------------------------------------------------------ policy
def test_pii_stays_off_a_worker_the_policy_rules_out_and_reaches_one_it_admits(egw, upstream):
    text = "Send the contract to jane.doe@example.com"
    for model in (REMOTE, "vectors"):
        refused = post(egw, {"model": model, "input": ["a clean first line", text]})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "policy_denied" and error["type"] == "permission_error"
        assert "sensitive-eu-or-local" in error["message"] and "jurisdiction US" in error["message"]
        assert refused.headers["x-polyroute-data-class"] == "pii"
    assert not upstream.requests
    admitted = post(egw, {"model": STATIC, "input": text})
    assert admitted.status_code == 200 and admitted.headers["x-polyroute-data-class"] == "pii"
    assert ledger(egw, admitted.headers["x-polyroute-request-id"])["query"] is None  # inputs never stored


def test_a_tagged_request_is_held_to_its_class(egw, upstream):
    tagged = post(egw, {"model": REMOTE, "input": "nothing personal"}, **{"x-polyroute-data-class": "pii"})
    assert tagged.status_code == 403
    via_metadata = post(egw, {"model": REMOTE, "input": "plain", "metadata": {"data_class": "secret"}})
    assert via_metadata.status_code == 403 and via_metadata.headers["x-polyroute-data-class"] == "secret"
    unknown = post(egw, {"model": REMOTE, "input": "plain", "metadata": {"data_class": "top-secret"}})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "invalid_data_class"
    assert not upstream.requests


def _cl100k(text: str) -> list[int]:
    from litellm.litellm_core_utils.default_encoding import encoding

    return encoding.encode(text)


@st.composite
def inputs_with_pii(draw):
    pii = draw(st.sampled_from(PII))
    words = draw(st.lists(st.sampled_from(["note", "call", "meet", "re:", "hi", "thanks"]), max_size=4))
    text = " ".join([*words[:2], pii, *words[2:]])
    shape = draw(st.sampled_from(["string", "batch", "tokens", "user"]))
    if shape == "string":
        return pii, {"input": text}
    if shape == "batch":
        items = draw(st.lists(st.sampled_from(["a clean line", "another"]), min_size=1, max_size=3))
        at = draw(st.integers(0, len(items)))
        return pii, {"input": [*items[:at], text, *items[at:]]}
    if shape == "tokens":
        return pii, {"input": [_cl100k("clean text"), _cl100k(text)]}
    return pii, {"input": "a clean text", "user": text}  # forwarded to the provider: classified too


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=inputs_with_pii())
def test_property_pii_in_any_input_shape_never_reaches_a_non_admissible_worker(egw, upstream, case):
    pii, body = case
    before = len(upstream.requests_for(REMOTE_MODEL))
    response = post(egw, {"model": REMOTE, **body})
    assert response.status_code == 403, (pii, response.text)
    assert response.headers["x-polyroute-data-class"] in ("pii", "secret")
    assert len(upstream.requests_for(REMOTE_MODEL)) == before


# ------------------------------------------------------------------------------ budgets, limits, books
def test_budgets_hold_under_concurrent_requests(egw, upstream):
    """40 at once against 50 micro-dollars: each call costs 3, so some must be refused, and what was
    spent never passes the budget (each hold is an upper bound of its call's cost)."""
    key = egw.keys["tight"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        egw.v1 + "/embeddings",
                        json={"model": REMOTE, "input": "alpha beta gamma"},
                        headers=egw.auth(key),
                    )
                    for _ in range(40)
                )
            )

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 403} and 200 in statuses and 403 in statuses, statuses
    refused = [r.json()["error"] for r in responses if r.status_code == 403]
    assert all("budget" in e["message"] for e in refused)
    spent = sum(Decimal(r.headers["x-polyroute-cost-usd"]) for r in responses if r.status_code == 200)
    assert spent <= Decimal("0.00005")
    assert len(upstream.requests_for(REMOTE_MODEL)) == statuses.count(200)
    records = [
        json.loads(line)
        for line in (egw.data_dir / "ledger.jsonl").read_text().splitlines()
        if '"tenant":"tight"' in line
    ]
    assert sum(r["cost_micros"] for r in records) <= 50


def test_a_free_worker_stays_usable_when_the_budget_is_spent(egw, upstream):
    key = egw.keys["broke"]
    assert post(egw, {"model": STATIC, "input": "still free"}, key).status_code == 200
    priced = post(egw, {"model": REMOTE, "input": "costs money"}, key)
    assert priced.status_code == 403 and "budget" in priced.json()["error"]["message"]
    assert not upstream.requests


def test_rate_limits_apply(egw, upstream):
    key = egw.keys["limited"]
    assert post(egw, {"model": REMOTE, "input": "one"}, key).status_code == 200
    second = post(egw, {"model": REMOTE, "input": "two"}, key)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(upstream.requests_for(REMOTE_MODEL)) == 1


def test_ledger_metrics_and_access_line(egw, upstream, caplog):
    caplog.set_level(logging.INFO, logger="polyroute.access")
    before = httpx.get(egw.url + "/metrics").text
    response = post(egw, {"model": REMOTE, "input": ["four words right here", "two more"]})
    assert response.status_code == 200
    request_id = response.headers["x-polyroute-request-id"]
    record = ledger(egw, request_id)
    assert record["endpoint"] == "embeddings" and record["worker"] == REMOTE and record["status"] == 200
    assert record["prompt_tokens"] == 6 and record["completion_tokens"] == 0 and record["cost_micros"] == 6
    assert record["strategy"] == "embedding" and record["data_class"] == "public" and record["query"] is None
    assert record["policy_version"] == response.headers["x-polyroute-policy-version"]
    line = next(
        r.getMessage()
        for r in caplog.records
        if r.name == "polyroute.access" and request_id in r.getMessage()
    )
    assert f"worker={REMOTE}" in line and "status=200" in line and "endpoint=embeddings" in line
    after = httpx.get(egw.url + "/metrics").text

    def delta(name: str, **labels: str) -> float:
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert delta("polyroute_requests_total", worker=REMOTE, strategy="embedding", status="200") == 1
    assert delta("polyroute_tokens_total", worker=REMOTE, kind="prompt") == 6
    assert delta("polyroute_cost_usd_total", worker=REMOTE) == pytest.approx(6e-6)


def test_transient_failures_are_retried_and_client_faults_are_not(egw, upstream, caplog):
    caplog.set_level(logging.INFO, logger="polyroute.access")
    upstream.behave(REMOTE_MODEL, status=500, fail_times=1)
    assert post(egw, {"model": REMOTE, "input": "retry me"}).status_code == 200
    assert upstream.behaviours[REMOTE_MODEL].calls == 2
    upstream.behave(REMOTE_MODEL, status=400)
    rejected = post(egw, {"model": REMOTE, "input": "refused"})
    assert rejected.status_code == 400 and rejected.json()["error"]["code"] == "upstream_rejected"
    assert upstream.behaviours[REMOTE_MODEL].calls == 1
    upstream.behave(REMOTE_MODEL, status=503)
    failed = post(egw, {"model": REMOTE, "input": "down"})
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_failed"
    worker = egw.state.catalog.get(REMOTE, kind=Kind.embedding)
    assert upstream.behaviours[REMOTE_MODEL].calls == egw.state.client.retries_for(worker) + 1
    request_id = failed.headers["x-polyroute-request-id"]
    assert ledger(egw, request_id)["status"] == 502 and failed.headers["x-polyroute-cost-usd"] == "0"
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "polyroute.access" and request_id in r.getMessage()
    ]
    assert len(lines) == 1 and "status=502" in lines[0]  # one line per request, failed or not


# ------------------------------------------------------------------------------ bad input
BAD = [
    ({"model": REMOTE}, "input"),
    ({"model": REMOTE, "input": ""}, "empty string"),
    ({"model": REMOTE, "input": []}, "must not be empty"),
    ({"model": REMOTE, "input": ["fine", ""]}, "input[1] is an empty string"),
    ({"model": REMOTE, "input": [[]]}, "empty token array"),
    ({"model": REMOTE, "input": [1, "a"]}, "input[0]"),
    ({"model": REMOTE, "input": [[1, True]]}, "mixes token ids"),
    ({"model": REMOTE, "input": [[1, 2.5]]}, "mixes token ids"),
    ({"model": REMOTE, "input": {"text": "a"}}, "input must be"),
    ({"model": REMOTE, "input": 42}, "input must be"),
    ({"model": REMOTE, "input": [[10**7]]}, "token id 10000000, which is no token of cl100k_base"),
    ({"model": REMOTE, "input": [[-1]]}, "token id -1, which is no token of cl100k_base"),
    ({"model": REMOTE, "input": [[15339, 100256, 5]]}, "token id 100256, which is no token"),  # a gap
    ({"model": REMOTE, "input": ["a"] * 2049}, "at most 2048"),
    ({"model": REMOTE, "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"model": REMOTE, "input": "a", "dimensions": 0}, "dimensions"),
    ({"model": REMOTE, "input": "a", "dimensions": "4"}, "dimensions"),
    (
        {"model": REMOTE, "input": "a", "temperature": 1},
        "Unrecognized request argument supplied: temperature",
    ),
    ({"model": "", "input": "a"}, "model"),
    ({"model": "auto", "input": "a"}, "vector space"),
    ({"model": STATIC, "input": "word " * 300}, "reads at most 256"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_clear_4xx_and_reaches_no_worker(egw, upstream, body, fragment):
    response = post(egw, body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    assert response.headers["x-polyroute-request-id"].startswith("req_")
    assert not upstream.requests


def test_a_body_that_is_not_json_is_a_400(egw, upstream):
    response = httpx.post(egw.v1 + "/embeddings", content=b"{not json", headers=egw.auth())
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert httpx.post(egw.v1 + "/embeddings", json={"model": REMOTE, "input": "a"}).status_code == 401
    assert not upstream.requests


# ------------------------------------------------------------------------------ chat never embeds
def test_chat_auto_never_reaches_an_embedding_worker(egw, upstream):
    """The embedding worker is the cheapest worker of this catalog for a short prompt, so a cheapest-
    first router would pick it if it were in the pool; chat `auto` goes to a chat worker every time."""
    catalog = egw.state.catalog
    remote, cheap = catalog.get(REMOTE, kind=Kind.embedding), catalog.get("cheap")
    assert remote.cost_usd(10, 0) < cheap.cost_usd(10, 256)
    sdk = client(egw)
    for prompt in ("hi", "Say hello in five words", "x" * 400):
        raw = sdk.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": prompt}]
        )
        assert raw.headers["x-polyroute-worker"] in catalog.names
    pinned = httpx.post(
        egw.v1 + "/chat/completions",
        headers=egw.auth(),
        json={"model": REMOTE, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert 400 <= pinned.status_code < 500
    assert not upstream.requests_for(REMOTE_MODEL)


def test_chat_pools_hold_chat_workers_only():
    """Every pool chat code draws from (policy admission, availability, /v1/models, calibration)."""
    from policies import admit
    from polyroute.calibrate import choose_workers

    catalog = load_catalog()
    embedding = {w.name for w in catalog.of_kind(Kind.embedding)}
    assert embedding == {"minilm-local", "text-embedding-3-small"}
    env = {"OPENAI_API_KEY": "sk-x"}
    engine = _engine()
    chat_pool = engine.evaluate(PolicyRequest(tenant="t", texts=("hi",)), catalog, env=env).pool
    assert chat_pool and not embedding & {w.name for w in chat_pool}
    assert not embedding & {w.name for w in admit(catalog, env=env).pool}
    assert not embedding & set(catalog.names) and catalog.get("minilm-local") is None
    embed_pool = engine.evaluate(PolicyRequest(tenant="t"), catalog, env=env, kind=Kind.embedding).pool
    assert {w.name for w in embed_pool} == embedding
    chosen, _ = choose_workers(catalog, None, local_enabled=True)
    assert not embedding & {w.name for w in chosen}


def _engine():
    from policies import PolicyEngine
    from policies.loader import DEFAULT_POLICY_PATH

    policy, version = parse_policy(DEFAULT_POLICY_PATH.read_text())
    return PolicyEngine(policy, version)


# ------------------------------------------------------------------------------ catalog and policy files
def test_the_default_catalog_has_the_local_minilm_and_openai_embedding_workers():
    catalog = load_catalog()
    minilm = catalog.get("minilm-local", kind=Kind.embedding)
    assert minilm.embedder == "minilm" and minilm.dimensions == 384 and minilm.input_price_per_m == 0
    assert minilm.jurisdiction == "local" and minilm.availability({}) is None
    small = catalog.get("text-embedding-3-small", kind=Kind.embedding)
    assert small.dimensions == 1536 and small.supports_dimensions and small.input_price_per_m > 0
    assert small.availability({}) == "env var OPENAI_API_KEY is not set"
    assert small.availability({"OPENAI_API_KEY": "sk-x"}) is None


BASE_EMBEDDING = """
version: 1
workers:
  - name: e
    kind: embedding
    model: openai/e
    input_price_per_m: 0.1
    tier: specialist
    license: x
    provider: p
    context_window: 512
"""


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("", "needs `dimensions`"),
        ("    dimensions: 8\n    output_price_per_m: 1\n", "no output tokens"),
        ("    dimensions: 8\n    embedder: word2vec\n", "not one of"),
        ("    dimensions: 8\n    embedder: minilm-static\n", "384-dimensional"),
        ("    dimensions: 384\n    embedder: minilm\n    supports_dimensions: true\n", "cannot shorten"),
        ("    dimensions: 8\n    kind: chat\n    output_price_per_m: 1\n", "for embedding workers"),
    ],
)
def test_invalid_embedding_workers_are_refused_with_the_reason(extra, fragment):
    text = BASE_EMBEDDING + extra
    if "kind: chat" in extra:
        text = text.replace("    kind: embedding\n", "")
    with pytest.raises(CatalogError) as info:
        parse_catalog(text)
    assert fragment in str(info.value)


def test_embedding_aliases_are_kept_apart_from_chat_aliases():
    policy, _ = parse_policy(yaml.safe_dump(POLICY))
    assert set(policy.aliases) == {"batch"}
    assert {k: v.worker for k, v in policy.embedding_aliases.items()} == {"house": STATIC, "vectors": REMOTE}
    with pytest.raises(ValueError, match="embedding_aliases.house.worker"):
        parse_policy(yaml.safe_dump({"version": 1, "aliases": {"house": {"description": "no worker"}}}))


# ------------------------------------------------------------------------------ the real MiniLM
@pytest.mark.slow
def test_minilm_local_worker_for_real(tmp_path, upstream):
    """The default catalog's minilm-local: retrieval's MiniLM in the gateway's process."""
    from retrieval.embed import shared_embedder

    default = load_catalog()
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    catalog = catalog.model_copy(
        update={"workers": (*catalog.workers, default.get("minilm-local", kind=None))}
    )
    gw = start_gateway(catalog, tmp_path)
    try:
        texts = ["Cats sleep most of the day.", "BGP routers exchange reachability information."]
        result = client(gw).embeddings.create(model="minilm-local", input=texts)
        vectors = f32([d.embedding for d in result.data])
        assert vectors.shape == (2, 384)
        assert np.array_equal(vectors, shared_embedder("minilm").encode(texts))
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        too_long = post(gw, {"model": "minilm-local", "input": "word " * 300})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert not upstream.requests
    finally:
        gw.server.stop()
