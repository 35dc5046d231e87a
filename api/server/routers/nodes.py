"""`/v1/nodes`: the registry's node view with the GPUs each job holds; an
operator's overrides of a node's GPU type and emulated speed."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Response

from kuangchao.api.server.dependencies.auth import Caller, allowed, require
from kuangchao.api.server.dependencies.listing import changed, polled, scope_of
from kuangchao.api.server.dependencies.store import Store, spec_422
from kuangchao.api.server.schemas.cluster import NodeList, NodeOverridden, NodeReleased, NodeSet
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.cluster.overrides import checked, store_override
from kuangchao.platform.control.operations import node_view
from kuangchao.platform.errors import SpecError
from kuangchao.platform.security.apikeys import Principal

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=errors(401, 503))
Manager = Annotated[Principal, Depends(require("node.manage"))]


@router.get("", summary="Nodes, their topology, and free and used GPUs", response_model=NodeList,
            response_model_exclude_unset=True)
def list_nodes(store: Store, who: Caller) -> Response:
    """Polled by every console tab: cached per tenant scope (api/server/dependencies/listing.py)."""
    return polled(("nodes", scope_of(who)), lambda: NodeList.model_validate(
        node_view(store, who.sees)).model_dump_json(exclude_unset=True).encode())


@router.patch("/{name}", summary="Override a node's GPU type or emulated speed (null clears)",
              response_model=NodeOverridden, response_model_exclude_unset=True,
              responses=errors(403, 404, 422))
def set_node(name: str, body: NodeSet, store: Store, who: Manager) -> dict[str, Any]:
    entry = next((n for n in (store.info("nodes") or {}).get("nodes", []) if n["name"] == name),
                 None)
    if entry is None:
        raise HTTPException(404, f"node {name!r} is not in the registry's view; `kc nodes` "
                                 "lists the nodes")
    try:
        changes = checked(entry, body.model_dump(include=body.model_fields_set))
    except SpecError as exc:
        raise spec_422(exc) from None
    overrides = store_override(store, name, changes)
    # The scheduler's cycle refreshes the registry's view, overrides applied.
    store.wake_scheduler("nodes")
    allowed(store, who, "node.set", f"node/{name}",
            **{k: "cleared" if v is None else v for k, v in changes.items()})
    changed()
    return {"node": name, "overrides": overrides}


@router.post("/{name}/release", summary="End a node's quarantine so jobs are placed on it again",
             response_model=NodeReleased, responses=errors(403, 404, 422))
def release_node(name: str, store: Store, who: Manager) -> dict[str, Any]:
    if not store.release_node(name):
        raise HTTPException(404, f"node {name!r} is not quarantined; `kc nodes` shows the "
                                 "quarantined nodes")
    allowed(store, who, "node.release", f"node/{name}")
    changed()
    return {"node": name, "released": True}
