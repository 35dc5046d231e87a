"""FastAPI dependencies: the job store, opened once per process."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from fastapi import Depends, HTTPException

from kuangchao.platform.errors import StoreUnavailable
from kuangchao.platform.settings import Settings
from kuangchao.platform.store import JobStore


@lru_cache(maxsize=1)
def _store() -> JobStore:
    s = Settings.from_env()
    return JobStore.from_url(s.redis_url, s.redis_prefix)


def get_store() -> JobStore:
    try:
        return _store()
    except StoreUnavailable as exc:
        raise HTTPException(status_code=503, detail=exc.message) from None


Store = Annotated[JobStore, Depends(get_store)]
