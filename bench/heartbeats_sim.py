"""The simulated side of bench/heartbeats.py: the ranks, their node agents, and their Redis.

* `redis_server`: a private `redis-server` on a free port for the run (no
  persistence, bind 127.0.0.1, maxclients raised), always stopped after; the
  shared KCBENCH_REDIS_URL when the binary is missing (`delete_keys` then
  cleans up). `raise_fd_limit` makes room for one connection per rank.
* `beat_writer`: one forked writer process for a contiguous shard of whole
  nodes (`RANKS_PER_NODE` ranks each). Its `WriterShared.mode` says which
  design it simulates, switchable while it runs:
  - `PER_RANK`: every rank beats on its own key once a second, each beat on the
    wire exactly what `workers/runtime/heartbeat.py` sends in its one round
    trip (see bench/heartbeats.py's docstring);
  - `AGENTS`: every node's agent sends once a second what
    `workers/runtime/node_agent.py`'s `relay_once` sends: its record
    (`encode_node_record` of its ranks' beats written within the last two
    periods, `SET ... PX <timeout>` as `queue_node_record` does), the fence
    set, the job's flags and its ranks' stack requests, in one round trip. A
    dead agent writes nothing from `DEAD_AFTER_S` on, and its ranks fall back
    to their own keys.
  Over raw sockets, with the RESP replies counted, not parsed. `WriterConfig`
  is one writer's part, `WriterShared` what the writers and the driver share,
  `Writers` starts and stops them.
* `pick_roles`, `pick_dead_agents`: which ranks and agents misbehave (fixed seeds).

The controller side (scans, classifier, measurements, metrics) is in
bench/heartbeats.py and bench/heartbeats_nodes.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.report import REDIS_URL, log
from kuangchao.platform.jobs import keys as redis_keys
from kuangchao.platform.jobs.fences import member
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import encode_node_record
from kuangchao.platform.runtime.procs import free_port

JOB = "hbbench"
HEARTBEAT_TIMEOUT_S = 10.0  # fault_tolerance.heartbeat_timeout_s default: key TTL and expiry
TICKS_PER_S = 20  # each writer sends its due beats in 20 batches a second
WARMUP_S = 2.0  # every rank has beaten at least once before measuring
DEAD_AFTER_S = 1.5  # dead ranks and dead agents stop this long after the start
RANKS_PER_NODE = 8  # one agent per node of 8 ranks (8 GPUs a node)
AGENT_PID_BASE = 900_000  # a simulated agent's pid: this + its node's number
DEAD_AGENTS = 2
WRITER_NICE = 5  # the writers' CPU priority (they stand in for other machines)
STALE_FILE_S = 2.0  # an agent relays a beat file rewritten within two periods (node_agent.py)

HEALTHY, DEAD, HUNG, SLOW_INIT = range(4)
PER_RANK, AGENTS = range(2)  # what the writers send (WriterShared.mode)


# -- Redis ---------------------------------------------------------------------

def raise_fd_limit() -> int:
    """Raise this process's open-file limit to the hard limit (inherited by
    redis-server and the writers); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@contextmanager
def redis_server(maxclients: int) -> Iterator[tuple[str, bool]]:
    """(url, private): a private redis-server for the run, always stopped after;
    the shared KCBENCH_REDIS_URL when the binary is missing."""
    exe = shutil.which("redis-server")
    if exe is None:
        log(f"redis-server not on PATH: using the shared Redis at {REDIS_URL} "
            "(its CPU numbers include other users)")
        yield REDIS_URL, False
        return
    tmp = Path(tempfile.mkdtemp(prefix="kcbench-redis-"))
    port = free_port()
    with open(tmp / "redis.log", "wb") as out:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxclients", str(maxclients), "--tcp-backlog", "1024", "--dir", str(tmp)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start:\n"
                                       + (tmp / "redis.log").read_text()[-2000:]) from None
                time.sleep(0.05)
        log(f"private redis-server pid {proc.pid} on port {port}")
        yield url, True
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def delete_keys(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i:i + 500])


