"""`router eval --from-ledger` and `router train --from-ledger` read traffic as the live router decided it.

The replay of a logged request must rebuild what the router saw: the policy's preference for fewer
active parameters, the λ the request, tenant or operator fixed (and no other: a λ the logging model
chose is the candidate's to choose), the question of a long prompt the ledger had to cut, and, of a
request's scores per source, the latest by `at` rather than by arrival.
"""

from __future__ import annotations

import copy
import json
import socket
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from typer.testing import CliRunner

from gateway.ledger import (
    MAX_QUERY_CHARS,
    QUERY_TAIL_CHARS,
    FeedbackRecord,
    RequestRecord,
    logged_query,
    record_problem,
    stored_query,
    training_rows,
)
from gateway.ledger_export import ledger_records
from gateway.store.health import Breaker
from gateway.store.ledger_redis import RedisLedger
from policies import parse_catalog
from polyroute.cli import app
from router import LearnedRouter, RouteRequest, feature_builder_for, save_artifact, train_artifact
from router.features import focus_text
from router.learned import cost_weight_of
from router.offline.ledger import compact_records, counted_score, evaluate_candidate, ledger_dataset
from router.routelog import replay_request, route_log, route_problem
from tests.conftest import catalog_yaml_for, start_gateway
from tests.test_router_learned import CHAT, MATH, synthetic

WEIGHTS = {"user": 1.0, "judge": 0.5, "calibration": 1.0}


@pytest.fixture(scope="module")
def trained():
    return train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)


def ask(gw, text: str, metadata: dict | None = None, score: float | None = 1.0) -> httpx.Response:
    """One `auto` request, and its user feedback when `score` is given."""
    body: dict = {"model": "auto", "messages": [{"role": "user", "content": text}]}
    if metadata:
        body["metadata"] = metadata
    r = httpx.post(gw.v1 + "/chat/completions", headers=gw.auth(), json=body, timeout=30)
    assert r.status_code == 200, r.text
    if score is not None:
        fb = httpx.post(
            gw.v1 + "/feedback",
            headers=gw.auth(),
            json={"request_id": r.headers["x-polyroute-request-id"], "score": score},
            timeout=30,
        )
        assert fb.status_code == 201, fb.text
    return r


def ledger_requests(data: Path) -> dict[str, dict]:
    """The request records of a stopped gateway's file ledger, by id."""
    lines = (data / "ledger.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines) if r["type"] == "request"}


def eval_report(tmp_path: Path, data: Path, version: str) -> dict:
    """`polyroute router eval --from-ledger --candidate VERSION` on a stopped gateway's ledger."""
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        [
            "router",
            "eval",
            "--from-ledger",
            "--candidate",
            version,
            "--ledger",
            str(data / "ledger.jsonl"),
            "--router-dir",
            str(data / "router"),
            "--workers-file",
            str(tmp_path / "workers.yaml"),
            "--out",
            str(out),
        ],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


# ---- the policy's preference for fewer active parameters -------------------------------------------
def sized_catalog_yaml(url: str) -> str:
    """The test catalog with parameter counts: cheap is a big model, pricey a small one."""
    data = yaml.safe_load(catalog_yaml_for(url))
    for worker in data["workers"]:
        if worker["name"] == "cheap":
            worker.update(total_params_b=100, active_params_b=100)
        if worker["name"] == "pricey":
            worker.update(total_params_b=10, active_params_b=10)
    return yaml.safe_dump(data)


def test_the_version_in_force_replays_its_own_choices_under_prefer_fewer_active_params(
    upstream, tmp_path, trained
):
    """Live, the preference folds active parameters into the price, so the small `pricey` wins. The
    replay of the very version in force (ε = 0) on its own log must pick what it picked: agreement
    1.0. Before, the route record lacked the preference and the replay ranked without it (cheap 8/8)."""
    data = tmp_path / "data"
    version = save_artifact(data / "router", trained).name
    catalog_text = sized_catalog_yaml(upstream.url)
    (tmp_path / "workers.yaml").write_text(catalog_text)
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"version": "p", "preferences": {"prefer_fewer_active_params": 1.0}}))
    gw = start_gateway(parse_catalog(catalog_text), data, policy_file=policy)
    try:
        texts = [f"Say hello to my friend number {200 + i} in a warm and friendly tone." for i in range(8)]
        live = [ask(gw, text).headers["x-polyroute-worker"] for text in texts]
    finally:
        gw.server.stop()
    assert set(live) == {"pricey"}  # live: the small model wins on active parameters
    report = eval_report(tmp_path, data, version)
    assert report["candidate_choices"] == {"pricey": 8}, report["candidate_choices"]
    assert report["agreement"] == 1.0
    routes = [r["route"] for r in ledger_requests(data).values()]
    assert [r["prefer_fewer_active_params"] for r in routes] == [1.0] * 8


