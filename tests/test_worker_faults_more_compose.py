"""A workflow step's worker calls the books lost, and its retries that asked no policy
(gateway/compose.py `_step_scope`, router/compose/base.py `Run.call` and `Run.readmit`).

1. A step's call cut by the step timeout or by the request's deadline is a cancellation, which
   carries no WorkerError: the cut call, and that worker's calls retried before it, were in no
   `x-polyroute-attempts` header and no ledger `trace.attempts`, though the provider may bill them.
   Now they are listed after the calls given up before, labelled with what cut them
   (`step_timeout`, `deadline`; 504), and, the request cancelled at shutdown, as `cancelled` (503).
   Steps that run together (an ensemble's members) each keep their own: one step's cut calls are
   never booked to another, nor twice.
2. A retry inside a step asked nothing: a worker a policy reload excluded between two of its calls
   was called again. Now the retry asks the run's re-check first, and the run leaves the worker out
   as it leaves out one excluded before a step (the note, `trace.detail.excluded_by_policy`, and the
   `x-polyroute-left-out` header).

No timing bets: the worker's first call fails at once and its retry is held at the test upstream
(`FakeUpstream.hold(..., after=1)`) until the test ends, so the cut falls on that retry; the tests
check that the retry reached the upstream. The step timeout and the deadline (CUT_S) only have to be
longer than a few loopback calls take on a loaded machine; each gateway answers a workflow before the
tests, so no first-request cost falls in them. A reload is made while a call is held (as in
tests/test_worker_faults_more_reload.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.upstream import ATTEMPTS_HEADER
from policies import parse_catalog
from tests.conftest import Gateway, catalog_yaml_for, ledger_record, start_gateway
from tests.fakes.upstream import FakeUpstream
from tests.test_compose_accounting import requests_in
from tests.test_router_live_change_plan import deny, during_first_step, edit_policy
from tests.test_worker_faults_more_books import REFUSED_503, entry, holding
from tests.test_worker_faults_more_reload import reloading_gateway

CUT_S = 10.0  # the step timeout of `step_gw`, the request's deadline of `deadline_gw`
QUESTION = "What is six times seven?"
CUT_ERRORS = {"step_timeout": f"timed out after {CUT_S:g} s", "deadline": "cut by the request's deadline"}
LEFT_OUT = "x-polyroute-left-out"


def cut(what: str) -> dict:
    """A cut call in the ledger's trace.attempts: it was sent, so the provider may bill it."""
    return {"outcome": what, "status": 504 if what != "cancelled" else 503, "may_be_billed": True}


def compose(gw: Gateway, workflow: str, timeout: float = 120) -> httpx.Response:
    body = {
        "model": f"compose:{workflow}",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 50,
    }
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    return httpx.post(gw.v1 + "/chat/completions", headers=headers, json=body, timeout=timeout)


def labels_of(response: httpx.Response, worker: str) -> list[str]:
    return [label for label in response.headers[ATTEMPTS_HEADER].split(",") if label.startswith(worker + ":")]


def step_of(trace: dict, worker: str, role: str = "member") -> dict:
    [step] = [s for s in trace["steps"] if s["worker"] == worker and s["role"] == role]
    return step


pytestmark = pytest.mark.usefixtures("reset_fake")  # the module's own upstream (conftest `fake`)


def _warm(fake: FakeUpstream, data_dir: Path, **settings) -> Iterator[Gateway]:
    """A gateway with one retry per worker that has answered a workflow (cheap, the judge, pricey)."""
    gateway = start_gateway(parse_catalog(catalog_yaml_for(fake.url)), data_dir, retries=1, **settings)
    try:
        answer = compose(gateway, "cascade")
        assert answer.status_code == 200, answer.text
        fake.reset()
        yield gateway
    finally:
        gateway.server.stop()


@pytest.fixture(scope="module")
def step_gw(fake, tmp_path_factory) -> Iterator[Gateway]:
    """Steps time out after CUT_S; the request's deadline is far."""
    yield from _warm(fake, tmp_path_factory.mktemp("compose-step"), compose_step_timeout_s=CUT_S)


@pytest.fixture(scope="module")
def deadline_gw(fake, tmp_path_factory) -> Iterator[Gateway]:
    """The request's deadline is CUT_S; a step's timeout is far."""
    yield from _warm(
        fake, tmp_path_factory.mktemp("compose-deadline"), request_timeout_s=CUT_S, compose_step_timeout_s=120
    )


