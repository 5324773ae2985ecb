"""Hot reload of the worker catalog: a valid edit of the workers file is put in force without a restart.

What can be applied safely is: prices, timeouts, retries, endpoints, key env vars, jurisdictions,
capabilities, remote workers added or removed, in-process embedding workers (`embedder:`) added or
removed or edited but for their embedder. What cannot is refused, and the catalog in force keeps
serving (CatalogFile says why on /readyz and GET /admin/workers, until the file changes again):

* a change to a local worker (`local:`, a llama.cpp process started once, at start): "restart to apply";
* another embedding model under the name of an embedding worker (an in-process one's `embedder`, a
  remote one's `model`; or it became, or stopped being, in-process): "restart to apply", with the reason. Vectors a client
  made with that name before the edit would not compare with those made after it, silently (the
  embeddings endpoint never falls back to another model for that reason); a new model deserves a
  name of its own. An in-process embedder is a shared model keyed by its backend (retrieval/embed.py
  shared_embedder), loaded on first use, at start as after a reload: nothing else is started per
  worker, so the rest of such a worker's entry is only data, applied as a remote worker's is;
* a catalog the policy in force does not fit (policies/catalog_check.py): the policy engine and the
  catalog must stay consistent, so the operator changes the policy first;
* an invalid file (CatalogFile reports it as `on_disk_error`, as before).

The new catalog is read and parsed off the event loop; everything derived from it is then swapped at
once, on the event loop (so no request sees half a swap between two of its reads), under the policy
source's lock (so no policy version is checked against the old catalog and put in force after the
new one): AppState.catalog, the policy source's check, the router's catalog, CatalogFile's catalog in
force, polyroute_worker_up. A request reads the catalog once, when it starts (AppState.catalog_for),
with the router in force: one in flight keeps the catalog it started with, prices included, and routes
on it (the router in force is replaced by a copy over the new catalog, not changed: RouterHolder.set_catalog).
A policy version being checked when a swap comes (the lock taken) puts the swap off to the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.state import AppState, catalog_check
from policies import Catalog, CatalogError, Kind, Worker, load_catalog

log = logging.getLogger("polyroute.gateway")


def _local_change(name: str, before: Worker | None, after: Worker | None) -> str | None:
    """How a local worker (a llama.cpp process the gateway starts once, at start) changed, or None."""
    if (before is None or before.local is None) and (after is None or after.local is None):
        return None
    if before is None:
        return f"local worker {name} added"
    if after is None:
        return f"local worker {name} removed"
    if before.model_dump(mode="json") != after.model_dump(mode="json"):
        return f"local worker {name} changed"
    return None


def _vectors_from(worker: Worker) -> str:
    """What makes an embedding worker's vectors: its in-process backend, else its provider's model."""
    return f"embedder {worker.embedder}" if worker.embedder else f"{worker.model} through litellm"


def _embedder_change(name: str, before: Worker | None, after: Worker | None) -> str | None:
    """Why the embedding model behind the name of an embedding worker changed (its in-process
    `embedder`, or a remote worker's `model`), or None."""
    if before is None or after is None:
        return None
    if before.kind != Kind.embedding or after.kind != Kind.embedding:
        return None  # a name that changes kind makes no vectors any more, or had made none: nothing to mix
    old, new = _vectors_from(before), _vectors_from(after)
    if old == new:
        return None
    return (
        f"the embedding model of worker {name} changed ({old} -> {new}), and vectors made with {name} "
        "before would not compare with those made after; to switch deliberately, restart, or add the "
        "new model as a worker of its own name"
    )


def restart_reason(old: Catalog, new: Catalog) -> str | None:
    """Why `new` cannot replace `old` without a restart: a local worker was added, removed or changed,
    or an in-process embedding worker's name now stands for another embedding model. None when only
    what can be swapped differs."""
    names = dict.fromkeys([*(w.name for w in old.workers), *(w.name for w in new.workers)])
    changes = []
    for name in names:
        before, after = old.get(name, kind=None), new.get(name, kind=None)
        why = _local_change(name, before, after) or _embedder_change(name, before, after)
        if why is not None:
            changes.append(why)
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
            log.debug(
                "worker catalog %s (sha256 %s) waits: a policy version is being checked; next round",
                state.catalog_file.path,
                digest,
            )
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
    state.set_worker_up(new)


async def reload(state: AppState) -> bool:
    """One check of the catalog file: True when a new catalog was put in force."""
    new = await asyncio.to_thread(read_edit, state)
    return new is not None and apply(state, new)
