"""A catalog swap racing a policy version being checked (gateway/catalog_reload.py apply, policies/loader.py
PolicySource.swap_check and replace), ordered without sleeps.

PUT /admin/policies checks the new version against the catalog check in force, writes the file and
swaps, all under the policy source's lock; a catalog swap takes the same lock without waiting (it runs
on the event loop), and when it is taken tries again on the next round. The tests hold a PUT between
its check and its swap for real: the policy file is written through a temporary file
(``policy.tmp.<pid>``), made here a named pipe bigger than a pipe holds, so the write blocks until the
test reads it. The pipe having data says the PUT is past its check and holds the lock; the test then
edits the workers file, waits until the reload has tried (its debug line) or swapped, and lets the
PUT go.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from contextlib import contextmanager
from decimal import Decimal

import httpx
import pytest
import yaml

from policies import check_against_catalog
from policies.catalog import text_digest
from tests.conftest import catalog_yaml_for
from tests.test_catalog_reload import (
    BASE_POLICY,
    TIMEOUT_S,
    catalog_file,
    chat,
    cost,
    judge,
    start,
    wait_applied,
    wait_for,
    wait_refused,
    write_text,
)

PIPE_BYTES = 1 << 18  # 256 KiB: more than a pipe holds (64 KiB on Linux), so the writer blocks
WAITS = "waits: a policy version is being checked"


def padded(policy: dict) -> str:
    """The policy as YAML, with a comment long enough to fill the pipe."""
    line = "# " + "x" * 98 + "\n"
    return yaml.safe_dump(policy) + line * (PIPE_BYTES // len(line) + 1)


@contextmanager
def put_held(gw, tmp_path, policy: dict):
    """PUT ``policy`` and yield once it is past its check, holding the lock, its file write blocked;
    on leaving, the write is let through. Yields a dict that gets the response as ``put``."""
    pipe = (tmp_path / "policy.yaml").with_suffix(f".tmp.{os.getpid()}")  # where PUT writes first
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a reader: the PUT's open does not block
    result: dict[str, httpx.Response] = {}

    def put() -> None:
        result["put"] = httpx.put(
            gw.url + "/admin/policies",
            headers={**gw.auth(gw.admin_key), "content-type": "application/yaml"},
            content=padded(policy),
            timeout=TIMEOUT_S * 2,
        )

    caller = threading.Thread(target=put)
    caller.start()
    try:
        readable, _, _ = select.select([reader], [], [], TIMEOUT_S)
        assert readable, "the PUT did not start writing the policy file"
        yield result
    finally:
        drain_until_done(reader, caller)
        os.close(reader)
        assert not caller.is_alive(), "the PUT did not finish"


def drain_until_done(reader: int, caller: threading.Thread) -> None:
    """Read the pipe until the PUT's thread has ended, keeping this read end open meanwhile. Reading
    only to the first end of file is not enough: a PUT that has not opened the pipe yet (this test
    failed before it did) reads as the end, and once the reader is closed its open would block
    forever, holding the policy lock in a worker thread of the gateway that its shutdown then waits
    on. Bounded: the PUT's own timeout ends it."""
    deadline = time.monotonic() + TIMEOUT_S * 3
    while caller.is_alive() and time.monotonic() < deadline:
        readable, _, _ = select.select([reader], [], [], 0.1)
        if not readable or not os.read(reader, 65536):  # nothing yet, or the end: is the PUT done?
            caller.join(0.1)


def reload_tried(gw, caplog, edited: str) -> str:
    """Wait until the catalog reload has looked at `edited` while the PUT is held: "waited" (it found
    a policy version being checked), "swapped" or "refused"; what the test expects is asserted by it."""
    digest = text_digest(edited)

    def outcome() -> str | None:
        if any(WAITS in r.getMessage() and digest in r.getMessage() for r in caplog.records):
            return "waited"
        status = gw.state.catalog_file.status()  # not over HTTP: a blocked event loop must not hang it
        if status["sha256"] == digest:
            return "swapped"
        return "refused" if status["refused"] else None

    return wait_for(outcome, f"the catalog reload looked at {digest}")


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="polyroute.gateway")
    return caplog


def test_a_catalog_edit_waits_for_a_policy_put_and_is_applied_after_it(upstream, tmp_path, debug_log):
    """The retry: the edit found the policy lock taken, is neither applied nor refused, and is applied
    on a later round, once the PUT is done, checked against the version the PUT put in force."""
    text = catalog_yaml_for(upstream.url)
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        edited = text.replace("input_price_per_m: 0.10", "input_price_per_m: 1.10")
        with put_held(gw, tmp_path, {**BASE_POLICY, "version": "v2"}) as result:
            write_text(workers_file, edited)
            assert reload_tried(gw, debug_log, edited) == "waited"
            status = gw.state.catalog_file.status()
            assert status["sha256"] == text_digest(text) and status["refused"] is None
        assert result["put"].status_code == 200, result["put"].text
        wait_applied(gw, edited)
        assert catalog_file(gw)["refused"] is None
        assert gw.state.policy.engine.version.startswith("v2+")
        assert cost(chat(gw, "cheap")) == Decimal("0.0013")  # the edit's price
    finally:
        gw.server.stop()


def test_a_policy_put_racing_a_catalog_swap_never_leaves_a_policy_that_does_not_fit(
    upstream, tmp_path, debug_log
):
    """The lock: a PUT checked against the catalog in force (its judge is mid) while an edit that drops
    mid is read. The catalog waits, the PUT goes in force, and the edit is then refused because the
    policy in force does not fit it. Without the lock the edit would be put in force between the PUT's
    check and its swap, leaving a judge outside the catalog."""
    text = catalog_yaml_for(upstream.url)
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        mid, pricey = text.index("  - name: mid"), text.index("  - name: pricey")
        edited = text[:mid] + text[pricey:]
        judged = {"version": "judge-mid", "tenants": {"acme": {"judge": judge("mid")}}}
        with put_held(gw, tmp_path, judged) as result:
            write_text(workers_file, edited)
            assert reload_tried(gw, debug_log, edited) == "waited"
            assert gw.state.catalog.digest == text_digest(text)
        assert result["put"].status_code == 200, result["put"].text
        refused = wait_refused(gw, edited)
        assert "policy in force does not fit" in refused["refused"] and "'mid'" in refused["refused"]
        assert gw.state.policy.engine.version.startswith("judge-mid+")
        assert gw.state.catalog.digest == text_digest(text)
        check_against_catalog(gw.state.policy.engine.policy, gw.state.catalog)  # they fit
        assert chat(gw, "mid").headers["x-polyroute-worker"] == "mid"
    finally:
        gw.server.stop()
