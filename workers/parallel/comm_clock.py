"""The clock of a rank's collectives: which intervals had one in flight (the comm share
of each step) and which is in flight now (`kc debug comm`).

It sits in workers/parallel/ because the step's own collectives, DDP's comm
hooks (comm_hooks.py), report to it; the rank's telemetry (workers/runtime/
telemetry.py) and `TrainContext.collective()` read and feed it from above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CommClock:
    """Collects the intervals with a collective in flight, per step, and which
    collectives are in flight now (for `kc debug comm`)."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: dict[int, tuple[str, str, float]] = {}
        self.last: dict[str, Any] | None = None
        self.count = 0

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._spans.append((start, end))

    def begin(self, op: str, group: str = "world") -> int:
        with self._lock:
            self._seq += 1
            self._pending[self._seq] = (op, group, time.perf_counter())
            return self._seq

    def end(self, seq: int) -> None:
        now = time.perf_counter()
        with self._lock:
            entry = self._pending.pop(seq, None)
            if entry is None:
                return
            op, group, start = entry
            self._spans.append((start, now))
            self.count += 1
            self.last = {"op": op, "group": group, "seq": seq, "took_s": now - start,
                         "ended_ago_s": 0.0, "_end": now}

    @contextmanager
    def timing(self, op: str = "collective", group: str = "world") -> Iterator[None]:
        seq = self.begin(op, group)
        try:
            yield
        finally:
            self.end(seq)

    def in_flight(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The oldest collective in flight (with how long it has waited), and the last one done."""
        now = time.perf_counter()
        with self._lock:
            pending = min(self._pending.items(), default=None)
            last = dict(self.last) if self.last else None
        out = None
        if pending is not None:
            seq, (op, group, start) = pending
            out = {"op": op, "group": group, "seq": seq, "waited_s": now - start}
        if last is not None:
            last["ended_ago_s"] = now - last.pop("_end")
        return out, last

    def busy_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] covered by at least one span; spans before `end` are dropped."""
        with self._lock:
            spans, self._spans = self._spans, [s for s in self._spans if s[1] > end]
        total, reach = 0.0, start
        for a, b in sorted(spans):
            a, b = max(a, reach), min(b, end)
            if b > a:
                total += b - a
                reach = b
        return total
