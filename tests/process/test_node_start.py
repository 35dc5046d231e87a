"""bench/node_start.py on real processes: a start-up under its prefix runs in a CPU
group weighing one niceness-19 task; a process of it that takes an actor's title
(`ray::<Class>...`) goes back to this process's group while the window is open,
with its threads' niceness as it was, Ray's own node processes only when the window
closes, and then the group is gone. A process begun before the window is never
touched; and a busy process in the group gets almost no CPU beside one outside it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from bench.node_start import NodeStart, is_actor, own_cpu_group

pytestmark = pytest.mark.timeout(120)
WINDOW_S = 4.0


def _group(pid: int) -> str:
    """The process's path in the cpu hierarchy (v1) or the unified one (v2)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return next(line[3:] for line in lines if line.startswith("0::"))


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def _wait(cond, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _titled(prefix: tuple[str, ...], title: str, niceness: int = 0) -> subprocess.Popen:
    # bash's `exec -a` sets the process's argv[0], which is where Ray puts its titles.
    return subprocess.Popen([*prefix, "nice", "-n", str(niceness), "bash", "-c",
                             f'exec -a "{title}" sleep 60'])


def _plain_where_no_groups() -> bool:
    """Where this machine has no CPU groups, the bench starts the node as it is, and says
    why: True then (the caller's test has nothing more to check)."""
    if own_cpu_group() is not None:
        return False
    start = NodeStart(window_s=0.1)
    assert start.begin() == ()
    assert start.why_not
    return True


def test_no_cpu_groups_means_a_plain_start_and_a_reason(tmp_path):
    assert own_cpu_group(tmp_path) is None
    start = NodeStart(window_s=0.1, cgroup_root=tmp_path)
    assert start.begin() == ()
    assert "no cgroup cpu controller" in start.why_not


def test_titles():
    assert is_actor("ray::SpareActor.__init__")
    assert is_actor("ray::RankActor.run")
    assert is_actor("ray::kc-keeper:job-1")
    for daemon in ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "python"):
        assert not is_actor(daemon)


def test_actors_go_back_at_once_and_the_rest_when_the_window_ends():
    if _plain_where_no_groups():
        return
    before = _titled((), "ray::Trainer.run")  # began before the window: never touched
    home = _group(os.getpid())
    start = NodeStart(window_s=WINDOW_S, poll_s=0.05)
    prefix = start.begin()
    assert start.group is not None
    t0 = time.monotonic()
    daemon = _titled(prefix, "ray::IDLE")
    actor = _titled(prefix, "ray::SpareActor.__init__", niceness=15)  # as Ray sets its workers
    # `nice -n` adds to the caller's niceness (the suite runs this tier at 10), up to 19.
    worker_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 15)
    procs = [before, daemon, actor]
    try:
        assert _wait(lambda: _title(daemon.pid) == "ray::IDLE", 10)
        assert _wait(lambda: _title(actor.pid) == "ray::SpareActor.__init__", 10)
        assert _group(daemon.pid).endswith(start.group.path.name)
        assert _wait(lambda: _group(actor.pid) == home, 10)
        # Inside the window: the actor is back, Ray's own process still waits.
        assert time.monotonic() - t0 < WINDOW_S, "the machine was too slow to see the window open"
        assert _group(daemon.pid).endswith(start.group.path.name)
        assert _nice(actor.pid) == worker_nice  # as it was set, not the group's doing
        start.join(30)
        assert _group(daemon.pid) == home
        assert _group(before.pid) == home
        assert not start.group.path.exists()
        assert "ray::SpareActor.__init__" in start.restored
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_busy_process_in_the_group_gets_almost_no_cpu_beside_one_outside():
    if _plain_where_no_groups():
        return
    start = NodeStart(window_s=60, poll_s=0.05)
    prefix = start.begin()
    spin = ["taskset", "-c", "0", "python3", "-c", "while True: pass"]
    inside = subprocess.Popen([*prefix, *spin])
    outside = subprocess.Popen(spin)
    try:
        # The one outside at niceness 0 (weight 1024; the group weighs 15), whatever
        # niceness this test runs at (the suite runs this tier at 10: weight 110).
        os.setpriority(os.PRIO_PROCESS, outside.pid, 0)
        assert _wait(lambda: _group(inside.pid).endswith(start.group.path.name), 10)
        # Both spin on CPU 0 for 1.5 s of wall time once both run.
        assert _wait(lambda: _cpu_ticks(inside.pid) + _cpu_ticks(outside.pid) > 0, 10)
        a0, b0 = _cpu_ticks(inside.pid), _cpu_ticks(outside.pid)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            time.sleep(0.1)
        a, b = _cpu_ticks(inside.pid) - a0, _cpu_ticks(outside.pid) - b0
        assert b > 0
        assert a < 0.1 * (a + b), f"in the group {a} ticks, outside {b}"
    finally:
        for p in (inside, outside):
            p.kill()
            p.wait()
        start.group.close()
