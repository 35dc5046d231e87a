"""The FastAPI application. Routes live in `routers/`, one per resource."""

from __future__ import annotations

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kuangchao.api.server import metrics
from kuangchao.api.server.dependencies import listing
from kuangchao.api.server.dependencies.auth import Caller
from kuangchao.api.server.dependencies.store import forget_active
from kuangchao.api.server.edge import Edge
from kuangchao.api.server.routers import (
    admin,
    audit,
    debug,
    goodput,
    health,
    jobs,
    nodes,
    queues,
    ui,
)
from kuangchao.platform.errors import StoreUnavailable
from kuangchao.platform.version import __version__

ROUTERS = (health.router, jobs.router, goodput.router, debug.router, queues.router, nodes.router,
           admin.router, audit.router, ui.router)


def create_app() -> FastAPI:
    # /docs and /redoc would load their assets from a CDN, which an offline
    # cluster cannot reach; they are off. /openapi.json is served to callers
    # with a key, like every route but /healthz and the console's static files (/ui).
    app = FastAPI(title="kuangchao", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    # A new app answers nothing an earlier one cached (tests build many, each on its store).
    listing.changed()
    forget_active()
    for router in ROUTERS:
        app.include_router(router)
    # Every request is authenticated and its body bounded before routing
    # (edge.py); the request timer, added after it, wraps it, so its
    # refusals are timed and counted too.
    app.add_middleware(Edge)
    metrics.install(app)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_: Caller) -> dict:
        return app.openapi()

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": exc.message})

    @app.exception_handler(redis.RedisError)
    async def _redis_error(_: Request, exc: redis.RedisError) -> JSONResponse:
        return JSONResponse(status_code=503, content={
            "detail": f"Redis is unavailable ({exc}); check that it is running and that "
                      "KC_REDIS_URL points at it"})

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": [
            {"loc": list(e["loc"]), "msg": e["msg"], "field": ".".join(map(str, e["loc"]))}
            for e in exc.errors()]})

    return app


app = create_app()
