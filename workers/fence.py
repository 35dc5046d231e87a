"""A rank's lease on its place in the job, and the fence that ends it.

When a node is cut off, the controller declares its ranks lost after
`heartbeat_timeout_s` without a beat and starts others in their place. The old
processes may still be alive when the network heals; nothing they write then
may count. So a rank writes only while it holds a *lease*:

- The lease runs `timeout_s` (the heartbeat TTL the controller judges by) from
  the moment the last beat Redis acknowledged was *sent*, less the heartbeat
  client's socket timeout (`margin_s`): a write begun while the lease holds has
  landed, or failed, before the controller can judge the rank. Every
  acknowledged beat renews it (workers/runtime/heartbeat.py).
- Lapsed, the rank writes nothing: no beat, no progress, no log line, no
  checkpoint file. Its heartbeat thread first reads the job's fence set
  (`{prefix}fenced:{job}`, which the controller writes and the job's Redis user
  may only read). Not in it: the lease is renewed and writes resume, which is
  what rides out a Redis outage for everyone (the controller holds its verdicts
  while it cannot read beats, so it fences no one). In it: the rank is fenced.
- Fenced, the process says why in one line on stderr and exits with
  `EXIT_FENCED`, at most `exit_bound_s` after the fence became readable.

Whatever writes as the rank asks first: `check(what)` (each checkpoint file,
the manifest commit, each upload) waits while the lease is lapsed and raises
`FencedError` once fenced; the job log sink holds its lines while lapsed and
drops them once fenced. A process without a running heartbeat (tools, tests,
`kc checkpoint`) holds no lease, and `check` passes at once.

One `Fence` per process (`current()`): a process hosts one rank. It lives
beside the layers (checkpoints, the runtime) that both consult it, so that
neither imports the other. `Lease` is the arithmetic alone, pure.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kuangchao.workers.errors import FencedError

_log = logging.getLogger(__name__)

# EX_TEMPFAIL: the process was replaced, not broken; Ray reports the exit code.
EXIT_FENCED = 75


def exit_bound_s(interval_s: float, socket_timeout_s: float) -> float:
    """At most how long after its fence became readable a fenced rank is gone.

    The heartbeat thread of a lapsed rank tries the fence set every
    `interval_s`; a try begun while Redis was still out of reach fails within
    the client's socket timeout; the next one then reads the fence (a round
    trip, milliseconds) and the process exits at once.
    """
    return interval_s + socket_timeout_s


class Lease:
    """The lease arithmetic, pure: times are one process's monotonic clock.

    Args:
        timeout_s: The heartbeat TTL the controller judges the rank by.
        granted_at: When the lease began (the heartbeat thread's start).
        margin_s: Taken off the end: the longest a write may take to land or fail.
    """

    def __init__(self, timeout_s: float, granted_at: float, margin_s: float = 0.0) -> None:
        self.timeout_s, self.margin_s = timeout_s, margin_s
        self.since = granted_at

    @property
    def length_s(self) -> float:
        return max(0.0, self.timeout_s - self.margin_s)

    def renew(self, sent_at: float) -> None:
        """A beat sent at `sent_at` was acknowledged, or a fence read sent then found
        this process not fenced (a late answer never moves the lease back)."""
        self.since = max(self.since, sent_at)

    def lapsed(self, now: float) -> bool:
        return now - self.since > self.length_s

    def left_s(self, now: float) -> float:
        return self.since + self.length_s - now


def _exit_process(code: int) -> None:
    os._exit(code)  # no atexit handler, no flush: they would write as the rank


class Fence:
    """This process's lease and fence.

    Args:
        clock: Monotonic clock (injectable for tests).
        on_exit: Called with `EXIT_FENCED` once fenced; None stays alive (tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_exit: Callable[[int], Any] | None = _exit_process) -> None:
        self.clock, self.on_exit = clock, on_exit
        self.lease: Lease | None = None
        self.reason: str | None = None
        self._cond = threading.Condition()
        self._waits_told = False  # a lapse is logged once, not at every file it holds

    # -- the heartbeat thread's side -------------------------------------------------
    def arm(self, timeout_s: float, margin_s: float = 0.0) -> None:
        """Hold a lease from now (the heartbeat thread starts)."""
        with self._cond:
            self.lease = Lease(timeout_s, self.clock(), margin_s)
            self._cond.notify_all()

    def disarm(self) -> None:
        """Hold no lease any more: the heartbeat stopped in good standing (a rank that
        left its job, or a process shutting down). A lapsed lease stays lapsed."""
        with self._cond:
            if self.lease is not None and not self.lease.lapsed(self.clock()):
                self.lease = None
                self._cond.notify_all()

    def renew(self, sent_at: float) -> None:
        with self._cond:
            if self.lease is not None:
                self.lease.renew(sent_at)
                self._waits_told = False
                self._cond.notify_all()

    def fence(self, reason: str) -> None:
        """Mark this process fenced, say why on stderr, and exit (`on_exit`). Once."""
        with self._cond:
            if self.reason is not None:
                return
            self.reason = reason
            self._cond.notify_all()
        line = (f"kuangchao: fenced: {reason}; exiting with code {EXIT_FENCED} "
                "(docs/fault-tolerance.md, 'Fencing')\n")
        try:  # fd 2 itself: sys.stderr may be the job log's tee, which writes no more
            os.write(2, line.encode(errors="replace"))
        except OSError:
            pass
        if self.on_exit is not None:
            self.on_exit(EXIT_FENCED)

    # -- what writers ask ----------------------------------------------------------
    def is_fenced(self) -> bool:
        return self.reason is not None

    def lapsed(self) -> bool:
        """Whether a lease is held and has run out (fenced or not)."""
        lease = self.lease
        return lease is not None and lease.lapsed(self.clock())

    def lease_ok(self) -> bool:
        """Whether this process may write as its rank now."""
        return self.reason is None and not self.lapsed()

    def wait_lease(self, timeout: float | None = None) -> bool:
        """Wait while the lease is lapsed; True once it holds, False when fenced or
        after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout  # real waiting
        with self._cond:
            while True:
                if self.reason is not None:
                    return False
                if not self.lapsed():
                    return True
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if wait <= 0:
                    return False
                self._cond.wait(wait)  # renew, fence and arm notify; the clock is polled

    def check(self, what: str) -> None:
        """Before writing `what` as the rank: wait while the lease is lapsed.

        Raises:
            FencedError: This process is fenced; it must write nothing.
        """
        if self.lease_ok():
            return
        if self.reason is None and not self._waits_told:
            self._waits_told = True
            _log.warning("%s waits: this rank's lease lapsed (Redis out of reach); it writes "
                         "again once it has read that it is not fenced", what)
        if not self.wait_lease():
            raise FencedError(f"{what} not written: {self.reason}")


_current = Fence()


def current() -> Fence:
    """This process's fence."""
    return _current


def use(fence: Fence) -> Fence:
    """Make `fence` this process's (tests); returns the one it replaces."""
    global _current
    previous, _current = _current, fence
    return previous


def lease_ok() -> bool:
    return _current.lease_ok()


def wait_lease(timeout: float | None = None) -> bool:
    return _current.wait_lease(timeout)


def fence(reason: str) -> None:
    _current.fence(reason)


def is_fenced() -> bool:
    return _current.is_fenced()


def check(what: str) -> None:
    """`Fence.check` on this process's fence."""
    _current.check(what)
