"""The simulated side of bench/heartbeats.py: the ranks and their Redis.

* `redis_server`: a private `redis-server` on a free port for the run (no
  persistence, bind 127.0.0.1, maxclients raised), always stopped after; the
  shared KCBENCH_REDIS_URL when the binary is missing (`delete_keys` then
  cleans up). `raise_fd_limit` makes room for one connection per rank.
* `beat_writer`: one forked writer process beating its contiguous shard of
  ranks once a second, each beat on the wire exactly what
  `workers/runtime/heartbeat.py` sends in its one round trip (see the module
  docstring of bench/heartbeats.py), over raw sockets with the RESP replies
  counted, not parsed. `WriterConfig` is one writer's part, `WriterShared`
  what the writers and the driver share.
* `pick_roles`: which ranks misbehave (dead, hung, slow-start; fixed seed).

The controller side (scans, classifier, measurements, metrics) stays in
bench/heartbeats.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
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
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.runtime.procs import free_port

JOB = "hbbench"
HEARTBEAT_TIMEOUT_S = 10.0  # fault_tolerance.heartbeat_timeout_s default: key TTL and expiry
TICKS_PER_S = 20  # each writer sends its due beats in 20 batches a second
WARMUP_S = 2.0  # every rank has beaten at least once before measuring
DEAD_AFTER_S = 1.5  # dead ranks stop beating this long after the start

HEALTHY, DEAD, HUNG, SLOW_INIT = range(4)


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


# -- the writers (forked processes) --------------------------------------------------

@dataclass(frozen=True)
class WriterConfig:
    index: int
    ranks: list[int]
    roles: dict[int, int]  # rank -> DEAD / HUNG / SLOW_INIT (absent: healthy)
    host: str
    port: int
    prefix: str
    connections: int
    flag_keys: list[str]  # the job's control flags every beat checks (preempt, cancel)
    progress_key: str  # rank 0's beats also carry the job's progress


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
    sent: mp.Array  # beats sent, per writer
    lag: mp.Array  # worst lateness of a batch after WARMUP_S, per writer (s)
    skipped: mp.Array  # ticks skipped after falling more than a second behind, per writer


def _count_replies(buf: bytes, pos: int) -> tuple[int, int]:
    """Complete flat RESP replies in buf[pos:]: (how many, where the next starts).

    The writers only send SET and GET, so replies are +OK, a bulk string or
    nil; an error reply raises.
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


def _await_replies(sock: socket.socket, expected: int) -> None:
    buf, pos, got = b"", 0, 0
    while got < expected:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("redis closed a writer connection")
        buf = buf[pos:] + chunk
        n, pos = _count_replies(buf, 0)
        got += n


def beat_writer(cfg: WriterConfig, shared: WriterShared) -> None:
    """Beat every rank of the shard once a second until `stop`.

    Runs at nice 5: the writers stand in for ranks on other machines, so on
    a small box they should not take the CPU from Redis or the controller.
    A writer more than a second behind schedule (starved by other work)
    skips the missed ticks, as late ranks would miss beats, instead of
    bursting to catch up; the skips are reported.
    """
    os.nice(5)
    try:
        socks = []
        for _ in range(cfg.connections):
            s = socket.create_connection((cfg.host, cfg.port), timeout=10)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
    except OSError as exc:
        shared.ready.put(f"writer {cfg.index}: connect failed: {exc}")
        return
    shared.ready.put("ok")

    # The protocol around each rank's value, built once: what redis-py's
    # pipeline in Heartbeat.beat_once puts on the wire, minus the value.
    ttl = str(int(HEARTBEAT_TIMEOUT_S * 1000)).encode()
    flags = b"".join(_resp(b"EXISTS", k.encode()) for k in cfg.flag_keys)
    heads, tails = [], []
    for r in cfg.ranks:
        key = redis_keys.beat(cfg.prefix, JOB, r).encode()
        req = redis_keys.stack_request(cfg.prefix, JOB, r).encode()
        heads.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n" % (len(key), key))
        tails.append(b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) + _resp(b"GET", req) + flags)
    replies = 2 + len(cfg.flag_keys)  # a beat's replies, +1 when it carries progress
    # Local rank i beats in tick i % TICKS_PER_S of every second, on connection i % connections.
    slots: list[dict[int, list[int]]] = [{} for _ in range(TICKS_PER_S)]
    for i in range(len(cfg.ranks)):
        slots[i % TICKS_PER_S].setdefault(i % cfg.connections, []).append(i)
    seq = [0] * len(cfg.ranks)
    frozen = [0.0] * len(cfg.ranks)  # progress_ts of hung / slow-start ranks
    roles = [cfg.roles.get(r, HEALTHY) for r in cfg.ranks]

    shared.go.wait()
    t0 = shared.t_start.value
    dead_at = t0 + DEAD_AFTER_S
    tick, sent, worst, skipped = 0, 0, 0.0, 0
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
        pending = []
        beats = 0
        for conn, idxs in slots[tick % TICKS_PER_S].items():
            parts, expected = [], 0
            for i in idxs:
                rank, role, ts = cfg.ranks[i], roles[i], time.time()
                if role == DEAD and ts >= dead_at:
                    continue
                seq[i] += 1
                if role == HEALTHY:  # a step per beat: progress is now
                    beat = Beat(rank, seq[i], "forward", 100_000 + rank, f"node-{rank // 8}",
                                ts, ts, seq[i])
                else:
                    frozen[i] = frozen[i] or ts
                    beat = Beat(rank, 1 if role == HUNG else 0,
                                "init" if role == SLOW_INIT else "collective",
                                100_000 + rank, f"node-{rank // 8}", ts, frozen[i], seq[i])
                value = beat.encode().encode()
                parts += (heads[i], b"$%d\r\n" % len(value), value, tails[i])
                beats, expected = beats + 1, expected + replies
                if rank == 0:  # the chief reports a step per beat (JobStore.set_progress's HSET)
                    parts.append(_resp(b"HSET", cfg.progress_key.encode(),
                                       b"step", b"%d" % seq[i], b"updated_at", b"%.3f" % ts))
                    expected += 1
            if parts:
                socks[conn].sendall(b"".join(parts))
                pending.append((conn, expected))
        for conn, expected in pending:
            _await_replies(socks[conn], expected)
        sent += beats
        shared.sent[cfg.index] = sent
        tick += 1
    for s in socks:
        s.close()
