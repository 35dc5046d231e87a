"""The store contract (tests/store_contract.py) on the Redis `JobStore`, against a
real Redis under a key prefix of its own (the `store` fixture deletes its keys)."""

from __future__ import annotations

import pytest

from tests.store_contract import *  # noqa: F403 -- the contract's tests run here
from tests.store_contract_security import *  # noqa: F403

pytestmark = pytest.mark.integration
