"""The API process's job store: the tables every submit reads, from a short cache.

A submit checks the job against the queue table (`info:queues`) and the
registry's node view (`info:nodes`); reading and parsing both from Redis on
every request cost two round trips. Here they are kept for `INFO_TTL_S`:

- a queue table replaced through this process (`PUT /v1/queues`, which calls
  `set_info`) is seen by the next request; one written by another process
  (`kc up`, another API worker) within `INFO_TTL_S`;
- the node view is the registry's, refreshed every scheduler cycle; a submit
  checked against a view up to `INFO_TTL_S` older is what it would have been
  a cycle earlier. The scheduler places against its own, current view.

The cached documents are shared between requests: readers must not change them
(none does; they are parsed into new objects).
"""

from __future__ import annotations

from typing import Any

from kuangchao.api.server.dependencies.fresh import MISSING, Fresh
from kuangchao.platform.jobs.store import JobStore

INFO_TTL_S = 1.0
CACHED_INFO = frozenset({"queues", "nodes"})
_info = Fresh(INFO_TTL_S)


class ServedStore(JobStore):
    """`JobStore` with `info("queues")` and `info("nodes")` served from `_info`."""

    def info(self, name: str) -> dict[str, Any] | None:
        if name not in CACHED_INFO:
            return super().info(name)
        got = _info.get((self.p, name))
        if got is MISSING:
            got = _info.put((self.p, name), super().info(name))
        return got

    def set_info(self, name: str, value: dict[str, Any]) -> None:
        super().set_info(name, value)
        _info.drop((self.p, name))
