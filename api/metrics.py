"""`/metrics` of the API server, and the request timing behind it.

`/metrics` is not public: Prometheus presents a scrape token (the file named
by `KC_METRICS_TOKEN_FILE`, which `kc up` writes to `$KC_HOME/metrics-token`)
as a bearer token, or an operator or admin presents an API key. A scrape
token reads metrics and nothing else. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from kuangchao.api.auth import audit, bearer, caller
from kuangchao.api.deps import get_store

REQUEST_SECONDS = Histogram(
    "kc_api_request_duration_seconds", "API request latency by route and status",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
AUTH_DENIALS = Counter("kc_api_auth_denials_total", "API requests refused by authentication "
                       "(401) or authorisation (403)", ["status"])


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
                                                  "operator key)")
    async def metrics(request: Request) -> Response:
        if not is_scrape_token(bearer(request.headers.get("authorization"))):
            store = await get_store()
            principal = await caller(request, store)
            if not principal.can("metrics.read"):
                audit(store, principal, "metrics.read", "/metrics", "deny",
                      f"role {principal.role} may not read metrics")
                raise HTTPException(403, f"role {principal.role} may not read metrics; use the "
                                         "scrape token or an operator key")
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
