"""`/metrics` of the API server, and the request timing behind it.

`/metrics` is not public: Prometheus presents a scrape token (the file named
by `KC_METRICS_TOKEN_FILE`, which `kc up` writes to `$KC_HOME/metrics-token`)
as a bearer token, or an operator or admin presents an API key. A scrape
token reads metrics and nothing else. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kuangchao.api.server.cluster_metrics import ClusterCollector
from kuangchao.api.server.dependencies.auth import audit, bearer, principal_of
from kuangchao.api.server.dependencies.store import get_store
from kuangchao.api.server.schemas.cluster import ScrapeGroup
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.observability import metrics as catalog
from kuangchao.platform.observability import scrape_targets

_log = logging.getLogger(__name__)
REQUEST_SECONDS = Histogram(catalog.API_REQUEST.name, catalog.API_REQUEST.help,
                            list(catalog.API_REQUEST.labels), buckets=catalog.API_REQUEST.buckets)
AUTH_DENIALS = Counter(catalog.API_AUTH_DENIALS.name.removesuffix("_total"),
                       catalog.API_AUTH_DENIALS.help, list(catalog.API_AUTH_DENIALS.labels))
for _status in ("401", "403"):  # present at 0, so the first denial shows in rate()
    AUTH_DENIALS.labels(_status)
STORE_UP = Gauge(catalog.STORE_UP.name, catalog.STORE_UP.help)


@lru_cache(maxsize=1)
def _scrape_digest() -> str | None:
    path = os.environ.get("KC_METRICS_TOKEN_FILE")
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError:
        return None
    return hashlib.sha256(token.encode()).hexdigest() if token else None


def is_scrape_token(presented: str | None) -> bool:
    want = _scrape_digest()
    if not presented or want is None:
        return False
    return hmac.compare_digest(want, hashlib.sha256(presented.encode()).hexdigest())


class RequestTimer:
    """Pure ASGI middleware timing each request by route template and status.

    (Starlette's `BaseHTTPMiddleware` would cost a task and a stream per request.)
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sent(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_SECONDS.labels(scope["method"], route, str(status)).observe(
                time.perf_counter() - start)
            if status in (401, 403):
                AUTH_DENIALS.labels(str(status)).inc()


def install(app: FastAPI) -> None:
    """Time every request and serve `/metrics`."""
    app.add_middleware(RequestTimer)

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics (scrape token or "
                                                  "operator key)",
             response_class=PlainTextResponse, responses={
                 **errors(401, 403, 503, inline=True),
                 200: {"content": {"text/plain": {"schema": {
                     "type": "string", "description": "the Prometheus text exposition format"}}}}})
    async def metrics(request: Request) -> Response:
        store = await _scraper(request)
        return Response(await run_in_threadpool(exposition, store), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics/targets", tags=["health"],
             summary="The ranks' metrics endpoints as Prometheus HTTP service discovery "
                     "(scrape token or operator key)",
             response_model=list[ScrapeGroup], responses=errors(401, 403, 503))
    async def targets(request: Request) -> list[dict]:
        store = await _scraper(request)
        return await run_in_threadpool(scrape_targets.read_groups, store)

    sd_file = os.environ.get("KC_METRICS_SD_FILE")
    if sd_file:
        app.router.on_startup.append(lambda: _start_sd_writer(Path(sd_file)))


async def _scraper(request: Request) -> JobStore:
    """The store, once the caller proved it may read metrics."""
    store = await get_store()
    if not is_scrape_token(bearer(request.headers.get("authorization"))):
        principal = await principal_of(request, store)
        if not principal.can("metrics.read"):
            audit(store, principal, "metrics.read", request.url.path, "deny",
                  f"role {principal.role} may not read metrics")
            raise HTTPException(403, f"role {principal.role} may not read metrics; use the "
                                     "scrape token or an operator key")
    return store


def _start_sd_writer(path: Path) -> None:
    """Keep the workers' file_sd list current (platform/observability/scrape_targets.py)."""
    from kuangchao.api.server.dependencies.store import open_store

    def loop() -> None:
        failing = False
        while True:
            try:
                scrape_targets.write_file_sd(path, scrape_targets.read_groups(open_store()))
                failing = False
            except Exception as exc:  # noqa: BLE001 -- Redis away: keep the last list, retry
                if not failing:
                    _log.warning("could not refresh %s: %s", path, exc)
                failing = True
            time.sleep(scrape_targets.REFRESH_S)

    threading.Thread(target=loop, daemon=True, name="kc-file-sd").start()


_registries: dict[str, CollectorRegistry] = {}


def exposition(store: JobStore) -> bytes:
    """This process's metrics and the control plane's, in the text format.

    When the store cannot be read, the process's own metrics are still served,
    with `kc_store_up 0`: a scrape that failed outright would hide the API's
    latency exactly when it matters.
    """
    registry = _registries.get(store.p)
    if registry is None:
        registry = _registries[store.p] = CollectorRegistry(auto_describe=False)
        registry.register(ClusterCollector(store))
    try:
        cluster = generate_latest(registry)
        STORE_UP.set(1)
    except Exception as exc:  # noqa: BLE001 -- Redis away, or a record that will not parse
        _log.warning("control-plane metrics unavailable: %s", exc)
        cluster = b""
        STORE_UP.set(0)
    return generate_latest() + cluster
