"""The controller's view of its ranks' heartbeats.

`RankWatch` reads every rank's beat each poll (one pipelined round trip) and
the job's fence set, feeds the pure `Classifier` (which counts a beat only from
the process placed at its rank, and never from a fenced one), and survives
Redis going away: a failed read
starts a grace period instead of a verdict. For a rank judged hung it
gathers evidence before the rank is killed: the Python stacks of every rank
that still answers (a survivor waiting in all_reduce shows who it waits on),
and for one that does not, its process state and, when installed, py-spy.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import redis

from kuangchao.platform.execution.beat_table import BeatTable, ScanUpdate
from kuangchao.platform.execution.heartbeat import Classifier, Verdict
from kuangchao.platform.execution.relayed import RelayView
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.protocol.heartbeat import Beat

log = logging.getLogger(__name__)

STACK_WAIT_S = 1.5


@dataclass(frozen=True)
class RankHost:
    """Where a rank's process runs, for looking at it from outside."""

    pid: int | None
    ip: str | None
    host: str | None


def process_state(pid: int) -> str | None:
    """The kernel's state line for a local pid (e.g. `T (stopped)`), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def py_spy_dump(pid: int, timeout_s: float = 15.0) -> str | None:
    """Native and Python stacks by py-spy, when it is installed and allowed to attach."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError) as exc:
        return f"py-spy failed: {exc}"
    return out.stdout if out.returncode == 0 else f"py-spy failed: {out.stderr.strip()[:500]}"


