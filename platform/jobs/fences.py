"""The job's fence set: the rank processes the controller replaced.

When the controller turns a lost heartbeat or a dead actor into a failure, the
processes it is about to replace may still be alive on a node cut off from the
network; once it heals they must write nothing. The controller adds each one,
as `pid@node` (pids repeat across hosts, and in every container's namespace),
to `{prefix}fenced:{job}`; a rank whose lease lapsed reads the set before it
writes again, and exits when it finds itself there (workers/fence.py). The key
is outside the job's own `job:{id}:*` keys, so the job's Redis user may only
read it (platform/jobs/redis_acl.py): no rank can take itself out.

The set lives `FENCE_TTL_S` after its last addition: a stale rank's lease
lapses within `heartbeat_timeout_s` of its cut, so only a process cut off for
longer than that, and healed while its job still runs, could miss it; once the
job has ended its Redis user is gone, and with it any write of its ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuangchao.platform.jobs import keys

FENCE_TTL_S = 30 * 24 * 3600


def member(pid: int, node: str) -> str:
    """A process's entry in the fence set; the node as a beat carries it (no `|`)."""
    return f"{pid}@{node.replace('|', '_')}"


def queue_fence_check(pipe: Any, p: str, job_id: str, pid: int, node: str) -> None:
    """Ask, in a rank's heartbeat pipeline, whether this process is fenced."""
    pipe.sismember(keys.fenced(p, job_id), member(pid, node))


def read_fenced(client: Any, p: str, job_id: str, pid: int, node: str) -> bool:
    """Whether this process is fenced (one round trip on the rank's own client)."""
    return bool(client.sismember(keys.fenced(p, job_id), member(pid, node)))


class Fences:
    """The fence part of `JobStore`: the controller writes, anyone reads."""

    r: Any
    p: str

    def fence(self, job_id: str, members: Iterable[str]) -> None:
        """Add processes (`member(pid, node)`) to the job's fence set."""
        members = sorted(set(members))
        if not members:
            return
        key = keys.fenced(self.p, job_id)
        with self.r.pipeline() as pipe:
            pipe.sadd(key, *members)
            pipe.expire(key, FENCE_TTL_S)
            pipe.execute()

    def fenced(self, job_id: str) -> set[str]:
        """Every process fenced off the job."""
        return set(self.r.smembers(keys.fenced(self.p, job_id)))
