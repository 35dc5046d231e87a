"""The heartbeat thread every rank runs.

Every `interval_s` it writes the rank's step, phase, pid, node and time to
Redis with a TTL of `timeout_s` (one pipelined round trip that also asks
whether the controller wants this rank's stacks). Training only updates two
attributes, so a beat costs the train loop nothing.

A Redis hiccup does not touch training: the thread backs off, logs once
when beats start failing and once when they resume.

When the controller suspects a hang it sets a stack request; the thread
answers with every Python thread's stack. It can, because the main thread
blocked in a collective or a sleep has released the GIL.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.beats import drop_beat, queue_beat
from kuangchao.platform.jobs.flags import carried_flags, queue_stack_answer
from kuangchao.platform.jobs.streams import queue_points, queue_progress
from kuangchao.platform.protocol.heartbeat import Beat

_log = logging.getLogger(__name__)


def dump_stacks() -> str:
    """Every Python thread's stack, newest frame last, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the heartbeat thread itself says nothing useful
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Heartbeat:
    """Writes one rank's heartbeats until `stop`.

    Args:
        client: A Redis client of its own, with short socket timeouts, so a
            stalled Redis never holds the thread past the next beat (the store's
            client retries for seconds). Its one exception to "no raw client
            outside the store": what it writes besides the beat goes through the
            store's own pipeline writes (queue_progress, queue_points,
            queue_stack_answer), so the two never drift.
        prefix, job_id, rank: Where the beats go.
        node: The node name shown in failure messages.
        interval_s, timeout_s: Beat period and key TTL.
        on_log: Receives the thread's own warnings (the job log).
    """

    def __init__(self, client: redis.Redis, prefix: str, job_id: str, rank: int, node: str,
                 interval_s: float = 1.0, timeout_s: float = 10.0,
                 on_log: Callable[[str, str], None] | None = None) -> None:
        self.client, self.prefix, self.job_id, self.rank = client, prefix, job_id, rank
        self.node, self.interval_s, self.timeout_s = node, interval_s, timeout_s
        self.on_log = on_log or (lambda level, msg: _log.log(logging.getLevelName(level), msg))
        self.step, self.phase = 0, "init"
        self._progress_ts = time.time()
        self.carries_progress = False
        self.flag_keys: dict[str, str] = {}
        self.flags: dict[str, bool] = {}
        self._progress: dict[str, Any] = {}
        self._points: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._seq = 0
        self.beats_sent = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Runs on this thread after a beat that found the `debug` flag set (kc debug).
        self.on_debug: Callable[[], None] | None = None

    # -- what training calls -------------------------------------------------
    def set_step(self, step: int) -> None:
        if step != self.step:
            self.step, self._progress_ts = step, time.time()

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase, self._progress_ts = phase, time.time()

    def rename(self, rank: int) -> None:
        """Beat as `rank` from now on (a resize renumbered this rank); the old key goes."""
        with self._beat_lock:
            old, self.rank = self.rank, rank
        if old != rank:
            try:
                drop_beat(self.client, self.prefix, self.job_id, old)
            except redis.RedisError:
                pass  # it expires on its own
        self.beat_once_quietly()

    def beat_once_quietly(self) -> None:
        try:
            self.beat_once()
        except (redis.RedisError, OSError):
            pass  # the thread's next beat retries

    def carry(self) -> None:
        """Also carry the job's progress out, and control flags in, with each beat.

        Training then never waits on Redis for either: `publish` only stores
        the newest progress, and `flags` is read from memory.
        """
        self.carries_progress = True
        self.flag_keys = carried_flags(self.prefix, self.job_id)

    def publish(self, progress: dict[str, Any], point: dict[str, Any] | None = None) -> None:
        """Queue progress fields for the next beat (newer values win), and a
        loss-curve point, which is never merged away: every logged step keeps one."""
        with self._lock:
            self._progress.update(progress)
            if point is not None:
                self._points.append(point)

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous = self.phase
        self.set_phase(phase)
        try:
            yield
        finally:
            self.set_phase(previous)

    # -- the thread ------------------------------------------------------------
    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kc-heartbeat-{self.rank}")
        self._thread.start()
        return self

    def stop(self, delete: bool = True) -> None:
        """End the beats. `delete=False` leaves the key to expire: a rank that left a
        resized job no longer owns its old number, which a survivor may now beat under."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if not delete:
            return
        try:  # a clean exit is not a death: take the key away at once
            drop_beat(self.client, self.prefix, self.job_id, self.rank)
        except redis.RedisError:
            pass

    def flush(self) -> None:
        """Send a beat now, with any queued progress (at the end of a run)."""
        try:
            self.beat_once()
        except (redis.RedisError, OSError) as exc:
            self.on_log("WARNING", f"final progress could not reach Redis: {exc}")

    def beat_once(self) -> None:
        """Write one beat and answer a pending stack request."""
        with self._beat_lock:
            self._beat_once()

    def _beat_once(self) -> None:
        self._seq += 1
        beat = Beat(self.rank, self.step, self.phase, os.getpid(), self.node, time.time(),
                    self._progress_ts, self._seq)
        with self._lock:
            progress, self._progress = self._progress, {}
            points, self._points = self._points, []
        flags = list(self.flag_keys.items())
        try:
            with self.client.pipeline(transaction=False) as pipe:
                queue_beat(pipe, self.prefix, self.job_id, self.rank, beat.encode(), self.timeout_s)
                pipe.get(keys.stack_request(self.prefix, self.job_id, self.rank))
                for _, key in flags:
                    pipe.exists(key)
                if progress and self.carries_progress:
                    queue_progress(pipe, self.prefix, self.job_id, progress)
                if points and self.carries_progress:
                    queue_points(pipe, self.prefix, self.job_id, points)
                replies = pipe.execute()
        except BaseException:
            with self._lock:  # keep the progress for the next beat
                self._progress = {**progress, **self._progress}
                self._points = points + self._points
            raise
        self.beats_sent += 1
        self.flags.update({name: bool(v) for (name, _), v in zip(flags, replies[2:], strict=False)})
        if replies[1]:
            self._answer_stack_request()

    def _answer_stack_request(self) -> None:
        text = (f"rank {self.rank} pid {os.getpid()} on {self.node}, step {self.step}, "
                f"phase {self.phase}\n" + dump_stacks())
        with self.client.pipeline(transaction=False) as pipe:
            queue_stack_answer(pipe, self.prefix, self.job_id, self.rank, text)
            pipe.execute()

    def _debug(self) -> None:
        if self.on_debug is None or not self.flags.get("debug"):
            return
        try:
            self.on_debug()
        except (redis.RedisError, OSError):
            raise  # the loop's backoff handles Redis
        except Exception as exc:  # noqa: BLE001 -- a diagnosis must never stop the beats
            self.on_log("WARNING", f"could not answer a debug request: {exc}")

    def _loop(self) -> None:
        delay = self.interval_s
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                self.beat_once()
                self._debug()
                if failing_since is not None:
                    self.on_log("WARNING", f"heartbeats resumed after "
                                f"{time.monotonic() - failing_since:.1f}s without Redis")
                failing_since, delay = None, self.interval_s
            except (redis.RedisError, OSError) as exc:
                self.failures += 1
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.on_log("WARNING", f"heartbeat to Redis failed ({exc}); retrying with "
                                "backoff, training continues")
                # Back off, but never past half the TTL: beats must resume
                # before the controller's grace runs out.
                delay = min(delay * 2, max(self.interval_s, self.timeout_s / 2))
            self._stop.wait(delay)


def heartbeat_client(url: str, timeout_s: float) -> redis.Redis:
    """A Redis client for heartbeats: no retries inside redis-py, short timeouts. The one
    client outside the store on a rank (the store's rides out a Redis restart for
    seconds, which would hold beats past their TTL); it writes through the store's
    functions (platform/jobs/beats.py, streams.py, flags.py, debug_requests.py)."""
    limit = max(0.5, min(5.0, timeout_s / 3))
    return redis.Redis.from_url(url, socket_connect_timeout=limit, socket_timeout=limit,
                                decode_responses=True)
