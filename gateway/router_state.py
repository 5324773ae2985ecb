"""Which router is in force: the learned model named by `<router dir>/current.json`, or the rules.

A new version (after `polyroute router train` or `rollback`) is loaded in the background and
swapped in one assignment; the version it replaces stays on disk for rollback. A corrupt or
mismatched model never takes the gateway down: the last good router stays, or the rule-based
router serves, and /readyz says which and why. A gateway that starts while current.json names a
version it refuses has no last good router of its own: the version current.json names as the
previous one serves (the one the other replicas kept), or the rules if it cannot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

from policies import Worker
from router import CheapestRouter, LearnedRouter, RouterLoadError, load_version, read_pointer
from router.artifacts import AcceptanceFile, acceptance_path, servable

log = logging.getLogger("polyroute.router")


class RouterHolder:
    def __init__(
        self,
        root: Path,
        default_cost_weight: float | None = None,
        exploration: float = 0.0,
        min_examples: int = 50,
        startup_error: str | None = None,
        catalog: Mapping[str, Worker] | None = None,
        plan_code_exec: bool = False,
    ) -> None:
        """``startup_error``: why the router the operator asked for at start (the shipped prior) is
        not in force; shown as ``error`` while the rules serve, until a version is put in force.
        ``catalog``: the catalog's workers by name, for the learned router's ``profile_like`` priors.
        ``default_cost_weight``: POLYROUTE_COST_WEIGHT (None: unset, the model's operating λ applies);
        ``plan_code_exec``: POLYROUTE_PLAN_CODE_EXEC, for the warning a plan trained on code behaviour
        gets at load when it is off (LearnedRouter.warnings)."""
        self.root = Path(root)
        self.catalog = dict(catalog or {})
        self.plan_code_exec = plan_code_exec
        self.rules = CheapestRouter()
        self.current: CheapestRouter | LearnedRouter = self.rules
        self.error: str | None = None
        self._loaded_version: str | None = None
        self._failed_version: str | None = None
        self._settings = (default_cost_weight, exploration, min_examples)
        self._lock = threading.Lock()
        # held only to assign: the catalog and the router in force change together (set_catalog, and a
        # version put in force by reload(), which runs in a thread)
        self._catalog_lock = threading.Lock()
        self._legacy_said: set[str] = set()  # versions whose cascade reads the router dir's file, said once
        self.reload()
        if self.error is None and self.current is self.rules:
            self.error = startup_error

    def pointer_version(self) -> str | None:
        try:
            return read_pointer(self.root).get("version")
        except RouterLoadError as exc:
            return f"unreadable: {exc}"

    def changed(self) -> bool:
        """Whether :meth:`reload` has something to do: the pointer names a version neither loaded nor
        already refused, or it is back on the version in force while a refusal is still reported (a
        rollback after a damaged version). A pointer that stays damaged is not retried each tick."""
        version = self.pointer_version()
        if version == self._loaded_version:
            return version is not None and self._failed_version is not None
        return version != self._failed_version

    def reload(self) -> bool:
        """Load the version current.json names, if it changed. True when a new router is in force."""
        with self._lock:
            try:
                pointer = read_pointer(self.root)
                version = pointer.get("version")
            except RouterLoadError as exc:
                return self._fail(str(exc), f"unreadable: {exc}")  # the form pointer_version() reports
            if version is not None and version == self._loaded_version:
                self.error, self._failed_version = None, None  # back on the router in force
                return False
            if version == self._loaded_version or (version is not None and version == self._failed_version):
                return False
            if version is None:
                self.current, self._loaded_version, self.error = self.rules, None, None
                return False
            try:
                router = self._build(version)
            except Exception as exc:  # RouterLoadError, or a model that cannot predict with these features
                error = f"router model {version}: {exc}"
                previous = pointer.get("previous")
                if self._loaded_version is None and previous and previous != version:
                    return self._previous(error, version, previous)
                return self._fail(error, version)
            self._put_in_force(router, version)
            return True

    def _build(self, version: str) -> LearnedRouter:
        """The learned router of ``version``, run once as a request runs it: it fails here, not on
        a client's request (router.artifacts.servable)."""
        weight, exploration, min_examples = self._settings
        return servable(
            load_version(self.root, version),
            default_cost_weight=weight,
            exploration=exploration,
            min_examples=min_examples,
            catalog=self.catalog,
        )

    def set_catalog(self, catalog: Mapping[str, Worker]) -> None:
        """A new worker catalog is in force (gateway/catalog_reload.py): the router in force, and every
        version loaded from now on, read its workers' ``profile_like`` priors from it.

        The router in force is replaced by a copy over the new catalog (LearnedRouter.with_catalog),
        never changed in place: a request holds the router it started with (read with its catalog,
        AppState.catalog_for, in the same step on the event loop, where this swap runs too) and routes
        with it from a worker thread, so an assignment here would reach a routing call part-way, its
        workers' priors read from two catalogs, or a request routed on a catalog it was not admitted on."""
        catalog = dict(catalog)
        with self._catalog_lock:
            self.catalog = catalog
            if isinstance(self.current, LearnedRouter):
                self.current = self.current.with_catalog(catalog)

    def _put_in_force(self, router: LearnedRouter, version: str) -> None:
        with self._catalog_lock:  # built with the catalog then in force; a reload since may have swapped it
            self.current = router = router.with_catalog(self.catalog)
        self._loaded_version, self.error, self._failed_version = version, None, None
        log.info("learned router %s in force (%d workers)", version, len(router.artifact.workers))
        for warning in router.warnings(self.plan_code_exec):  # once per version put in force
            log.warning("learned router %s: %s", version, warning)

    def _previous(self, error: str, version: str, previous: str) -> bool:
        """No learned router in force yet (a start, a new replica) and the version current.json names is
        refused: the version it names as the previous one serves, if it can. A running gateway keeps
        the router it served when a new version is refused; a gateway that starts then has served
        nothing, and without this would serve the rule-based router while every replica started
        before keeps the previous version — replicas that disagree until the pointer is fixed."""
        try:
            router = self._build(previous)
        except Exception as exc:
            log.error("router model %s (current.json's previous version): %s", previous, exc)
            return self._fail(error, version)
        self._put_in_force(router, previous)
        self.error = f"{error}; serving {previous}, the version current.json names as the previous one"
        self._failed_version = version
        log.error(self.error)
        return True

    def _fail(self, error: str, version: str | None) -> bool:
        keeping = self.current.version
        log.error("%s; keeping the %s router", error, "rule-based" if keeping == "rules" else keeping)
        self.error = error
        self._failed_version = version
        return False

    def acceptance(self, version: str | None = None) -> AcceptanceFile | None:
        """The cascade's acceptance model for ``version`` (default: the router in force; "rules": the
        rule-based router): the version's own file, so a rollback or a new version switches it with
        the quality model. A version without one reads the router dir's `acceptance.joblib`, where
        it was kept before versions carried it — for one release, said once per version in the log."""
        version = self.current.version if version is None else version
        found = acceptance_path(self.root, version)
        if found is not None and found.legacy and version not in self._legacy_said:
            self._legacy_said.add(version)
            log.warning(
                "router version %s has no acceptance model of its own: the cascade reads %s, where it was "
                "kept before versions carried it (read for one more release; store it in the version with "
                "`polyroute router eval --strategy cascade --save-acceptance`)",
                version,
                found.path,
            )
        return found

    def status(self) -> dict:
        router = self.current
        return {
            "active": router.name,
            "version": router.version,
            "fallback": router is self.rules,
            "error": self.error,
            "root": str(self.root),
        }
