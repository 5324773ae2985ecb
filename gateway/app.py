"""The FastAPI application factory; `create_app()` is what uvicorn serves."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.errors import install_error_handlers
from gateway.routes import router
from gateway.settings import Settings
from gateway.state import build_state
from policies import Catalog

log = logging.getLogger("polyroute.gateway")


def create_app(settings: Settings | None = None, catalog: Catalog | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    state = build_state(settings, catalog)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for proc in state.local.values():
            proc.start()
        log.info(
            "polyroute ready: %d workers in catalog, %d admissible now",
            len(state.catalog.workers),
            len(state.admission().pool),
        )
        try:
            yield
        finally:
            for proc in state.local.values():
                await proc.stop()
            await state.client.aclose()

    app = FastAPI(title="polyroute", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.polyroute = state
    install_error_handlers(app)
    app.include_router(router)
    return app
