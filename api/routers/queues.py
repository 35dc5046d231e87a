"""`/v1/queues`: the queue table with each queue's current use."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kuangchao.api.deps import Store
from kuangchao.platform.jobs import queue_view

router = APIRouter(prefix="/v1/queues", tags=["queues"])


@router.get("", summary="Queues, quotas, and the GPUs each holds")
def list_queues(store: Store) -> dict[str, Any]:
    return queue_view(store)
