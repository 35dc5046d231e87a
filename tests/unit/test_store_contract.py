"""The store contract (tests/store_contract.py) on the in-memory store."""

from __future__ import annotations

import pytest

from kuangchao.platform.jobs.memory import MemoryStore
from tests.store_contract import *  # noqa: F403 -- the contract's tests run here
from tests.store_contract_security import *  # noqa: F403


@pytest.fixture
def store():
    return MemoryStore()
