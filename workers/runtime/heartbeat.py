"""The heartbeat thread every rank runs.

Every `interval_s` it writes the rank's step, phase, pid, node and time to
Redis with a TTL of `timeout_s` (one pipelined round trip that also asks
whether the controller wants this rank's stacks). Training only updates two
attributes, so a beat costs the train loop nothing.

A Redis hiccup does not touch training: the thread backs off, logs once
when beats start failing and once when they resume.

The beats also hold the rank's lease (workers/fence.py): every acknowledged
beat renews it, and each beat's round trip asks whether this process was
fenced. Once the lease has lapsed the thread writes nothing, not even a beat,
until it has read the job's fence set: not in it, the lease is renewed and
beats resume (a Redis outage, ridden out); in it, the process exits.

When the controller suspects a hang it sets a stack request; the thread
answers with every Python thread's stack. It can, because the main thread
blocked in a collective or a sleep has released the GIL.

With a node agent (`relay_via`), a beat goes to a file the agent relays, and the
round trip is the agent's, once per node (workers/runtime/beat_relay.py): its ack
renews the lease, says whether this process is fenced, and brings the flags
and stack requests. Only progress (the chief's) still goes to Redis from here.
Without a fresh ack the rank beats on its own key, as without an agent.
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
from kuangchao.platform.jobs.fences import member, queue_fence_check, read_fenced
from kuangchao.platform.jobs.flags import carried_flags, queue_stack_answer
from kuangchao.platform.jobs.streams import queue_points, queue_progress
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.workers import fence as fencing
from kuangchao.workers.runtime.beat_client import socket_timeout
from kuangchao.workers.runtime.beat_relay import BeatRelay, beat_folder

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
        node: The node name shown in failure messages (with the pid, this
            process's entry in the fence set: the controller's name for the node).
        interval_s, timeout_s: Beat period and key TTL; the lease lasts the TTL,
            less the client's socket timeout.
        on_log: Receives the thread's own warnings (the job log).
        fence: The lease and fence it keeps (default: this process's).
    """

    def __init__(self, client: redis.Redis, prefix: str, job_id: str, rank: int, node: str,
                 interval_s: float = 1.0, timeout_s: float = 10.0,
                 on_log: Callable[[str, str], None] | None = None,
                 fence: fencing.Fence | None = None) -> None:
        self.client, self.prefix, self.job_id, self.rank = client, prefix, job_id, rank
        self.node, self.interval_s, self.timeout_s = node, interval_s, timeout_s
        self.fence = fence if fence is not None else fencing.current()
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
        self._warned_unfenceable = False
        # Runs on this thread after a beat that found the `debug` flag set (kc debug).
        self.on_debug: Callable[[], None] | None = None
        self.relay: BeatRelay | None = None

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
            if self.relay is not None and old != rank:
                self.relay.rename(rank)
        if old != rank and self.fence.lease_ok():
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

    def relay_via(self, job_id: str, node: str) -> None:
        """Hand beats to this node's agent for the job, when it acknowledges them."""
        try:
            self.relay = BeatRelay(beat_folder(job_id, node), self.rank,
                                   fresh_s=2 * self.interval_s)
        except OSError as exc:  # no folder for it: beat on the own key only
            self.on_log("WARNING", f"no node-agent folder ({exc}); this rank beats on its own")

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
        """Hold the lease and beat, from now on. The lease is the TTL less the client's
        socket timeout, but never less than two thirds of it (more than a beat period:
        the spec asks for two beats per TTL), or a TTL under 1.5 s would leave none."""
        margin_s = min(socket_timeout(self.client), self.timeout_s / 3)
        self.fence.arm(self.timeout_s, margin_s=margin_s)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kc-heartbeat-{self.rank}")
        self._thread.start()
        return self

    def stop(self, delete: bool = True) -> None:
        """End the beats. `delete=False` leaves the key to expire: a rank that left a
        resized job no longer owns its old number, which a survivor may now beat under.
        A lease in good standing is given up (nothing renews it now); a lapsed one stays."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if delete and self.fence.lease_ok():
            try:  # a clean exit is not a death: take the key away at once
                drop_beat(self.client, self.prefix, self.job_id, self.rank)
            except redis.RedisError:
                pass
        if delete and self.relay is not None:
            self.relay.drop()
        if self._thread is not None:
            self.fence.disarm()

    def flush(self) -> None:
        """Send a beat now, with any queued progress (at the end of a run)."""
        try:
            self.beat_once()
        except (redis.RedisError, OSError) as exc:
            self.on_log("WARNING", f"final progress could not reach Redis: {exc}")

    def beat_once(self) -> None:
        """Write one beat and answer a pending stack request; with the lease lapsed,
        first read whether this process is fenced (and write nothing if it is)."""
        with self._beat_lock:
            if self.fence.is_fenced():
                return  # its process is on its way out
            if self.fence.lapsed() and not self._renew():
                return
            self._beat_once()

    def _renew(self) -> bool:
        """The lease lapsed: read the fence set. True (lease renewed) when this process
        is not in it; raises when Redis does not answer (the loop tries again)."""
        sent_at = self.fence.clock()
        try:
            fenced = read_fenced(self.client, self.prefix, self.job_id, os.getpid(), self.node)
        except redis.exceptions.NoPermissionError as exc:
            fenced = self._unfenceable(exc)
        if fenced:
            self._fenced()
            return False
        self.fence.renew(sent_at)
        return True

    def _unfenceable(self, exc: Exception) -> bool:
        """The job's Redis user may not read the fence set: one made before fencing
        existed (redis_acl.py). Such a rank cannot learn it was fenced; it runs as
        ranks did before, its beats still ignored once replaced."""
        if not self._warned_unfenceable:
            self._warned_unfenceable = True
            self.on_log("WARNING", f"cannot read this job's fence set ({exc}); this rank "
                        "cannot be fenced")
        return False

    def _fenced(self) -> None:
        self._stop.set()
        self.fence.fence(f"rank {self.rank} (pid {os.getpid()} on {self.node}) of job "
                         f"{self.job_id} was replaced by the controller while out of reach")

    def _beat_once(self) -> None:
        self._seq += 1
        beat = Beat(self.rank, self.step, self.phase, os.getpid(), self.node, time.time(),
                    self._progress_ts, self._seq)
        if self.relay is not None and self._relayed(beat):
            return
        with self._lock:
            progress, self._progress = self._progress, {}
            points, self._points = self._points, []
        flags = list(self.flag_keys.items())
        sent_at = self.fence.clock()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                # Asked first, answered with the rest: a process fenced while its lease
                # held learns it here, one beat (and its progress) late at most.
                queue_fence_check(pipe, self.prefix, self.job_id, os.getpid(), self.node)
                queue_beat(pipe, self.prefix, self.job_id, self.rank, beat.encode(), self.timeout_s)
                pipe.get(keys.stack_request(self.prefix, self.job_id, self.rank))
                for _, key in flags:
                    pipe.exists(key)
                self._queue_progress(pipe, progress, points)
                replies = pipe.execute(raise_on_error=False)
            if isinstance(replies[0], redis.exceptions.NoPermissionError):
                replies[0] = self._unfenceable(replies[0])
            error = next((r for r in replies if isinstance(r, Exception)), None)
            if error is not None:
                raise error
        except BaseException:
            with self._lock:  # keep the progress for the next beat
                self._progress = {**progress, **self._progress}
                self._points = points + self._points
            raise
        if replies[0]:
            self._fenced()
            return
        self.fence.renew(sent_at)
        self.beats_sent += 1
        self.flags.update({name: bool(v) for (name, _), v in zip(flags, replies[3:], strict=False)})
        if replies[2]:
            self._answer_stack_request()

    def _queue_progress(self, pipe: Any, progress: dict[str, Any],
                        points: list[dict[str, Any]]) -> None:
        if progress and self.carries_progress:
            queue_progress(pipe, self.prefix, self.job_id, progress)
        if points and self.carries_progress:
            queue_points(pipe, self.prefix, self.job_id, points)

    def _relayed(self, beat: Beat) -> bool:
        """Hand `beat` to the node agent; True when a fresh ack made the own round trip
        needless (the lease renewed, flags and stack requests taken from it)."""
        assert self.relay is not None
        at = self.fence.clock()
        try:
            self.relay.write(beat, at)
        except OSError:
            return False  # the own key carries this beat
        found = self.relay.fresh_ack(time.time())
        if found is None:
            return False
        ack, beat_at = found
        if member(os.getpid(), self.node) in ack.fenced:
            self._fenced()
            return True
        self.fence.renew(beat_at)
        self.beats_sent += 1
        self.flags.update({name: ack.flags.get(name, False) for name in self.flag_keys})
        with self._lock:
            progress, self._progress = self._progress, {}
            points, self._points = self._points, []
        try:
            if progress or points:  # the chief's: not the agent's to carry
                with self.client.pipeline(transaction=False) as pipe:
                    self._queue_progress(pipe, progress, points)
                    pipe.execute()
            if self.rank in ack.stack_requests:
                self._answer_stack_request()
        except BaseException:
            with self._lock:  # keep the progress for the next beat
                self._progress = {**progress, **self._progress}
                self._points = points + self._points
            raise
        return True

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
        lapse_told = False
        while not self._stop.is_set():
            try:
                self.beat_once()
                if self._stop.is_set():
                    break  # fenced
                self._debug()
                if failing_since is not None:
                    self.on_log("WARNING", f"heartbeats resumed after "
                                f"{time.monotonic() - failing_since:.1f}s without Redis")
                failing_since, delay, lapse_told = None, self.interval_s, False
            except (redis.RedisError, OSError) as exc:
                self.failures += 1
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.on_log("WARNING", f"heartbeat to Redis failed ({exc}); retrying with "
                                "backoff, training continues")
                # Back off, but never past half the TTL: beats must resume
                # before the controller's grace runs out. Once the lease has
                # lapsed, try every period: a fenced rank must learn it within
                # one period of Redis answering again (fence.exit_bound_s).
                delay = min(delay * 2, max(self.interval_s, self.timeout_s / 2))
                if self.fence.lapsed():
                    delay = self.interval_s
                    if not lapse_told:
                        lapse_told = True
                        self.on_log("WARNING", "this rank's lease lapsed: it writes nothing "
                                    "(beats, progress, log lines, checkpoints) until it has "
                                    "read from Redis that it was not replaced meanwhile")
            self._stop.wait(delay)
