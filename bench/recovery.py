"""Recovery: kuangchao against Ray Train v2 when a worker is killed or hangs.

Both systems run the same loop (`bench.recovery_ray.resumable_loop`: the GPT,
data, optimizer and steps of `bench.harness.bench_loop`, plus a checkpoint
every CKPT_EVERY steps and resume from the newest one) with 2 data-parallel
ranks on the same fake Ray cluster. Every rank appends its events (start with
pid and resumed step, each step, each acknowledged checkpoint) to a trace
file; the benchmark SIGKILLs or SIGSTOPs rank 1 by that pid at the same step
for both systems and reads all timings from the traces and, for kuangchao,
from the job record's `restart_log` and events.

  mttr_s               SIGKILL of rank 1 -> first completed step after restart
                       (median over the kills); vs TorchTrainer with
                       FailureConfig(max_failures=kills). Target ratio 0.5.
  crash_detect_ms      p99 of SIGKILL -> kuangchao marks the rank failed
                       (`failed_at` of the restart); vs Ray's own
                       ActorDiedError latency for a plain actor. Target 3.
  steps_redone         step reached at the kill - step resumed from (median);
                       vs Ray Train. Target 1.0.
  hang_detect_s        SIGSTOP of rank 1 -> kuangchao marks it failed; vs Ray
                       Train with its defaults, waited for at most --hang-wait
                       seconds (the baseline is then that bound). Target
                       0.5 (ours; the issue sets none).
  ckpt_save_throughput, async_ckpt_blocked_fraction
                       from bench/ckpt_io.py when it exists.

Run: .venv/bin/python bench/recovery.py   (one JSON object per line on stdout)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
# Each kill stands for one isolated failure. Kuangchao would otherwise
# quarantine rank 1's node after its third failure in 10 minutes (a different
# scenario: a flaky node); read when the harness builds the Settings.
os.environ.setdefault("KC_QUARANTINE_FAILURES", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import (  # noqa: E402
    BenchCluster,
    connect,
    emit,
    local_cluster,
    log,
    median,
    tiny_spec,
    wait_for_quiet,
)
from kuangchao.platform.spec import validate_spec  # noqa: E402

CKPT_EVERY = 10  # checkpoint interval, steps, both systems
KILL_OFFSET = 5  # kill this many steps after a checkpoint
REPEATS = 4  # kills per run
DETECT_SAMPLES = 10  # kills of a plain Ray actor for the ActorDiedError baseline
DETECT_KILLS = 4  # kuangchao kills after the MTTR ones, for crash_detect_ms only
DETECT_KILL_AFTER = 2  # ... each this many steps into the restarted loop
HANG_WAIT_S = 120.0
# Kuangchao's fault-tolerance settings for every run of this benchmark.
# Warm spares on: the platform's fastest recovery path (see docs/fault-tolerance.md);
# `--no-spare` measures the in-place path with a freshly started replacement.
FAULT_TOLERANCE = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0, "hang_timeout_s": 20.0,
                   "spare_workers": True}
RANK = 1  # the rank killed or stopped
WAIT_S = 240.0  # longest wait for any one thing before the run is declared stuck
BENCH = "recovery"


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
    first_step: float  # first step completed

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
        out.append(Recovery(k, reached, acked["step"], acked["t"], new.start["step"], new.start["t"],
                            new.start["built"], new.start["restored"], new.steps[0]["t"]))
    return out


def describe(who: str, recs: list[Recovery]) -> None:
    for i, r in enumerate(recs):
        lost = "" if r.resumed >= r.acked else f"  LOST acknowledged checkpoint {r.acked}"
        log(f"{who} kill {i}: reached {r.reached}, acked ckpt {r.acked} "
            f"({r.kill.t - r.acked_at:.2f}s before the kill), resumed {r.resumed} "
            f"(redid {r.redone}); kill -> loop start {r.loop_start - r.kill.t:.2f}s, "
            f"build {r.built - r.loop_start:.2f}s, restore {r.restored - r.built:.2f}s, "
            f"first step {r.first_step - r.restored:.2f}s; MTTR {r.mttr_s:.2f}s{lost}")
    log(f"{who} MTTR median breakdown (s): kill -> loop start "
        f"{median([r.loop_start - r.kill.t for r in recs]):.2f}, model+optimizer+data "
        f"{median([r.built - r.loop_start for r in recs]):.2f}, restore "
        f"{median([r.restored - r.built for r in recs]):.2f}, first step "
        f"{median([r.first_step - r.restored for r in recs]):.2f}; total "
        f"{median([r.mttr_s for r in recs]):.2f}")


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); q in [0, 100]."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# -- kuangchao ----------------------------------------------------------------------

def recovery_spec(steps: int, trace: Path, every: int, max_restarts: int, name: str) -> dict[str, Any]:
    """`tiny_spec` with a checkpoint every `every` steps, the trace folder and FAULT_TOLERANCE."""
    doc = tiny_spec(steps, name=name)
    doc["checkpoint"].update(interval_steps=every, keep_last=2)
    doc["fault_tolerance"] = {**doc.get("fault_tolerance", {}), "max_restarts": max_restarts,
                              **FAULT_TOLERANCE}
    doc["entrypoint"] = "bench.recovery_ray:kc_entry"
    doc["args"] = {"trace": str(trace)}
    validate_spec(doc)
    return doc


def _store(cluster: BenchCluster):
    from kuangchao.platform.store import JobStore

    return JobStore.from_url(cluster.settings.redis_url, cluster.settings.redis_prefix)


def _find_job(store, name: str, since: float) -> str | None:
    jobs = [j for j in store.list() if j.name == name and j.created_at >= since]
    return jobs[-1].id if jobs else None


def _start_kc(cluster: BenchCluster, doc: dict[str, Any]) -> tuple[Background, str]:
    from kuangchao.platform.driver import run_as_driver

    store = _store(cluster)
    since = time.time() - 1
    run = Background(lambda: run_as_driver(doc, cluster.settings), "kc-driver")
    job_id = wait_until(lambda: _find_job(store, doc["task"]["name"], since), 60, "the job", run.alive)
    if job_id is None:
        raise TimeoutError("the kuangchao job was not submitted within 60s")
    return run, job_id


def _kc_phases(store, job_id: str, recs: list[Recovery], n_mttr: int) -> list[dict[str, Any]]:
    """Match each kill with its restart_log entry; print where the time went for the
    first `n_mttr` (the MTTR kills; the others only feed crash_detect_ms)."""
    job = store.get(job_id)
    events = store.events(job_id)
    restarts = list(job.restart_log)
    missing: set[str] = set()
    wanted = ("kind", "rank", "node", "failed_at", "detected_after_s", "teardown_s", "placement_s",
              "restore_s", "first_step_s", "resumed_step", "first_step_at", "path")
    entries = []
    splits: list[dict[str, float]] = []
    for i, r in enumerate(recs):
        end = recs[i + 1].kill.t if i + 1 < len(recs) else float("inf")
        entry = next((e for e in restarts if r.kill.t < float(e.get("failed_at", 0)) < end), None)
        if entry is None:  # fall back to the failure event
            entry = next((e for e in events if e.get("type") == "failure"
                          and r.kill.t < float(e.get("failed_at", e.get("ts", 0))) < end), None)
        entry = dict(entry or {})
        entries.append(entry)
        if i >= n_mttr:
            continue
        missing |= {k for k in wanted if k not in entry}
        t0 = r.kill.t
        marks = [("marked failed", entry.get("failed_at"))]
        for e in events:
            if t0 < e.get("ts", 0) <= r.first_step and e.get("type") != "failure":
                name = (f"{e.get('from', '')}->{e.get('to', '')}" if e.get("type") == "state"
                        else "workers started (pids recorded)" if e.get("type") == "placement"
                        else str(e.get("type")))
                marks.append((name, e["ts"]))
        marks += [("loop start", r.loop_start), ("model+data built", r.built),
                  ("checkpoint restored", r.restored), ("first step", r.first_step)]
        marks = sorted((m for m in marks if m[1] is not None), key=lambda m: float(m[1]))
        log(f"kuangchao kill {i} timeline (s after SIGKILL): "
            + ", ".join(f"{name} +{float(ts) - t0:.2f}" for name, ts in marks))
        if entry:
            log(f"kuangchao kill {i} restart_log: {json.dumps(entry, default=str)}")
        failed_at = float(entry.get("failed_at", t0))
        placed = next((e["ts"] for e in events if e.get("type") == "placement"
                       and failed_at <= e.get("ts", 0) <= r.loop_start), None)
        running = next((e["ts"] for e in events if e.get("type") == "state"
                        and e.get("to") == "RUNNING" and failed_at <= e.get("ts", 0) <= r.loop_start),
                       None)
        if "failed_at" in entry and placed is not None and running is not None:
            splits.append({"detect": failed_at - t0, "replacement started": placed - failed_at,
                           "rendezvous": running - placed, "dispatch": r.loop_start - running,
                           "model+optimizer+data": r.built - r.loop_start,
                           "restore": r.restored - r.built, "first step": r.first_step - r.restored})
    if splits:
        log("kuangchao MTTR median breakdown (s): " + ", ".join(
            f"{k} {median([d[k] for d in splits]):.2f}" for k in splits[0])
            + f"; paths {[e.get('path') for e in entries]}")
    if missing:
        log(f"restart_log lacks {sorted(missing)} (measured from the outside where needed)")
    return entries


def kc_mttr(cluster: BenchCluster, targets: list[int], steps: int, every: int,
            extra: int) -> tuple[list[Recovery], list[float]]:
    """The MTTR kills, then `extra` more for crash-detection samples; returns the
    MTTR kills' recoveries and every kill's SIGKILL -> failed_at in ms."""
    folder = cluster.tmp / "kc-mttr"
    doc = recovery_spec(steps, folder, every, len(targets) + extra, "bench-recovery")
    tail = TraceTail(folder)
    run, job_id = _start_kc(cluster, doc)
    store = _store(cluster)
    try:
        kills = drive_kills(tail, targets, run, extra)
        job = run.join(WAIT_S, "the kuangchao job")
    except BaseException:
        with contextlib.suppress(Exception):
            from kuangchao.platform import jobs
            jobs.cancel(store, job_id)
        raise
    if run.error is not None:
        raise run.error
    log(f"kuangchao job {job_id} ended {job['state']} after {job['restarts']} restart(s): "
        f"{job.get('message')}")
    recs = analyse(tail, kills)
    describe("kuangchao", recs[:len(targets)])
    placed = {p["rank"]: p.get("pid") for p in job.get("placement", [])}
    log(f"kuangchao final placement pids {placed}")
    entries = _kc_phases(store, job_id, recs, len(targets))
    detect = []
    for r, e in zip(recs, entries, strict=True):
        if "failed_at" in e:
            detect.append((float(e["failed_at"]) - r.kill.t) * 1000)
        else:
            log("no failed_at for a kill; crash_detect_ms has one sample fewer")
        if "resumed_step" in e and e["resumed_step"] != r.resumed:
            log(f"restart_log resumed_step {e['resumed_step']} != traced {r.resumed}")
    for r in recs:
        if r.resumed < r.acked:
            log(f"kuangchao LOST an acknowledged checkpoint: step {r.acked} acknowledged before "
                f"the kill, resumed from {r.resumed}")
    return recs[:len(targets)], detect


def kc_hang(cluster: BenchCluster, at_step: int, every: int, bound_s: float) -> float | None:
    """SIGSTOP rank 1; seconds until kuangchao marks a rank failed, None if not within bound_s."""
    from kuangchao.platform import jobs

    folder = cluster.tmp / "kc-hang"
    doc = recovery_spec(100_000, folder, every, 1, "bench-hang")
    tail = TraceTail(folder)
    run, job_id = _start_kc(cluster, doc)
    store = _store(cluster)
    stop: Signalled | None = None
    try:
        stop = signal_at(tail, at_step, 0.0, signal.SIGSTOP, run.alive)
        log(f"  SIGSTOP rank {RANK} pid {stop.pid} after step {at_step}")
        s = stop

        def failed() -> dict[str, Any] | None:
            job = store.get(job_id)
            hit = next((e for e in job.restart_log if float(e.get("failed_at", 0)) > s.t), None)
            if hit is None and job.state.is_terminal:
                return {"failed_at": job.finished_at, "cause": job.message, "terminal": True}
            return hit
        entry = wait_until(failed, bound_s, "the hang to be detected", poll_s=0.05)
        if entry is None:
            log(f"kuangchao: hang not detected within {bound_s:.0f}s")
            return None
        log(f"kuangchao: hang detected: {json.dumps(entry, default=str)}")
        took = float(entry["failed_at"]) - stop.t
        if entry.get("last_heartbeat_at"):
            last = float(entry["last_heartbeat_at"]) - stop.t
            silence = float(entry.get("detected_after_s") or 0.0)
            log(f"kuangchao: SIGSTOP -> marked failed {took:.2f}s = last heartbeat {last:+.2f}s "
                f"+ {silence:.2f}s of silence until the verdict (heartbeat_timeout_s "
                f"{FAULT_TOLERANCE['heartbeat_timeout_s']}) + {took - last - silence:.2f}s "
                "between the verdict and the recorded failure (evidence: stacks, process state)")
        return took
    finally:
        with contextlib.suppress(Exception):
            jobs.cancel(store, job_id)
        if stop is not None:
            release(stop.pid)
        with contextlib.suppress(Exception):
            run.join(120, "the cancelled kuangchao job")


# -- Ray Train ---------------------------------------------------------------------

def ray_trainer(cluster: BenchCluster, doc: dict[str, Any], trace: Path, name: str,
                max_failures: int):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.recovery_ray import ray_train_loop

    # As in bench/overhead.py: 1 CPU per worker like kuangchao's ranks, no GPU
    # (use_gpu would switch to NCCL), kept off the head node by the label selector.
    return TorchTrainer(
        ray_train_loop,
        train_loop_config={"spec": doc, "trace": str(trace)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     label_selector={"kc.io/leaf": "leaf-0"}),  # type: ignore[call-arg]
        run_config=RunConfig(storage_path=str(cluster.tmp / "ray-train"), name=name,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )


def ray_mttr(cluster: BenchCluster, targets: list[int], steps: int, every: int) -> list[Recovery]:
    folder = cluster.tmp / "ray-mttr"
    doc = recovery_spec(steps, folder, every, len(targets), "bench-recovery")
    trainer = ray_trainer(cluster, doc, folder, "recovery-mttr", max_failures=len(targets))
    tail = TraceTail(folder)
    run = Background(trainer.fit, "ray-train-fit")
    kills = drive_kills(tail, targets, run)
    run.join(WAIT_S, "Ray Train's fit()")
    if run.error is not None:
        raise run.error
    recs = analyse(tail, kills)
    describe("ray-train", recs)
    for r in recs:
        if r.resumed < r.acked:
            log(f"ray-train resumed from step {r.resumed} although report(checkpoint=) for step "
                f"{r.acked} had returned before the kill")
    return recs


def ray_hang(cluster: BenchCluster, at_step: int, every: int, bound_s: float) -> float | None:
    """SIGSTOP rank 1 under Ray Train's defaults; seconds until it reacts, None if not within bound_s."""
    folder = cluster.tmp / "ray-hang"
    doc = recovery_spec(100_000, folder, every, 0, "bench-hang")
    trainer = ray_trainer(cluster, doc, folder, "recovery-hang", max_failures=0)  # the default
    tail = TraceTail(folder)
    run = Background(trainer.fit, "ray-train-fit")
    stop: Signalled | None = None
    try:
        stop = signal_at(tail, at_step, 0.0, signal.SIGSTOP, run.alive)
        log(f"  SIGSTOP rank {RANK} pid {stop.pid} after step {at_step}")
        s = stop

        def reacted() -> float | None:
            if not run.alive():  # fit() raised: the failure was detected
                return run.ended_at
            tail.poll()  # or a new worker group started
            started = [a.start["t"] for r in (0, 1) for a in tail.attempts(r) if a.start["t"] > s.t]
            return min(started) if started else None
        t = wait_until(reacted, bound_s, "Ray Train to notice", poll_s=0.1)
        if t is None:
            log(f"ray-train: not detected within {bound_s:.0f}s (default worker health-check "
                f"timeout RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S=600s, gloo timeout 1800s)")
            return None
        log(f"ray-train: reacted {t - stop.t:.1f}s after the SIGSTOP ({run.error!r})")
        return t - stop.t
    finally:
        if stop is not None:
            release(stop.pid)
        try:
            run.join(120, "Ray Train's fit() after the kill")
        except TimeoutError as exc:
            log(f"{exc}; the cluster teardown will stop it")
        if run.error is not None:
            log(f"ray-train hang run ended with {type(run.error).__name__} (expected after the kill)")


