"""`/v1/nodes`: the registry's node view with the GPUs each job holds."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException

from kuangchao.api.server.dependencies.auth import Caller, allowed, require
from kuangchao.api.server.dependencies.store import Store
from kuangchao.api.server.schemas.cluster import NodeList, NodeReleased
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.control.operations import node_view
from kuangchao.platform.security.apikeys import Principal

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=errors(401, 503))


@router.get("", summary="Nodes, their topology, and free and used GPUs", response_model=NodeList,
            response_model_exclude_unset=True)
def list_nodes(store: Store, who: Caller) -> dict[str, Any]:
    return node_view(store, who.sees)


@router.post("/{name}/release", summary="End a node's quarantine so jobs are placed on it again",
             response_model=NodeReleased, responses=errors(403, 404, 422))
def release_node(name: str, store: Store,
                 who: Annotated[Principal, Depends(require("node.manage"))]) -> dict[str, Any]:
    if not store.release_node(name):
        raise HTTPException(404, f"node {name!r} is not quarantined; `kc nodes` shows the "
                                 "quarantined nodes")
    allowed(store, who, "node.release", f"node/{name}")
    return {"node": name, "released": True}