# ---- 1. a step's call cut short ----------------------------------------------------------------------
def test_a_step_call_its_timeout_cut_is_listed_with_the_retry_before_it(step_gw, fake):
    """The cascade's cheap refuses (503), its retry is in flight when the step times out; pricey, the
    last level, answers. Both of cheap's calls are on the books, the cut one as a step timeout."""
    fake.behave("cheap-model", status=503, fail_times=1)
    fake.behave("pricey-model", text="42")
    with holding(fake, "cheap-model", after=1):
        response = compose(step_gw, "cascade")
    assert len(fake.requests_for("cheap-model")) == 2  # the retry was in flight when the step timed out
    assert response.status_code == 200, response.text
    assert response.headers["x-polyroute-worker"] == "pricey"
    assert response.headers[ATTEMPTS_HEADER] == "cheap:http_503,cheap:step_timeout:may-be-billed"
    trace = response.json()["polyroute"]["trace"]
    assert step_of(trace, "cheap", "answer")["error"] == CUT_ERRORS["step_timeout"]
    expected = [entry("cheap", REFUSED_503), entry("cheap", cut("step_timeout"))]
    assert trace["attempts"] == expected
    record = ledger_record(step_gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 200 and record["trace"]["attempts"] == expected


def test_a_step_call_the_deadline_cut_is_listed_and_no_later_step_starts(deadline_gw, fake):
    """The same cut by the request's deadline: pricey's step does not start, the workflow the client
    asked for has no answer (502), and cheap's two calls are on the books, the cut one as `deadline`."""
    fake.behave("cheap-model", status=503, fail_times=1)
    fake.behave("pricey-model", text="42")
    with holding(fake, "cheap-model", after=1):
        response = compose(deadline_gw, "cascade")
    assert len(fake.requests_for("cheap-model")) == 2
    assert not fake.requests_for("pricey-model")
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "workflow_failed"
    assert response.headers[ATTEMPTS_HEADER] == "cheap:http_503,cheap:deadline:may-be-billed"
    record = ledger_record(deadline_gw, response.headers["x-polyroute-request-id"])
    assert record["status"] == 502
    assert step_of(record["trace"], "cheap", "answer")["error"] == CUT_ERRORS["deadline"]
    assert record["trace"]["attempts"] == [entry("cheap", REFUSED_503), entry("cheap", cut("deadline"))]


@pytest.mark.parametrize("what", ["step_timeout", "deadline"])
def test_members_cut_together_each_book_their_own_calls(request, fake, what):
    """An ensemble's members run together, each under its own scope: cheap refuses and its retry is
    held, mid's first call is held, pricey answers. Both cuts are booked once each, to their own
    worker, cheap's after its refusal (the order between the two workers is the order they were cut)."""
    gw = request.getfixturevalue("step_gw" if what == "step_timeout" else "deadline_gw")
    fake.behave("cheap-model", status=503, fail_times=1)
    fake.behave("mid-model")
    fake.behave("pricey-model", text="42")
    with holding(fake, "cheap-model", after=1), holding(fake, "mid-model"):
        response = compose(gw, "ensemble")
    assert len(fake.requests_for("cheap-model")) == 2 and len(fake.requests_for("mid-model")) == 1
    assert response.status_code == 200, response.text
    assert response.headers["x-polyroute-worker"] == "pricey"
    assert labels_of(response, "cheap") == ["cheap:http_503", f"cheap:{what}:may-be-billed"]
    assert labels_of(response, "mid") == [f"mid:{what}:may-be-billed"]
    assert len(response.headers[ATTEMPTS_HEADER].split(",")) == 3  # nobody's calls booked twice
    record = ledger_record(gw, response.headers["x-polyroute-request-id"])
    attempts = record["trace"]["attempts"]
    assert [a for a in attempts if a["worker"] == "cheap"] == [
        entry("cheap", REFUSED_503),
        entry("cheap", cut(what)),
    ]
    assert [a for a in attempts if a["worker"] == "mid"] == [entry("mid", cut(what))]
    assert len(attempts) == 3
    for worker in ("cheap", "mid"):
        assert step_of(record["trace"], worker)["error"] == CUT_ERRORS[what]


def test_a_step_call_cut_at_shutdown_is_booked_as_cancelled(fake, tmp_path):
    """The gateway stops while cheap's retry is in flight: the server cancels the request after its
    graceful timeout, and the ledger's 503 record lists both of cheap's calls, the cut one as
    `cancelled` (it was sent: the provider may bill it)."""
    gw = start_gateway(parse_catalog(catalog_yaml_for(fake.url)), tmp_path / "data", retries=1)
    fake.behave("cheap-model", status=503, fail_times=1)
    result: dict = {}

    def client() -> None:
        try:
            result["response"] = compose(gw, "cascade")
        except httpx.HTTPError as exc:  # the connection goes with the server
            result["error"] = exc

    thread = threading.Thread(target=client)
    with holding(fake, "cheap-model", after=1):
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while len(fake.requests_for("cheap-model")) < 2:  # the retry is in flight, held
                assert time.monotonic() < deadline, "cheap's retry never reached the upstream"
                time.sleep(0.05)
        finally:
            gw.server.stop()  # the request is cancelled after the graceful timeout (5 s)
            thread.join(60)
    assert not gw.server.thread.is_alive()
    [record] = requests_in(gw.data_dir)
    assert record["status"] == 503 and record["trace"]["ended"] == "cancelled"
    assert record["trace"]["attempts"] == [entry("cheap", REFUSED_503), entry("cheap", cut("cancelled"))]


# ---- 2. a policy reload between two calls of a step's worker ------------------------------------------
@pytest.fixture
def reload_gw(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    """Two retries per worker, a policy file the test reloads itself."""
    yield from reloading_gateway(held, tmp_path)


@pytest.mark.parametrize(
    ("workflow", "role", "answers"), [("cascade", "answer", "pricey"), ("ensemble", "member", "mid")]
)
def test_a_step_worker_excluded_between_its_calls_is_not_retried(reload_gw, held, workflow, role, answers):
    """cheap's first call is held while the policy is reloaded to exclude it, then refused (503): its
    retry is not made (before, it was, and answered), the step fails with its 503, and the run leaves
    cheap out as it leaves out a worker excluded before a step. The cascade's last level answers; the
    ensemble's other members do (its fuser, cheap, is left out: the best-ranked answer is returned)."""
    gw = reload_gw
    held.behave("cheap-model", status=503, fail_times=1)
    held.behave("mid-model", text="42")
    held.behave("pricey-model", text="42")
    body = {
        "model": f"compose:{workflow}",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 50,
    }
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    answer = during_first_step(gw, held, "cheap", edit_policy(gw, deny(gw, "cheap")), body, headers)
    assert len(held.requests_for("cheap-model")) == 1  # the retry never reached the upstream
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == answers
    assert answer.headers["x-polyroute-compose"].endswith(
        "left out by a policy reload during the workflow: cheap"
    )
    assert answer.headers[LEFT_OUT] == "cheap"
    assert answer.headers[ATTEMPTS_HEADER] == "cheap:http_503"
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["status"] == 200
    why = record["trace"]["detail"]["excluded_by_policy"]["cheap"]
    assert gw.state.policy.engine.version in why and "deny-late" in why
    error = step_of(record["trace"], "cheap", role)["error"]
    assert "503" in error and "not retried: the policy in force no longer admits it" in error
    assert record["trace"]["attempts"] == [entry("cheap", REFUSED_503)]


def test_a_retry_after_a_reload_that_excludes_nobody_is_made(reload_gw, held):
    """The same rules under a new label: the step's worker is asked about again, and retried."""
    gw = reload_gw
    held.behave("cheap-model", status=503, fail_times=1, text="42")
    held.behave("pricey-model", text="42", replies={"How likely is the proposed answer": "9"})
    body = {"model": "compose:cascade", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 50}
    answer = during_first_step(gw, held, "cheap", edit_policy(gw, {"version": "open-again"}), body, gw.auth())
    assert answer.status_code == 200, answer.text
    assert len(held.requests_for("cheap-model")) == 2
    assert answer.headers["x-polyroute-worker"] == "cheap"
    assert LEFT_OUT not in answer.headers
    assert answer.headers[ATTEMPTS_HEADER] == "cheap:http_503"
