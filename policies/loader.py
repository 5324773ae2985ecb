"""The policy in force: loaded from a file, hot-reloaded when the file changes, replaced by admins.

A new version is parsed, validated and compiled before it is swapped in with one reference
assignment, so a request sees either the old engine or the new one, never a mix. An invalid
version is refused, its error kept for /admin/policies/status, and the last good one stays.
Every change — an edit on disk or an admin PUT — is appended to the audit log.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from policies.engine import PolicyEngine
from policies.schema import PolicyError, parse_policy

log = logging.getLogger("polyroute.policies")

DEFAULT_POLICY_PATH = Path(__file__).parent / "defaults" / "policy.yaml"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def compile_policy(text: str, source: str) -> PolicyEngine:
    policy, version = parse_policy(text, source)
    return PolicyEngine(policy, version)


class AuditLog:
    """Append-only JSON lines: who, when, which versions, and the unified diff."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def append(
        self,
        who: str,
        action: str,
        before: str,
        after: str,
        old_version: str | None,
        new_version: str | None,
        error: str | None = None,
    ) -> dict:
        diff = "".join(
            difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True), "before", "after"
            )
        )
        entry = {
            "at": _now(),
            "who": who,
            "action": action,
            "old_version": old_version,
            "new_version": new_version,
            "error": error,
            "diff": diff,
        }
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
        return entry

    def entries(self, limit: int = 100) -> list[dict]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines[-limit:]]


@dataclass(frozen=True)
class _Loaded:
    engine: PolicyEngine
    text: str
    fingerprint: tuple[int, int, int] | None
    loaded_at: str


class PolicySource:
    """Owns the current engine for one policy file."""

    def __init__(self, path: Path, audit: AuditLog | None = None) -> None:
        self.path = Path(path)
        self.audit = audit
        self._loaded: _Loaded | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self.last_checked: str | None = None
        self._failed_fingerprint: tuple[int, int, int] | None = None
        self.reload(who="startup")

    @property
    def engine(self) -> PolicyEngine | None:
        """The engine in force, or None when no valid policy was ever loaded (fail closed)."""
        loaded = self._loaded
        return loaded.engine if loaded else None

    @property
    def text(self) -> str | None:
        loaded = self._loaded
        return loaded.text if loaded else None

    def _fingerprint(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        fingerprint = self._fingerprint()
        current = self._loaded.fingerprint if self._loaded else None
        return fingerprint != current and fingerprint != self._failed_fingerprint

    def reload(self, who: str = "file") -> bool:
        """Load the file if it changed. True when a new version is now in force."""
        with self._lock:
            self.last_checked = _now()
            fingerprint = self._fingerprint()
            if fingerprint is None:
                self.last_error = f"{self.path}: file is missing; keeping the last good policy"
                if self._failed_fingerprint != (0, 0, 0):
                    log.error(self.last_error)
                self._failed_fingerprint = (0, 0, 0)
                return False
            if self._loaded and fingerprint == self._loaded.fingerprint:
                return False
            try:
                text = self.path.read_text(encoding="utf-8")
                engine = compile_policy(text, str(self.path))
            except (OSError, PolicyError, ValueError) as exc:
                return self._refuse(str(exc), who, fingerprint)
            return self._swap(engine, text, fingerprint, who, "reload")

    def replace(
        self, text: str, who: str, check: Callable[[PolicyEngine], None] | None = None
    ) -> PolicyEngine:
        """Validate, write the file atomically, swap. Raises PolicyError and changes nothing if invalid;
        ``check`` adds the caller's validation of the compiled policy (it raises PolicyError too)."""
        engine = compile_policy(text, "request body")
        if check is not None:
            check(engine)
        with self._lock:
            tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path)
            self._swap(engine, text, self._fingerprint(), who, "put")
        return engine

    def _refuse(self, error: str, who: str, fingerprint) -> bool:
        if fingerprint != self._failed_fingerprint:
            log.error("policy refused, keeping %s: %s", self.engine.version if self.engine else "none", error)
            if self.audit:
                before = self.text or ""
                with contextlib.suppress(OSError):
                    after = self.path.read_text(encoding="utf-8")
                    self.audit.append(
                        who, "rejected", before, after, self.engine and self.engine.version, None, error
                    )
        self.last_error = error
        self._failed_fingerprint = fingerprint
        return False

    def _swap(self, engine: PolicyEngine, text: str, fingerprint, who: str, action: str) -> bool:
        old = self._loaded
        self._loaded = _Loaded(engine, text, fingerprint, _now())
        self.last_error = None
        self._failed_fingerprint = None
        log.info("policy %s in force (%s by %s)", engine.version, action, who)
        if self.audit and old is not None and old.text != text:  # startup is not a change
            self.audit.append(
                who, action, old.text if old else "", text, old and old.engine.version, engine.version
            )
        return True

    def status(self) -> dict:
        loaded = self._loaded
        return {
            "path": str(self.path),
            "version": loaded.engine.version if loaded else None,
            "loaded_at": loaded.loaded_at if loaded else None,
            "last_checked": self.last_checked,
            "last_error": self.last_error,
            "in_force": loaded is not None,
        }
