"""The controller's side of bench/heartbeats.py: its scans, and where a scan's time goes.

* `AgentScan`: the controller's scan with node agents, as the controller runs
  it: `read_relayed` of every node's record and of the own keys of the ranks
  `RelayView.direct_ranks` names, `RelayView.update`, `BeatTable.observe` (with
  the placed processes' pids, as `RankWatch` builds it). It
  keeps the verdicts (the first per rank, and the last scan's) and times the
  three parts of every scan.
* `RankScan`: the per-rank-key design: `read_beats` over every rank's own key
  (pipelined MGETs, the parse cache kept between scans) and `Classifier.observe`.
* `StaticRanks`: own keys for the per-rank baseline at a scale no writer
  processes could keep beating on this machine (131,072 beats a second): this
  process writes them once, then rewrites half of them (new seq, ts, step)
  before each scan, untimed, so each scan finds half the values changed, as a
  0.5 s poll of 1 Hz beats does.
* `breakdown` / `profile`: a node-agent scan cut into its Redis round trip,
  record decoding, the rest of `read_relayed`, the merge and the classifier;
  and the functions cProfile finds the time in.
* `poll_loop`, `measure`, `Load`: the scans' cadence, and what one measured
  window used: Redis's CPU (`INFO cpu`), the writers', the scanning
  controller's and the whole machine's CPU (/proc), writes and Redis commands.
* `Controller`: one design's scan in a forked process of its own, driven scan
  by scan from the benchmark's process over a pipe, so each design's heap (and
  with it each full GC collection) holds only its own state, as a real
  controller's would: at 131,072 ranks the two classifiers and caches in one
  process would double the objects every full collection walks.
"""

from __future__ import annotations

import cProfile
import gc
import io
import math
import multiprocessing as mp
import os
import pstats
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import redis

from bench.heartbeats_sim import DEAD, HUNG, JOB, RANKS_PER_NODE, SLOW_INIT, Writers, node_name
from kuangchao.platform.execution import relayed as relayed_mod
from kuangchao.platform.execution.beat_table import BeatTable
from kuangchao.platform.execution.heartbeat import Classifier, Verdict
from kuangchao.platform.execution.relayed import RelayView
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.beats import read_beats, read_relayed
from kuangchao.platform.protocol.heartbeat import Beat

POLL_S = 0.5  # JobController.poll_s


def placed_pids(ranks: int) -> dict[int, int]:
    """The process placed at each rank, as `RankWatch` gives its classifier (the
    writers' beats carry these pids): a changed beat is checked against it."""
    return {r: 100_000 + r for r in range(ranks)}