def pick_roles(ranks: int) -> dict[int, int]:
    """4 dead, 4 hung and 2 slow-start ranks, spread over the shards (fixed seed)."""
    special = random.Random(7).sample(range(ranks), 10)
    return {r: DEAD if k < 4 else HUNG if k < 8 else SLOW_INIT for k, r in enumerate(special)}


def pick_dead_agents(ranks: int, roles: dict[int, int]) -> list[int]:
    """`DEAD_AGENTS` nodes whose agent dies, among the nodes without a misbehaving
    rank (whose verdict would then be the agent's), fixed seed."""
    busy = {r // RANKS_PER_NODE for r in roles}
    free = [n for n in range(ranks // RANKS_PER_NODE) if n not in busy]
    return sorted(random.Random(11).sample(free, DEAD_AGENTS))


def node_name(node: int) -> str:
    return f"node-{node}"


# -- the writers (forked processes) --------------------------------------------------

@dataclass(frozen=True)
class WriterConfig:
    index: int
    ranks: list[int]  # contiguous, whole nodes (rank // RANKS_PER_NODE is its node)
    roles: dict[int, int]  # rank -> DEAD / HUNG / SLOW_INIT (absent: healthy)
    dead_agents: frozenset[int]  # nodes whose agent stops at DEAD_AFTER_S
    host: str
    port: int
    prefix: str
    rank_connections: int  # for PER_RANK (0: this writer only simulates agents)
    agent_connections: int  # for AGENTS
    flag_keys: list[str]  # the job's flags every beat reads (`carried_flags`)
    fence_key: str  # the job's fence set
    progress_key: str  # rank 0's beats also carry the job's progress
    ttl_s: float  # the keys' PX: the heartbeat timeout


def _resp(*args: bytes) -> bytes:
    """One command in the Redis protocol."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


@dataclass
class WriterShared:
    """What the writers and the driver share (created before the fork)."""

    ready: mp.Queue
    go: mp.Event
    stop: mp.Event
    t_start: mp.Value  # wall time of tick 0, set before `go`
    mode: mp.Value  # PER_RANK or AGENTS, read every tick
    beats: mp.Array  # per-rank beats (SETs of a rank's own key) sent, per writer
    records: mp.Array  # node records sent, per writer
    lag: mp.Array  # worst lateness of a batch after WARMUP_S, per writer (s)
    skipped: mp.Array  # ticks skipped after falling more than a second behind, per writer


def _count_replies(buf: bytes, pos: int) -> tuple[int, int]:
    """Complete flat RESP replies in buf[pos:]: (how many, where the next starts).

    The writers send SET, GET, EXISTS, SISMEMBER, HSET and SMEMBERS of an empty
    set, so replies are +OK, an integer, a bulk string, nil or an empty array. An
    error reply raises.
    """
    n = 0
    while True:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return n, pos
        kind = buf[pos:pos + 1]
        if kind == b"-":
            raise RuntimeError(f"redis error: {buf[pos + 1:end].decode(errors='replace')}")
        if kind == b"$" and (length := int(buf[pos + 1:end])) >= 0:
            if len(buf) < end + 4 + length:
                return n, pos
            end += 2 + length
        pos, n = end + 2, n + 1


# A reply other than one line: an error, a bulk string with content, a non-empty array.
_NOT_ONE_LINE = re.compile(rb"(?:^|\r\n)(?:-|\$\d|\*[1-9])")


def _await_replies(sock: socket.socket, expected: int) -> None:
    """Read the replies to `expected` commands. The usual ones are one line each
    (+OK, an integer, nil, an empty array), so counting lines is enough; anything
    else is parsed reply by reply (`_count_replies`)."""
    buf = b""
    while buf.count(b"\r\n") < expected:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("redis closed a writer connection")
        buf += chunk
        if _NOT_ONE_LINE.search(buf):
            break
    else:
        return
    pos, got = 0, 0
    while True:
        n, pos = _count_replies(buf, pos)
        got += n
        if got >= expected:
            return
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("redis closed a writer connection")
        buf = buf[pos:] + chunk
        pos = 0


class _Shard:
    """One writer's ranks and nodes: their beats' state, and the protocol around
    each value, built once (what redis-py's pipeline puts on the wire, minus the value)."""

    def __init__(self, cfg: WriterConfig) -> None:
        self.cfg = cfg
        self.first = cfg.ranks[0]
        self.first_node = self.first // RANKS_PER_NODE
        n, nodes = len(cfg.ranks), len(cfg.ranks) // RANKS_PER_NODE
        ttl = str(int(cfg.ttl_s * 1000)).encode()
        px = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
        flags = b"".join(_resp(b"EXISTS", k.encode()) for k in cfg.flag_keys)
        fenced = cfg.fence_key.encode()
        self.progress = cfg.progress_key.encode()
        self.names = [node_name(self.first_node + j) for j in range(nodes)]
        # A rank's own beat (workers/runtime/heartbeat.py `_beat_once`): SISMEMBER of its
        # process in the fence set, SET hb:{rank} PX, GET stackreq:{rank}, EXISTS of the flags.
        self.heads, self.tails, self.stack_checks = [], [], []
        for i, r in enumerate(cfg.ranks):
            key = redis_keys.beat(cfg.prefix, JOB, r).encode()
            req = redis_keys.stack_request(cfg.prefix, JOB, r).encode()
            me = member(100_000 + r, self.names[i // RANKS_PER_NODE]).encode()
            self.heads.append(_resp(b"SISMEMBER", fenced, me)
                              + b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n" % (len(key), key))
            self.tails.append(px + _resp(b"GET", req) + flags)
            self.stack_checks.append(req)
        self.rank_replies = 3 + len(cfg.flag_keys)
        # An agent's record (workers/runtime/node_agent.py `relay_once`): SET nb:{node} PX,
        # SMEMBERS of the fence set (empty: one reply), and one MGET of the flags and the
        # stack request of each rank it relays (nil each: one line each, after its header).
        self.node_heads, self.node_tails = [], []
        self.flag_names = [k.encode() for k in cfg.flag_keys]
        for name in self.names:
            key = redis_keys.node_beat(cfg.prefix, JOB, name).encode()
            self.node_heads.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n" % (len(key), key))
            self.node_tails.append(px + _resp(b"SMEMBERS", fenced))
        self.node_replies = 3 + len(cfg.flag_keys)  # SET, SMEMBERS, MGET's header and flags
        self.roles = [cfg.roles.get(r, HEALTHY) for r in cfg.ranks]
        self.seq = [0] * n
        self.frozen = [0.0] * n  # progress_ts of hung / slow-start ranks
        self.last: list[Beat | None] = [None] * n  # each rank's newest beat (its beat file)
        self.agent_seq = [0] * nodes
        self.dead_at = 0.0

    def beat(self, i: int, ts: float) -> Beat | None:
        """Local rank i's next beat; None once a dead rank has stopped."""
        role = self.roles[i]
        if role == DEAD and ts >= self.dead_at:
            return None
        self.seq[i] += 1
        rank, seq = self.first + i, self.seq[i]
        node = self.names[i // RANKS_PER_NODE]
        if role == HEALTHY:  # a step per beat: progress is now
            beat = Beat(rank, seq, "forward", 100_000 + rank, node, ts, ts, seq)
        else:
            self.frozen[i] = self.frozen[i] or ts
            beat = Beat(rank, 1 if role == HUNG else 0, "init" if role == SLOW_INIT else "collective",
                        100_000 + rank, node, ts, self.frozen[i], seq)
        self.last[i] = beat
        return beat

    def _hset_progress(self, seq: int, ts: float) -> bytes:
        return _resp(b"HSET", self.progress, b"step", b"%d" % seq, b"updated_at", b"%.3f" % ts)

    def rank_batch(self, idxs: list[int] | range, parts: list[bytes]) -> tuple[int, int]:
        """Own-key beats of local ranks `idxs` appended to `parts`: (replies, beats)."""
        expected = beats = 0
        for i in idxs:
            ts = time.time()
            beat = self.beat(i, ts)
            if beat is None:
                continue
            value = beat.encode().encode()
            parts += (self.heads[i], b"$%d\r\n" % len(value), value, self.tails[i])
            beats, expected = beats + 1, expected + self.rank_replies
            if beat.rank == 0:  # the chief reports a step per beat (JobStore.set_progress's HSET)
                parts.append(self._hset_progress(beat.seq, ts))
                expected += 1
        return expected, beats

    def node_batch(self, js: list[int], parts: list[bytes]) -> tuple[int, int, int]:
        """Records of local nodes `js` appended to `parts`: (replies, beats, records).
        A dead agent's ranks beat on their own keys instead (they fell back)."""
        expected = beats = records = 0
        for j in js:
            ts = time.time()
            lo = j * RANKS_PER_NODE
            if self.first_node + j in self.cfg.dead_agents and ts >= self.dead_at \
                    and self.agent_seq[j]:  # dies once it wrote a record (a late writer's did not)
                e, b = self.rank_batch(range(lo, lo + RANKS_PER_NODE), parts)
                expected, beats = expected + e, beats + b
                continue
            relayed, checks = [], []
            for i in range(lo, lo + RANKS_PER_NODE):
                beat = self.beat(i, ts) or self.last[i]  # a dead rank's file: its last beat
                if beat is not None and ts - beat.ts <= STALE_FILE_S:
                    relayed.append(beat)
                    checks.append(self.stack_checks[i])
            self.agent_seq[j] += 1
            record = encode_node_record(self.names[j], AGENT_PID_BASE + self.first_node + j, ts,
                                        self.agent_seq[j], relayed)
            parts += (self.node_heads[j], b"$%d\r\n" % len(record), record, self.node_tails[j],
                      _resp(b"MGET", *self.flag_names, *checks))
            expected, records = expected + self.node_replies + len(checks), records + 1
            if self.first + lo == 0:  # rank 0's own HSET of its progress (not the agent's)
                parts.append(self._hset_progress(self.seq[0], ts))
                expected += 1
        return expected, beats, records


def _connect(cfg: WriterConfig, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection((cfg.host, cfg.port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    return socks


def beat_writer(cfg: WriterConfig, shared: WriterShared) -> None:
    """Beat every rank (PER_RANK) or write every node's record (AGENTS) of the shard
    once a second until `stop`, in the mode `shared.mode` says at each tick.

    Each second is cut into TICKS_PER_S ticks: local rank i beats in tick i % 20
    on rank connection i % rank_connections; local node j's agent writes in
    tick j % 20 on agent connection j % agent_connections. Runs at `WRITER_NICE`:
    the writers stand in for ranks and agents on other machines, so on a small
    box they should not take the CPU from Redis or the controller. A writer more
    than a second behind schedule (starved by other work) skips the missed
    ticks, as late ranks would miss beats, instead of bursting to catch up;
    the skips are reported.
    """
    os.nice(WRITER_NICE)
    try:
        rank_socks = _connect(cfg, cfg.rank_connections)
        agent_socks = _connect(cfg, cfg.agent_connections)
    except OSError as exc:
        shared.ready.put(f"writer {cfg.index}: connect failed: {exc}")
        return
    shared.ready.put("ok")
    shard = _Shard(cfg)
    rank_slots: list[dict[int, list[int]]] = [{} for _ in range(TICKS_PER_S)]
    if rank_socks:
        for i in range(len(cfg.ranks)):
            rank_slots[i % TICKS_PER_S].setdefault(i % len(rank_socks), []).append(i)
    node_slots: list[dict[int, list[int]]] = [{} for _ in range(TICKS_PER_S)]
    if agent_socks:
        for j in range(len(shard.names)):
            node_slots[j % TICKS_PER_S].setdefault(j % len(agent_socks), []).append(j)

    shared.go.wait()
    t0 = shared.t_start.value
    shard.dead_at = t0 + DEAD_AFTER_S
    tick, beats, records, worst, skipped = 0, 0, 0, 0.0, 0
    while not shared.stop.is_set():
        due = t0 + tick / TICKS_PER_S
        now = time.time()
        if now < due:
            time.sleep(due - now)
        elif now - due > worst and due - t0 > WARMUP_S:
            worst = shared.lag[cfg.index] = now - due
        if now - due > 1.0:
            behind = int((now - due) * TICKS_PER_S)
            tick, skipped = tick + behind, skipped + behind
            shared.skipped[cfg.index] = skipped
        agents = shared.mode.value == AGENTS
        slot = (node_slots if agents else rank_slots)[tick % TICKS_PER_S]
        socks = agent_socks if agents else rank_socks
        pending = []
        for conn, idxs in slot.items():
            parts: list[bytes] = []
            if agents:
                expected, b, r = shard.node_batch(idxs, parts)
                records += r
            else:
                expected, b = shard.rank_batch(idxs, parts)
            beats += b
            if parts:
                socks[conn].sendall(b"".join(parts))
                pending.append((conn, expected))
        for conn, expected in pending:
            _await_replies(socks[conn], expected)
        shared.beats[cfg.index], shared.records[cfg.index] = beats, records
        tick += 1
    for s in rank_socks + agent_socks:
        s.close()


def _share(total: int, w: int, writers: int) -> int:
    """Writer w's part of `total` connections (at least one unless `total` is 0)."""
    return 0 if total <= 0 else max(1, (w + 1) * total // writers - w * total // writers)


class Writers:
    """The writer processes of one phase: `start` forks and connects them, `go`
    starts the clock, `close` stops them.

    Args:
        ranks: All ranks (a multiple of RANKS_PER_NODE); each writer gets a
            contiguous shard of whole nodes.
        rank_connections / agent_connections: Over all writers (0: that mode is off).
    """

    def __init__(self, ctx: mp.context.BaseContext, ranks: int, writers: int,
                 roles: dict[int, int], dead_agents: list[int], host: str, port: int,
                 prefix: str, rank_connections: int, agent_connections: int,
                 flag_keys: list[str], fence_key: str, progress_key: str, ttl_s: float,
                 mode: int) -> None:
        self.shared = WriterShared(
            ready=ctx.Queue(), go=ctx.Event(), stop=ctx.Event(),
            t_start=ctx.Value("d", 0.0, lock=False), mode=ctx.Value("i", mode, lock=False),
            beats=ctx.Array("q", writers, lock=False), records=ctx.Array("q", writers, lock=False),
            lag=ctx.Array("d", writers, lock=False), skipped=ctx.Array("q", writers, lock=False))
        nodes = ranks // RANKS_PER_NODE
        self.procs: list[mp.process.BaseProcess] = []
        for w in range(writers):
            lo, hi = w * nodes // writers * RANKS_PER_NODE, (w + 1) * nodes // writers * RANKS_PER_NODE
            cfg = WriterConfig(w, list(range(lo, hi)), {r: x for r, x in roles.items() if lo <= r < hi},
                               frozenset(dead_agents), host, port, prefix,
                               min(_share(rank_connections, w, writers), hi - lo),
                               min(_share(agent_connections, w, writers), (hi - lo) // RANKS_PER_NODE),
                               flag_keys, fence_key, progress_key, ttl_s)
            self.procs.append(ctx.Process(target=beat_writer, args=(cfg, self.shared), daemon=True))

    def start(self) -> float:
        """Fork the writers and wait until all are connected; seconds it took."""
        t = time.monotonic()
        for p in self.procs:
            p.start()
        for _ in self.procs:
            msg = self.shared.ready.get(timeout=120)
            if msg != "ok":
                raise RuntimeError(msg)
        return time.monotonic() - t

    def go(self) -> None:
        self.shared.t_start.value = time.time()
        self.shared.go.set()

    def set_mode(self, mode: int) -> None:
        self.shared.mode.value = mode

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def counts(self) -> tuple[int, int]:
        """(per-rank beats, node records) sent so far."""
        return sum(self.shared.beats), sum(self.shared.records)

    def check_alive(self) -> None:
        dead = [p.pid for p in self.procs if p.pid is not None and not p.is_alive()]
        if dead:
            raise RuntimeError(f"writer processes {dead} died")

    def close(self) -> None:
        self.shared.stop.set()
        self.shared.go.set()  # writers still waiting for the start must see the stop
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
