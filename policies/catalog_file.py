"""Has the worker catalog file changed on disk since the gateway put its catalog in force?

A valid edit is hot-reloaded (gateway/catalog_reload.py), unless it cannot be applied safely: a
change to a local (llama.cpp) or in-process embedding worker, which are started once, or a catalog
the policy in force does not fit. Such an edit is refused (`refused`: why) and, like an invalid file,
is not in force until a restart. An edit that silently does nothing is a trap — an operator who
moves a worker out of the EU on disk would believe requests follow — so the gateway says so:
/readyz and GET /admin/workers carry this status, and the log says it once per version of the file.
Whether a restart would succeed is said too: the changed file is validated.

The file is looked at no more than every `interval_s` (a stat; the text is read and hashed only
when the stat changed), so a probe every second costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from policies.catalog import Catalog, CatalogError, parse_catalog, text_digest

log = logging.getLogger("polyroute.policies")

CHECK_INTERVAL_S = 5.0


class CatalogFile:
    """The file a catalog in force was read from (Catalog.source), compared with the file on disk."""

    def __init__(self, catalog: Catalog, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._in_force(catalog)

    def put_in_force(self, catalog: Catalog) -> None:
        """A catalog read from this file is now in force (a hot reload): it is what the file is
        compared with from now on."""
        with self._lock:
            self._in_force(catalog)

    def _in_force(self, catalog: Catalog) -> None:
        self.path: Path | None = catalog.source[0] if catalog.source else None
        self.digest: str | None = catalog.digest
        self._checked_at: float | None = None
        self._stat: tuple[int, int, int] | None = None
        self._status: dict = self._same()
        self._logged: str | None = self.digest  # the on-disk version the log last spoke of
        # (sha256 on disk, why, the policy version it did not fit or None) of an edit not applied
        self._refused: tuple[str, str, str | None] | None = None

    def refuse(self, digest: str, why: str, policy_version: str | None = None) -> None:
        """The valid version `digest` of the file was not applied (gateway/catalog_reload.py): the
        status says so, with why, until the file changes again. `policy_version`: the policy the
        catalog did not fit, when that is why (it is tried again under another policy version)."""
        with self._lock:
            self._refused = (digest, why, policy_version)
            self._stat, self._checked_at = None, None  # the next status() looks again and reports it

    def refused(self) -> tuple[str, str | None] | None:
        """(sha256, the policy version it did not fit or None) of the edit last refused, or None."""
        refused = self._refused
        return (refused[0], refused[2]) if refused else None

    def status(self) -> dict:
        """{path, sha256 (in force), on_disk: unchanged|changed|missing|unreadable|not_watched,
        on_disk_sha256, on_disk_error, refused (why a valid edit was not applied), warning};
        `warning` is None unless the file differs."""
        if self.path is None:  # built in code (tests, embedding the gateway): no file to compare
            return {**self._same(), "on_disk": "not_watched"}
        with self._lock:
            now = time.monotonic()
            if self._checked_at is None or now - self._checked_at >= self.interval_s:
                self._checked_at = now
                self._look()
            return dict(self._status)

    def _look(self) -> None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stat = None
            self._report("missing", None, f"{self.path} is missing")
            return
        except OSError as exc:
            self._stat = None
            self._report("unreadable", None, f"{self.path} cannot be read: {exc.strerror or exc}")
            return
        stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stat == self._stat:
            return  # the same file as last time: the same status
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            self._stat = None
            self._report("unreadable", None, f"{self.path} cannot be read: {exc}")
            return
        self._stat = stat
        digest = text_digest(text)
        if digest == self.digest:
            self._report("unchanged", digest, None)
            return
        try:
            parse_catalog(text, str(self.path))
            error = None
        except CatalogError as exc:
            error = str(exc)
        self._report("changed", digest, error)

    def _report(self, on_disk: str, digest: str | None, error: str | None) -> None:
        if on_disk == "unchanged":
            if self._logged != self.digest:
                log.info("the worker catalog %s matches the catalog in force again", self.path)
            self._status, self._logged = self._same(), self.digest
            return
        refused = None
        if on_disk == "changed":
            if error is not None:
                warning = (
                    f"the worker catalog {self.path} changed on disk and is invalid, so it is not applied "
                    f"and a restart would fail: {error}; the gateway serves the catalog in force"
                )
            elif self._refused is not None and self._refused[0] == digest:
                refused = self._refused[1]
                warning = (
                    f"the worker catalog {self.path} changed on disk and was not applied: {refused}; "
                    "the gateway serves the catalog in force"
                )
            else:  # not looked at by the reload yet
                warning = (
                    f"the worker catalog {self.path} changed on disk; not applied yet, the gateway serves "
                    "the catalog in force"
                )
        else:
            warning = f"the worker catalog {error}; the gateway serves the catalog in force"
        self._status = {
            **self._same(),
            "on_disk": on_disk,
            "on_disk_sha256": digest,
            "on_disk_error": error if on_disk == "changed" else None,
            "refused": refused,
            "warning": warning,
        }
        version = digest or on_disk
        # once per version of the file (or per absence); a valid edit is logged by the reload that
        # applies or refuses it (gateway/catalog_reload.py), as one line
        if version != self._logged and (on_disk != "changed" or error is not None):
            self._logged = version
            log.warning(warning)

    def _same(self) -> dict:
        return {
            "path": str(self.path) if self.path else None,
            "sha256": self.digest,
            "on_disk": "unchanged",
            "on_disk_sha256": self.digest,
            "on_disk_error": None,
            "refused": None,
            "warning": None,
        }
