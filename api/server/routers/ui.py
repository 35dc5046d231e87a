"""`/ui`: the web console, static files shipped inside the package.

The console is a page of vanilla ES modules that reads the same REST API with
the same API keys (the browser sends `Authorization: Bearer ...`); the page
itself holds no data, so serving it needs no key. Nothing is loaded from
outside this server: an offline cluster gets the whole console.

Every answer carries a strict Content-Security-Policy. No inline script or
style is allowed, so a job name or log line that slipped into the DOM as
markup still could not run; the console also only ever writes data with
`textContent`. See docs/console.md.
"""

from __future__ import annotations

import html
import os
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, Response

# Path(__file__), not importlib.resources: `kuangchao.api` is a namespace
# portion (no __init__.py), and a plain directory works the same for an
# editable install and a wheel.
UI_DIR = Path(__file__).resolve().parent.parent / "ui"
ASSETS = UI_DIR / "assets"

CSP = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self'",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'none'",  # forms are handled in JS; none posts anywhere
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # for browsers that predate frame-ancestors
    "Referrer-Policy": "no-referrer",
    # A new release must show at once; the files are small and revalidated.
    "Cache-Control": "no-cache",
}
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".svg": "image/svg+xml", ".html": "text/html; charset=utf-8"}

router = APIRouter(tags=["ui"], include_in_schema=False)


def grafana_url() -> str:
    """`KC_GRAFANA_URL` if it is an http(s) URL, else empty (the link is hidden).

    Anything else (a `javascript:` URL, say) is dropped here rather than
    trusted to the browser.
    """
    url = os.environ.get("KC_GRAFANA_URL", "").strip()
    parts = urlsplit(url)
    return url.rstrip("/") if parts.scheme in ("http", "https") and parts.netloc else ""


@lru_cache(maxsize=1)
def _template() -> str:
    return (UI_DIR / "index.html").read_text(encoding="utf-8")


def render_index() -> str:
    # The placeholder sits inside a double-quoted attribute; html.escape
    # quotes `"` too, so the value cannot leave it.
    return _template().replace("{{grafana_url}}", html.escape(grafana_url(), quote=True))


@lru_cache(maxsize=1)
def _asset_names() -> frozenset[str]:
    # Only files that exist at start are served: a request names one of them
    # exactly, so no path (`..`, `%2F`) can reach anything else.
    return frozenset(p.name for p in ASSETS.iterdir() if p.is_file() and p.suffix in TYPES)


@router.get("/ui", response_class=HTMLResponse)
@router.get("/ui/", response_class=HTMLResponse)
def console() -> HTMLResponse:
    return HTMLResponse(render_index(), headers=HEADERS)


@router.get("/ui/assets/{name}")
def asset(name: str) -> Response:
    if name not in _asset_names():
        raise HTTPException(404, f"no console asset {name!r}")
    path = ASSETS / name
    return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=HEADERS)
