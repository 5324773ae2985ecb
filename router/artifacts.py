"""Router model files: versioned artifacts with a model card, and a pointer to the one in force.

Layout under the router dir (default `<data dir>/router/`):
    <version>/model.joblib       the fitted quality model + what is needed to use it
    <version>/card.json          data, metrics, features, workers, date — readable without loading
    <version>/acceptance.joblib  the cascade's acceptance model (router/compose/acceptance.py), if any
    current.json                 {"version": ..., "previous": ...}; the gateway watches this file
    acceptance.joblib            the acceptance model while no version is in force (and, for one
                                 release, for a version without one: where it lived before versions
                                 carried it)
Switching versions is a rewrite of current.json (atomic rename), so a gateway never reads a
half-written model, and the acceptance model switches with the version it belongs to; the previous
version stays on disk for `polyroute router rollback`, which rolls both back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import joblib

if TYPE_CHECKING:
    from router.learned import LearnedRouter

FORMAT = 1
CURRENT = "current.json"
ACCEPTANCE = "acceptance.joblib"


class RouterLoadError(RuntimeError):
    """A model file is missing, corrupt or does not match this gateway; the message says which."""


@dataclass
class RouterArtifact:
    workers: list[str]  # column order of the quality model's predictions (catalog worker names)
    features: dict[str, Any]  # FeatureBuilder.describe(): how queries become features
    model: Any  # fitted quality model: predict(X) -> [n, len(workers)]
    output_tokens: dict[str, float]  # expected completion tokens per worker (median of history)
    observed: dict[str, int]  # labelled examples per worker (for exploration and cold start)
    tier_prior: dict[str, float] = field(default_factory=dict)  # mean quality per tier, for unknown workers
    card: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    format: int = FORMAT
    # the answer-aware planner (router/planner.py CascadePlanner), from `--strategy cascade`; None: none
    # trained. Older pickles lack the attribute: the class default (None) answers for them.
    cascade: Any = None
    # per query, the completion tokens each worker is expected to write (router/costs.py CostModel fitted
    # on the lengths of the recorded answers, columns as ``workers``), for the workers ``output_tokens``
    # has; None (older pickles, data without answers): the medians in ``output_tokens``
    output_model: Any = None


def new_version(payload: bytes) -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + hashlib.sha256(payload).hexdigest()[:6]


def is_version_name(version: str) -> bool:
    """A version is a directory name under the router dir, never a path: a name typed on a command
    line must not reach outside it (``..``, ``a/b``) or be the router dir itself (``""``)."""
    return bool(version) and version not in (".", "..") and "/" not in version and "\\" not in version


def _replace_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` whole or not at all: ``write`` fills a temporary file of its own, renamed over
    it, so a gateway reads the old content or the new, never half of it. The temporary name is
    unique, not the process id: replicas sharing a router dir (a ReadWriteMany volume) each run as
    PID 1 in their container, and two writers of one name would write into the same file, one
    renaming the other's (or a mix of both) into place."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # as a file written plainly would be: every replica's user reads it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: dict) -> None:
    _replace_whole(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str) + "\n"))


def _version_dir(root: Path, version: str) -> Path:
    """The directory of trained version ``version``; RouterLoadError when ``root`` holds no such model."""
    if not is_version_name(version) or not (root / version / "model.joblib").is_file():
        raise RouterLoadError(f"no router model version {version!r} under {root}")
    return root / version


def read_pointer(root: Path) -> dict:
    try:
        pointer = json.loads((Path(root) / CURRENT).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RouterLoadError(f"{Path(root) / CURRENT}: unreadable ({exc})") from exc
    if not isinstance(pointer, dict):  # `[1]`, `"v1"`: every caller reads it with .get
        raise RouterLoadError(f"{Path(root) / CURRENT}: not a JSON object")
    return pointer


def save_artifact(
    root: Path, artifact: RouterArtifact, activate: bool = True, acceptance: Any = None
) -> Path:
    """Write model and card into a new version directory; optionally make it current.

    Both files are written into a hidden staging directory renamed into place, so a failed write (a
    full disk, a crash) leaves no half version that `router activate` could point at: the error is
    raised as an OSError naming the router dir, and the version in force is untouched.

    The cascade's acceptance model goes into the version too: ``acceptance`` when given, else the
    version in force's (or the router dir's own, see `acceptance_path`), copied: a new quality model
    does not drop the verifier trained apart from it (`router eval --save-acceptance`), and a
    rollback past this version finds the one it replaced where it was."""
    root = Path(root)
    if not artifact.version:
        artifact.version = new_version(json.dumps(artifact.card, sort_keys=True, default=str).encode())
    directory = root / artifact.version
    if directory.exists():
        raise FileExistsError(f"router version {artifact.version} already exists under {root}")
    card = {
        **artifact.card,
        "version": artifact.version,
        "workers": artifact.workers,
        "features": artifact.features,
        "observed": artifact.observed,
        "format": artifact.format,
    }
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{artifact.version}.saving.{os.getpid()}"
    try:
        staging.mkdir()
        joblib.dump(artifact, staging / "model.joblib", compress=3)
        _write_json(staging / "card.json", card)
        if acceptance is not None:
            joblib.dump(acceptance, staging / ACCEPTANCE)
        elif (carried := _acceptance_in_force(root)) is not None:
            shutil.copy2(carried, staging / ACCEPTANCE)
        staging.rename(directory)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise OSError(f"cannot write router version {artifact.version} under {root}: {exc}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if activate:
        activate_version(root, artifact.version, check=False)  # just written by this process
    return directory


WARM_UP_QUERY = "warm-up query"


def servable(artifact: RouterArtifact, **options: Any) -> LearnedRouter:
    """The learned router a gateway serves from ``artifact``, run once on a made-up query as a request
    runs it: its features rebuilt, P(success) predicted, the per-query output-length model run and
    each of ``options["catalog"]``'s workers estimated (predicted quality and cost), and a planner
    asked for a decision before and after an answer. Raises RouterLoadError saying why a version
    cannot serve: a gateway refuses it at load (and keeps the router in force), and `router activate`
    refuses to put it in force (a pointer every gateway refuses would be reported in force while none
    serves it, and a gateway started then would serve without it). ``options``: LearnedRouter's."""
    from router.compose.planned import check_planner
    from router.learned import LearnedRouter
    from router.rules import RouteRequest
    from router.training import feature_builder_for

    try:
        router = LearnedRouter(artifact, feature_builder_for(artifact.features), **options)
        router.predict_quality(WARM_UP_QUERY, 1)
        # the output-length model runs for any pool, an empty one too (`router activate` has no catalog)
        request = RouteRequest(len(WARM_UP_QUERY), None, text=WARM_UP_QUERY)
        router.estimates(request, list(router.catalog.values()))
        if router.planner is not None:
            check_planner(router.planner)
    except RouterLoadError:
        raise
    except Exception as exc:  # a model that cannot predict with these features, a planner of other code
        raise RouterLoadError(f"cannot serve: {type(exc).__name__}: {exc}") from None
    return router