# -- plain Ray actor: the ActorDiedError baseline ----------------------------------------

def ray_actor_died_ms(samples: int) -> list[float]:
    """SIGKILL a plain actor while the driver waits in ray.get on a call to it."""
    import ray

    from bench.recovery_ray import CrashProbe

    cls = ray.remote(CrashProbe)
    out = []
    for _ in range(samples):
        actor = cls.options(num_cpus=1, label_selector={"kc.io/leaf": "leaf-0"}).remote()
        pid = ray.get(actor.pid.remote(), timeout=120)
        ref = actor.spin.remote(60.0)  # the kill comes 0.3 s into it
        killed: list[float] = []

        def kill(pid: int = pid, killed: list[float] = killed) -> None:
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
        timer = threading.Timer(0.3, kill)
        timer.start()
        try:
            ray.get(ref, timeout=60)
            raise RuntimeError("the probe actor survived its SIGKILL")
        except ray.exceptions.RayActorError:
            out.append((time.time() - killed[0]) * 1000)
        finally:
            timer.cancel()
            with contextlib.suppress(Exception):
                ray.kill(actor)
    return out


# -- orchestration -----------------------------------------------------------------------

def _settle(timeout_s: float = 30.0) -> None:
    """Wait until the previous run released its resources and the CPUs are quiet."""
    import ray

    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources()
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            break
        time.sleep(0.5)
    wait_for_quiet()


