"""`kc doctor`'s judgement of Redis's capacity against the cluster's size: the
`redis-clients` and `redis-memory` findings.

Pure: `doctor_probe.redis_facts` reads CONFIG GET and INFO, `ray_facts` the
cluster's rank slots; platform/jobs/redis_sizing.py says what they should be.
"""

from __future__ import annotations

from typing import Any

from kuangchao.platform.jobs.redis_sizing import (
    FD_MARGIN,
    MIB,
    REDIS_RESERVED_FDS,
    ClusterSize,
    RedisSizing,
    sizing,
)
from kuangchao.platform.runtime.doctor import Finding

FD_NEED = REDIS_RESERVED_FDS + FD_MARGIN  # file descriptors besides the clients
BUSY_WARN = 0.8  # connected clients or used memory, as a share of the limit


def capacity_findings(redis: dict[str, Any], size: ClusterSize | None) -> list[Finding]:
    """`redis` is `redis_facts`' answer; `size` the cluster's current size (None: Ray
    did not answer, so only the limits' use is judged). Nothing when Redis is down:
    the `redis` finding says so."""
    if redis.get("error"):
        return []
    want = sizing(size) if size is not None else None
    if redis.get("config_error"):
        target = (f"maxclients >= {want.maxclients} and maxmemory >= {want.maxmemory_text()}"
                  if want else "maxclients and maxmemory")
        return [Finding("redis-clients", "warn", "cannot read Redis's limits: "
                        f"{redis['config_error']}",
                        "grant the user CONFIG GET and INFO (ACL SETUSER "
                        f"{redis.get('user') or 'USER'} +config|get +info), or, on a managed "
                        f"Redis, check {target} in its settings")]
    return [_clients(redis, want), *_memory(redis, want)]


def _more(limit: int, sized: int) -> int:
    """A new limit for one that is in use: double, or the sized one if that is more."""
    return max(limit * 2, sized)


def _whom(want: RedisSizing) -> str:
    return f"{want.size.slots} rank slot(s) on {want.size.nodes} node(s)"


def _clients(facts: dict[str, Any], want: RedisSizing | None) -> Finding:
    limit = int(facts.get("maxclients") or 0)
    connected = int(facts.get("connected_clients") or 0)
    rejected = int(facts.get("rejected_connections") or 0)
    now = f"maxclients {limit}, {connected} connected"

    def fix(maxclients: int) -> str:
        return (f"set `maxclients {maxclients}` and the open-file limit of redis-server to "
                f"{maxclients + FD_NEED} or more (short of it, Redis lowers maxclients to the limit less "
                f"{REDIS_RESERVED_FDS})")

    sized = want.maxclients if want else 0
    if want is not None and limit < want.clients:
        return Finding("redis-clients", "fail", f"{now}: {_whom(want)} open up to {want.clients} "
                       "connections, more than Redis accepts", fix(want.maxclients))
    if rejected:
        return Finding("redis-clients", "fail", f"{now}: Redis refused {rejected} connection(s) "
                       "since it started (maxclients reached)", fix(_more(limit, sized)))
    if connected >= BUSY_WARN * limit:
        return Finding("redis-clients", "warn", f"{now}: {connected / max(limit, 1):.0%} of the "
                       "limit in use", fix(_more(limit, sized)))
    if want is not None and limit < want.needed:
        return Finding("redis-clients", "warn", f"{now}: enough for {_whom(want)} "
                       f"({want.clients} connections at most), without the headroom for restarts "
                       "and `kc` commands", fix(want.maxclients))
    whom = f", enough for {_whom(want)}" if want else ""
    return Finding("redis-clients", "ok", f"{now}{whom}")


def _memory(facts: dict[str, Any], want: RedisSizing | None) -> list[Finding]:
    limit = int(facts.get("maxmemory") or 0)
    used = int(facts.get("used_memory") or 0)
    policy = str(facts.get("maxmemory_policy") or "")
    lines = f"`maxmemory {want.maxmemory_text()}` and `maxmemory-policy noeviction`" if want \
        else "`maxmemory` and `maxmemory-policy noeviction`"
    out = []
    if policy and policy != "noeviction":
        out.append(Finding("redis-memory", "fail", f"maxmemory-policy is {policy}: at the limit "
                           "Redis evicts keys, job records and heartbeats among them",
                           "set `maxmemory-policy noeviction` (a write past the limit then fails "
                           "with OOM, and its writer says so)"))
    now = f"{used / MIB:.0f} MiB used"
    if not limit:
        out.append(Finding("redis-memory", "warn", f"{now}, maxmemory is 0 (no limit): a job "
                           "writing in a loop can take the host's memory", f"set {lines}"))
    elif used >= BUSY_WARN * limit:
        out.append(Finding("redis-memory", "warn", f"{now} of maxmemory {limit / MIB:.0f} MiB "
                           f"({used / limit:.0%}); past it every write fails with OOM",
                           f"set `maxmemory {_more(limit, want.maxmemory if want else 0) // MIB}mb`"
                           " (finished jobs keep their logs, events and curves in Redis)"))
    elif want is not None and limit < want.maxmemory:
        out.append(Finding("redis-memory", "warn", f"{now} of maxmemory {limit / MIB:.0f} MiB, "
                           f"less than the {want.maxmemory_text()} sized for {_whom(want)}",
                           f"set {lines}"))
    elif not out:
        whom = f", enough for {_whom(want)}" if want else ""
        out.append(Finding("redis-memory", "ok", f"{now} of maxmemory {limit / MIB:.0f} MiB"
                           f" ({policy or 'noeviction'}){whom}"))
    return out
