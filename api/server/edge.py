"""The API's edge: what every request passes before a route sees it.

- **Authentication first.** Every path but the public ones needs a valid API
  key, checked here, before FastAPI parses a body or matches a route. A
  stranger's malformed body gets 401, not a 422 that would say what the
  route wants; an unknown path gets 401 too, so routes cannot be probed.
  The principal rides on the request (`request.state.principal`) for the
  routes' role checks.
- **Bounded bodies.** A body larger than `KC_API_MAX_BODY_BYTES` (1 MiB by
  default) gets 413 without being read: a declared length is refused from
  its header, a chunked body as soon as it outgrows the limit.

Pure ASGI (Starlette's `BaseHTTPMiddleware` would cost a task and a stream
per request, measured in bench/api.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from kuangchao.api.server.dependencies import store as store_dependency
from kuangchao.api.server.dependencies.auth import authenticate_request
from kuangchao.platform.errors import KuangchaoError, StoreUnavailable

DEFAULT_MAX_BODY_BYTES = 1 << 20
# Answer without a key: the health probe, the console's static page (it holds no
# data), and the scrape routes, which take a scrape token or a key themselves.
PUBLIC_PATHS = frozenset({"/healthz", "/ui", "/ui/", "/metrics", "/v1/metrics/targets"})
PUBLIC_PREFIXES = ("/ui/assets/",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def max_body_bytes() -> int:
    raw = os.environ.get("KC_API_MAX_BODY_BYTES", "")
    try:
        return int(raw) if raw else DEFAULT_MAX_BODY_BYTES
    except ValueError:
        raise KuangchaoError(f"KC_API_MAX_BODY_BYTES={raw!r} is not a whole number of bytes; "
                             f"unset it for the default ({DEFAULT_MAX_BODY_BYTES})") from None


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


class Edge:
    """The middleware: authenticate, then bound the body (see the module docstring)."""

    def __init__(self, app: Any, limit: int | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes() if limit is None else limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not is_public(scope["path"]):
            refused = await self._authenticate(scope)
            if refused is not None:
                await _answer(send, *refused)
                return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await _answer(send, 413, self._too_large())
                return
            await self.app(scope, receive, send)
            return
        if _header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body at all
            return
        body = await self._read_chunked(receive)
        if body is None:
            await _answer(send, 413, self._too_large())
            return
        await self.app(scope, _replay(body, receive), send)

    async def _authenticate(self, scope: Scope) -> tuple[int, str, dict[str, str]] | None:
        try:
            store = store_dependency.open_store()
        except StoreUnavailable as exc:
            return 503, exc.message, {}
        client = scope.get("client")
        try:
            principal = authenticate_request(
                store, _header(scope, b"authorization"), f"{scope['method']} {scope['path']}",
                client[0] if client else None)
        except PermissionError as exc:
            return 401, f"API key refused ({exc})", {"www-authenticate": "Bearer"}
        except Exception as exc:  # Redis went away mid-request
            return 503, f"Redis is unavailable ({exc}); check that it is running", {}
        scope.setdefault("state", {})["principal"] = principal
        return None

    async def _read_chunked(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it outgrows the limit (or the client left)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away; the answer goes nowhere
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> str:
        return (f"the request body is larger than {self.limit} bytes; a job spec is a few "
                "kilobytes (an operator can raise KC_API_MAX_BODY_BYTES)")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()  # what comes after the body: a disconnect
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer(send: Send, status: int, detail: str, headers: dict[str, str] | None = None
                  ) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           *((k.encode(), v.encode()) for k, v in (headers or {}).items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
