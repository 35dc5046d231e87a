"""Ship a worker's output to the job's log in Redis.

Everything a rank prints (the built-in trainer's log lines, a user's print
calls, a traceback) becomes a structured JSON line carrying job_id, rank and
module, batched by a background thread so printing never waits on Redis.

The lines are written as the rank, so they wait for its lease
(workers/fence.py): while it is lapsed they are held (the newest `HOLD_LINES`),
and once the process is fenced they are dropped, since nothing a replaced rank
says may reach its job's log.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kuangchao.platform.jobs.store import JobStore
from kuangchao.workers import fence as fencing

_log = logging.getLogger(__name__)

HOLD_LINES = 5000  # kept while Redis does not take them, newest first


class JobLogSink:
    """Buffers log records and flushes them to the store every `interval_s`, while
    the rank's lease holds (`fence`: default, this process's)."""

    def __init__(self, store: JobStore | None, job_id: str, rank: int,
                 interval_s: float = 0.5, fence: fencing.Fence | None = None) -> None:
        self.store, self.job_id, self.rank = store, job_id, rank
        self.fence = fence if fence is not None else fencing.current()
        self._failing = False
        self._buf: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True,
                                        name=f"kc-log-sink-{rank}")
        self._thread.start()

    def emit(self, message: str, level: str = "INFO", module: str = "train", **fields: Any) -> None:
        if self.fence.is_fenced():
            return
        rec = {"ts": time.time(), "level": level, "job_id": self.job_id, "rank": self.rank,
               "module": module, "message": message, **fields}
        with self._lock:
            self._buf.append(rec)

    def flush(self) -> None:
        if self.fence.is_fenced():
            with self._lock:
                self._buf = []
            return
        if not self.fence.lease_ok():  # held, never sent while the lease is lapsed
            with self._lock:
                self._buf = self._buf[-HOLD_LINES:]
            return
        with self._lock:
            batch, self._buf = self._buf, []
        if not batch or self.store is None:
            return
        try:
            self.store.add_logs(self.job_id, batch)
            self._failing = False
        except Exception as exc:  # a Redis hiccup must not kill training
            if not self._failing:  # once per outage: the client gives up fast, and often
                _log.warning("could not ship %d log lines: %s", len(batch), exc)
            self._failing = True
            with self._lock:
                self._buf = (batch + self._buf)[-HOLD_LINES:]

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()


class _Tee(io.TextIOBase):
    """A text stream that writes through and emits each full line to a sink."""

    def __init__(self, inner: Any, sink: JobLogSink, level: str) -> None:
        self.inner, self.sink, self.level = inner, sink, level
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.inner.write(s)
        self._partial += s
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if line.strip():
                self.sink.emit(line, level=self.level, module="stdout" if self.level == "INFO"
                               else "stderr")
        return len(s)

    def flush(self) -> None:
        self.inner.flush()


@contextmanager
def capture_output(sink: JobLogSink) -> Iterator[None]:
    """Copy stdout and stderr lines to the job log while the block runs."""
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout = _Tee(old_out, sink, "INFO")
    sys.stderr = _Tee(old_err, sink, "ERROR")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old_out, old_err
