"""A judge's grade is traced with the request it grades (gateway/judge.py, docs/observability.md).

The judge's grading call was a lone root CLIENT span in a trace of its own, tied to nothing: from a
request's trace nobody could find its grade, nor from a grade the request. The graded request's span
context now travels on the judge's job, and each grade is a `polyroute.judge` span (rooting a trace
of its own, the judge's CLIENT call its child) that links to the request's span and names its
request id. A link, not a parent: the grade starts after the request's response (and its span) has
ended and may run long after, so as a child it would stretch the request's trace past what its
client waited.

Real parts only: a gateway on uvicorn in this process (so the SDK's in-memory exporter, a real
exporter, receives its spans) in front of the loopback test upstream; the grade runs in the
background and is waited for on its judge metric, with a generous deadline, never a fixed sleep."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from opentelemetry.trace import SpanKind

from gateway import tracing
from policies import parse_catalog
from tests.conftest import catalog_yaml_for, ledger_record, start_gateway
from tests.test_judge import JUDGE, policy

WAIT_S = 60.0  # a loaded 2-core machine: generous, and only reached when something is broken
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(autouse=True)
def _clean(exporter, reset_fake):
    exporter.clear()
    tracing.setup(provider=exporter.provider, capture_content=False)
    yield


@pytest.fixture(scope="module")
def gw(fake, tmp_path_factory, exporter):
    """Tenant acme's every answer is graded by pricey."""
    data_dir = tmp_path_factory.mktemp("metrics_agree_judge")
    (data_dir / "policy.yaml").write_text(yaml.safe_dump(policy(JUDGE)))
    catalog = parse_catalog(catalog_yaml_for(fake.url), "judge trace catalog")
    gateway = start_gateway(catalog, data_dir, policy_file=data_dir / "policy.yaml", judge_seed=0)
    yield gateway
    gateway.server.stop()


def judged(gw) -> int:
    return sum(
        int(sample.value)
        for metric in gw.state.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "polyroute_judge_total" and sample.labels == {"tenant": "acme", "outcome": "judged"}
    )


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def only(spans, what: str):
    assert len(spans) == 1, (what, [(s.name, dict(s.attributes)) for s in spans])
    return spans[0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_grade_links_to_the_request_it_grades(gw, fake, exporter, stream):
    fake.behave("pricey-model", text="8")  # the judge's grade: 8/10
    graded_before = judged(gw)
    response = httpx.post(
        gw.v1 + "/chat/completions",
        headers=gw.auth(),
        json={"model": "cheap", "messages": MESSAGES, "stream": stream},
        timeout=WAIT_S,
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-polyroute-request-id"]
    ledger_record(gw, request_id)
    wait_for(lambda: judged(gw) > graded_before, "the grade")  # counted after its span has ended
    spans = exporter.get_finished_spans()

    request = only(
        [
            s
            for s in spans
            if s.kind == SpanKind.SERVER and s.attributes.get("polyroute.request_id") == request_id
        ],
        "the request span",
    )
    call = only(
        [s for s in spans if s.kind == SpanKind.CLIENT and s.attributes.get("polyroute.worker") == "pricey"],
        "the judge's call",
    )
    assert call.parent is not None, "the judge's call is a lone root span, tied to no request"
    grade = only([s for s in spans if s.context.span_id == call.parent.span_id], "the call's parent")

    assert grade.name == "polyroute.judge"
    assert grade.attributes["polyroute.request_id"] == request_id
    assert grade.attributes["polyroute.judge.outcome"] == "judged"
    assert [link.context for link in grade.links] == [request.context]
    # a trace of its own: the request's trace is what its client waited for, and no more
    assert grade.parent is None and grade.context.trace_id != request.context.trace_id
    assert call.context.trace_id == grade.context.trace_id
    answered = [
        s for s in spans if s.context.trace_id == request.context.trace_id and s.kind == SpanKind.CLIENT
    ]
    assert [s.attributes["polyroute.worker"] for s in answered] == ["cheap"]
