"""A node that comes back in a chaos run starts as if on a machine of its own.

bench/goodput.py runs the head and three worker nodes of a Ray cluster on one
machine. When a killed or drained node comes back, Ray's start-up of it (the
raylet, its dashboard and runtime-env agents, the workers Ray starts ahead:
several core-seconds of Python imports) would, in a real cluster, run on that
node's own CPUs. On one machine of 2 cores it takes them from the training ranks
of whichever system is measured, and the chaos run would bill that to the
system as lost training time.

So `ray start` for a node that comes back runs in a CPU control group of its own
whose weight is that of one task at niceness 19 (`SHARES`, 15; Ray's workers at
their niceness 15 weigh 36 each, everything at niceness 0 1024). The processes it
starts are born in that group. For WINDOW_S after
it began, a watcher thread moves each of them back to this process's own group as
soon as it runs an actor (Ray titles an actor's process `ray::<Class>...`): a
spare, a keeper, a rank or a Ray Train worker is the measured system's own work,
and runs with the weight everything else has. When the window ends, the rest
follow and the group goes.

A group, not a niceness: Ray gives its workers niceness 15 and leaves its core
threads (gRPC, the IO loop) at 0, and moving a process between groups keeps every
thread's niceness as Ray set it. (An earlier version ran `ray start` under `nice
-n 19` and set the actors' threads to 0 afterwards: a rank relocated to a returned
node then ran at 0 and its peer at Ray's 15.) The group weighs what that start-up
weighed under `nice -n 19`, so a node takes as long to come back as before: at the
lowest weight the kernel allows (2), a returning raylet joined so late in the run of
2026-12-06 20:51 that the next raylet kill found no node to move its replica to.

Both systems get the same, and only on a node's return: the cluster's first start
and the nodes that stay are untouched. Where no CPU group can be made (no cgroup
`cpu` controller, or not writable), `ray start` runs as it is, and stderr says so.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from pathlib import Path

from bench.report import log

SHARES = 15  # cgroup v1 `cpu.shares`: a niceness-19 task's weight (the default, niceness 0's, is 1024)
WEIGHT = 1  # cgroup v2 `cpu.weight`: the nearest to it (the default is 100)
WINDOW_S = 30.0
POLL_S = 0.1
# Ray's own per-node processes that carry a `ray::` title without running an actor.
NODE_DAEMONS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


def is_actor(title: str) -> bool:
    return title.startswith("ray::") and not title.startswith(NODE_DAEMONS)


def title_of(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode(errors="replace")


def own_cpu_group(root: Path = CGROUP_ROOT) -> tuple[Path, str] | None:
    """This process's CPU group folder and the file that sets a group's weight: cgroup
    v1's `cpu` hierarchy, else v2's unified one where it has the `cpu` controller; None
    where there is neither."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") and (root / "cpu").is_dir():
            return root / "cpu" / path.lstrip("/"), "cpu.shares"
    for line in lines:
        if line.startswith("0::"):
            here = root / line[3:].lstrip("/")
            with contextlib.suppress(OSError):
                if "cpu" in (root / "cgroup.controllers").read_text().split():
                    return here, "cpu.weight"
    return None


class CpuGroup:
    """A child CPU group of this process's own, weighing one niceness-19 task."""

    def __init__(self, parent: Path, weight_file: str) -> None:
        self.parent = parent
        self.path = parent / f"kcbench-node-start-{os.getpid()}-{next(_names)}"
        self.path.mkdir()
        try:
            (self.path / weight_file).write_text(str(SHARES if weight_file == "cpu.shares" else WEIGHT))
        except OSError:
            self.path.rmdir()
            raise

    @classmethod
    def make(cls, root: Path = CGROUP_ROOT) -> tuple[CpuGroup | None, str]:
        """A new group, or None and why not."""
        found = own_cpu_group(root)
        if found is None:
            return None, "no cgroup cpu controller on this machine"
        try:
            return cls(*found), ""
        except OSError as exc:
            return None, f"cannot make a CPU group under {found[0]}: {exc}"

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def move_out(self, pid: int) -> bool:
        """`pid`, with all its threads, back to the parent group; False if it is gone."""
        try:
            (self.parent / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:
            return False

    def close(self) -> list[int]:
        """Every process back to the parent, and the group removed; returns those moved."""
        moved: list[int] = []
        for _ in range(20):  # a process forked meanwhile is born in the group: go again
            left = self.pids()
            moved += [pid for pid in left if self.move_out(pid)]
            with contextlib.suppress(OSError):
                self.path.rmdir()
                return moved
            time.sleep(0.05)
        log(f"  node start-up: could not remove {self.path} (processes still in it: {self.pids()})")
        return moved


class NodeStart:
    """The watch over one node's start-up (`begin` before `ray start`, whose command it
    returns a prefix for; the watcher ends the window by itself)."""

    def __init__(self, window_s: float = WINDOW_S, poll_s: float = POLL_S,
                 cgroup_root: Path = CGROUP_ROOT) -> None:
        self.window_s, self.poll_s, self.cgroup_root = window_s, poll_s, cgroup_root
        self.restored: list[str] = []  # titles of the actors moved back, for the log
        self.group: CpuGroup | None = None
        self.why_not = ""
        self._thread: threading.Thread | None = None

    def begin(self) -> tuple[str, ...]:
        """The prefix for `ray start`: it joins the new group, then runs the command."""
        self.group, self.why_not = CpuGroup.make(self.cgroup_root)
        if self.group is None:
            log(f"  node start-up runs at the machine's normal weight: {self.why_not}")
            return ()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="node-start-group")
        self._thread.start()
        procs = self.group.path / "cgroup.procs"
        return ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs))

    def _watch(self) -> None:
        group = self.group
        assert group is not None
        end = time.monotonic() + self.window_s
        while time.monotonic() < end:
            for pid in group.pids():
                with contextlib.suppress(OSError):
                    title = title_of(pid)
                    if is_actor(title) and group.move_out(pid):
                        self.restored.append(title.split()[0])
            time.sleep(self.poll_s)
        left = group.close()
        log(f"  node start-up window over: {len(self.restored)} actor process(es) moved back to "
            f"the normal weight as they began ({', '.join(sorted(set(self.restored))) or 'none'}), "
            f"{len(left)} more now")

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
