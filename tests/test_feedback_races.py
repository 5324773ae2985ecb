"""POST /v1/feedback sent right after an answer is accepted, although the request's ledger record may
not exist yet when it arrives: a stream's record is written once the stream is settled, and a replica
keeps its records in memory until its next flush to Redis, where another replica finds them. The
endpoint waits (up to POLYROUTE_FEEDBACK_WAIT_S) for an id it cannot find yet; an unknown id, or
another tenant's, is still a 404 after that wait.

Real gateways, a real redis-server and the test upstream. No test depends on timing: the wait is set
far longer than anything here takes (30 s), and the record is held back by the test itself (a replica
that does not flush until the test flushes it, a stream the upstream sends slowly)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import redis
import yaml

from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

GENEROUS_WAIT_S = 30.0  # never reached when the code is right, whatever the machine's load
SHORT_WAIT_S = 0.2  # the tests of a 404, kept fast
NEVER_S = 3600.0  # a flush interval no test outlives: the replica flushes when the test says so


def budget_policy(tmp_path) -> str:
    """Tenant acme (the test key's) with a daily budget: a stream is settled against it in Redis
    before its ledger record is written, which widens the window the feedback can fall into."""
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"version": "fb", "tenants": {"acme": {"budget": {"daily_usd": "100"}}}}))
    return path


def gateway(upstream, redis_server, tmp_path, backend: str, name: str = "gw", **settings) -> Gateway:
    """A gateway on the test catalog, its state in-process or in the (flushed) redis-server."""
    redis_url = None
    if backend == "redis":
        redis_url = redis_server.url
    return start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url)),
        tmp_path / name,
        policy_file=budget_policy(tmp_path),
        redis_url=redis_url,
        **settings,
    )


def post_feedback(gw: Gateway, request_id: str, key: str | None = None) -> httpx.Response:
    return httpx.post(
        gw.v1 + "/feedback",
        headers=gw.auth(key),
        json={"request_id": request_id, "thumbs": "up"},
        timeout=GENEROUS_WAIT_S + 30,
    )


def ask(gw: Gateway, text: str) -> str:
    """A plain answer from `gw`; returns its request id."""
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "cheap", "messages": [{"role": "user", "content": text}]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-polyroute-request-id"]


@pytest.fixture
def flushed_redis(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server


def test_feedback_at_another_replica_before_the_answering_replica_flushes_is_accepted(
    upstream, flushed_redis, tmp_path
):
    """Replica A answers and keeps the record in its buffer (it flushes only when the test says so);
    the feedback reaches replica B, which waits for the id, serving other requests meanwhile, and
    accepts it once A's flush puts the record in Redis. Before the fix B answered 404 at once."""
    a = gateway(upstream, flushed_redis, tmp_path, "redis", "a", store_flush_interval_s=NEVER_S)
    b = gateway(upstream, flushed_redis, tmp_path, "redis", "b", feedback_wait_s=GENEROUS_WAIT_S)
    try:
        request_id = ask(a, "what is a token bucket")
        assert a.state.ledger.buffered >= 1  # the record is still in A's memory, not in Redis
        with ThreadPoolExecutor(1) as pool:
            pending: Future[httpx.Response] = pool.submit(post_feedback, b, request_id, a.api_key)
            ask(b, "and a leaky bucket")  # B's event loop keeps serving while the feedback waits
            assert not pending.done(), pending.result().text  # still waiting: A has not flushed
            assert a.state.ledger.flush() >= 1  # A's periodic flush, run now
            accepted = pending.result()
        assert accepted.status_code == 201, accepted.text
        assert accepted.json() == {"request_id": request_id, "worker": "cheap", "score": 1.0}
    finally:
        a.server.stop()
        b.server.stop()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_feedback_sent_while_the_answer_still_streams_is_accepted_once_it_is_recorded(
    upstream, flushed_redis, tmp_path, backend
):
    """The stream's record is written when the stream ends (after its budget settle), so feedback
    posted while it still streams comes before the record, on the in-process ledger as in Redis. It
    waits for the record and is accepted; before the fix it got 404 at once."""
    gw = gateway(upstream, flushed_redis, tmp_path, backend, feedback_wait_s=GENEROUS_WAIT_S)
    upstream.behave("cheap-model", text="one two three four five six", chunk_delay_s=0.5)
    body = {"model": "cheap", "stream": True, "messages": [{"role": "user", "content": "count to six"}]}
    try:
        with (
            ThreadPoolExecutor(1) as pool,
            httpx.Client(timeout=60) as http,
            http.stream("POST", gw.v1 + "/chat/completions", headers=gw.auth(), json=body) as response,
        ):
            assert response.status_code == 200
            request_id = response.headers["x-polyroute-request-id"]
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the stream has begun
            pending: Future[httpx.Response] = pool.submit(post_feedback, gw, request_id)
            assert any(line == "data: [DONE]" for line in lines)
            accepted = pending.result()
        assert accepted.status_code == 201, accepted.text
        assert accepted.json() == {"request_id": request_id, "worker": "cheap", "score": 1.0}
    finally:
        gw.server.stop()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_an_unknown_id_and_another_tenants_id_are_still_404_after_the_wait(
    upstream, flushed_redis, tmp_path, backend
):
    """The wait ends: an id never recorded gets 404 request_not_found, and another tenant's id the very
    same answer (its existence is not confirmed), while the tenant's own id is accepted."""
    gw = gateway(upstream, flushed_redis, tmp_path, backend, feedback_wait_s=SHORT_WAIT_S)
    try:
        request_id = ask(gw, "what is a token bucket")
        _, other_key = gw.state.auth.store.create("globex", "another tenant")
        unknown = post_feedback(gw, "req_never_answered")
        foreign = post_feedback(gw, request_id, other_key)
        own = post_feedback(gw, request_id)
    finally:
        gw.server.stop()
    for response, asked in ((unknown, "req_never_answered"), (foreign, request_id)):
        assert response.status_code == 404, response.text
        assert response.json()["error"] == {
            "message": f"no request with id {asked!r}",
            "type": "not_found_error",
            "param": None,
            "code": "request_not_found",
        }
    assert own.status_code == 201, own.text


def test_the_feedback_wait_setting_is_checked():
    """A negative wait, or one that would hold a feedback request for minutes, is refused at start."""
    from pydantic import ValidationError

    from gateway.settings import Settings

    assert Settings.from_env({}).feedback_wait_s == 2.0
    assert Settings.from_env({"POLYROUTE_FEEDBACK_WAIT_S": "0"}).feedback_wait_s == 0.0
    for bad in ("-1", "61", "soon"):
        with pytest.raises(ValidationError, match="feedback_wait_s"):
            Settings.from_env({"POLYROUTE_FEEDBACK_WAIT_S": bad})