def test_a_route_record_without_the_preference_replays_as_before():
    """Records written before the preference was logged replay at 0 (what the policy default is); a
    preference outside 0..1 is a record the reader names rather than replays."""
    log = {
        "chosen": "cheap",
        "greedy": "cheap",
        "propensity": 1.0,
        "pool": ["cheap"],
        "cost_weight": 0.5,
        "prompt_chars": 10,
    }
    assert route_problem(log) is None
    assert replay_request(log, "hi").prefer_fewer_active_params == 0.0
    assert replay_request({**log, "prefer_fewer_active_params": 0.7}, "hi").prefer_fewer_active_params == 0.7
    assert "prefer_fewer_active_params" in route_problem({**log, "prefer_fewer_active_params": 2})
    assert "prefer_fewer_active_params" in route_problem({**log, "prefer_fewer_active_params": "1"})


# ---- λ: the candidate's own unless the request, tenant or operator fixed it -------------------------
def logged_records(logger: LearnedRouter, pool, texts: list[str], **request) -> list[dict]:
    """A request and a user score per text, as the gateway logs them under `logger` (ε = 0)."""
    records = []
    for i, text in enumerate(texts):
        route = RouteRequest(len(text), text=text, **request)
        decision = logger.route(route, pool)
        weight = cost_weight_of(route, None, logger)
        record = RequestRecord(
            id=f"req_{i}",
            tenant="acme",
            model="auto",
            worker=decision.workers[0].name,
            strategy="fast",
            status=200,
            data_class="public",
            query=text,
            route=route_log(decision, route, [w.name for w in pool], weight.value, weight.source),
        )
        feedback = FeedbackRecord(f"req_{i}", "acme", 1.0, decision.workers[0].name)
        records += [json.loads(json.dumps(asdict(record))), json.loads(json.dumps(asdict(feedback)))]
    return records


def picks(router: LearnedRouter, pool, texts: list[str], **request) -> dict[str, int]:
    """What `router` chooses live for each text, counted."""
    counted: dict[str, int] = {}
    for text in texts:
        pick = router.route(RouteRequest(len(text), text=text, **request), pool).workers[0].name
        counted[pick] = counted.get(pick, 0) + 1
    return counted


@pytest.fixture(scope="module")
def operating(trained):
    """(catalog, pool, the logging router at 0.5, a candidate whose card stores operating λ 3.0)."""
    catalog = parse_catalog(catalog_yaml_for("http://127.0.0.1:9"))
    pool = tuple(w for w in catalog.workers if w.name in ("cheap", "mid", "pricey"))
    features = feature_builder_for(trained.features)
    artifact = copy.deepcopy(trained)
    artifact.card = {**trained.card, "operating_cost_weight": 3.0}
    return catalog, pool, LearnedRouter(trained, features), LearnedRouter(artifact, features)


def test_the_candidate_is_replayed_at_its_own_operating_lambda(operating):
    """A request that sets no λ runs live at the operating λ of the model in force. The candidate's
    card says 3.0 and the logging model ran at the default 0.5: the replay must run the candidate at
    3.0, as it would once in force. Before, the logged 0.5 was forced on it (pricey 10 / cheap 10)."""
    catalog, pool, logger, candidate = operating
    texts = MATH[:10] + CHAT[:10]
    records = logged_records(logger, pool, texts)
    assert {r["route"]["cost_weight_source"] for r in records if r["type"] == "request"} == {"default"}
    report = evaluate_candidate(candidate, training_rows(iter(records)), catalog)
    assert report["candidate_choices"] == picks(candidate, pool, texts) == {"cheap": 20}


@pytest.mark.parametrize("fixed_by", ["cost_weight", "tenant_cost_weight"])
def test_a_lambda_the_request_or_tenant_fixed_is_replayed_as_logged(operating, fixed_by):
    """λ set by the request or its tenant binds any model in force: the replay keeps it, and the
    candidate's operating λ does not apply (as live, where those come first)."""
    catalog, pool, logger, candidate = operating
    texts = MATH[:10] + CHAT[:10]
    records = logged_records(logger, pool, texts, **{fixed_by: 0.01})
    report = evaluate_candidate(candidate, training_rows(iter(records)), catalog)
    live = picks(candidate, pool, texts, **{fixed_by: 0.01})
    assert report["candidate_choices"] == live == {"pricey": 10, "cheap": 10}


