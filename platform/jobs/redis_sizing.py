"""How big Redis must be for a cluster: `maxclients`, the open-file limit and `maxmemory`.

Pure: `kc up` sizes its embedded Valkey with it, the compose stack's redis.conf
and the Helm chart's Redis restate its numbers (tests compare them), and `kc
doctor` judges a running Redis against it. docs/operator-guide.md, "Redis
sizing", explains each number.

A cluster's size is its rank slots: on each node, the most ranks that run
there at once. A GPU node holds one rank per GPU (`gpus_per_rank` 1, the
most); a node that declares no GPUs holds CPU-only ranks (`gpus_per_rank: 0`),
one per whole CPU at the default `cpus_per_rank` of 1. CPU-only ranks a job
puts on a GPU node's spare CPUs, or fractional `cpus_per_rank`, go beyond the
declared size: the headroom absorbs some, and `kc doctor` compares the
connections Redis actually holds with its limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kuangchao.platform.jobs.encoding import AUDIT_CAP, EVENT_CAP, LOG_CAP, METRICS_CAP

# -- connections ---------------------------------------------------------------------
# What each process keeps open to Redis at the most. redis-py opens a pool's
# connections on demand, one per thread using the client at the same moment.
#
# A rank (workers/runtime/worker.py, liveness.py):
RANK_STORE = 2       # its JobStore: the train loop, and the token thread's revocation
                     # check (workers/runtime/credentials.py, `kc-token`)
RANK_HEARTBEAT = 1   # beat_client.heartbeat_client, used by the heartbeat thread alone
                     # (beats, progress, flags, `kc debug` answers)
RANK_LOG = 1         # liveness.log_sink: a second heartbeat_client for the job log
RANK_PROBE = 1       # platform/jobs/link_probe.timed_write's own connection, and
                     # workers/runtime/reach.py's connect check at start (brief)
RANK_CONNECTIONS = RANK_STORE + RANK_HEARTBEAT + RANK_LOG + RANK_PROBE
# A job's controller (platform/runtime/actors.py, JobControllerActor):
CONTROLLER_STORE = 2  # its JobStore: the run loop, and a second call beside it
                      # (the actor's max_concurrency is 2)
CONTROLLER_SPARES = 1  # platform/execution/spares.py opens a store of its own
CONTROLLER_CONNECTIONS = CONTROLLER_STORE + CONTROLLER_SPARES
# A job's node agent (workers/runtime/node_agent.py): one heartbeat client on each
# node the job uses, so at most one per rank slot (a cluster of one-rank jobs with
# `node_agents: on`).
NODE_AGENT_CONNECTIONS = 1
# The control plane's fixed actors (platform/runtime/actors.py, authority_actor.py):
# the scheduler (its store, and the store launch_controller opens per launch until
# collected) 2, the registry 1, the token authority (its calls and its sweep
# thread) 2, the bootstrap / `kc control-plane start --watch` 1.
CONTROL_PLANE_CONNECTIONS = 6
# One API server process (api/server): one store, but its sync routes run on
# anyio's thread pool (40 threads by default), each taking a pooled connection,
# plus the metrics file_sd refresher and the event loop's own calls.
API_CONNECTIONS = 40 + 2
# `kc` commands, `kc logs --follow`, `kc doctor`, redis-cli: people, not the cluster.
OPERATOR_MARGIN = 64
# Up to one job per rank slot (a cluster of one-rank jobs), so one controller per slot.
SLOT_CONNECTIONS = RANK_CONNECTIONS + CONTROLLER_CONNECTIONS + NODE_AGENT_CONNECTIONS
CLIENT_HEADROOM = 2  # restarts overlap old and new processes; redis-py pools grow
# Redis's own default. Sizing only raises it: a small cluster's need (`needed`) is
# far below it, and a few thousand idle descriptors cost nothing.
MIN_MAXCLIENTS = 10_000
# File descriptors besides clients: Redis reserves 32 for itself (and lowers
# maxclients when RLIMIT_NOFILE is below maxclients + 32); the rest covers the AOF
# and RDB files, listening sockets, replicas and the log.
REDIS_RESERVED_FDS = 32
FD_MARGIN = 96

# -- memory --------------------------------------------------------------------------
MIB = 1 << 20
# Average sizes of what the capped lists keep (platform/jobs/encoding.py caps them
# by count): a JSON log line with its ts/level/job_id/rank/module, an event, a point
# of the loss curve. A job whose lines run to LOG_LINE_BYTES fills more: the
# headroom and `kc doctor`'s used-memory check are there for it.
LOG_LINE_AVG_BYTES = 400
EVENT_AVG_BYTES = 300
POINT_AVG_BYTES = 120
JOB_RECORD_BYTES = 256 << 10  # record, progress, checkpoints, samples, reports, targets
JOB_BYTES = (LOG_CAP * LOG_LINE_AVG_BYTES + EVENT_CAP * EVENT_AVG_BYTES
             + METRICS_CAP * POINT_AVG_BYTES + JOB_RECORD_BYTES)
# Per rank: its beat, an answer to a stack request (kept STACK_TTL_S) and one to `kc debug`.
RANK_BYTES = 128 << 10
# Per node: one link probe in flight (workers/trainer/links.py PROBE_BYTES, 8 MiB),
# and the node's failure window.
NODE_BYTES = 8 * MIB + (64 << 10)
AUDIT_AVG_BYTES = 500
FIXED_BYTES = AUDIT_CAP * AUDIT_AVG_BYTES + 64 * MIB  # the audit stream; keys, queues, info
CLIENT_BYTES = 32 << 10  # a client's query and reply buffers when idle
# x3/2: fragmentation, and the history of finished jobs growing (integers: see `sizing`)
MEMORY_HEADROOM = (3, 2)
MIN_MAXMEMORY = 2048 * MIB  # what compose and the chart had before sizing: never less
MAXMEMORY_STEP = 256 * MIB


@dataclass(frozen=True)
class ClusterSize:
    """What sizing needs to know of a cluster: its nodes and their rank slots."""

    nodes: int
    slots: int
    api_processes: int = 1


@dataclass(frozen=True)
class RedisSizing:
    size: ClusterSize
    clients: int  # connections the cluster opens at the most, without headroom
    needed: int  # clients with headroom: less than this is too few
    maxclients: int  # needed, and never below Redis's default
    nofile: int  # RLIMIT_NOFILE Redis needs for maxclients
    maxmemory: int  # bytes

    def maxmemory_text(self) -> str:
        """maxmemory as redis.conf writes it (`2304mb`)."""
        return f"{self.maxmemory // MIB}mb"

    def config_lines(self) -> list[str]:
        return [f"maxclients {self.maxclients}", f"maxmemory {self.maxmemory_text()}",
                "maxmemory-policy noeviction"]


def node_slots(gpus: float, cpus: float) -> int:
    """The most ranks one node holds at once (see the module's docstring)."""
    return max(int(gpus), 0) if gpus > 0 else max(int(math.floor(cpus)), 0)


def size_of(nodes: Iterable[tuple[float, float]], api_processes: int = 1) -> ClusterSize:
    """A cluster of nodes given as (GPUs, CPUs)."""
    listed = list(nodes)
    return ClusterSize(len(listed), sum(node_slots(g, c) for g, c in listed), api_processes)


def expected_clients(size: ClusterSize) -> int:
    return (size.slots * SLOT_CONNECTIONS + CONTROL_PLANE_CONNECTIONS
            + size.api_processes * API_CONNECTIONS)


def sizing(size: ClusterSize) -> RedisSizing:
    """maxclients, the open-file limit and maxmemory for `size`.

    Integer steps only, so that the Helm chart's template can repeat them
    (helm/kuangchao/templates/_helpers.tpl, `kuangchao.redisSizing`).
    """
    if size.nodes < 0 or size.slots < 0 or size.api_processes < 0:
        raise ValueError(f"a cluster size cannot be negative: {size}")
    clients = expected_clients(size)
    needed = CLIENT_HEADROOM * clients + OPERATOR_MARGIN
    maxclients = max(MIN_MAXCLIENTS, needed)
    need = (size.slots * (JOB_BYTES + RANK_BYTES) + size.nodes * NODE_BYTES + FIXED_BYTES
            + clients * CLIENT_BYTES)
    num, den = MEMORY_HEADROOM
    steps = -(-need * num // (den * MAXMEMORY_STEP))  # rounded up to a whole step
    return RedisSizing(size=size, clients=clients, needed=needed, maxclients=maxclients,
                       nofile=maxclients + REDIS_RESERVED_FDS + FD_MARGIN,
                       maxmemory=max(MIN_MAXMEMORY, steps * MAXMEMORY_STEP))


def parse_memory(text: str) -> int:
    """A redis.conf memory value (`2gb`, `512mb`, `1048576`) in bytes.

    Raises:
        ValueError: Naming the value.
    """
    units = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000 ** 2, "mb": MIB,
             "g": 1000 ** 3, "gb": 1 << 30}
    raw = text.strip().lower()
    digits = raw.rstrip("kmgb")
    if not digits.isdigit() or raw[len(digits):] not in units:
        raise ValueError(f"{text!r} is not a Redis memory value (such as 2gb or 512mb)")
    return int(digits) * units[raw[len(digits):]]
