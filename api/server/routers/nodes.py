"""`/v1/nodes`: the registry's node view with the GPUs each job holds."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException

from kuangchao.api.server.auth import Caller, allowed, require
from kuangchao.api.server.deps import Store
from kuangchao.platform.jobs.operations import node_view
from kuangchao.platform.security.apikeys import Principal

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", summary="Nodes, their topology, and free and used GPUs")
def list_nodes(store: Store, who: Caller) -> dict[str, Any]:
    return node_view(store, who.sees)


@router.post("/{name}/release", summary="End a node's quarantine so jobs are placed on it again")
def release_node(name: str, store: Store,
                 who: Annotated[Principal, Depends(require("node.manage"))]) -> dict[str, Any]:
    if not store.release_node(name):
        raise HTTPException(404, f"node {name!r} is not quarantined; `kc nodes` shows the "
                                 "quarantined nodes")
    allowed(store, who, "node.release", f"node/{name}")
    return {"node": name, "released": True}