def test_lambda_sources_replay_as_fixed_or_the_candidate_s_own():
    """What replay_request makes of each source; a record without one (written before sources were
    logged) keeps its λ, as before; an unknown source is a record the reader names."""
    log = {
        "chosen": "cheap",
        "greedy": "cheap",
        "propensity": 1.0,
        "pool": ["cheap"],
        "cost_weight": 0.25,
        "prompt_chars": 10,
    }
    old = replay_request(log, "q")
    assert (old.cost_weight, old.tenant_cost_weight) == (0.25, None)
    for source, expected in [
        ("request", (0.25, None)),
        ("setting", (0.25, None)),
        ("tenant", (None, 0.25)),
        ("model card", (None, None)),
        ("default", (None, None)),
    ]:
        replayed = replay_request({**log, "cost_weight_source": source}, "q")
        assert (replayed.cost_weight, replayed.tenant_cost_weight) == expected, source
        assert route_problem({**log, "cost_weight_source": source}) is None
    assert "cost_weight_source" in route_problem({**log, "cost_weight_source": "vibes"})
    assert "cost_weight_source" in route_problem({**log, "cost_weight_source": ["request"]})


def test_router_eval_runs_a_candidate_at_its_own_operating_lambda(upstream, tmp_path, trained):
    """End to end: the gateway logs traffic under a version without an operating λ (0.5: the
    arithmetic goes to pricey); `router eval --candidate` of a retrain whose card stores 3.0 must
    report what that candidate would choose once in force (cheap for all), not its choices at 0.5."""
    data = tmp_path / "data"
    save_artifact(data / "router", trained)
    catalog_text = catalog_yaml_for(upstream.url)
    (tmp_path / "workers.yaml").write_text(catalog_text)
    texts = MATH[:5] + CHAT[:5]
    gw = start_gateway(parse_catalog(catalog_text), data)
    try:
        logged = [ask(gw, text).headers["x-polyroute-worker"] for text in texts]
    finally:
        gw.server.stop()
    assert logged.count("pricey") == 5  # the logging model's λ (0.5) pays for the arithmetic
    artifact = copy.deepcopy(trained)
    artifact.card = {**trained.card, "operating_cost_weight": 3.0}
    artifact.version = None  # a retrain: a version of its own
    candidate = save_artifact(data / "router", artifact, activate=False).name
    in_force = LearnedRouter(artifact, feature_builder_for(artifact.features))
    [logged_pool] = {tuple(r["route"]["pool"]) for r in ledger_requests(data).values()}
    pool = tuple(w for w in parse_catalog(catalog_text).workers if w.name in logged_pool)
    report = eval_report(tmp_path, data, candidate)
    assert report["candidate_choices"] == picks(in_force, pool, texts) == {"cheap": 10}


def test_the_gateway_logs_where_each_lambda_came_from(upstream, tmp_path, trained):
    """The route record says whose λ it is: the model card's operating λ when nothing set one, the
    request's when it set one."""
    data = tmp_path / "data"
    artifact = copy.deepcopy(trained)
    artifact.card = {**trained.card, "operating_cost_weight": 3.0}
    save_artifact(data / "router", artifact)
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), data)
    try:
        plain = ask(gw, CHAT[0], score=None).headers["x-polyroute-request-id"]
        fixed = ask(gw, CHAT[1], {"cost_weight": 0.2}, score=None).headers["x-polyroute-request-id"]
    finally:
        gw.server.stop()
    requests = ledger_requests(data)
    assert {k: requests[plain]["route"][k] for k in ("cost_weight", "cost_weight_source")} == {
        "cost_weight": 3.0,
        "cost_weight_source": "model card",
    }
    assert {k: requests[fixed]["route"][k] for k in ("cost_weight", "cost_weight_source")} == {
        "cost_weight": 0.2,
        "cost_weight_source": "request",
    }


# ---- a long prompt: replayed and trained on the question the router read ----------------------------
EXAMPLES = "\n\n".join(f"Example {i}: " + CHAT[i % len(CHAT)] + " Answer: Hello, friend!" for i in range(120))


