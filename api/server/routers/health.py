"""`/healthz` (no key needed): the API is up and can reach Redis; `/v1/whoami`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kuangchao.api.server.dependencies.auth import Caller
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.schemas.access import WhoAmI
from kuangchao.api.server.schemas.cluster import Health
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.security.apikeys import PERMISSIONS
from kuangchao.platform.version import __version__

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses=errors(503))
def healthz(store: Store) -> dict[str, Any]:
    store.ping()
    return {"status": "ok", "version": __version__}


@router.get("/v1/whoami", summary="The principal the presented API key speaks for",
            response_model=WhoAmI, responses=errors(401, 503))
def whoami(who: Caller) -> dict[str, Any]:
    return {**who.to_json(), "permissions": sorted(PERMISSIONS[who.role])}