class RankWatch:
    """Heartbeat-based failure detection for one job's ranks.

    Args:
        store: The job store (its Redis client does the reads).
        job_id: The job.
        ranks: The ranks to watch.
        heartbeat_timeout_s, hang_timeout_s, interval_s, peer_wait_s: From the job's spec.
        hosts: Per rank, where its process runs (for stack dumps from outside).
        nodes: Per rank, its node, when the job runs node agents: their records are
            read then, and the ranks they cover are judged from them (relayed.py).
        clock: Monotonic clock; injectable for tests.
    """

    def __init__(self, store: JobStore, job_id: str, ranks: list[int], heartbeat_timeout_s: float,
                 hang_timeout_s: float, interval_s: float,
                 hosts: dict[int, RankHost] | None = None, nodes: dict[int, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 peer_wait_s: float | None = None) -> None:
        self.store, self.job_id, self.ranks = store, job_id, list(ranks)
        self.interval_s = interval_s
        self.hosts = hosts or {}
        self.clock = clock
        pids = {r: h.pid for r, h in self.hosts.items() if h.pid is not None}
        self.relay = RelayView({r: n for r, n in nodes.items() if r in set(self.ranks)}) \
            if nodes else None
        # With agents, the columnar classifier: the scan that covers 131,072 ranks.
        self.classifier: Classifier | BeatTable = (
            BeatTable(self.ranks, heartbeat_timeout_s, hang_timeout_s, grace_s=2 * interval_s,
                      pids=pids, nodes=self.relay.nodes, peer_wait_s=peer_wait_s)
            if self.relay is not None else
            Classifier(self.ranks, heartbeat_timeout_s, hang_timeout_s, grace_s=2 * interval_s,
                       pids=pids, peer_wait_s=peer_wait_s))
        self.classifier.start(clock())
        self.store_down_since: float | None = None
        self._parsed: dict[int, tuple[str, Beat | None]] = {}
        # Ranks with no node in the placement: always read from their own keys.
        self._unplaced = [r for r in self.ranks if self.relay and r not in self.relay.node_of]

    def poll(self) -> list[Verdict]:
        """Read every beat once; return the ranks judged failed (none while Redis is away)."""
        now = self.clock()
        try:
            beats = self._read()
            self.classifier.fenced = frozenset(self.store.fenced(self.job_id))
            if self.clock() - now > max(1.0, 2 * self.interval_s):
                # The read waited out an outage (the client retries): beats
                # written meanwhile were lost, so nobody's silence counts yet.
                self.classifier.store_failed(self.clock())
                return []
        except (redis.RedisError, OSError) as exc:
            if self.store_down_since is None:
                self.store_down_since = now
                log.warning("job %s: cannot read heartbeats (%s); holding verdicts until Redis "
                            "is back", self.job_id, exc)
            self.classifier.store_failed(now)
            return []
        if self.store_down_since is not None:
            # Beats written while Redis was away are lost; give ranks a fresh timeout.
            self.classifier.store_failed(now)
            log.warning("job %s: heartbeats readable again after %.1fs", self.job_id,
                        now - self.store_down_since)
            self.store_down_since = None
        return self.classifier.observe(beats, now)

    def _read(self) -> dict[int, Beat | None] | ScanUpdate:
        """One scan: every rank's own key, or with agents their records and the own keys
        of the ranks no agent covers."""
        if self.relay is None:
            return self.store.beats(self.job_id, self.ranks, cache=self._parsed)
        relay = self.relay
        records, direct = self.store.relayed_raw(
            self.job_id, relay.nodes, relay.direct_ranks() + self._unplaced, self._parsed)
        gone = set(relay.gone)
        beats = relay.update(records, direct)
        for node in sorted(relay.gone - gone):
            log.warning("job %s: the node agent on %s stopped writing its record; the ranks "
                        "it relayed are judged lost with their node unless it comes back",
                        self.job_id, node)
        return beats

    def agent_gone(self, rank: int) -> str | None:
        """The node whose agent stopped, when `rank` was relayed by it (else None)."""
        return self.relay.agent_gone(rank) if self.relay is not None else None

    def last_beat(self, rank: int) -> Beat | None:
        return self.classifier.last_beat(rank)

    def collect_stacks(self, suspects: list[int], silent: Collection[int] = ()) -> dict[int, str]:
        """Every rank's stacks, asked through the heartbeat thread; for ranks
        that do not answer, what can be seen from outside the process.

        Ranks in `silent` (their beats expired: their heartbeat thread does not run,
        or cannot reach Redis) are not waited for: the wait ends once the others
        answered, so a hang's recovery does not wait out STACK_WAIT_S for them."""
        try:
            self.store.request_stacks(self.job_id, self.ranks)
            deadline = time.monotonic() + max(STACK_WAIT_S, 2.5 * self.interval_s)
            expected = set(self.ranks) - set(silent)
            got: dict[int, str] = {}
            while time.monotonic() < deadline:
                got = self.store.stacks(self.job_id, self.ranks)
                if expected <= got.keys():
                    break
                time.sleep(0.1)
        except redis.RedisError as exc:
            got = {}
            log.warning("job %s: could not collect stacks: %s", self.job_id, exc)
        for rank in suspects:
            if rank not in got:
                got[rank] = self._outside_view(rank)
        return got

    def _outside_view(self, rank: int) -> str:
        host = self.hosts.get(rank)
        if host is None or host.pid is None:
            return "no answer from the rank's heartbeat thread, and its process is unknown"
        if not _is_local(host):
            return (f"no answer from the rank's heartbeat thread (pid {host.pid} on {host.host}); "
                    "the process holds the GIL or is stopped")
        state = process_state(host.pid)
        lines = [f"no answer from the rank's heartbeat thread; pid {host.pid} state: "
                 f"{state or 'gone'}"]
        if state and state.startswith("T"):
            lines.append("the process is stopped (SIGSTOP or a debugger); it cannot run any code")
        else:
            dump = py_spy_dump(host.pid)
            lines.append(dump or "py-spy is not installed; install it for native stacks")
        return "\n".join(lines)


def kill_process(host: RankHost | None, node_id: str | None) -> None:
    """SIGKILL a rank's process directly.

    `ray.kill` asks the process to exit first and kills it only after a
    timeout, which a stopped or wedged process cannot answer; survivors
    blocked on it in a collective would wait that long too.
    """
    if host is None or host.pid is None:
        return
    if _is_local(host):
        try:
            os.kill(host.pid, signal.SIGKILL)
        except OSError:
            pass
        return
    if node_id:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray.remote(_kill_pid).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote(host.pid)


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _is_local(host: RankHost) -> bool:
    if host.host and host.host == socket.gethostname():
        return True
    try:
        import ray

        return bool(host.ip) and host.ip == ray.util.get_node_ip_address()
    except Exception:
        return False
