"""The FastAPI application factory; `create_app()` is what uvicorn serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import catalog_reload, tracing
from gateway.datadir_lock import DataDirLock, DataDirLocked
from gateway.errors import APIError, install_error_handlers
from gateway.routes import router
from gateway.settings import Settings
from gateway.state import build_state
from policies import Catalog, CatalogError, PolicyError

log = logging.getLogger("polyroute.gateway")

SPEND_SAVE_INTERVAL_S = 5.0


class BodyDeadline:
    """ASGI middleware: a request's whole body must arrive within `timeout_s`, else 408.

    uvicorn has no such bound: a client that sends its body a byte at a time keeps a connection
    and a request task for as long as it likes. The bound sits on `receive`, so every route's body
    read (JSON, uploaded files) is cut the same way, with the OpenAI error shape; the 408 closes
    the connection, since the rest of that body will never be read.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete, deadline
            if complete:  # the body is in: later reads wait for a disconnect, which takes what it takes
                return await receive()
            if deadline is None:  # from the app's first read: the server's own delays are not the client's
                deadline = asyncio.get_running_loop().time() + self.timeout_s
            limit = asyncio.timeout_at(deadline)
            try:
                async with limit:
                    message = await receive()
            except TimeoutError:
                if not limit.expired():
                    raise
                raise APIError(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s",
                    code="body_timeout",
                    headers={"connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, receive_in_time, send)


class ListeningAddress:
    """ASGI middleware: tell the data-dir lock where this gateway listens, from its first request
    (the scope's `server`, the connection's local address). Under `uvicorn --factory` the app is
    built and started before uvicorn binds, so only a request can tell; once known, one attribute
    read per request. `polyroute serve` binds first and gives a lock that knows it already."""

    def __init__(self, app: ASGIApp, lock: DataDirLock) -> None:
        self.app = app
        self.lock = lock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.lock.listening and scope["type"] == "http":
            server = scope.get("server")
            if server is not None and server[1] is not None:  # a Unix socket has no port: not learned
                self.lock.listening_on(server[0], server[1])
        await self.app(scope, receive, send)


def create_app(
    settings: Settings | None = None, catalog: Catalog | None = None, lock: DataDirLock | None = None
) -> FastAPI:
    """The app on `settings.data_dir`, which it locks first (gateway/datadir_lock.py): a second gateway
    on that dir raises DataDirLocked here. `lock`: one the caller already holds (`polyroute serve`
    takes it before assembling local models). The app's shutdown releases it; a start takes it again.

    Called with no settings, as `uvicorn gateway.app:create_app --factory` calls it, it reads them
    from the environment and is the process's entry point: a start refused as `polyroute serve`
    refuses it (the data dir in use, an invalid catalog, a refused policy) logs one line, "cannot
    start: …", and exits 2 (uvicorn lets SystemExit through), not a traceback ending in the reason."""
    if settings is None:
        try:
            return _create_app(Settings.from_env(), catalog, lock)
        except (DataDirLocked, CatalogError, PolicyError) as exc:
            log.error("cannot start: %s", exc)
            raise SystemExit(2) from None
    return _create_app(settings, catalog, lock)


def _create_app(settings: Settings, catalog: Catalog | None, lock: DataDirLock | None) -> FastAPI:
    # not `listening`: the ASGI server that serves this app binds after it is built, where it chooses
    lock = lock or DataDirLock(settings.data_dir, settings.host, settings.port, listening=False)
    lock.acquire()  # before the data dir is read or written
    try:
        state = build_state(settings, catalog)
        traces = tracing.setup()  # OpenTelemetry when OTEL_EXPORTER_OTLP_ENDPOINT is set, else None
    except BaseException:
        lock.release()  # e.g. a refused policy: a corrected start in this process must not find it held
        raise

    async def watch_policy() -> None:
        """Hot reload: check the policy file's fingerprint; a change is validated, then swapped."""
        while True:
            await asyncio.sleep(settings.policy_reload_interval_s)
            if state.policy.changed():
                await asyncio.to_thread(state.policy.reload, "file")

    async def watch_catalog() -> None:
        """Hot reload: a valid edit of the workers file is put in force, or refused with the reason
        (gateway/catalog_reload.py); the file is looked at no more than CatalogFile's interval."""
        while True:
            await asyncio.sleep(settings.policy_reload_interval_s)
            try:
                await catalog_reload.reload(state)
            except Exception:  # the catalog in force keeps serving; the next round looks again
                log.exception("reloading the worker catalog failed; keeping the catalog in force")

    async def watch_router() -> None:
        """Hot swap: a new current.json (train, rollback) loads in a thread and swaps when it works."""
        while True:
            await asyncio.sleep(settings.router_reload_interval_s)
            if state.router.changed():
                await asyncio.to_thread(state.router.reload)

    async def flush_stores() -> None:
        """Send buffered ledger records and spend; a failure leaves them buffered for the next round."""
        stores = state.stores
        last_save = 0.0
        while True:
            await asyncio.sleep(settings.store_flush_interval_s)
            try:
                if stores.backend == "redis":
                    await stores.budgets.flush()
                    if stores.ledger.buffered:
                        await asyncio.to_thread(stores.ledger.flush)
                    state.metrics.ledger_buffered.set(stores.ledger.buffered)
                elif time.monotonic() - last_save > SPEND_SAVE_INTERVAL_S:
                    last_save = time.monotonic()
                    await stores.budgets.flush()
            except Exception:  # keep flushing whatever one round hit
                log.exception("flushing the shared store failed; retrying")

    @asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        for proc in state.local.values():
            proc.start()
        tasks = [asyncio.create_task(t()) for t in (watch_policy, watch_catalog, watch_router, flush_stores)]
        log.info(
            "polyroute ready: %d workers in catalog, %d callable now, policy %s, router %s",
            len(state.catalog.workers),
            len(state.availability().pool),
            state.policy.engine.version if state.policy.engine else "NONE (requests refused)",
            state.router.current.version,
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if state.background:
                _, late = await asyncio.wait(state.background, timeout=5)
                # what is still running (a judge's grade waiting on its worker) is cancelled before the
                # budgets are flushed, so its own handler settles its hold into what is saved
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late, timeout=2)
            await state.stores.budgets.flush()
            await asyncio.to_thread(state.stores.ledger.close)
            await state.stores.close()
            await state.client.aclose()
            if (retriever := getattr(app.state, "polyroute_retriever", None)) is not None:
                # releases the embedded shards' locks, so another gateway in this process (a
                # restart, a test) can open the same data dir
                await asyncio.to_thread(retriever.close)
            for proc in state.local.values():
                await proc.stop()
            if traces is not None:  # the last spans are sent before the process goes
                await asyncio.to_thread(tracing.shutdown, traces)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """The data dir's lock around the whole run, released once everything is written out; held
        since create_app, and taken again when this app is started after a shutdown."""
        with lock:
            async with serving(app):
                yield

    app = FastAPI(title="polyroute", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.polyroute = state
    install_error_handlers(app)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    app.add_middleware(ListeningAddress, lock=lock)
    app.include_router(router)
    return app
