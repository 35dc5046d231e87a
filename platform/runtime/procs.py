"""Finding and stopping the processes a local cluster started."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from pathlib import Path

# Ports below the kernel's ephemeral range and above Ray's worker ports
# (10002-19999 by default). A port the kernel picks for a bind to 0 is one it
# also hands to the next outgoing connection on the machine, so between the
# check and the server's own bind any client socket may take it; in this band
# only another server can.
_BAND_LOW = 20000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server to bind soon.

    Never the same port twice in one process, so that several ports picked
    before any is bound (a Ray head wants four) are distinct."""
    high = _ephemeral_low()
    if high - _BAND_LOW > 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_BAND_LOW, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    while True:  # an odd port range: fall back on the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


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
