"""Everything a request handler needs, built once per app (no module-level globals)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import Authenticator
from gateway.judge import Judge
from gateway.keys import KeyStore, KeyStoreUnavailable, open_key_store
from gateway.local_worker import LocalWorkerProcess
from gateway.metrics import Metrics
from gateway.router_state import RouterHolder
from gateway.settings import Settings
from gateway.store import Stores, open_stores
from gateway.upstream import WorkerClient
from policies import (
    DEFAULT_POLICY_PATH,
    Admission,
    AuditLog,
    Catalog,
    CatalogFile,
    Kind,
    Policy,
    PolicyError,
    PolicySource,
    Worker,
    admit,
    check_against_catalog,
    load_catalog,
    parse_policy,
)
from router.compose import WORKFLOWS

log = logging.getLogger("polyroute.gateway")


@dataclass
class AppState:
    settings: Settings
    catalog: Catalog
    auth: Authenticator
    router: RouterHolder
    metrics: Metrics
    client: WorkerClient
    policy: PolicySource
    stores: Stores
    catalog_file: CatalogFile  # the catalog file on disk vs the catalog in force (policies/catalog_file.py)
    local: dict[str, LocalWorkerProcess] = field(default_factory=dict)
    # what the shutdown waits for before it closes the ledger: bookkeeping tasks (`spawn`) and the
    # books of requests still calling workers (`awaits`, PendingBooks)
    background: set[asyncio.Future] = field(default_factory=set)
    judge: Judge = field(default_factory=Judge)  # judge-labelled traffic (gateway/judge.py)
    store_reached: bool = False  # the shared store answered a readiness probe since start (/readyz)

    @property
    def ledger(self):
        return self.stores.ledger

    def spawn(self, coro) -> None:
        """Run bookkeeping (settles, ledger) to completion even if the request's task is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._done)

    def awaits(self, pending: asyncio.Future) -> None:
        """Have the shutdown wait for ``pending`` (until it is done, or cancelled after the shutdown's
        grace) as it waits for spawned bookkeeping, without a task of its own: a request's books are
        pending on every request that calls a worker, so this costs no task on the hot path."""
        self.background.add(pending)
        pending.add_done_callback(self._done)

    def pending_books(self) -> PendingBooks:
        """A request's books, pending from now until they are written (fast mode, workflows)."""
        return PendingBooks(self)

    def _done(self, task: asyncio.Future) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background bookkeeping failed", exc_info=task.exception())

    def catalog_for(self, request) -> Catalog:
        """The catalog one request uses from start to end: the one in force at its first read, kept
        on the request. The catalog is hot-reloaded (gateway/catalog_reload.py); a request that read
        it twice could price, admit and pin workers from two different versions."""
        catalog = getattr(request.state, "polyroute_catalog", None)
        if catalog is None:
            catalog = request.state.polyroute_catalog = self.catalog
        return catalog

    def down_workers(self, catalog: Catalog | None = None) -> dict[str, str]:
        """The local workers of `catalog` (default: the one in force) that cannot be called, and why."""
        down: dict[str, str] = {}
        for worker in (catalog or self.catalog).workers:
            if worker.local is None:
                continue
            proc = self.local.get(worker.name)
            if proc is None:
                down[worker.name] = "local workers are disabled (POLYROUTE_LOCAL_WORKERS=false)"
            elif (reason := proc.down_reason()) is not None:
                down[worker.name] = reason
        return down

    def availability(self, catalog: Catalog | None = None, kind: Kind = Kind.chat) -> Admission:
        """Which workers of `kind` can be called at all, before any policy (for /v1/models and /readyz)."""
        catalog = catalog or self.catalog
        return admit(catalog, down=self.down_workers(catalog), kind=kind)

    def set_worker_up(self, catalog: Catalog) -> None:
        """polyroute_worker_up for every worker of `catalog`, chat and embedding: 1 callable (key set,
        local server up), 0 not, by the catalog's names (a bounded label set). At each scrape, and
        when a catalog is put in force (new workers have a series from then, not the next scrape)."""
        down = self.down_workers(catalog)
        for kind in (Kind.chat, Kind.embedding):
            available = admit(catalog, down=down, kind=kind)
            for worker in available.pool:
                self.metrics.worker_up.labels(worker.name).set(1)
            for exclusion in available.excluded:
                self.metrics.worker_up.labels(exclusion.worker).set(0)

    def api_base(self, worker: Worker) -> str | None:
        proc = self.local.get(worker.name)
        return proc.api_base if proc is not None else worker.api_base


def bootstrap_admin_key(store: KeyStore, settings: Settings) -> None:
    """First start without POLYROUTE_ADMIN_KEY: create an admin key, readable only by the operator."""
    try:
        if settings.admin_key or store.has_admin():
            return
    except KeyStoreUnavailable as exc:  # Redis down at start: serve anyway, /readyz says why
        log.error(
            "cannot check for an admin key (%s); set POLYROUTE_ADMIN_KEY or restart once Redis is up", exc
        )
        return
    _, plaintext = store.create(tenant="admin", name="bootstrap admin key", admin=True)
    path = Path(settings.data_dir) / "admin-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(plaintext + "\n")
    log.warning("created an admin key in %s (mode 0600); set POLYROUTE_ADMIN_KEY to use your own", path)


