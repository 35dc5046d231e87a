"""FastAPI dependencies: the job store, opened once per process."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from fastapi import Depends, HTTPException

from kuangchao.platform.errors import SpecError, StoreUnavailable
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


def spec_422(exc: SpecError) -> HTTPException:
    """A `SpecError` as 422, one `{loc, msg, field}` per problem, like pydantic's own."""
    return HTTPException(status_code=422, detail=[
        {"loc": path.split(".") if path else [], "msg": msg, "field": path}
        for path, msg in exc.errors])
