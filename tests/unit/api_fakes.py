"""The API in-process over an in-memory store, for unit tests of its routes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuangchao.api.server.dependencies import auth
from kuangchao.api.server.dependencies import store as deps
from kuangchao.platform.jobs.memory import MemoryStore


def memory_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> MemoryStore:
    """A fresh `MemoryStore` that the API's store dependency hands out, `KC_HOME` in
    `tmp_path` (the audit file goes there), and no audit trail cached from an
    earlier test's store. Build the app (`create_app`) after this."""
    store = MemoryStore()
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    monkeypatch.setattr(deps, "open_store", lambda: store)
    auth._trail.cache_clear()
    return store