POLICY_AUDIT = "policy-audit.jsonl"
LEDGER_FILE = "ledger.jsonl"


def policy_path(settings: Settings, seed: bool = True) -> Path:
    """The operator's policy file; on a true first start the embedded default is copied there to edit
    (``seed`` False: nothing is written and the embedded default's path is returned, for a reader
    that must not change the data dir, such as calibrate's dry run).

    Only on a first start: a data dir that has served before (it holds the policy audit log, where
    seeding the default is the first entry, or a ledger) and has lost its policy file refuses to start.
    Copying the default there would put the shipped policy in force in place of the operator's,
    silently — for a fail-closed gateway, the one outcome worse than not starting."""
    if settings.policy_file is not None:
        return Path(settings.policy_file)
    data_dir = Path(settings.data_dir)
    path = data_dir / "policy.yaml"
    if path.exists():
        return path
    served = [name for name in (POLICY_AUDIT, LEDGER_FILE) if (data_dir / name).exists()]
    if served:
        message = (
            f"the policy file {path} is missing, and this data dir has served before (it holds "
            f"{' and '.join(served)}): refusing to start rather than put the shipped default policy in "
            f"force in place of yours. Restore your policy file ({POLICY_AUDIT} records every change as "
            f"a diff), or copy the default ({DEFAULT_POLICY_PATH}) there to start from it deliberately"
        )
        log.error(message)
        raise PolicyError(message)
    if not seed:
        return DEFAULT_POLICY_PATH
    text = DEFAULT_POLICY_PATH.read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    _, version = parse_policy(text, str(DEFAULT_POLICY_PATH))
    AuditLog(data_dir / POLICY_AUDIT).append("startup", "seeded", "", text, None, version)
    log.info("wrote the default policy to %s; edit it (hot-reloaded) or PUT /admin/policies", path)
    return path


def catalog_check(catalog: Catalog):
    """The check every policy version passes before it is put in force: it fits this catalog."""

    def check(policy: Policy, source: str) -> None:
        check_against_catalog(policy, catalog, source, workflows=WORKFLOWS)

    return check


def build_state(settings: Settings, catalog: Catalog | None = None) -> AppState:
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    catalog = catalog or load_catalog(settings.workers_file)
    store = open_key_store(data_dir, settings.redis_url, settings.key_reload_interval_s)
    bootstrap_admin_key(store, settings)
    metrics = Metrics()
    policy = PolicySource(policy_path(settings), AuditLog(data_dir / POLICY_AUDIT), catalog_check(catalog))
    if policy.engine is None:
        log.error("no valid policy: every chat request is refused until one loads (%s)", policy.last_error)
    router_dir = settings.router_dir or data_dir / "router"
    prior_error = None
    if settings.router_prior:
        from router.shipped import try_install_shipped_prior

        prior_error = try_install_shipped_prior(router_dir)
    state = AppState(
        settings=settings,
        catalog=catalog,
        auth=Authenticator(store, settings.admin_key),
        router=RouterHolder(
            router_dir,
            settings.cost_weight,
            settings.exploration,
            settings.exploration_min_examples,
            startup_error=prior_error,
            catalog={worker.name: worker for worker in catalog.workers},
            plan_code_exec=settings.plan_code_exec,
        ),
        metrics=metrics,
        client=WorkerClient(
            metrics,
            retries=settings.retries,
            backoff_s=settings.retry_backoff_s,
            fast_path=settings.fast_path,
        ),
        policy=policy,
        catalog_file=CatalogFile(catalog),
        stores=open_stores(
            data_dir, settings.redis_url, settings.ledger_buffer_max, settings.ledger_stream_max
        ),
        judge=Judge(settings.judge_seed),
    )
    if settings.local_workers:
        for worker in catalog.workers:
            if worker.local is not None:
                state.local[worker.name] = LocalWorkerProcess(
                    worker, models_dir=data_dir / "models", logs_dir=data_dir / "logs"
                )
    return state


class PendingBooks:
    """A request's books, pending in the gateway's background work (which the shutdown awaits
    before it closes the ledger and flushes the budgets) from its first worker call (a workflow's
    start, fast mode's first attempt: gateway/completions.py) until they are written: a request
    cancelled at shutdown reaches its bookkeeping only after the cancel, and its record must not
    come after the ledger is closed. `Exchange.finish` writes every request's books through one too:
    the shutdown's cancel may land while they are being written (a budget settle waiting on Redis)."""

    def __init__(self, state: AppState) -> None:
        self._written = asyncio.get_running_loop().create_future()
        self._writing: asyncio.Task | None = None
        state.awaits(self._written)  # a future, not a task: fast mode makes one per request

    async def write(self, coro) -> None:
        """Run the bookkeeping ``coro`` in a task of its own and wait for it, shielded: cancelling
        the request again does not stop it, and the books stay pending until it ends."""
        self._writing = asyncio.get_running_loop().create_task(coro)
        self._writing.add_done_callback(self._wrote)
        await asyncio.shield(self._writing)

    def _wrote(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("a request's bookkeeping failed", exc_info=task.exception())
        self._end()

    def done(self) -> None:
        """The request is done with its books (unless a bookkeeping task still writes them)."""
        if self._writing is None:
            self._end()

    def _end(self) -> None:
        if not self._written.done():
            self._written.set_result(None)
