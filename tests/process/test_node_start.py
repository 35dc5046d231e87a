"""bench/node_start.py on real processes: a start-up under its `nice` prefix runs at
niceness 19; a process of it that takes an actor's title (`ray::<Class>...`) is set
back to 0 while the window is open, Ray's own node processes only when it closes, and
a process that began before the window is never touched."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from bench.node_start import NICE, NodeStart, _uptime_ticks, is_actor

pytestmark = pytest.mark.timeout(120)
WINDOW_S = 4.0


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _started(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


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


def _titled(prefix: tuple[str, ...], title: str) -> subprocess.Popen:
    # bash's `exec -a` sets the process's argv[0], which is where Ray puts its titles.
    return subprocess.Popen([*prefix, "bash", "-c", f'exec -a "{title}" sleep 60'])


def test_titles():
    assert is_actor("ray::SpareActor.__init__")
    assert is_actor("ray::RankActor.run")
    assert is_actor("ray::kc-keeper:job-1")
    for daemon in ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "python"):
        assert not is_actor(daemon)


def test_actors_get_their_priority_back_at_once_and_the_rest_when_the_window_ends():
    before = _titled((), "ray::Trainer.run")  # began before the window: never touched
    os.setpriority(os.PRIO_PROCESS, before.pid, NICE)
    # The window counts processes by their start in clock ticks, with a tick's slack.
    assert _wait(lambda: _uptime_ticks() > _started(before.pid) + 2)
    start = NodeStart(window_s=WINDOW_S, poll_s=0.05)
    prefix = start.begin()
    t0 = time.monotonic()
    daemon = _titled(prefix, "ray::IDLE")
    actor = _titled(prefix, "ray::SpareActor.__init__")
    procs = [before, daemon, actor]
    try:
        # Each runs under its title once `nice` has set 19 and bash has exec'd.
        assert _wait(lambda: _title(daemon.pid) == "ray::IDLE", 10)
        assert _wait(lambda: _title(actor.pid) == "ray::SpareActor.__init__", 10)
        assert _nice(daemon.pid) == NICE
        assert _wait(lambda: _nice(actor.pid) == 0, 10)
        # Inside the window: the actor is back, Ray's own process still waits.
        assert time.monotonic() - t0 < WINDOW_S, "the machine was too slow to see the window open"
        assert _nice(daemon.pid) == NICE
        start.join(30)
        assert _nice(daemon.pid) == 0
        assert _nice(actor.pid) == 0
        assert _nice(before.pid) == NICE
        assert "ray::SpareActor.__init__" in start.restored
    finally:
        for p in procs:
            p.kill()
            p.wait()
