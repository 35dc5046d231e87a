"""Finding and stopping the processes a local cluster started."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def matching(needles: list[str]) -> set[int]:
    """Pids whose command line contains any needle, plus all their descendants."""
    pids = _all_pids()
    roots = {p for p in pids if p != os.getpid() and any(n in _cmdline(p) for n in needles)}
    children: dict[int, list[int]] = {}
    for p in pids:
        children.setdefault(_ppid(p), []).append(p)
    out, stack = set(), list(roots)
    while stack:
        p = stack.pop()
        if p in out:
            continue
        out.add(p)
        stack.extend(children.get(p, []))
    out.discard(os.getpid())
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:  # a zombie is as good as gone
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# What a stack's processes get between SIGTERM and SIGKILL: Ray's own wait for
# `ray job stop` (RAY_JOB_STOP_WAIT_TIME_S). The API server, drivers and actors
# finish within it; Ray's daemons (gcs_server, raylets, their agents, the
# autoscaler monitor) do not act on SIGTERM while their peers go away (seen on
# Ray 2.60: still up 10 s later), and keep nothing a SIGKILL could lose.
STOP_GRACE_S = 3.0


def stop(pids: set[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        if not any(alive(p) for p in pids):
            return
