"""Everything a request handler needs, built once per app (no module-level globals)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import Authenticator
from gateway.keys import FileKeyStore
from gateway.local_worker import LocalWorkerProcess
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.upstream import WorkerClient
from policies import Admission, Catalog, Worker, admit, load_catalog
from router import CheapestRouter

log = logging.getLogger("polyroute.gateway")


@dataclass
class AppState:
    settings: Settings
    catalog: Catalog
    auth: Authenticator
    router: CheapestRouter
    metrics: Metrics
    client: WorkerClient
    local: dict[str, LocalWorkerProcess] = field(default_factory=dict)

    def down_workers(self) -> dict[str, str]:
        down: dict[str, str] = {}
        for worker in self.catalog.workers:
            if worker.local is None:
                continue
            proc = self.local.get(worker.name)
            if proc is None:
                down[worker.name] = "local workers are disabled (POLYROUTE_LOCAL_WORKERS=false)"
            elif (reason := proc.down_reason()) is not None:
                down[worker.name] = reason
        return down

    def admission(self) -> Admission:
        return admit(self.catalog, down=self.down_workers())

    def api_base(self, worker: Worker) -> str | None:
        proc = self.local.get(worker.name)
        return proc.api_base if proc is not None else worker.api_base


def bootstrap_admin_key(store: FileKeyStore, settings: Settings) -> None:
    """First start without POLYROUTE_ADMIN_KEY: create an admin key, readable only by the operator."""
    if settings.admin_key or store.has_admin():
        return
    _, plaintext = store.create(tenant="admin", name="bootstrap admin key", admin=True)
    path = Path(settings.data_dir) / "admin-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(plaintext + "\n")
    log.warning(
        "created an admin key; it is in %s (mode 0600). Set POLYROUTE_ADMIN_KEY to use your own.", path
    )


def build_state(settings: Settings, catalog: Catalog | None = None) -> AppState:
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    catalog = catalog or load_catalog(settings.workers_file)
    store = FileKeyStore(data_dir / "keys.json", settings.key_reload_interval_s)
    bootstrap_admin_key(store, settings)
    metrics = Metrics()
    state = AppState(
        settings=settings,
        catalog=catalog,
        auth=Authenticator(store, settings.admin_key),
        router=CheapestRouter(),
        metrics=metrics,
        client=WorkerClient(metrics, retries=settings.retries, backoff_s=settings.retry_backoff_s),
    )
    if settings.local_workers:
        for worker in catalog.workers:
            if worker.local is not None:
                state.local[worker.name] = LocalWorkerProcess(
                    worker, models_dir=data_dir / "models", logs_dir=data_dir / "logs"
                )
    return state
