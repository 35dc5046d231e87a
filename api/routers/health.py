"""`/healthz`: the API is up and can reach Redis."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kuangchao.api.deps import Store
from kuangchao.platform.version import __version__

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(store: Store) -> dict[str, Any]:
    store.r.ping()
    return {"status": "ok", "version": __version__}
