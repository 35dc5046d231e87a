"""`/v1/nodes`: the registry's node view with the GPUs each job holds."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from kuangchao.api.deps import Store
from kuangchao.platform.jobs import node_view

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", summary="Nodes, their topology, and free and used GPUs")
def list_nodes(store: Store) -> dict[str, Any]:
    return node_view(store)


@router.post("/{name}/release", summary="End a node's quarantine so jobs are placed on it again")
def release_node(name: str, store: Store) -> dict[str, Any]:
    if not store.release_node(name):
        raise HTTPException(404, f"node {name!r} is not quarantined; `kc nodes` shows the "
                                 "quarantined nodes")
    return {"node": name, "released": True}