def test_a_long_few_shot_prompt_is_replayed_on_the_question_the_router_read(upstream, tmp_path):
    """A last-paragraph model (RouterBench) reads the question after the few-shot examples. The ledger
    keeps a long query's head and tail, and the replay reads the question again: the version in force
    agrees with itself. Before, it read the last paragraph of the first 4,000 characters, a solved
    example (cheap 6/6, agreement 0)."""
    texts, turns, labels, workers = synthetic()
    artifact = train_artifact(
        texts,
        turns,
        labels,
        workers,
        backend="static",
        model="logreg",
        random_state=0,
        text_rule="last_paragraph",
    )
    data = tmp_path / "data"
    version = save_artifact(data / "router", artifact).name
    catalog_text = catalog_yaml_for(upstream.url)
    (tmp_path / "workers.yaml").write_text(catalog_text)
    assert len(EXAMPLES) > MAX_QUERY_CHARS + QUERY_TAIL_CHARS
    gw = start_gateway(parse_catalog(catalog_text), data)
    questions = [
        f"Compute {31 + 2 * i} * 7 + {38 + 2 * i} and show every step of the arithmetic." for i in range(6)
    ]
    try:
        live = [
            ask(gw, EXAMPLES + "\n\n" + q, {"cost_weight": 0.1}).headers["x-polyroute-worker"]
            for q in questions
        ]
    finally:
        gw.server.stop()
    assert set(live) == {"pricey"}  # live: the question (arithmetic) goes to pricey
    report = eval_report(tmp_path, data, version)
    assert report["candidate_choices"] == {"pricey": 6}, report["candidate_choices"]
    assert report["agreement"] == 1.0
    stored = list(ledger_requests(data).values())
    assert [len(r["query"]) for r in stored] == [MAX_QUERY_CHARS] * 6  # the record stays bounded
    assert [len(r["query_tail"]) for r in stored] == [QUERY_TAIL_CHARS] * 6
    assert [r["query_chars"] for r in stored] == [len(EXAMPLES) + 2 + len(q) for q in questions]
    assert [focus_text(logged_query(r)) for r in stored] == questions


def stored_request(query) -> RequestRecord:
    """A routed request record req_1 of acme's (answered by pricey) holding `query` (a StoredQuery)."""
    return RequestRecord(
        id="req_1",
        tenant="acme",
        model="auto",
        worker="pricey",
        strategy="fast",
        status=200,
        data_class="public",
        query=query.text,
        query_tail=query.tail,
        query_chars=query.chars,
    )


def test_training_from_the_ledger_reads_head_and_tail():
    """`router train --from-ledger` (compact_records → training_rows → ledger_dataset, as the CLI
    chains them) trains on head + tail, so the question is in the text it learns from."""
    question = "Compute 41 * 7 + 48 and show every step of the arithmetic."
    text = EXAMPLES + "\n\n" + question
    query = stored_query(text, "public")
    request = stored_request(query)
    records = [
        json.loads(json.dumps(asdict(r))) for r in (request, FeedbackRecord("req_1", "acme", 1.0, "pricey"))
    ]
    assert all(record_problem(r) is None for r in records)
    scored = {rid for r in records if (rid := counted_score(r, WEIGHTS)) is not None}
    [row] = training_rows(iter(compact_records(records, scored, WEIGHTS)), WEIGHTS)
    assert row["query"] == text[:MAX_QUERY_CHARS] + "\n\n" + text[-QUERY_TAIL_CHARS:]
    assert focus_text(ledger_dataset([row]).texts[0]) == question


def test_a_parquet_export_keeps_a_long_querys_tail(tmp_path):
    """A Parquet `ledger export` reads back with the tail, as a JSONL one does: training or replaying
    from it reads the question after the examples."""
    from gateway.ledger_export import located_parquet_records, write_parquet

    question = "Compute 41 * 7 + 48 and show every step of the arithmetic."
    query = stored_query(EXAMPLES + "\n\n" + question, "public")
    record = stored_request(query)
    out = tmp_path / "ledger.parquet"
    assert write_parquet(iter([json.loads(json.dumps(asdict(record)))]), out, lambda: None) == 1
    [(_, back)] = list(located_parquet_records(out))
    assert (back["query_tail"], back["query_chars"]) == (query.tail, query.chars)
    assert focus_text(logged_query(back)) == question


def test_what_the_ledger_keeps_of_a_query():
    """Short: whole, no tail. Up to head + tail long: whole again, in two parts joined without a gap.
    Longer: head, a paragraph break, tail. Never for data classes that may not be stored. A record
    written before tails were kept reads as it was stored."""
    assert stored_query("short", "public") == stored_query("short", "internal")
    assert (stored_query("short", "public").tail, stored_query("short", "public").chars) == (None, None)
    assert stored_query("x" * 9000, "pii").text is None and stored_query("x" * 9000, None).text is None
    middle = "".join(chr(ord("a") + i % 26) for i in range(MAX_QUERY_CHARS + 1500))
    kept = stored_query(middle, "public")
    assert logged_query({"query": kept.text, "query_tail": kept.tail, "query_chars": kept.chars}) == middle
    long = "h" * MAX_QUERY_CHARS + "m" * 10_000 + "t" * QUERY_TAIL_CHARS
    kept = stored_query(long, "public")
    assert (kept.text, kept.tail, kept.chars) == ("h" * MAX_QUERY_CHARS, "t" * QUERY_TAIL_CHARS, len(long))
    record = {"query": kept.text, "query_tail": kept.tail, "query_chars": kept.chars}
    assert logged_query(record) == kept.text + "\n\n" + kept.tail
    assert logged_query({"query": kept.text}) == kept.text  # an old record: the head alone, as before
    base = {"type": "request", "id": "r"}
    assert "query_tail" in record_problem({**base, "query_tail": 5})
    assert "query_chars" in record_problem({**base, "query_chars": -1})
    assert "query_chars" in record_problem({**base, "query_chars": True})


