"""What both halves of bench/recovery.py share: reading the traces, signalling
rank 1, driving the kills and turning the traces into recoveries.

* `TraceTail` / `Attempt`: the ranks' trace files (written by
  `bench.recovery_ray.Trace`), read incrementally and cut into one attempt per
  process run of the loop.
* `Background`, `wait_until`, `signal_at`, `drive_kills`, `release`: run a
  blocking `run_as_driver` or `fit()` in a thread, SIGKILL or SIGSTOP rank RANK
  at a step found in its trace, wait for the recovery.
* `Recovery`, `analyse`, `describe`: per kill, what the traces say (steps
  reached, acknowledged checkpoint, resumed step, MTTR and its phases).
* `recovery_spec`: the kuangchao job spec both systems' runs are built from:
  kuangchao's `fault_tolerance` at the defaults a user gets (`OURS_DEFAULTS`,
  read from the spec's own model), plus the overrides a run names (warm
  spares: `WARM_SPARES`).

The kuangchao runner is in `bench.recovery_kc`, the Ray Train one in
`bench.recovery_rt`; both import this module, never each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import log, median, tiny_spec
from kuangchao.platform.spec.jobspec import FaultToleranceSection, validate_spec

DETECT_KILL_AFTER = 2  # extra kills for crash_detect_ms come this many steps into the restarted loop
# Kuangchao's fault-tolerance settings as a user gets them (the spec's defaults):
# what every run of this benchmark uses unless it names an override.
_FT = FaultToleranceSection()
OURS_DEFAULTS: dict[str, Any] = {k: getattr(_FT, k) for k in (
    "heartbeat_interval_s", "heartbeat_timeout_s", "hang_timeout_s", "spare_workers")}
# The one override of the second MTTR line: a warm process per node of the job takes
# over a failed rank (docs/fault-tolerance.md), not on by default.
WARM_SPARES: dict[str, Any] = {"spare_workers": True}
RANK = 1  # the rank killed or stopped
WAIT_S = 240.0  # longest wait for any one thing before the run is declared stuck


# -- traces ---------------------------------------------------------------------

class TraceTail:
    """Reads the ranks' trace files (see `bench.recovery_ray.Trace`) incrementally."""

    def __init__(self, folder: Path, world_size: int = 2) -> None:
        self.folder, self.world_size = folder, world_size
        self._offset = [0] * world_size
        self._partial = [""] * world_size
        self.events: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]

    def poll(self) -> None:
        for r in range(self.world_size):
            path = self.folder / f"rank{r}.jsonl"
            try:
                with path.open() as f:
                    f.seek(self._offset[r])
                    chunk = f.read()
                    self._offset[r] = f.tell()
            except FileNotFoundError:
                continue
            lines = (self._partial[r] + chunk).split("\n")
            self._partial[r] = lines.pop()  # "" after a complete line, else a line being written
            self.events[r].extend(json.loads(line) for line in lines if line)

    def attempts(self, rank: int) -> list[Attempt]:
        return attempts_of(self.events[rank])


@dataclass
class Attempt:
    """One run of the train loop in one process: its `start` event and what followed."""

    pid: int
    start: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    ckpts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return self.steps[-1]["step"] if self.steps else self.start["step"]


def attempts_of(events: list[dict[str, Any]]) -> list[Attempt]:
    out: list[Attempt] = []
    for e in events:
        if e["ev"] == "start":
            out.append(Attempt(e["pid"], e))
            continue
        mine = next((a for a in reversed(out) if a.pid == e["pid"]), None)
        if mine is not None:
            (mine.steps if e["ev"] == "step" else mine.ckpts).append(e)
    return out


# -- driving runs ----------------------------------------------------------------

