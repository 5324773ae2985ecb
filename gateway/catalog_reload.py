"""Hot reload of the worker catalog: a valid edit of the workers file is put in force without a restart.

What can be applied safely is: prices, timeouts, retries, endpoints, key env vars, jurisdictions,
capabilities, remote workers added or removed. What cannot is refused, and the catalog in force keeps
serving (CatalogFile says why on /readyz and GET /admin/workers, until the file changes again):

* a change to a local worker (`local:`, a llama.cpp process started once, at start) or an in-process
  embedding worker (`embedder:`): "restart to apply";
* a catalog the policy in force does not fit (policies/catalog_check.py): the policy engine and the
  catalog must stay consistent, so the operator changes the policy first;
* an invalid file (CatalogFile reports it as `on_disk_error`, as before).

The new catalog is read and parsed off the event loop; everything derived from it is then swapped at
once, on the event loop (so no request sees half a swap between two of its reads), under the policy
source's lock (so no policy version is checked against the old catalog and put in force after the
new one): AppState.catalog, the policy source's check, the router's catalog, CatalogFile's catalog in
force, polyroute_worker_up. A request reads the catalog once, when it starts (AppState.catalog_for):
one in flight keeps the catalog it started with, prices included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.state import AppState, catalog_check
from policies import Catalog, CatalogError, Kind, Worker, admit, load_catalog

log = logging.getLogger("polyroute.gateway")


def _started_once(worker: Worker | None) -> str | None:
    """What kind of worker the gateway starts itself (so cannot change while it runs), or None."""
    if worker is None:
        return None
    if worker.local is not None:
        return "local worker"
    if worker.embedder is not None:
        return "in-process embedding worker"
    return None


def restart_reason(old: Catalog, new: Catalog) -> str | None:
    """Why `new` cannot replace `old` without a restart: a local or in-process embedding worker was
    added, removed or changed. None when only what can be swapped differs."""
    names = dict.fromkeys([*(w.name for w in old.workers), *(w.name for w in new.workers)])
    changes = []
    for name in names:
        before, after = old.get(name, kind=None), new.get(name, kind=None)
        what = _started_once(before) or _started_once(after)
        if what is None:
            continue
        if before is None:
            changes.append(f"{what} {name} added")
        elif after is None:
            changes.append(f"{what} {name} removed")
        elif before.model_dump(mode="json") != after.model_dump(mode="json"):
            changes.append(f"{what} {name} changed")
    return f"restart to apply: {', '.join(changes)}" if changes else None


def _refused_already(state: AppState, digest: str | None) -> bool:
    """Whether this version of the file was refused and would be again: for a local worker's change,
    until the file changes; for a policy misfit, until another policy version is in force."""
    refused = state.catalog_file.refused()
    if refused is None or refused[0] != digest:
        return False
    misfit_of = refused[1]
    engine = state.policy.engine
    return misfit_of is None or (engine is not None and engine.version == misfit_of)


def read_edit(state: AppState) -> Catalog | None:
    """The catalog file's valid version that differs from the catalog in force and was not refused
    already, or None. Blocking (a stat, and a read when the file changed): call it off the event loop."""
    watched = state.catalog_file
    status = watched.status()
    if status["on_disk"] != "changed" or status["on_disk_error"] is not None or watched.path is None:
        return None
    if _refused_already(state, status["on_disk_sha256"]):
        return None
    try:
        catalog = load_catalog(watched.path)
    except CatalogError:  # edited again since the look: the next look reports it
        return None
    if catalog.digest == watched.digest or _refused_already(state, catalog.digest):
        return None
    return catalog


def apply(state: AppState, new: Catalog) -> bool:
    """Put `new` in force, or refuse it (logged once, reported by CatalogFile). On the event loop."""
    old = state.catalog
    digest = new.digest or "?"
    why = restart_reason(old, new)
    misfit_of = None
    if why is None:
        engine = state.policy.engine
        try:  # not blocking the event loop: a policy version being checked now means the next round
            misfit = state.policy.swap_check(
                catalog_check(new), lambda: _swap(state, old, new), blocking=False
            )
        except BlockingIOError:
            return False
        if misfit is not None:
            why = f"the policy in force does not fit it, change the policy first: {misfit}"
            misfit_of = engine.version if engine is not None else None
    if why is not None:
        state.catalog_file.refuse(digest, why, misfit_of)
        log.warning(
            "worker catalog %s (sha256 %s) refused, keeping %s: %s",
            state.catalog_file.path,
            digest,
            _digest(old),
            why,
        )
        return False
    before, after = {w.name for w in old.workers}, {w.name for w in new.workers}
    changed = sorted(w.name for w in new.workers if w.name in before and w != old.get(w.name, kind=None))
    log.info(
        "worker catalog %s (sha256 %s) in force, replacing %s: added %s, removed %s, changed %s",
        state.catalog_file.path,
        digest,
        _digest(old),
        sorted(after - before) or "none",
        sorted(before - after) or "none",
        changed or "none",
    )
    return True


def _digest(catalog: Catalog) -> str:
    return catalog.digest or "a catalog built in code"


def _swap(state: AppState, old: Catalog, new: Catalog) -> None:
    """Everything derived from the catalog, at once (called with the policy source's lock held)."""
    state.catalog = new
    state.router.set_catalog({worker.name: worker for worker in new.workers})
    state.catalog_file.put_in_force(new)
    gone = {w.name for w in old.workers} - {w.name for w in new.workers}
    for name in gone:  # a removed worker's series goes, rather than staying at its last value
        with contextlib.suppress(KeyError):
            state.metrics.worker_up.remove(name)
    down = state.down_workers(new)
    for kind in (Kind.chat, Kind.embedding):  # new workers have a series from now, not the next scrape
        available = admit(new, down=down, kind=kind)
        for worker in available.pool:
            state.metrics.worker_up.labels(worker.name).set(1)
        for exclusion in available.excluded:
            state.metrics.worker_up.labels(exclusion.worker).set(0)


async def reload(state: AppState) -> bool:
    """One check of the catalog file: True when a new catalog was put in force."""
    new = await asyncio.to_thread(read_edit, state)
    return new is not None and apply(state, new)
