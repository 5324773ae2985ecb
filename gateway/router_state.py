"""Which router is in force: the learned model named by `<router dir>/current.json`, or the rules.

A new version (after `polyroute router train` or `rollback`) is loaded in the background and
swapped in one assignment; the version it replaces stays on disk for rollback. A corrupt or
mismatched model never takes the gateway down: the last good router stays, or the rule-based
router serves, and /readyz says which and why.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from router import (
    CheapestRouter,
    LearnedRouter,
    RouterLoadError,
    feature_builder_for,
    load_version,
    read_pointer,
)

log = logging.getLogger("polyroute.router")


class RouterHolder:
    def __init__(
        self,
        root: Path,
        default_cost_weight: float = 0.5,
        exploration: float = 0.0,
        min_examples: int = 50,
    ) -> None:
        self.root = Path(root)
        self.rules = CheapestRouter()
        self.current: CheapestRouter | LearnedRouter = self.rules
        self.error: str | None = None
        self._loaded_version: str | None = None
        self._failed_version: str | None = None
        self._settings = (default_cost_weight, exploration, min_examples)
        self._lock = threading.Lock()
        self.reload()

    def pointer_version(self) -> str | None:
        try:
            return read_pointer(self.root).get("version")
        except RouterLoadError as exc:
            return f"unreadable: {exc}"

    def changed(self) -> bool:
        version = self.pointer_version()
        return version != self._loaded_version and version != self._failed_version

    def reload(self) -> bool:
        """Load the version current.json names, if it changed. True when a new router is in force."""
        with self._lock:
            try:
                version = read_pointer(self.root).get("version")
            except RouterLoadError as exc:
                return self._fail(str(exc), None)
            if version == self._loaded_version or (version is not None and version == self._failed_version):
                return False
            if version is None:
                self.current, self._loaded_version, self.error = self.rules, None, None
                return False
            try:
                artifact = load_version(self.root, version)
                features = feature_builder_for(artifact.features)
                weight, exploration, min_examples = self._settings
                router = LearnedRouter(artifact, features, weight, exploration, min_examples)
                router.predict_quality("warm-up query", 1)  # fail here, not on a client's request
                if router.planner is not None:
                    from router.compose.planned import check_planner

                    check_planner(router.planner)
            except Exception as exc:  # RouterLoadError, or a model that cannot predict with these features
                return self._fail(f"router model {version}: {exc}", version)
            self.current, self._loaded_version, self.error, self._failed_version = router, version, None, None
            log.info("learned router %s in force (%d workers)", version, len(artifact.workers))
            return True

    def _fail(self, error: str, version: str | None) -> bool:
        keeping = self.current.version
        log.error("%s; keeping the %s router", error, "rule-based" if keeping == "rules" else keeping)
        self.error = error
        self._failed_version = version
        return False

    def status(self) -> dict:
        router = self.current
        return {
            "active": router.name,
            "version": router.version,
            "fallback": router is self.rules,
            "error": self.error,
            "root": str(self.root),
        }
