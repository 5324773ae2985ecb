"""Router versions on disk and the gateway's holder of the one in force: a version is written whole
or not at all, `activate` refuses what no gateway could load, the rollback target survives
re-activation, and the holder's reported error follows the pointer."""

from __future__ import annotations

import logging

import pytest

from gateway.router_state import RouterHolder
from router import (
    RouterLoadError,
    activate_version,
    list_versions,
    read_pointer,
    rollback,
    save_artifact,
    train_artifact,
)
from tests.test_router_learned import synthetic


@pytest.fixture(scope="module")
def make():
    def artifact(seed: int):
        return train_artifact(*synthetic(), backend="static", model="logreg", random_state=seed)

    return artifact


class _Unpicklable:
    """A model object that fails half-way through being written, as a full disk would."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


def test_a_failed_write_leaves_no_version_and_keeps_the_one_in_force(tmp_path, make):
    good = save_artifact(tmp_path, make(0)).name
    broken = make(1)
    broken.model = _Unpicklable()
    with pytest.raises(OSError, match="cannot write router version .* No space left"):
        save_artifact(tmp_path, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([good, "current.json"])
    assert read_pointer(tmp_path)["version"] == good
    assert [card["version"] for card in list_versions(tmp_path)] == [good]


def test_activate_refuses_a_damaged_version_and_changes_nothing(tmp_path, make):
    good = save_artifact(tmp_path, make(0)).name
    bad = save_artifact(tmp_path, make(1), activate=False).name
    (tmp_path / bad / "model.joblib").write_bytes(b"\x00" * 10)
    with pytest.raises(RouterLoadError, match="cannot load model"):
        activate_version(tmp_path, bad)
    assert read_pointer(tmp_path) == {"version": good, "previous": None}


def test_re_activating_the_version_in_force_keeps_the_rollback_target(tmp_path, make):
    a = save_artifact(tmp_path, make(0)).name
    b = save_artifact(tmp_path, make(1)).name
    activate_version(tmp_path, b)
    assert read_pointer(tmp_path) == {"version": b, "previous": a}
    assert rollback(tmp_path) == a


def test_the_holder_clears_a_refusal_once_the_pointer_is_back_on_the_router_in_force(tmp_path, make):
    a = save_artifact(tmp_path, make(0)).name
    holder = RouterHolder(tmp_path)
    b = save_artifact(tmp_path, make(1)).name
    (tmp_path / b / "model.joblib").write_bytes(b"garbage")
    assert holder.changed() and not holder.reload()
    assert b in holder.status()["error"]
    assert rollback(tmp_path) == a  # the operator rolls back to what the gateway still serves
    assert holder.changed()
    holder.reload()
    assert holder.current.version == a and holder.status()["error"] is None
    assert not holder.changed()


def test_a_damaged_pointer_is_reported_once_not_every_tick(tmp_path, make, caplog):
    a = save_artifact(tmp_path, make(0)).name
    holder = RouterHolder(tmp_path)
    (tmp_path / "current.json").write_text('{"version": "2026')
    with caplog.at_level(logging.ERROR, logger="polyroute.router"):
        for _ in range(5):  # five ticks of the gateway's watcher
            if holder.changed():
                holder.reload()
    assert holder.current.version == a and "unreadable" in holder.status()["error"]
    assert len([r for r in caplog.records if "unreadable" in r.getMessage()]) == 1
    activate_version(tmp_path, a)  # repaired: the pointer is readable again and names the router in force
    assert holder.changed()
    holder.reload()
    assert holder.status()["error"] is None


def test_the_holder_reports_why_the_router_asked_for_at_start_is_missing(tmp_path):
    holder = RouterHolder(tmp_path, startup_error="the shipped router prior was not put in force: x")
    assert holder.current.name == "rules-cheapest"
    assert holder.status()["error"].startswith("the shipped router prior")


def test_a_staging_directory_is_never_listed_as_a_version(tmp_path, make):
    good = save_artifact(tmp_path, make(0)).name
    stale = tmp_path / f".{good}x.saving.123"
    stale.mkdir()
    (stale / "card.json").write_text('{"version": "stale"}')
    assert [card["version"] for card in list_versions(tmp_path)] == [good]
