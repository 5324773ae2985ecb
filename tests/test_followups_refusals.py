"""Requests refused before any worker call, as a client and an operator see them:

- the tokens the rate-limit check charged go back (refusals used up a key's tokens per minute, and
  the next request that fit the limit was a 429), on the in-process and the Redis limiter;
- an exhausted budget is one error code, 403 `budget_exceeded`, whether the policy's budget rule
  caught it at admission or the reservation did a moment later;
- every refusal is in the latency histogram (docs/api.md says every request is), and
  polyroute_worker_up covers the embedding workers of the catalog too;
- the final 429 of one worker (a pinned one) names it, instead of "All workers are rate limited".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from policies import parse_catalog
from tests.conftest import Gateway, backend_redis_url, catalog_yaml_for, start_gateway
from tests.test_auth_admin_metrics import _sample
from tests.test_embeddings import embedding_workers

PII_RULE = {"id": "pii-eu-only", "when": {"data_classes": ["pii"]}, "allow_jurisdictions": ["EU", "local"]}
PII = "Please e-mail the summary to jane.doe@example.com"
HELLO = "hello there, how are you?"
TPM = 2500
MAX_TOKENS = 1200  # the estimate of one chat request is ~1210 tokens: two fit in TPM, three do not


def write_policy(path: Path, version: str, tenants: dict | None = None) -> None:
    policy = {"version": version, "rules": [PII_RULE], "tenants": tenants or {}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(policy))
    tmp.replace(path)


@pytest.fixture(params=["memory", "redis"])
def make_gateway(request, upstream, tmp_path) -> Iterator[Callable[..., Gateway]]:
    """A gateway on the test catalog (chat and embedding workers), the PII rule in force, on the
    in-process stores or on a real redis-server."""
    url = backend_redis_url(request)
    started: list[Gateway] = []

    def make(tenants: dict | None = None, **settings) -> Gateway:
        policy_file = tmp_path / "policy.yaml"
        write_policy(policy_file, "refusals", tenants)
        catalog = parse_catalog(catalog_yaml_for(upstream.url) + embedding_workers(upstream.url))
        gw = start_gateway(
            catalog,
            tmp_path / f"data{len(started)}",
            policy_file=policy_file,
            redis_url=url,
            policy_reload_interval_s=3600,
            **settings,
        )
        gw.policy_file = policy_file  # type: ignore[attr-defined]
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.server.stop()


def new_key(gw: Gateway, **limits) -> str:
    response = httpx.post(
        gw.url + "/admin/keys", headers=gw.auth(gw.admin_key), json={"tenant": "acme", **limits}
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


def chat(gw: Gateway, key: str | None = None, content: str = HELLO, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "model": "auto", **extra}
    return httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(key), json=body, timeout=60)


def embed(
    gw: Gateway, key: str | None = None, text: str = HELLO, model: str = "embed-remote"
) -> httpx.Response:
    body = {"model": model, "input": text}
    return httpx.post(gw.v1 + "/embeddings", headers=gw.auth(key), json=body, timeout=60)


def reload(gw: Gateway, version: str, tenants: dict | None = None) -> None:
    write_policy(gw.policy_file, version, tenants)  # type: ignore[attr-defined]
    assert gw.state.policy.reload("file"), gw.state.policy.last_error


# ---- 1. the tokens of a refused request go back ---------------------------------------------------
def test_policy_refusals_do_not_use_up_the_keys_tokens(make_gateway, upstream):
    gw = make_gateway()
    key = new_key(gw, tpm=TPM)
    for _ in range(2):  # PII pinned to mid (jurisdiction CN): refused by the policy, no worker called
        refused = chat(gw, key, PII, model="mid", max_tokens=MAX_TOKENS)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "policy_denied"
    assert not upstream.requests
    answer = chat(gw, key, max_tokens=MAX_TOKENS)
    assert answer.status_code == 200, answer.text  # it was a 429: the refusals had drained the tokens
    assert answer.headers["x-polyroute-worker"] == "cheap"


def test_budget_refusals_at_admission_do_not_use_up_the_keys_tokens(make_gateway, upstream):
    """The budget rule excludes every worker (each predicted above what is left of $0.00001): two
    refusals, then the operator raises the budget, and the key's next request fits its tokens."""
    gw = make_gateway({"acme": {"budget": {"daily_usd": "0.00001"}}})
    key = new_key(gw, tpm=TPM)
    for _ in range(2):
        refused = chat(gw, key, max_tokens=MAX_TOKENS)
        assert refused.status_code == 403, refused.text
        assert "budget:daily" in refused.json()["error"]["message"]
    assert not upstream.requests
    reload(gw, "roomier", {"acme": {"budget": {"daily_usd": "5"}}})
    answer = chat(gw, key, max_tokens=MAX_TOKENS)
    assert answer.status_code == 200, answer.text


