"""The chaos half of bench/goodput.py: the seeded fault schedule, the faults, and the
traces turned into ETTR, redone steps and survivors' stalls. Nothing here knows
which system runs: both are driven, and measured, the same way.

* `schedule(seed, interval_s, kinds)`: the fault list, the same for both systems:
  a fault every `interval_s` seconds after the job's first step, cycling through
  `kinds` in a seeded order, each aimed at a seeded rank.
* `Chaos`: injects them while a run lasts. `kill_rank` SIGKILLs the process that
  holds the rank; `stop_rank` SIGSTOPs it and leaves it stopped (the system must
  find the hang; the bench releases it only once the rank has moved on or the
  run is over); `kill_raylet` SIGKILLs the raylet of the rank's node
  (`Cluster.remove_node`'s way) and starts a node of the same name, labels and
  resources 30 s later; `nan` makes the next forward pass NaN
  (bench/goodput_ray.py); `drain` asks Ray's GCS to drain the rank's node with a
  20 s deadline (the call `ray drain-node` makes), kills the raylet at the
  deadline if it is still there (on a real cluster the cloud would) and brings
  the node back 30 s after it went. A node that comes back starts as on a machine
  of its own: Ray's start-up of it runs in a CPU group weighing one niceness-19
  task, the actors it then runs back beside everything else (bench/node_start.py).
  A fault whose rank no live process holds (the system is still recovering from
  the previous one) waits for one, up to WAIT_RANK_S, and records the delay.
* `Trace`, `analyse`: the per-step trace lines of every process
  (bench/goodput_ray.py) within a run's time window; ETTR, steps redone and the
  stall around each kill, computed the same way for both systems.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.goodput_ray import NAN_FILE
from bench.harness import BenchCluster, log
from bench.node_start import NodeStart
from bench.recovery_common import release
from bench.resize_common import add_node, kill_node, leaf_nodes, node_of_pid

KINDS = ("kill_rank", "stop_rank", "kill_raylet", "nan", "drain")
BACK_AFTER_S = 30.0  # a killed or drained node comes back this long after it went
DRAIN_DEADLINE_S = 20.0
WAIT_RANK_S = 60.0  # longest wait for a live process holding the fault's rank
NODE_LABEL = "kc.io/node"


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the job's first step
    kind: str
    rank: int


def schedule(seed: int, interval_s: float, kinds: tuple[str, ...] = KINDS, ranks: int = 2,
             count: int = 1000) -> list[Fault]:
    """`count` faults, one every `interval_s` s, the kinds in a seeded order, cycled,
    each aimed at a seeded rank."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    return [Fault(interval_s * (i + 1), order[i % len(order)], rng.randrange(ranks))
            for i in range(count)]


# -- traces ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    t: float
    pid: int
    rank: int
    step: int


class Trace:
    """Every process's step lines under one folder (bench/goodput_ray.py writes them)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.steps: list[Step] = []

    def poll(self) -> list[Step]:
        new: list[Step] = []
        for path in sorted(self.folder.glob("p*.jsonl")):
            try:
                with path.open() as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
                    self._offsets[path] = f.tell()
            except FileNotFoundError:
                continue
            lines = (self._partial.get(path, "") + chunk).split("\n")
            self._partial[path] = lines.pop()
            for line in lines:
                if line:
                    e = json.loads(line)
                    if e["rank"] >= 0:  # -1: a process outside any process group
                        new.append(Step(e["t"], e["pid"], e["rank"], e["step"]))
        self.steps.extend(new)
        return new

    def window(self, start: float, end: float = float("inf")) -> list[Step]:
        self.poll()
        return sorted((s for s in self.steps if start <= s.t <= end), key=lambda s: s.t)

    def holder(self, rank: int, since: float) -> Step | None:
        """The newest step line of `rank` since `since` whose process is alive and running."""
        for s in reversed(self.window(since)):
            if s.rank == rank and _running(s.pid):
                return s
        return None


def _running(pid: int) -> bool:
    """Alive and not stopped (state T) or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("T", "t", "Z", "X")


# -- faults -----------------------------------------------------------------------------

@dataclass
class Injected:
    kind: str
    rank: int
    due: float  # when the schedule said
    t: float = 0.0  # when it was injected
    pid: int | None = None
    node: str | None = None  # kc.io/node name
    node_id: str | None = None
    step: int | None = None  # the rank's newest step then
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _label(node_id: str) -> tuple[str | None, dict[str, Any] | None]:
    for n in leaf_nodes(alive=False):
        if n["NodeID"] == node_id:
            return n["Labels"].get(NODE_LABEL), n
    return None, None