def activate_version(root: Path, version: str, check: bool = True) -> None:
    """Point current.json at ``version``. With ``check`` the version is loaded and run as a gateway
    runs it (:func:`servable`) first, so a damaged or incompatible one is refused here
    (RouterLoadError) rather than reported in force while every gateway refuses it. Re-activating the
    version in force keeps the rollback target; a damaged current.json is replaced (its rollback
    target is lost with it)."""
    root = Path(root)
    _version_dir(root, version)
    if check:
        artifact = load_version(root, version)
        try:
            servable(artifact)
        except RouterLoadError as exc:
            raise RouterLoadError(f"router model {version}: {exc}") from None
    try:
        pointer = read_pointer(root)
    except RouterLoadError:  # a damaged pointer is what activating a version repairs
        pointer = {}
    current = pointer.get("version")
    previous = pointer.get("previous") if current == version else current
    _write_json(root / CURRENT, {"version": version, "previous": previous if previous != version else None})


def rollback(root: Path) -> str:
    pointer = read_pointer(Path(root))
    previous = pointer.get("previous")
    if not previous:
        raise RouterLoadError("no previous router version to roll back to")
    activate_version(Path(root), previous)
    return previous


def load_version(root: Path, version: str) -> RouterArtifact:
    if not is_version_name(version):
        raise RouterLoadError(f"{version!r} is not a router version name (a directory under {root})")
    path = Path(root) / version / "model.joblib"
    try:
        artifact = joblib.load(path)
    except FileNotFoundError:
        raise RouterLoadError(f"{path}: model file is missing") from None
    except Exception as exc:  # joblib/pickle raise many types for a damaged file
        raise RouterLoadError(f"{path}: cannot load model ({type(exc).__name__}: {exc})") from None
    if not isinstance(artifact, RouterArtifact):
        raise RouterLoadError(f"{path}: not a polyroute router model (found {type(artifact).__name__})")
    if artifact.format != FORMAT:
        raise RouterLoadError(f"{path}: model format {artifact.format}, this gateway reads {FORMAT}")
    if not hasattr(artifact.model, "predict") or not artifact.workers:
        raise RouterLoadError(f"{path}: model has no predict() or no workers")
    artifact.version = version
    return artifact