@dataclass
class Results:
    lines: list[tuple[str, str, str, float, float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, metric: str, unit: str, ours: float, baseline: float, target: float,
            bench: str = BENCH) -> None:
        self.lines.append((bench, metric, unit, ours, baseline, target))

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        log(f"== {name}")
        try:
            yield
        except Exception:
            self.failed.append(name)
            log(f"{name} failed:\n{traceback.format_exc()}")
        finally:
            log(f"== {name}: {time.monotonic() - t0:.1f}s")


def ckpt_io_metrics(res: Results) -> None:
    """Run bench/ckpt_io.py's two measurements and emit its two metrics, as its own main() does.

    Imported, not copied: bench/ckpt_io.py owns these metrics (one process, no
    Ray; see its section of bench/README.md). Skipped with a note when the
    module is missing. Runs after the cluster is gone, with one torch thread
    like the trainer.
    """
    try:
        from bench import ckpt_io  # type: ignore[attr-defined]
    except ImportError as exc:
        log(f"bench/ckpt_io.py not importable ({exc}); skipping ckpt_save_throughput and "
            "async_ckpt_blocked_fraction")
        return
    import warnings

    import torch

    # (metric, function, unit, ours field, baseline field, target), as in ckpt_io.main().
    # ckpt_save_throughput: higher is better, its target is a floor on the ratio.
    table = (("ckpt_save_throughput", "measure_save_throughput", "B/s", "ours_bytes_per_s",
              "baseline_bytes_per_s", 0.8),
             ("async_ckpt_blocked_fraction", "measure_async_blocked", "fraction", "blocked_s",
              "sync_save_s", 0.1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for metric, fn_name, unit, ours_key, base_key, target in table:
            fn = getattr(ckpt_io, fn_name, None)
            if fn is None:
                log(f"bench/ckpt_io.py has no {fn_name}(); skipping {metric}")
                continue
            with res.phase(f"ckpt_io.{fn_name}"), warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)  # dcp's single-process note
                out = fn()
                log(f"{fn_name}() -> {json.dumps(out, default=str)}")
                if ours_key in out and base_key in out:
                    res.add(metric, unit, float(out[ours_key]), float(out[base_key]), target,
                            bench="ckpt_io")
                else:
                    res.failed.append(metric)
                    log(f"{fn_name}() returned no {ours_key}/{base_key}; {metric} not emitted")
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS, help="kills per MTTR run")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps of the MTTR runs (default: enough for the kills)")
    parser.add_argument("--ckpt-every", type=int, default=CKPT_EVERY)
    parser.add_argument("--kill-offset", type=int, default=KILL_OFFSET,
                        help="kill this many steps after a checkpoint")
    parser.add_argument("--detect-samples", type=int, default=DETECT_SAMPLES,
                        help="kills of a plain Ray actor (crash_detect_ms baseline)")
    parser.add_argument("--detect-kills", type=int, default=DETECT_KILLS,
                        help="extra kuangchao kills for crash_detect_ms, after the MTTR ones")
    parser.add_argument("--hang-wait", type=float, default=HANG_WAIT_S)
    parser.add_argument("--skip-hang", action="store_true")
    parser.add_argument("--skip-ckpt-io", action="store_true")
    parser.add_argument("--no-spare", action="store_true",
                        help="recover with a freshly started replacement instead of a warm spare")
    args = parser.parse_args()
    if args.no_spare:
        FAULT_TOLERANCE["spare_workers"] = False
    every, offset = args.ckpt_every, args.kill_offset
    if not 0 < offset < every:
        parser.error("--kill-offset must be between 1 and --ckpt-every - 1")
    targets = [every * (i + 1) + offset for i in range(args.repeats)]
    steps = max(args.steps, every * (args.repeats + 1) + 2)
    log(f"checkpoint every {every} steps; SIGKILL rank {RANK} after steps {targets} "
        f"of {steps}; kuangchao fault_tolerance {FAULT_TOLERANCE}; Ray Train "
        f"FailureConfig(max_failures={args.repeats}) and report(checkpoint=) every {every} steps")
    t0 = time.monotonic()
    res = Results()
    ours: list[Recovery] = []
    theirs: list[Recovery] = []
    detect_ours: list[float] = []
    detect_ray: list[float] = []
    # Libraries may print; keep stdout for the JSON lines alone.
    with contextlib.redirect_stdout(sys.stderr), local_cluster(nodes=2, gpus=4, cpus=4) as cluster:
        connect(cluster)
        with res.phase("Ray ActorDiedError latency"):
            _settle()
            detect_ray = ray_actor_died_ms(args.detect_samples)
            log("ActorDiedError after SIGKILL (ms): " + ", ".join(f"{x:.0f}" for x in detect_ray))
        with res.phase("kuangchao MTTR"):
            _settle()
            ours, detect_ours = kc_mttr(cluster, targets, steps, every, args.detect_kills)
            log("kuangchao SIGKILL -> marked failed (ms): " + ", ".join(f"{x:.0f}" for x in detect_ours))
        with res.phase("Ray Train MTTR"):
            _settle()
            theirs = ray_mttr(cluster, targets, steps, every)
        if not args.skip_hang:
            hang_ours = hang_ray = None
            with res.phase("kuangchao hang"):
                _settle()
                hang_ours = kc_hang(cluster, targets[0], every, args.hang_wait)
            with res.phase("Ray Train hang"):
                _settle()
                hang_ray = ray_hang(cluster, targets[0], every, args.hang_wait)
            if "kuangchao hang" not in res.failed and "Ray Train hang" not in res.failed:
                if hang_ray is None:
                    log(f"hang_detect_s baseline = the {args.hang_wait:.0f}s bound: Ray Train did "
                        "not detect the hang within it, so the ratio is an upper bound")
                res.add("hang_detect_s", "s", args.hang_wait if hang_ours is None else hang_ours,
                        args.hang_wait if hang_ray is None else hang_ray, 0.5)
    if ours and theirs:
        res.add("mttr_s", "s", median([r.mttr_s for r in ours]),
                median([r.mttr_s for r in theirs]), 0.5)
    if detect_ours and detect_ray:
        res.add("crash_detect_ms", "ms", percentile(detect_ours, 99), percentile(detect_ray, 99), 3.0)
    if ours and theirs:
        log(f"steps_redone with a checkpoint every {every} steps, kill {offset} steps after one")
        res.add("steps_redone", "steps", median([r.redone for r in ours]),
                median([r.redone for r in theirs]), 1.0)
    if not args.skip_ckpt_io:
        with contextlib.redirect_stdout(sys.stderr):
            ckpt_io_metrics(res)
    for line in res.lines:
        emit(*line)
    log(f"total wall time {time.monotonic() - t0:.1f}s")
    if res.failed:
        log(f"failed: {', '.join(res.failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
