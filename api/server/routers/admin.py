"""`/v1/admin/keys`: API keys, for admins. A key is shown once, when created."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from kuangchao.api.server.dependencies.auth import allowed, forget_key, keystore, require
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.schemas.access import KeyCreated, KeyList, PrincipalPublic
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.security.apikeys import ROLES, Principal

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"],
                   responses=errors(401, 403, 422, 503))
Admin = Annotated[Principal, Depends(require("key.manage"))]
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_NAME, description="who the key is for")
    tenant: str = Field(pattern=_NAME, description="the tenant whose jobs the key reaches")
    role: str = Field(pattern="^(" + "|".join(ROLES) + ")$", description=", ".join(ROLES))
    ttl_s: float | None = Field(None, gt=0, le=10 * 365 * 86400,
                                description="seconds until the key expires (default: never)")


@router.post("", status_code=201, summary="Create a key; the response holds it, shown once",
             response_model=KeyCreated)
def create_key(body: KeyRequest, store: Store, who: Admin) -> dict[str, Any]:
    key, principal = keystore(store).create(body.name, body.tenant, body.role, body.ttl_s)
    allowed(store, who, "key.create", f"key/{principal.key_id}", name=body.name,
            tenant=body.tenant, role=body.role)
    return {"key": key, **principal.to_json()}


@router.get("", summary="Keys (never the keys themselves)", response_model=KeyList)
def list_keys(store: Store, _: Admin, include_revoked: bool = False) -> dict[str, Any]:
    return {"keys": [p.to_json() for p in keystore(store).list(include_revoked)]}


@router.delete("/{key_id}", summary="Revoke a key; requests with it answer 401 from now on",
               response_model=PrincipalPublic, responses=errors(404))
def revoke_key(key_id: str, store: Store, who: Admin) -> dict[str, Any]:
    principal = keystore(store).revoke(key_id)
    forget_key(store, key_id)  # refused from the next request on, not after the key cache's TTL
    if principal is None:
        raise HTTPException(404, f"no key with id {key_id!r}; `kc admin key list` shows them")
    allowed(store, who, "key.revoke", f"key/{key_id}", name=principal.name)
    return principal.to_json()
