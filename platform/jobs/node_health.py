"""Node health: each node's recent failures, the quarantine table, and the
cluster-wide info the registry and `kc up` publish."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys


class NodeHealth:
    """The node-health part of `JobStore`."""

    r: redis.Redis
    p: str

    def record_node_failure(self, node: str, ts: float, window_s: float) -> list[float]:
        """Add one failure to a node's history; return its failures within the window."""
        k = keys.node_failures(self.p, node)
        with self.r.pipeline() as pipe:
            pipe.zadd(k, {f"{ts:.6f}": ts})
            pipe.zremrangebyscore(k, "-inf", ts - window_s)
            pipe.expire(k, int(window_s) + 60)
            pipe.zrange(k, 0, -1, withscores=True)
            *_, members = pipe.execute()
        return [score for _, score in members]

    def quarantine_node(self, node: str, entry: dict[str, Any]) -> None:
        self.r.hset(keys.quarantine(self.p), node, json.dumps(entry))

    def release_node(self, node: str) -> bool:
        with self.r.pipeline() as pipe:
            pipe.hdel(keys.quarantine(self.p), node)
            pipe.delete(keys.node_failures(self.p, node))
            removed, _ = pipe.execute()
        return bool(removed)

    def quarantine(self) -> dict[str, dict[str, Any]]:
        """Every stored quarantine entry (expired ones included; see quarantine.active)."""
        return {k: json.loads(v) for k, v in self.r.hgetall(keys.quarantine(self.p)).items()}

    def set_info(self, name: str, value: dict[str, Any]) -> None:
        self.r.set(keys.info(self.p, name), json.dumps(value))

    def info(self, name: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.info(self.p, name))
        return json.loads(raw) if raw else None