def drain_node(cluster: BenchCluster, node_id: str, deadline_s: float) -> tuple[bool, str]:
    """Ask Ray's GCS to drain a node (reason PREEMPTION, with a deadline): the call
    `ray drain-node` makes (tests/integration/test_drain.py makes it the same way)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = time.time_ns() // 1_000_000 + int(deadline_s * 1000)
    gcs = ray._raylet.GcsClient(address=cluster.ray_address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(
        "DRAIN_NODE_REASON_PREEMPTION"), "kcbench goodput chaos", deadline_ms)
    return bool(accepted), str(why)


@dataclass
class Chaos:
    """Injects a schedule's faults into one run and puts the cluster back afterwards."""

    cluster: BenchCluster
    trace: Trace
    folder: Path  # where the NaN trigger goes (the trace folder)
    cpus: int
    gpus: int
    injected: list[Injected] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _node_lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, plan: list[Fault], first_step: float, alive, start: float) -> None:
        """Inject `plan` (times after `first_step`) while `alive()`; `start` is the run's
        window start (older trace lines belong to other runs)."""
        for fault in plan:
            due = first_step + fault.at_s
            while time.time() < due and alive():
                time.sleep(min(0.1, max(0.0, due - time.time())))
                self._release_moved(start)
            if not alive():
                return
            rec = Injected(fault.kind, fault.rank, due)
            try:
                self._inject(rec, start, alive)
            except Exception as exc:  # a fault that could not be made is recorded, not fatal
                rec.note = f"not injected: {type(exc).__name__}: {exc}"
            log(f"  fault {len(self.injected) + 1}: {json.dumps(rec.to_json())}")
            self.injected.append(rec)

    def _inject(self, rec: Injected, start: float, alive) -> None:
        if rec.kind == "nan":
            rec.t = time.time()
            tmp = self.folder / f"{NAN_FILE}.tmp"
            tmp.write_text(str(rec.t))
            tmp.rename(self.folder / NAN_FILE)
            return
        deadline = time.monotonic() + WAIT_RANK_S
        while (held := self.trace.holder(rec.rank, start)) is None:
            if not alive():
                raise RuntimeError("the run ended first")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no live process held rank {rec.rank} for {WAIT_RANK_S:.0f}s")
            time.sleep(0.05)
        rec.pid, rec.step = held.pid, held.step
        if rec.kind in ("kill_raylet", "drain"):
            rec.node_id = node_of_pid(held.pid)
            if rec.node_id is None:
                raise RuntimeError(f"no raylet above pid {held.pid}")
            rec.node, _ = _label(rec.node_id)
        rec.t = time.time()
        if rec.t - rec.due > 0.5:
            rec.note = f"delayed {rec.t - rec.due:.1f}s: rank {rec.rank} was not held by a live process"
        if rec.kind == "kill_rank":
            os.kill(held.pid, signal.SIGKILL)
        elif rec.kind == "stop_rank":
            os.kill(held.pid, signal.SIGSTOP)
            self.stopped.append(held.pid)
        elif rec.kind == "kill_raylet":
            kill_node(rec.node_id)
            self._later(rec.node_id, rec.node, gone=rec.t)
        elif rec.kind == "drain":
            accepted, why = drain_node(self.cluster, rec.node_id, DRAIN_DEADLINE_S)
            if not accepted:
                raise RuntimeError(f"Ray refused the drain: {why}")
            self._later(rec.node_id, rec.node, deadline=rec.t + DRAIN_DEADLINE_S)
        else:
            raise ValueError(f"unknown fault kind {rec.kind!r}")

    def _later(self, node_id: str, name: str | None, gone: float | None = None,
               deadline: float | None = None) -> None:
        """In the background: (a drain) kill the raylet at the deadline if it is still
        there; then, BACK_AFTER_S after the node went, start one like it."""
        def go() -> None:
            went = gone
            if deadline is not None:
                while time.time() < deadline and any(n["NodeID"] == node_id for n in leaf_nodes()):
                    time.sleep(0.2)
                alive_at_deadline = any(n["NodeID"] == node_id for n in leaf_nodes())
                if alive_at_deadline:
                    with contextlib.suppress(Exception):
                        kill_node(node_id)
                went = time.time()
                log(f"  drained node {name}: " + ("killed at its deadline" if alive_at_deadline
                                                  else "left before its deadline"))
            time.sleep(max(0.0, went + BACK_AFTER_S - time.time()))
            self._bring_back(node_id, name)
        th = threading.Thread(target=go, daemon=True, name=f"node-back-{name}")
        th.start()
        self._threads.append(th)

    def _bring_back(self, node_id: str, name: str | None) -> None:
        if name is None:
            log(f"  node {node_id[:8]} has no {NODE_LABEL} label; not brought back")
            return
        end = time.monotonic() + 90
        while any(n["NodeID"] == node_id for n in leaf_nodes()) and time.monotonic() < end:
            time.sleep(0.5)  # Ray has not declared it dead yet
        with self._node_lock:  # raylet starts race for local ports: one at a time
            start = NodeStart()  # its start-up as on a machine of its own (node_start.py)
            try:
                new_id, joined = add_node(self.cluster, name, self.cpus, self.gpus,
                                          prefix=start.begin())
                log(f"  node {name} back as {new_id[:8]}")
            except Exception as exc:
                log(f"  node {name} could not come back: {type(exc).__name__}: {exc}")

    def _release_moved(self, start: float) -> None:
        """Release stopped processes whose rank another process has taken over."""
        for pid in list(self.stopped):
            mine = [s for s in self.trace.window(start) if s.pid == pid]
            rank = mine[-1].rank if mine else None
            if rank is None or not _exists(pid):
                self.stopped.remove(pid)
                continue
            taken = any(s.rank == rank and s.pid != pid and s.t > mine[-1].t
                        for s in self.trace.window(start))
            if taken:
                release(pid)
                self.stopped.remove(pid)

    def settle(self, timeout_s: float = 150.0) -> None:
        """After the run: release every stopped process, drop a NaN nobody took, and wait
        until every node that went has come back."""
        for pid in self.stopped:
            release(pid)
        self.stopped.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.folder / NAN_FILE).unlink()
            log("  a NaN was injected but no forward pass took it before the run ended")
        end = time.monotonic() + timeout_s
        for th in self._threads:
            th.join(max(0.0, end - time.monotonic()))
        if any(th.is_alive() for th in self._threads):
            log("a node did not come back in time; the next run may have one node fewer")
        self._threads.clear()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- analysis ------------------------------------------------------------------------------

