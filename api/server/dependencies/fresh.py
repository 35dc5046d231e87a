"""Short-lived, per-process memory of what every request would otherwise read
from Redis: verified API keys, the queue and node tables, the listings the
console polls.

Each entry is kept for `ttl_s` seconds, so a change made by another process
(a key revoked through another API worker, the scheduler's new node view) is
seen within that bound; a change made through this process drops its entry
at once (the admin and queue routes call `drop` or `clear`). Entries are
never refreshed in place: a reader after the deadline reads Redis again.

No lock: a lookup and a store are each one dict operation, atomic under the
GIL, and two threads that miss at once both read Redis and store the same
answer.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

MISSING: Any = object()


class Fresh:
    """A dict whose entries expire `ttl_s` after they were stored.

    Bounded: past `max_items` entries everything is dropped (the next
    requests read Redis again), which costs less than tracking an order.
    """

    def __init__(self, ttl_s: float, max_items: int = 4096) -> None:
        self.ttl_s, self.max_items = ttl_s, max_items
        self._items: dict[Hashable, tuple[float, Any]] = {}

    def get(self, key: Hashable) -> Any:
        """The value stored under `key` less than `ttl_s` ago, else `MISSING`."""
        hit = self._items.get(key)
        if hit is None or time.monotonic() >= hit[0]:
            return MISSING
        return hit[1]

    def put(self, key: Hashable, value: Any) -> Any:
        if len(self._items) >= self.max_items:
            self._items.clear()
        self._items[key] = (time.monotonic() + self.ttl_s, value)
        return value

    def drop(self, key: Hashable) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()