def _acceptance_in_force(root: Path) -> Path | None:
    """The acceptance model file a gateway's cascade reads now (before a new version is saved)."""
    try:
        version = read_pointer(root).get("version")
    except RouterLoadError:  # a damaged pointer names no version: nothing to carry over but the dir's own
        version = None
    found = acceptance_path(root, version if isinstance(version, str) else None)
    return found.path if found is not None else None


@dataclass(frozen=True)
class AcceptanceFile:
    """Where the cascade's acceptance model of a router version is read from."""

    path: Path
    version: str | None  # the version whose file it is; None: the router dir's own file
    legacy: bool  # the router dir's file read for a version that has none of its own (one release)


def acceptance_path(root: Path, version: str | None) -> AcceptanceFile | None:
    """The acceptance model of ``version`` (None, or "rules": no learned router in force): its own
    `<version>/acceptance.joblib`; else the router dir's `acceptance.joblib`, the place before
    versions carried one and the place while none is in force; None when neither exists."""
    root = Path(root)
    if version is not None and is_version_name(version) and version != "rules":
        own = root / version / ACCEPTANCE
        if own.is_file():
            return AcceptanceFile(own, version, False)
    shared = root / ACCEPTANCE
    if shared.is_file():
        in_force = version is not None and version != "rules"
        return AcceptanceFile(shared, None, in_force)
    return None


def save_acceptance(root: Path, model: Any, version: str | None = None) -> Path:
    """Store the cascade's acceptance model in router ``version`` (default: the version in force, as
    current.json names it), replacing the one it had whole (written aside, renamed over), so a
    gateway reads the old model or the new one, never half of one. The version's quality model and
    card are untouched. With no version in force (no router ever trained), the router dir's own
    file, which the rule-based router's cascade reads and the next version saved takes along.
    Returns the file written; RouterLoadError for a version that is not there."""
    root = Path(root)
    if version is None:
        named = read_pointer(root).get("version")
        version = named if isinstance(named, str) else None
    path = (root if version is None else _version_dir(root, version)) / ACCEPTANCE
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_whole(path, lambda tmp: joblib.dump(model, tmp))
    return path


def load_current(root: Path) -> RouterArtifact | None:
    """The artifact current.json points to; None when no model was ever trained."""
    version = read_pointer(Path(root)).get("version")
    return load_version(Path(root), version) if version else None


def list_versions(root: Path) -> list[dict]:
    root = Path(root)
    if not root.is_dir():
        return []
    cards = []
    for card in sorted(root.glob("*/card.json")):
        if card.parent.name.startswith("."):  # a staging directory, never a version
            continue
        try:
            cards.append(json.loads(card.read_text()))
        except (OSError, ValueError):
            cards.append({"version": card.parent.name, "error": "unreadable card"})
    return cards
