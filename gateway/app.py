"""The FastAPI application factory; `create_app()` is what uvicorn serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.errors import install_error_handlers
from gateway.routes import router
from gateway.settings import Settings
from gateway.state import build_state
from policies import Catalog

log = logging.getLogger("polyroute.gateway")

SPEND_SAVE_INTERVAL_S = 5.0


def create_app(settings: Settings | None = None, catalog: Catalog | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    state = build_state(settings, catalog)

    async def watch_policy() -> None:
        """Hot reload: check the policy file's fingerprint; a change is validated, then swapped."""
        while True:
            await asyncio.sleep(settings.policy_reload_interval_s)
            if state.policy.changed():
                await asyncio.to_thread(state.policy.reload, "file")

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
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for proc in state.local.values():
            proc.start()
        tasks = [asyncio.create_task(t()) for t in (watch_policy, watch_router, flush_stores)]
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
                await asyncio.wait(state.background, timeout=5)
            await state.stores.budgets.flush()
            await asyncio.to_thread(state.stores.ledger.close)
            await state.stores.close()
            await state.client.aclose()
            for proc in state.local.values():
                await proc.stop()

    app = FastAPI(title="polyroute", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.polyroute = state
    install_error_handlers(app)
    app.include_router(router)
    return app
