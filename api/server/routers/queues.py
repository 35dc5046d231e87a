"""`/v1/queues`: the queue table with each queue's current use; operators replace it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response

from kuangchao.api.server.dependencies.auth import Caller, allowed, require
from kuangchao.api.server.dependencies.listing import changed, polled
from kuangchao.api.server.dependencies.store import Store, spec_422
from kuangchao.api.server.schemas.cluster import QueueList
from kuangchao.api.server.schemas.common import errors
from kuangchao.platform.control.operations import queue_view
from kuangchao.platform.errors import SpecError
from kuangchao.platform.scheduling.policies import POLICIES
from kuangchao.platform.security.apikeys import Principal
from kuangchao.platform.spec.queues import parse_queues

router = APIRouter(prefix="/v1/queues", tags=["queues"], responses=errors(401, 503))


@router.get("", summary="Queues, quotas, and the GPUs each holds", response_model=QueueList)
def list_queues(store: Store, _: Caller) -> Response:
    """Polled by every console tab; the same for every caller, cached (api/server/dependencies/listing.py)."""
    return polled(("queues",), lambda: QueueList.model_validate(
        queue_view(store)).model_dump_json().encode())


@router.put("", summary="Replace the queue table (the same document as `kc up --queues`)",
            response_model=QueueList, responses=errors(403, 422))
def put_queues(store: Store, who: Annotated[Principal, Depends(require("queue.manage"))],
               doc: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    try:
        table = parse_queues(doc)
        if table.policy not in POLICIES:
            raise SpecError([("policy", f"{table.policy!r} is unknown; choose one of "
                                        f"{', '.join(sorted(POLICIES))}")])
    except SpecError as exc:
        raise spec_422(exc) from None
    store.set_info("queues", table.to_json())
    store.wake_scheduler("queues")
    allowed(store, who, "queue.manage", "queues", queues=",".join(table.names))
    changed()
    return queue_view(store)
