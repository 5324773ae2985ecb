"""The policy in force: loaded from a file, hot-reloaded when the file changes, replaced by admins.

A new version is parsed, validated, checked against the worker catalog (`check`) and compiled
before it is swapped in with one reference assignment, so a request sees either the old engine or
the new one, never a mix. An invalid version is refused, its error kept for /admin/policies/status,
and the last good one stays. Every change and every refusal — an edit on disk or an admin PUT — is
logged and appended to the audit log: both doors to the policy apply the same checks, with the same
trace.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from policies.engine import PolicyEngine
from policies.schema import Policy, PolicyError, parse_policy

log = logging.getLogger("polyroute.policies")

DEFAULT_POLICY_PATH = Path(__file__).parent / "defaults" / "policy.yaml"
# The fingerprint of a file that is not there: distinct from every real (mtime, size, inode) and from
# None ("never looked"), so the watcher notices a file deleted after a clean load.
MISSING: tuple[int, int, int] = (0, 0, 0)

# The compiled policy, and where it came from (a file path or "request body"): raises PolicyError
# when the policy does not fit what it will run against (the worker catalog: policies/catalog_check.py).
Check = Callable[[Policy, str], None]


class PolicyNotWritable(Exception):
    """PUT could not write the policy file, and nothing was changed. `read_only`: the file may not be
    written here at all — a read-only mount, as the Helm chart mounts its ConfigMap — so the policy is
    managed where the file comes from; otherwise the write failed (a full disk) and may be retried."""

    def __init__(self, message: str, read_only: bool) -> None:
        super().__init__(message)
        self.read_only = read_only


READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


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

    def __init__(self, path: Path, audit: AuditLog | None = None, check: Check | None = None) -> None:
        self.path = Path(path)
        self.audit = audit
        self.check = check
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

    def _fingerprint(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return MISSING
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        """Whether the file differs from what was last looked at: the version in force, or the
        version (or absence) last refused. A file moved back as it was loaded is a change too, so
        the error it left is cleared."""
        fingerprint = self._fingerprint()
        if self._failed_fingerprint is not None:
            return fingerprint != self._failed_fingerprint
        return fingerprint != (self._loaded.fingerprint if self._loaded else None)

    def reload(self, who: str = "file") -> bool:
        """Load the file if it changed. True when a new version is now in force."""
        with self._lock:
            self.last_checked = _now()
            fingerprint = self._fingerprint()
            if fingerprint == MISSING:
                self.last_error = f"{self.path}: file is missing; keeping the last good policy"
                if self._failed_fingerprint != MISSING:
                    log.error(self.last_error)
                self._failed_fingerprint = MISSING
                return False
            if self._loaded and fingerprint == self._loaded.fingerprint:
                if self.last_error is not None:  # moved back, or an edit undone: what is in force
                    log.info("policy file %s is back as loaded (%s)", self.path, self._loaded.engine.version)
                self.last_error, self._failed_fingerprint = None, None
                return False
            try:
                text = self.path.read_text(encoding="utf-8")
                engine = self._compile(text, str(self.path))
            except (OSError, PolicyError, ValueError) as exc:
                return self._refuse(str(exc), who, fingerprint, text=None)
            return self._swap(engine, text, fingerprint, who, "reload")

    def _compile(self, text: str, source: str) -> PolicyEngine:
        engine = compile_policy(text, source)
        if self.check is not None:
            self.check(engine.policy, source)
        return engine

    def replace(self, text: str, who: str) -> PolicyEngine:
        """Validate, check, write the file atomically, swap. Raises PolicyError (invalid, or it does not
        fit the catalog) or PolicyNotWritable (the file cannot be written) and changes nothing; either
        refusal is logged and audited as a refused file edit is."""
        with self._lock:  # checked under the lock: a catalog swap (swap_check) cannot land in between
            try:
                engine = self._compile(text, "request body")
            except PolicyError as exc:
                self._refuse(str(exc), who, None, text=text)
                raise
            tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
            try:
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                read_only = exc.errno in READ_ONLY_ERRNOS
                if read_only:
                    error = (
                        f"the policy file {self.path} is read-only here ({exc.strerror}), so PUT cannot "
                        "change it; nothing was changed. Edit the policy where the file comes from: with "
                        "the Helm chart, `helm upgrade --reuse-values --set-file policy=<file>` (the pods "
                        "reload it without a restart)"
                    )
                else:
                    why = exc.strerror or exc
                    error = f"the policy file {self.path} could not be written ({why}); nothing was changed"
                self._refuse(error, who, None, text=text)
                raise PolicyNotWritable(error, read_only) from exc
            self._swap(engine, text, self._fingerprint(), who, "put")
        return engine

    def _refuse(self, error: str, who: str, fingerprint, text: str | None) -> bool:
        """Log and audit a refused version. A file's refusal (``text`` None: read from the file) is
        logged once per version and kept in last_error; a PUT's (``text``: the body) every time, and
        the file's status is left as it was (the file did not change)."""
        from_file = text is None
        if not from_file or fingerprint != self._failed_fingerprint:
            keeping = self.engine.version if self.engine else "none"
            log.error(
                "policy refused (%s by %s), keeping %s: %s",
                "reload" if from_file else "put",
                who,
                keeping,
                error,
            )
            if self.audit:
                before = self.text or ""
                with contextlib.suppress(OSError):
                    after = self.path.read_text(encoding="utf-8") if from_file else text
                    self.audit.append(
                        who, "rejected", before, after, self.engine and self.engine.version, None, error
                    )
        if from_file:
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

    def swap_check(self, check: Check, apply: Callable[[], None], blocking: bool = True) -> str | None:
        """Replace the check every future version passes (the worker catalog it must fit), together
        with whatever `apply` swaps (the catalog itself), under the lock every reload and PUT holds
        while it checks: the policy in force is checked first, and nothing changes unless it fits.
        None when applied; else why the policy in force does not fit the new check. ``blocking``
        False (a caller on the event loop): raises BlockingIOError, changing nothing, while a policy
        version is being checked or written, rather than wait for it."""
        if not self._lock.acquire(blocking=blocking):
            raise BlockingIOError("a policy version is being checked; try again")
        try:
            engine = self.engine
            if engine is not None:
                try:
                    check(engine.policy, f"the policy in force ({engine.version})")
                except PolicyError as exc:
                    return str(exc)
            apply()
            self.check = check
            return None
        finally:
            self._lock.release()

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