def step_gaps(steps: list[Step]) -> list[float]:
    """Intervals between consecutive steps (s-1 -> s) of the same process."""
    last: dict[int, Step] = {}
    out = []
    for s in steps:
        prev = last.get(s.pid)
        if prev is not None and s.step == prev.step + 1:
            out.append(s.t - prev.t)
        last[s.pid] = s
    return out


@dataclass
class RunFacts:
    """What the trace of one run says, the same way for both systems."""

    first_t: float | None = None  # first step completed (any rank)
    end_t: float | None = None  # the last step (`steps`) completed on every rank
    first_step: int = 0  # its index
    last_step: int = 0
    kept: int = 0  # steps completed after first_t that the final trajectory keeps
    median_step_s: float | None = None
    productive_s: float | None = None
    wall_s: float | None = None
    ettr: float | None = None
    redone: int = 0  # completions (by rank 0) beyond each step's first, up to `steps`
    redone_by_step: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("redone_by_step")
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def analyse(steps: list[Step], total: int) -> RunFacts:
    """ETTR: the kept steps (from the first completed step to step `total`) at the run's
    own median step time, over the wall time from that first step to the end (step
    `total` completed on every rank); redone: rank 0's completions of a step beyond
    its first."""
    f = RunFacts()
    mine = [s for s in steps if s.step <= total]
    if not mine:
        return f
    f.first_t = mine[0].t
    f.first_step = mine[0].step
    finals = [s.t for s in mine if s.step == total]
    f.end_t = max(finals) if finals else mine[-1].t
    f.last_step = max(s.step for s in mine)
    f.kept = f.last_step - f.first_step
    gaps = step_gaps(mine)
    f.median_step_s = statistics.median(gaps) if gaps else None
    f.wall_s = f.end_t - f.first_t
    if f.median_step_s is not None and f.wall_s > 0:
        f.productive_s = f.kept * f.median_step_s
        f.ettr = min(1.0, f.productive_s / f.wall_s)
    counts: dict[int, int] = {}
    for s in mine:
        if s.rank == 0:
            counts[s.step] = counts.get(s.step, 0) + 1
    f.redone_by_step = {k: c - 1 for k, c in counts.items() if c > 1}
    f.redone = sum(f.redone_by_step.values())
    return f


def survivor_stall(steps: list[Step], kill_t: float, until_t: float, victim: int,
                   median_s: float) -> float | None:
    """The stall of the ranks that were not killed: the longest gap between consecutive
    step lines of a surviving rank (whatever process holds it), from its last step
    before `kill_t` to `until_t` (the next fault, or the run's end), minus a normal
    step. None when no surviving rank stepped on both sides of the kill."""
    best = None
    for rank in sorted({s.rank for s in steps} - {victim}):
        mine = [s for s in steps if s.rank == rank and s.t <= until_t]
        before = [s for s in mine if s.t <= kill_t]
        after = [s for s in mine if s.t > kill_t]
        if not before or not after:
            continue
        seq = [before[-1], *after]
        gap = max(b.t - a.t for a, b in zip(seq, seq[1:], strict=False))
        best = gap if best is None else max(best, gap)
    return None if best is None else max(0.0, best - median_s)
