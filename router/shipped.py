"""The router model shipped inside the package (router/prior/), put in force on a gateway's first start.

It is an ordinary version (model.joblib + card.json, built by `python -m router.offline.prior`), so a
first start only copies it into the router dir and points current.json at it: `router status`,
`rollback`, `router calibrate` and the hot swap treat it like any trained version. A router dir that
already has a version in force (or had one: a rollback to "none" is not undone) is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from router.artifacts import CURRENT, activate_version

log = logging.getLogger("polyroute.router")

SHIPPED_DIR = Path(__file__).resolve().parent / "prior"


def shipped_version() -> str | None:
    """The shipped prior's version name, or None when this install has none (a trimmed build)."""
    try:
        return json.loads((SHIPPED_DIR / "card.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install_shipped_prior(root: Path) -> str | None:
    """Copy the shipped prior into ``root`` and put it in force if no router was ever put in force there.

    Returns the version installed, or None when nothing was done. Copying goes to a temporary
    directory renamed into place, so a crash mid-copy leaves no half version behind."""
    root = Path(root)
    version = shipped_version()
    if version is None or (root / CURRENT).exists():
        return None
    root.mkdir(parents=True, exist_ok=True)
    target = root / version
    if not (target / "model.joblib").is_file():
        staging = root / f".{version}.installing.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(SHIPPED_DIR, staging)
        try:
            staging.rename(target)
        except OSError:  # another replica sharing the dir installed it first
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / "model.joblib").is_file():
                raise
    activate_version(root, version)
    log.info("first start: the shipped router prior %s is in force (router dir %s)", version, root)
    return version