def test_embedding_refusals_do_not_use_up_the_keys_tokens(make_gateway, upstream):
    """/v1/embeddings: PII to a US worker is refused by the policy after the rate-limit check."""
    gw = make_gateway()
    text = "x" * 48  # 12 tokens by the gateway's estimate (4 characters a token)
    pii = "jane.doe@example.com " + "y" * 27  # 48 characters too, with an e-mail address
    key = new_key(gw, tpm=25)  # two of them fit, three do not
    for _ in range(2):
        refused = embed(gw, key, pii)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "policy_denied"
    assert not upstream.requests
    answer = embed(gw, key, text)
    assert answer.status_code == 200, answer.text


# ---- 2. one condition, one code: budget_exceeded ---------------------------------------------------
@pytest.mark.parametrize("model", ["auto", "cheap"])
def test_a_budget_the_policy_catches_is_budget_exceeded_as_at_the_reservation(make_gateway, upstream, model):
    gw = make_gateway({"acme": {"budget": {"daily_usd": "0.00001"}}})
    refused = chat(gw, model=model, max_tokens=MAX_TOKENS)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "insufficient_quota"
    assert "budget:daily" in error["message"]
    assert not upstream.requests
    # a pool the PII rule emptied stays policy_denied, the budget's exclusions beside it or not
    mixed = chat(gw, content=PII, model="mid", max_tokens=MAX_TOKENS)
    assert mixed.status_code == 403 and mixed.json()["error"]["code"] == "policy_denied"


def test_an_embedding_budget_the_policy_catches_is_budget_exceeded(make_gateway, upstream):
    gw = make_gateway({"acme": {"budget": {"daily_usd": "0"}}})
    refused = embed(gw)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded" and "budget:daily" in error["message"]
    assert not upstream.requests


# ---- 3. metrics: every refusal is in the latency histogram; embedding workers are up or down ---------
def _latencies(gw: Gateway, stream: str) -> float:
    return _sample(
        httpx.get(gw.url + "/metrics").text, "polyroute_request_latency_seconds_count", stream=stream
    )


def test_refused_requests_are_in_the_latency_histogram(make_gateway, upstream):
    gw = make_gateway()
    plain, streamed = _latencies(gw, "false"), _latencies(gw, "true")
    url = gw.v1 + "/chat/completions"
    hello = [{"role": "user", "content": HELLO}]
    refusals = [
        httpx.post(url, headers=gw.auth("pr-wrong"), json={"model": "auto", "messages": hello}),  # 401
        httpx.post(url, headers=gw.auth(), content=b"{oops"),  # 400
        httpx.post(url, headers=gw.auth(), json={"model": "nope", "messages": hello}),  # 404
        chat(gw, content=PII, model="mid"),  # 403
        embed(gw, model="nope"),  # 404 on /v1/embeddings
    ]
    assert [r.status_code for r in refusals] == [401, 400, 404, 403, 404]
    streamed_refusal = chat(gw, model="nope", stream=True)
    assert streamed_refusal.status_code == 404
    assert not upstream.requests
    assert _latencies(gw, "false") == plain + len(refusals)
    assert _latencies(gw, "true") == streamed + 1


def test_worker_up_covers_the_embedding_workers(make_gateway):
    gw = make_gateway()
    text = httpx.get(gw.url + "/metrics").text
    assert _sample(text, "polyroute_worker_up", worker="cheap") == 1.0
    assert _sample(text, "polyroute_worker_up", worker="embed-remote") == 1.0
    assert _sample(text, "polyroute_worker_up", worker="embed-static") == 1.0
    assert 'polyroute_worker_up{worker="embed-nokey"} 0.0' in text  # its key is not set


# ---- 4. one worker's final 429 names it -----------------------------------------------------------
def test_a_pinned_workers_final_429_is_worded_for_that_worker(make_gateway, upstream):
    gw = make_gateway(retries=0)
    upstream.behave("cheap-model", status=429, retry_after_s=2)
    pinned = chat(gw, model="cheap")
    assert pinned.status_code == 429, pinned.text
    error = pinned.json()["error"]
    assert error["code"] == "upstream_rate_limited"
    assert error["message"].startswith("The worker cheap is rate limited.")
    assert pinned.headers["retry-after"] == "2"
    for model in ("mid-model", "pricey-model"):
        upstream.behave(model, status=429)
    every = chat(gw)
    assert every.status_code == 429
    assert every.json()["error"]["message"].startswith("All 3 workers tried are rate limited.")


def test_a_workflow_refused_before_its_first_step_gives_its_tokens_back(make_gateway, upstream):
    """compose:builder with metadata.tests that is no Python source: refused once the workflow is
    set up (compose.respond), after the rate-limit check; its tokens go back and it is timed too."""
    gw = make_gateway()
    key = new_key(gw, tpm=TPM)
    before = _latencies(gw, "false")
    for _ in range(2):
        refused = chat(gw, key, model="compose:builder", max_tokens=MAX_TOKENS, metadata={"tests": 42})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "metadata.tests"
    assert not upstream.requests
    assert _latencies(gw, "false") == before + 2
    answer = chat(gw, key, max_tokens=MAX_TOKENS)
    assert answer.status_code == 200, answer.text
