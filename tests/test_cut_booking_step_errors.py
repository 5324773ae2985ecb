"""A step's error keeps what the gateway appended to a provider's message (router/compose/base.py
`error_text`, gateway/upstream.py `WorkerError.append`).

A step's error, and a failed worker's in the trace of a workflow answered in fast mode, were the
error's first 300 characters: a provider that answers with a long message (its whole body quoted,
a stack trace) pushed out the end the gateway appends, such as why the call was not retried. Now
the provider's part is shortened, with an ellipsis, and what the gateway appended is kept whole;
the error stays within 300 characters.

Real path: the worker's error object (a 200 whose body is OpenAI's error object, code 503) carries a
~2,000-character message; its first call is held at the test upstream while the policy is reloaded
to exclude it, so its retry is not made and its error says so (as in
tests/test_worker_faults_more_compose.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from router.compose.base import ERROR_CHARS, error_text
from tests.conftest import Gateway, ledger_record
from tests.fakes.upstream import FakeUpstream
from tests.test_router_live_change_plan import deny, during_first_step, edit_policy
from tests.test_worker_faults_more_reload import reloading_gateway

NOT_RETRIED = " (not retried: the policy in force no longer admits it)"
LONG = "the provider's backend is overloaded; " * 55  # ~2,000 characters
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class _Noted(Exception):
    """An exception that says which end of its text is the gateway's own (WorkerError's shape)."""

    def __init__(self, text: str, appended: str) -> None:
        super().__init__(text + appended)
        self.appended = appended


# ---- the helper -----------------------------------------------------------------------------------
def test_a_short_error_is_kept_as_it_is():
    assert error_text(_Noted("cheap: 503 busy", NOT_RETRIED)) == "cheap: 503 busy" + NOT_RETRIED
    assert error_text(ValueError()) == "ValueError"


def test_a_long_error_keeps_what_was_appended_whole():
    text = error_text(_Noted("cheap: 503 " + LONG, NOT_RETRIED))
    assert len(text) == ERROR_CHARS
    assert text.endswith("…" + NOT_RETRIED)
    assert text.startswith("cheap: 503 the provider's backend is overloaded")


def test_a_long_error_with_nothing_appended_is_cut_with_an_ellipsis():
    text = error_text(RuntimeError(LONG))
    assert len(text) == ERROR_CHARS and text.endswith("…") and LONG.startswith(text[:-1])


def test_a_text_of_the_callers_keeps_the_exceptions_appended_end():
    err = _Noted("cheap: 503 " + LONG, NOT_RETRIED)
    text = error_text(err, f"ended by {type(err).__name__}: {err}")
    assert len(text) == ERROR_CHARS
    assert text.startswith("ended by _Noted: cheap: 503") and text.endswith("…" + NOT_RETRIED)


# ---- through the gateway --------------------------------------------------------------------------
@pytest.fixture
def gw(held: FakeUpstream, tmp_path: Path) -> Iterator[Gateway]:
    """Two retries per worker, a policy file the test reloads itself."""
    yield from reloading_gateway(held, tmp_path)


def _refuses_at_length(held: FakeUpstream) -> None:
    """cheap answers every call with an error object whose message is ~2,000 characters (code 503:
    retried, were it still admitted)."""
    error = {"error": {"message": LONG, "type": "server_error", "code": 503}}
    held.behave("cheap-model", raw_body=orjson.dumps(error).decode())
    held.behave("mid-model", text="42")
    held.behave("pricey-model", text="42")


def _kept_whole(error: str) -> None:
    assert error.endswith(NOT_RETRIED), error
    assert "503" in error and "overloaded" in error and "…" in error
    assert len(error) <= ERROR_CHARS


def test_a_step_error_keeps_not_retried_after_a_long_provider_message(gw, held):
    """The cascade's first step on cheap fails with the long message and is not retried: its step's
    error in the client's trace and the ledger's ends with the gateway's "not retried"."""
    _refuses_at_length(held)
    body = {"model": "compose:cascade", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50}
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    answer = during_first_step(gw, held, "cheap", edit_policy(gw, deny(gw, "cheap")), body, headers)
    assert len(held.requests_for("cheap-model")) == 1  # not retried
    assert answer.status_code == 200, answer.text
    [step] = [s for s in answer.json()["polyroute"]["trace"]["steps"] if s["worker"] == "cheap"]
    _kept_whole(step["error"])
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    [step] = [s for s in record["trace"]["steps"] if s["worker"] == "cheap"]
    _kept_whole(step["error"])


def test_a_degraded_workflows_failed_worker_keeps_not_retried(gw, held):
    """A workflow asked for with tools answers in fast mode: cheap fails with the long message and is
    not retried, mid answers. The trace's step for cheap ends with "not retried"."""
    _refuses_at_length(held)
    body = {
        "model": "compose:cascade",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 50,
        "tools": TOOLS,
    }
    headers = {**gw.auth(), "x-polyroute-trace": "1"}
    answer = during_first_step(gw, held, "cheap", edit_policy(gw, deny(gw, "cheap")), body, headers)
    assert len(held.requests_for("cheap-model")) == 1
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-polyroute-worker"] == "mid"
    assert "does not take tools" in answer.headers["x-polyroute-compose"]
    record = ledger_record(gw, answer.headers["x-polyroute-request-id"])
    assert record["trace"]["degraded"] is True
    [step] = [s for s in record["trace"]["steps"] if s["worker"] == "cheap"]
    _kept_whole(step["error"])
