"""One membership of a job's process group: the document the controller publishes in
Redis and every rank reads to re-form the group (workers/elastic/generation.py joins it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Generation:
    """One membership of a job's process group, as the controller publishes it."""

    gen: int
    world_size: int
    replicas: int
    accum: int
    host: str
    port: int
    ranks: dict[int, int]  # current rank -> rank in this generation; absent ranks leave
    joining: tuple[int, ...]  # ranks of this generation that start without state
    cause: str = ""
    # The job's peer-memory keepers and each rank's node in this generation
    # (`KeeperPlan.to_json()`), or None without peer memory: survivors copy by it
    # from here on, so that a rank whose node changed copies to its new peers.
    keepers: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"gen": self.gen, "world_size": self.world_size, "replicas": self.replicas,
                "accum": self.accum, "host": self.host, "port": self.port,
                "ranks": {str(k): v for k, v in self.ranks.items()},
                "joining": list(self.joining), "cause": self.cause, "keepers": self.keepers}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Generation:
        return cls(gen=int(d["gen"]), world_size=int(d["world_size"]),
                   replicas=int(d["replicas"]), accum=int(d["accum"]), host=d["host"],
                   port=int(d["port"]), ranks={int(k): int(v) for k, v in d["ranks"].items()},
                   joining=tuple(d.get("joining") or ()), cause=d.get("cause", ""),
                   keepers=d.get("keepers") if isinstance(d.get("keepers"), dict) else None)

    @property
    def prefix(self) -> str:
        """The generation's key prefix in the rendezvous store (PrefixStore adds the "/")."""
        return f"gen{self.gen}"

    def ready_key(self, rank: int) -> str:
        """The key `mark_ready` sets, as the controller sees it in the unprefixed store."""
        return f"{self.prefix}/ready/{rank}"