class Background:
    """Runs `fn` in a daemon thread (a blocking `run_as_driver` or `fit()`)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended_at = time.time()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout_s: float, what: str) -> Any:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{what} still running after {timeout_s:.0f}s")
        return self.result


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str,
               alive: Callable[[], bool] | None = None, poll_s: float = 0.01) -> Any:
    """Poll `pred` until it returns something truthy; None when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if alive is not None and not alive():
            value = pred()
            if value:
                return value
            raise RuntimeError(f"the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


@dataclass(frozen=True)
class Signalled:
    target: int  # the step rank RANK had to complete first (relative: steps into its loop)
    pid: int
    t: float  # time.time() just before the signal
    relative: bool = False


def signal_at(tail: TraceTail, target: int, after_t: float, sig: int,
              alive: Callable[[], bool], relative: bool = False) -> Signalled:
    """Send `sig` to rank RANK once a loop started after `after_t` has completed step
    `target` (with `relative`: `target` steps since that loop started)."""
    def ready() -> int | None:
        tail.poll()
        att = [a for a in tail.attempts(RANK) if a.start["t"] > after_t]
        if not att:
            return None
        done = len(att[-1].steps) if relative else att[-1].last_step
        return att[-1].pid if done >= target else None

    what = f"{target} steps into its loop" if relative else f"step {target}"
    pid = wait_until(ready, WAIT_S, f"rank {RANK} to reach {what}", alive)
    if pid is None:
        raise TimeoutError(f"rank {RANK} did not reach {what} within {WAIT_S:.0f}s")
    t = time.time()
    os.kill(pid, sig)
    return Signalled(target, pid, t, relative)


def first_step_after(tail: TraceTail, t: float) -> dict[str, Any] | None:
    """Rank 0's first completed step of a loop that started after `t`."""
    tail.poll()
    for a in tail.attempts(0):
        if a.start["t"] > t and a.steps:
            return a.steps[0]
    return None


def release(pid: int) -> None:
    """Continue and kill a stopped process, if it still exists (never leave it stopped)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def drive_kills(tail: TraceTail, targets: list[int], run: Background,
                extra: int = 0) -> list[Signalled]:
    """SIGKILL rank RANK at each target step, each time after the previous recovery;
    then `extra` more times, DETECT_KILL_AFTER steps into each restarted loop."""
    kills: list[Signalled] = []
    after = 0.0
    plan = [(t, False) for t in targets] + [(DETECT_KILL_AFTER, True)] * extra
    for target, relative in plan:
        k = signal_at(tail, target, after, signal.SIGKILL, run.alive, relative)
        log(f"  SIGKILL rank {RANK} pid {k.pid} "
            + (f"{target} steps into its loop" if relative else f"after step {target}"))
        kills.append(k)
        if not wait_until(lambda k=k: first_step_after(tail, k.t), WAIT_S, "the first step "
                          "after the restart", run.alive):
            raise TimeoutError(f"no step completed within {WAIT_S:.0f}s of the kill")
        after = k.t
    return kills


# -- analysis ---------------------------------------------------------------------

@dataclass
class Recovery:
    """One kill and what followed, from the traces (both systems)."""

    kill: Signalled
    reached: int  # highest step any rank completed before the kill
    acked: int  # newest checkpoint whose save had returned on rank 0 before the kill
    acked_at: float  # when that save returned
    resumed: int  # step the restarted loop started from
    loop_start: float  # the restarted loop (rank 0) began
    built: float  # model, optimizer and data built
    restored: float  # checkpoint loaded
    first_step: float  # the restarted loops' first step completed on EVERY rank (the latest)
    first_step_rank0: float  # the same step completed on rank 0

    @property
    def mttr_s(self) -> float:
        return self.first_step - self.kill.t

    @property
    def redone(self) -> int:
        return self.reached - self.resumed


def analyse(tail: TraceTail, kills: list[Signalled]) -> list[Recovery]:
    tail.poll()
    out = []
    for i, k in enumerate(kills):
        before = kills[i - 1].t if i else 0.0
        reached = max((e["step"] for ev in tail.events for e in ev
                       if e["ev"] == "step" and before < e["t"] <= k.t), default=0)
        acks = [e for e in tail.events[0] if e["ev"] == "ckpt" and e["t"] <= k.t]
        acked = max(acks, key=lambda e: e["step"]) if acks else {"step": 0, "t": 0.0}
        new = next(a for a in tail.attempts(0) if a.start["t"] > k.t and a.steps)
        first = new.steps[0]
        out.append(Recovery(k, reached, acked["step"], acked["t"], new.start["step"], new.start["t"],
                            new.start["built"], new.start["restored"],
                            all_ranks_at(tail, k.t, first["step"], first["t"]), first["t"]))
    return out


def all_ranks_at(tail: TraceTail, after: float, step: int, rank0_t: float) -> float:
    """When every rank had completed `step` in a loop started after `after`: the
    latest of their trace times for it (rank 0's time if another rank never
    traced it, which the caller's log shows as a zero spread)."""
    latest = rank0_t
    for r in range(1, tail.world_size):
        hit = next((e["t"] for a in tail.attempts(r) if a.start["t"] > after
                    for e in a.steps if e["step"] == step), None)
        if hit is None:
            log(f"rank {r} never traced step {step} after the kill; rank 0's time stands for it")
        else:
            latest = max(latest, hit)
    return latest


def describe(who: str, recs: list[Recovery]) -> None:
    for i, r in enumerate(recs):
        lost = "" if r.resumed >= r.acked else f"  LOST acknowledged checkpoint {r.acked}"
        log(f"{who} kill {i}: reached {r.reached}, acked ckpt {r.acked} "
            f"({r.kill.t - r.acked_at:.2f}s before the kill), resumed {r.resumed} "
            f"(redid {r.redone}); kill -> loop start {r.loop_start - r.kill.t:.2f}s, "
            f"build {r.built - r.loop_start:.2f}s, restore {r.restored - r.built:.2f}s, "
            f"first step {r.first_step - r.restored:.2f}s (every rank; rank 0 "
            f"{r.first_step_rank0 - r.restored:.2f}s); MTTR {r.mttr_s:.2f}s{lost}")
    log(f"{who} MTTR median breakdown (s): kill -> loop start "
        f"{median([r.loop_start - r.kill.t for r in recs]):.2f}, model+optimizer+data "
        f"{median([r.built - r.loop_start for r in recs]):.2f}, restore "
        f"{median([r.restored - r.built for r in recs]):.2f}, first step "
        f"{median([r.first_step - r.restored for r in recs]):.2f}; total "
        f"{median([r.mttr_s for r in recs]):.2f}")


# -- the job spec -----------------------------------------------------------------

def recovery_spec(steps: int, trace: Path, every: int, max_restarts: int, name: str,
                  ft: dict[str, Any] | None = None) -> dict[str, Any]:
    """`tiny_spec` with a checkpoint every `every` steps, the trace folder, `max_restarts`
    and kuangchao's fault tolerance at its defaults, plus the overrides in `ft`."""
    doc = tiny_spec(steps, name=name)
    doc["checkpoint"].update(interval_steps=every, keep_last=2)
    base = {k: v for k, v in doc.get("fault_tolerance", {}).items() if k not in OURS_DEFAULTS}
    doc["fault_tolerance"] = {**base, "max_restarts": max_restarts, **OURS_DEFAULTS, **(ft or {})}
    doc["entrypoint"] = "bench.recovery_ray:kc_entry"
    doc["args"] = {"trace": str(trace)}
    validate_spec(doc)
    return doc