class AgentScan:
    """The controller's scan with node agents, `RANKS_PER_NODE` ranks a node."""

    def __init__(self, client: Any, prefix: str, ranks: int, timeout_s: float, hang_s: float) -> None:
        self.client, self.prefix = client, prefix
        self.view = RelayView({r: node_name(r // RANKS_PER_NODE) for r in range(ranks)})
        self.clf = BeatTable(list(range(ranks)), timeout_s, hang_s, pids=placed_pids(ranks),
                             nodes=self.view.nodes)
        self.rank_cache: dict = {}  # kept between scans, as the controller's watch does
        self.first: dict[int, Verdict] = {}
        self.final: list[Verdict] = []
        self.parts: list[tuple[float, float, float]] = []  # (read, merge, observe) s per scan

    def __call__(self) -> list[Verdict]:
        t0 = time.perf_counter()
        records, direct = read_relayed(self.client, self.prefix, JOB, self.view.nodes,
                                       self.view.direct_ranks(), self.rank_cache)
        t1 = time.perf_counter()
        beats = self.view.update(records, direct)
        t2 = time.perf_counter()
        verdicts = self.clf.observe(beats, time.monotonic(), time.time())
        self.parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        self.final = verdicts
        for v in verdicts:
            self.first.setdefault(v.rank, v)
        return verdicts


class RankScan:
    """The per-rank-key design's scan: every rank's own key."""

    def __init__(self, client: Any, prefix: str, ranks: int, timeout_s: float, hang_s: float) -> None:
        self.client, self.prefix, self.ranks = client, prefix, list(range(ranks))
        self.clf = Classifier(self.ranks, timeout_s, hang_s, pids=placed_pids(ranks))
        self.cache: dict = {}
        self.parts: list[tuple[float, float]] = []  # (read, observe) s per scan

    def __call__(self) -> list[Verdict]:
        t0 = time.perf_counter()
        beats = read_beats(self.client, self.prefix, JOB, self.ranks, cache=self.cache)
        t1 = time.perf_counter()
        verdicts = self.clf.observe(beats, time.monotonic(), time.time())
        self.parts.append((t1 - t0, time.perf_counter() - t1))
        return verdicts


class StaticRanks:
    """Own keys of `ranks` ranks written by this process (MSET, no TTL: they must
    outlive the node-agent segments between baseline segments). Dead ranks are
    written once; hung and slow-start ones keep their frozen progress."""

    CHUNK = 4096

    def __init__(self, client: redis.Redis, prefix: str, ranks: int, roles: dict[int, int]) -> None:
        self.client, self.prefix, self.ranks, self.roles = client, prefix, ranks, roles
        self.seq = 0
        self.parity = 0
        self.t0 = time.time()
        self.write_s: list[float] = []

    def _beat(self, rank: int, ts: float) -> Beat:
        role = self.roles.get(rank)
        node = node_name(rank // RANKS_PER_NODE)
        if role in (HUNG, SLOW_INIT):
            return Beat(rank, 1 if role == HUNG else 0, "init" if role == SLOW_INIT else "collective",
                        100_000 + rank, node, ts, self.t0, self.seq)
        return Beat(rank, self.seq, "forward", 100_000 + rank, node, ts, ts, self.seq)

    def write(self, ranks: range) -> None:
        """New beats for `ranks` (dead ones only on the first write)."""
        t = time.perf_counter()
        self.seq += 1
        ts = time.time()
        todo = [r for r in ranks if self.seq == 1 or self.roles.get(r) != DEAD]
        with self.client.pipeline(transaction=False) as pipe:
            for i in range(0, len(todo), self.CHUNK):
                pipe.mset({keys.beat(self.prefix, JOB, r): self._beat(r, ts).encode()
                           for r in todo[i:i + self.CHUNK]})
            pipe.execute()
        self.write_s.append(time.perf_counter() - t)

    def write_all(self) -> None:
        self.write(range(self.ranks))

    def rewrite_half(self) -> None:
        """Before a scan: the next half (even or odd ranks) beats again."""
        self.write(range(self.parity, self.ranks, 2))
        self.parity ^= 1


class GcPauses:
    """Collector pauses in this process (full collections, and all of them), seconds."""

    def __init__(self) -> None:
        self.gen2: list[float] = []
        self.total = 0.0
        self._t = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        took = time.perf_counter() - self._t
        self.total += took
        if info["generation"] == 2:
            self.gen2.append(took)

    def reset(self) -> None:
        self.gen2, self.total = [], 0.0


class _TimedPipelines:
    """A client whose pipelines time their `execute` (packing the commands, the round
    trip to Redis, and hiredis parsing the replies)."""

    def __init__(self, client: Any) -> None:
        self.client, self.execute_s = client, 0.0

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.client.pipeline(transaction=transaction)
        execute = pipe.execute

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.execute_s += time.perf_counter() - t

        pipe.execute = timed
        return pipe


def breakdown(scan: AgentScan, scans: int, poll_s: float, pauses: GcPauses) -> dict[str, float]:
    """Median ms per part over `scans` node-agent scans, one per `poll_s`.

    Parts: `execute` (build and send the MGETs, Redis, hiredis parsing the
    replies), `read_rest` (the rest of read_relayed: the keys' names, the own
    keys' cache), `decode` (node_columns.gather of the records that changed
    since the last scan, into one table; `decoded` says how many), `merge` (the
    rest of RelayView.update: comparing the records, placing and covering the
    entries), `observe` (BeatTable.observe), `total` and `cpu` (the scan's CPU
    time in this process); `gc` is the collector's pauses within the scan,
    already counted in whichever part allocated when it ran. The scans'
    verdicts count as usual.
    """
    timed = _TimedPipelines(scan.client)
    decode = relayed_mod.gather
    state = {"s": 0.0, "n": 0}

    def timed_decode(changed: Any) -> Any:
        t = time.perf_counter()
        try:
            return decode(changed)
        finally:
            state["s"] += time.perf_counter() - t
            state["n"] += len(changed)

    rows: list[dict[str, float]] = []
    client, scan.client, relayed_mod.gather = scan.client, timed, timed_decode
    try:
        for _ in range(scans):
            timed.execute_s, state["s"], state["n"] = 0.0, 0.0, 0
            g = pauses.total
            t, c = time.perf_counter(), time.process_time()
            scan()
            total, cpu = time.perf_counter() - t, time.process_time() - c
            read, merge, observe = scan.parts[-1]
            rows.append({"execute": timed.execute_s * 1e3, "decode": state["s"] * 1e3,
                         "decoded": state["n"],
                         "read_rest": (read - timed.execute_s) * 1e3,
                         "merge": (merge - state["s"]) * 1e3, "observe": observe * 1e3, "total": total * 1e3,
                         "cpu": cpu * 1e3, "gc": (pauses.total - g) * 1e3})
            time.sleep(max(0.0, poll_s - (time.perf_counter() - t)))
    finally:
        scan.client, relayed_mod.gather = client, decode
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def profile(scan: AgentScan, scans: int, poll_s: float, top: int = 12) -> str:
    """cProfile of `scans` node-agent scans (one per `poll_s`): the `top` functions by
    own time (cProfile's overhead inflates the Python parts)."""
    prof = cProfile.Profile()
    for _ in range(scans):
        t = time.perf_counter()
        prof.enable()
        scan()
        prof.disable()
        time.sleep(max(0.0, poll_s - (time.perf_counter() - t)))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


class _Failed(str):
    """A controller process's exception, as text."""


def _serve(conn: Connection, make_scan: Callable[[], Any], poll_s: float) -> None:
    """The controller process: builds its scan, then answers the driver's commands."""
    pauses = GcPauses()
    scan = make_scan()
    while True:
        cmd = conn.recv()
        try:
            if cmd == "scan":
                t, c = time.perf_counter(), time.process_time()
                scan()
                reply: Any = (time.perf_counter() - t, time.process_time() - c, scan.parts[-1])
            elif cmd == "start":
                scan.clf.start(time.monotonic())
                reply = None
            elif cmd == "gc":  # the pauses since the last ask
                reply = (pauses.gen2, pauses.total)
                pauses.reset()
            elif cmd == "breakdown":
                reply = breakdown(scan, 6, poll_s, pauses)
            elif cmd == "profile":
                reply = profile(scan, 3, poll_s)
            elif cmd == "verdicts":
                reply = ({r: (v.kind, v.detected_after_s) for r, v in scan.first.items()},
                         {v.rank: v.kind for v in scan.final})
            elif cmd == "stop":
                conn.send(None)
                return
            else:
                reply = _Failed(f"unknown command {cmd!r}")
        except Exception:  # noqa: BLE001 - the driver reports it and stops the run
            reply = _Failed(traceback.format_exc())
        conn.send(reply)


class Controller:
    """One design's scan in a forked process of its own (see the module docstring).

    `make_scan` runs in the child (it opens the child's own Redis client); `scan()`
    runs one scan there and returns its duration in seconds, measured there.
    """

    def __init__(self, ctx: mp.context.BaseContext, make_scan: Callable[[], Any], poll_s: float,
                 name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, make_scan, poll_s), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.parts: list[tuple] = []  # each scan's parts (AgentScan / RankScan.parts)
        self.cpu: list[float] = []  # each scan's CPU seconds in the controller process
        self.started = False

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, cmd: str, timeout_s: float = 300.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"controller process {self.proc.name} did not answer {cmd!r} "
                               f"in {timeout_s:.0f}s")
        reply = self.conn.recv()
        if isinstance(reply, _Failed):
            raise RuntimeError(f"controller process {self.proc.name} failed on {cmd!r}:\n{reply}")
        return reply

    def start(self) -> None:
        """The classifier's clock starts: ranks have the timeout from now to beat."""
        self.call("start")
        self.started = True

    def scan(self) -> float:
        took, cpu, parts = self.call("scan")
        self.parts.append(parts)
        self.cpu.append(cpu)
        return took

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=10)
            except (RuntimeError, OSError, EOFError):
                pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# -- measurements --------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def redis_cpu(client: redis.Redis) -> float:
    """Redis's CPU seconds so far (user + sys, all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # less idle and iowait


def poll_loop(scan: Callable[[], float], seconds: float, min_scans: int = 1,
              check: Callable[[], None] | None = None,
              before: Callable[[], None] | None = None) -> list[float]:
    """Scan every POLL_S (back to back when a scan takes longer) for `seconds` and at
    least `min_scans` scans; `before` runs untimed ahead of each scan. Returns each
    scan's duration in seconds (as `scan` measured it)."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(times) < min_scans:
        c = time.perf_counter()
        if before is not None:
            before()
        times.append(scan())
        if check is not None:
            check()
        time.sleep(max(0.0, POLL_S - (time.perf_counter() - c)))
    return times


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + sys) a live process has used, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Load:
    """Redis CPU, writes and CPU use over one measured window."""

    wall_s: float
    redis_cpu_s: float
    beats: int  # SETs of a rank's own key
    records: int  # SETs of a node record
    commands: int
    writers_cpu_s: float = 0.0
    controller_cpu_s: float = 0.0  # the scanning design's controller process
    machine_cpu_s: float = 0.0  # all CPUs' busy time, whoever used them

    @property
    def cores(self) -> float:
        return self.redis_cpu_s / self.wall_s

    def per_s(self, what: str) -> float:
        return getattr(self, what) / self.wall_s


@contextmanager
def measure(client: redis.Redis, writers: Writers | None, controller: int | None = None
            ) -> Iterator[list[Load]]:
    """Yields a list that holds the window's Load once the block is done."""
    out: list[Load] = []

    def cpu() -> tuple[float, float, float]:
        busy, total = machine_jiffies()
        return (sum(proc_cpu_s(pid) for pid in writers.pids) if writers else 0.0,
                proc_cpu_s(controller) if controller else 0.0,
                busy / max(1, total) * (os.cpu_count() or 1))

    def counts() -> tuple[int, int]:
        return writers.counts() if writers else (0, 0)

    t, rcpu, (wcpu, ccpu, _) = time.monotonic(), redis_cpu(client), cpu()
    busy0, total0 = machine_jiffies()
    (beats, records), cmds = counts(), int(client.info("stats")["total_commands_processed"])
    yield out
    b, r = counts()
    w, c, _ = cpu()
    busy1, total1 = machine_jiffies()
    wall = time.monotonic() - t
    out.append(Load(wall, redis_cpu(client) - rcpu, b - beats, r - records,
                    int(client.info("stats")["total_commands_processed"]) - cmds, w - wcpu, c - ccpu,
                    (busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1) * wall))


def combined(windows: list[Load]) -> Load:
    """Several measured windows as one (sums of seconds, CPU, writes and commands)."""
    return Load(*(sum(getattr(w, f) for w in windows)
                  for f in ("wall_s", "redis_cpu_s", "beats", "records", "commands", "writers_cpu_s",
                            "controller_cpu_s", "machine_cpu_s")))