# ---- the latest score counts, by `at` ---------------------------------------------------------------
def scores_in_order(*scored: tuple[float, float | None], source: str = "user") -> list[dict]:
    """One request and its (score, at) feedback records, in ledger order (at None: a record without)."""
    request = RequestRecord(
        id="req_1", tenant="acme", model="auto", worker="cheap", strategy="fast", status=200, query="q"
    )
    records = [asdict(request)]
    for score, at in scored:
        record = asdict(FeedbackRecord("req_1", "acme", score, "cheap", source=source))
        if at is None:
            del record["at"]
        else:
            record["at"] = at
        records.append(record)
    return records


@pytest.mark.parametrize(
    ("scored", "latest"),
    [
        (((1.0, 200.0), (0.0, 100.0)), 1.0),  # the older verdict arrived last: the newer still counts
        (((0.0, 100.0), (1.0, 200.0)), 1.0),
        (((0.0, 100.0), (1.0, 100.0)), 1.0),  # same `at`: the later in the ledger
        (((1.0, 100.0), (0.0, None)), 1.0),  # no `at` (hand-written): the oldest
        (((0.0, None), (1.0, None)), 1.0),
    ],
)
def test_the_latest_score_by_at_counts(scored, latest):
    """Per request and source the score with the greatest `at` counts, also after compact_records
    (what `router train` and `router eval --from-ledger` read): it keeps `at`."""
    records = scores_in_order(*scored)
    assert all(record_problem(r) is None for r in records)
    [row] = training_rows(iter(records), WEIGHTS)
    assert row["score"] == latest
    [compacted] = training_rows(iter(compact_records(records, {"req_1"}, WEIGHTS)), WEIGHTS)
    assert compacted["score"] == latest


def test_a_feedback_time_that_is_no_number_is_named():
    [_, feedback] = scores_in_order((1.0, 100.0))
    assert "at" in record_problem({**feedback, "at": "yesterday"})


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # nothing listens there


def test_a_user_s_changed_mind_wins_after_a_replica_re_sends_its_spill(redis_server, tmp_path):
    """Replica A stops during a Redis outage with the user's first verdict (0) unsent: it is spilled.
    The user changes their mind (1) at replica B. A restarts and re-sends its spill, which lands in
    the stream after B's record. Training takes the newer verdict by `at`, not the last to arrive."""
    redis.Redis.from_url(redis_server.url).flushdb()
    good = redis.Redis.from_url(redis_server.url)
    b = RedisLedger(good, Breaker("Redis"), tmp_path / "b-unsent.jsonl")
    b.record_request(
        RequestRecord(
            id="req_1", tenant="acme", model="auto", worker="cheap", strategy="fast", status=200, query="q"
        )
    )
    b.flush()
    spill = tmp_path / "a-unsent.jsonl"
    down = redis.Redis.from_url(dead_url(), socket_timeout=0.2, socket_connect_timeout=0.2)
    a = RedisLedger(down, Breaker("Redis"), spill)
    a.record_feedback(FeedbackRecord("req_1", "acme", 0.0, "cheap", at=time.time() - 60))
    a.close()  # Redis unreachable: spilled
    assert spill.exists()
    b.record_feedback(FeedbackRecord("req_1", "acme", 1.0, "cheap"))
    b.flush()
    RedisLedger(good, Breaker("Redis"), spill).flush()  # A's next start re-sends its spill

    records = list(ledger_records(tmp_path, redis_server.url))  # what `router train --from-ledger` reads
    assert [r["score"] for r in records if r["type"] == "feedback"] == [1.0, 0.0]  # arrival order
    scored = {rid for r in records if (rid := counted_score(r, WEIGHTS)) is not None}
    [row] = training_rows(iter(compact_records(records, scored, WEIGHTS)), WEIGHTS)
    assert row["score"] == 1.0, f"the older verdict won: {row['score']}"
