"""The router model shipped inside the package (router/prior/), put in force on a gateway's first start.

It is an ordinary version (model.joblib + card.json, built by `python -m router.offline.prior`), so a
first start only copies it into the router dir and points current.json at it: `router status`,
`rollback`, `router calibrate` and the hot swap treat it like any trained version. A router dir that
already has a version in force (or had one: a rollback to "none" is not undone) is never touched.

An install without the prior (no card.json: a trimmed build) is a quiet no-op. A *damaged* one (card
unreadable, model file missing) raises :class:`ShippedPriorError`, so the gateway can say why it serves
the rule-based router instead of silently doing so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from router.artifacts import CURRENT, RouterLoadError, activate_version, is_version_name

log = logging.getLogger("polyroute.router")

SHIPPED_DIR = Path(__file__).resolve().parent / "prior"
MODEL_FILE = "model.joblib"
CARD_FILE = "card.json"


class ShippedPriorError(RuntimeError):
    """The package ships a router prior that cannot be used (a damaged or half-copied install)."""


def shipped_version(source: Path = SHIPPED_DIR) -> str | None:
    """The shipped prior's version name; None when this install ships none (no card.json).

    Raises :class:`ShippedPriorError` when the card is unreadable or the model file is missing."""
    source = Path(source)
    card = source / CARD_FILE
    if not card.exists():
        return None
    try:
        version = json.loads(card.read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShippedPriorError(
            f"the shipped router prior's card {card} is unreadable ({type(exc).__name__}: {exc}); "
            "reinstall polyroute"
        ) from None
    if not isinstance(version, str) or not is_version_name(version):
        raise ShippedPriorError(
            f"the shipped router prior's card {card} names no valid version ({version!r})"
        )
    if not (source / MODEL_FILE).is_file():
        raise ShippedPriorError(
            f"the shipped router prior has a card but no {MODEL_FILE} in {source}; reinstall polyroute"
        )
    return version


def install_shipped_prior(root: Path, source: Path = SHIPPED_DIR) -> str | None:
    """Copy the shipped prior into ``root`` and put it in force if no router was ever put in force there.

    Returns the version installed, or None when nothing was done. Copying goes to a temporary
    directory renamed into place, so a crash mid-copy leaves no half version behind; a version
    directory left without its model by something else is set aside (renamed, not deleted) and
    installed afresh. Raises :class:`ShippedPriorError` for a damaged install, OSError when the
    router dir cannot be written."""
    root = Path(root)
    if (root / CURRENT).exists():
        return None
    version = shipped_version(source)
    if version is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    target = root / version
    if target.exists() and not (target / MODEL_FILE).is_file():
        aside = root / f".{version}.incomplete.{os.getpid()}"
        target.rename(aside)
        log.warning("set aside %s, a router version directory without its model, as %s", target, aside)
    installed_now = not target.exists()
    if installed_now:
        # a staging directory of this call's own: replicas sharing the router dir start together on a
        # first install, each as PID 1 of its container, and must not copy into (or delete) another's
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{version}.installing."))
        try:
            shutil.copytree(source, staging, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            staging.chmod(0o755)  # mkdtemp's 0700 would keep the version from other users of the dir
            staging.rename(target)
        except OSError:  # another replica sharing the dir installed it first, or the copy failed
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / MODEL_FILE).is_file():
                raise
    try:
        activate_version(root, version)  # loads the model: a damaged one is refused here
    except RouterLoadError:
        if installed_now:  # leave nothing half-installed behind
            shutil.rmtree(target, ignore_errors=True)
        raise
    log.info("first start: the shipped router prior %s is in force (router dir %s)", version, root)
    return version


def try_install_shipped_prior(root: Path, source: Path = SHIPPED_DIR) -> str | None:
    """:func:`install_shipped_prior` for callers that must go on without it (the gateway's start,
    `router calibrate`): returns the reason it could not be installed, logged, or None when it was
    installed or had nothing to do."""
    try:
        install_shipped_prior(root, source)
    except (ShippedPriorError, RouterLoadError, OSError) as exc:
        reason = f"the shipped router prior was not put in force: {exc}"
        log.error("%s; the rule-based router serves", reason)
        return reason
    return None
