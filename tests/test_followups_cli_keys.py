"""`polyroute keys create/list/revoke` with REDIS_URL set and Redis not there: one line saying so and
exit 1, as a user runs them (a real subprocess), instead of a traceback."""

from __future__ import annotations

import os
import socket

import pytest

from tests.test_cli import run_cli


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "command", [["create", "--tenant", "acme"], ["list"], ["revoke", "key_0123456789ab"]], ids=lambda c: c[0]
)
def test_keys_commands_say_redis_is_unreachable_in_one_line(tmp_path, command):
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    env.pop("POLYROUTE_REDIS_URL", None)
    done = run_cli("keys", *command, "--data-dir", str(tmp_path), env=env)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and not done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "unreachable" in lines[0] and "REDIS_URL" in lines[0]
    assert not (tmp_path / "keys.json").exists()  # nothing went to the file store instead


def test_the_one_line_names_the_variable_the_redis_url_came_from(tmp_path):
    """POLYROUTE_REDIS_URL is read before REDIS_URL (as the gateway reads them): the line names it."""
    env = {**os.environ, "POLYROUTE_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    env.pop("REDIS_URL", None)
    done = run_cli("keys", "list", "--data-dir", str(tmp_path), env=env)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "as POLYROUTE_REDIS_URL is set" in done.stderr, done.stderr
