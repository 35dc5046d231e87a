"""A node that comes back in a chaos run starts as if on a machine of its own.

bench/goodput.py runs the head and three worker nodes of a Ray cluster on one
machine. When a killed or drained node comes back, Ray's start-up of it (the
raylet, its dashboard and runtime-env agents, the workers Ray starts ahead:
several core-seconds of Python imports) would, in a real cluster, run on that
node's own CPUs. On one machine of 2 cores it takes them from the training ranks
of whichever system is measured, and the chaos run would bill that to the
system as lost training time.

So `ray start` for a node that comes back runs at niceness NICE, which the
processes it starts inherit, and for WINDOW_S after it began a watcher thread
sets every process of that start-up back to niceness 0 as soon as it runs an
actor (Ray titles an actor's process `ray::<Class>...`): a spare, a keeper, a
rank or a Ray Train worker is the measured system's own work, and runs at the
priority everything else has. When the window ends, every process still at NICE
is set back to 0 too. Both systems get the same, and only on a node's return:
the cluster's first start and the nodes that stay are untouched.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from bench.report import log

NICE = 19
WINDOW_S = 30.0
POLL_S = 0.1
# Ray's own per-node processes that carry a `ray::` title without running an actor.
NODE_DAEMONS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
_TICKS = os.sysconf("SC_CLK_TCK")


def prefix() -> tuple[str, ...]:
    """What `ray start` runs under for a node that comes back."""
    return ("nice", "-n", str(NICE))


def _uptime_ticks() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * _TICKS


def _niced_since(since_ticks: float) -> Iterator[tuple[int, str]]:
    """(pid, title) of each process started after `since_ticks` (clock ticks since
    boot) whose niceness is NICE."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[16]) != NICE or int(fields[19]) <= since_ticks:  # nice, starttime
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        yield int(entry), title


def _renice(pid: int, niceness: int = 0) -> None:
    """Every thread of `pid` to `niceness` (on Linux a niceness is a thread's own)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


def is_actor(title: str) -> bool:
    return title.startswith("ray::") and not title.startswith(NODE_DAEMONS)


class NodeStart:
    """The watch over one node's start-up (`begin` before `ray start`, `end` after the
    node joined); `end` returns at once, the watcher ends the window by itself."""

    def __init__(self, window_s: float = WINDOW_S, poll_s: float = POLL_S) -> None:
        self.window_s, self.poll_s = window_s, poll_s
        self.since = 0.0
        self.restored: list[str] = []  # titles of the actors set back to 0, for the log
        self._thread: threading.Thread | None = None

    def begin(self) -> tuple[str, ...]:
        self.since = _uptime_ticks() - 1  # a tick's slack: starttime is whole ticks
        self._thread = threading.Thread(target=self._watch, daemon=True, name="node-start-nice")
        self._thread.start()
        return prefix()

    def _watch(self) -> None:
        end = time.monotonic() + self.window_s
        while time.monotonic() < end:
            for pid, title in _niced_since(self.since):
                if is_actor(title):
                    _renice(pid)
                    self.restored.append(title.split()[0])
            time.sleep(self.poll_s)
        left = list(_niced_since(self.since))
        for pid, _ in left:
            _renice(pid)
        log(f"  node start-up window over: {len(self.restored)} actor process(es) set back to "
            f"niceness 0 as they began ({', '.join(sorted(set(self.restored))) or 'none'}), "
            f"{len(left)} more now")

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
