"""The Ray half of bench/recovery.py: Ray Train v2's `TorchTrainer` under the
same kills (`ray_mttr`) and hang (`ray_hang`), and Ray's own ActorDiedError
latency for a plain actor (`ray_actor_died_ms`, the crash_detect_ms baseline).

How Ray Train v2 (ray 2.60) notices a failed worker
---------------------------------------------------
The controller (`TrainController._poll_workers`,
ray/train/v2/_internal/execution/controller/controller.py) polls every worker
(`WorkerGroup.poll_status`, worker_group/worker_group.py) at most once every
`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (default 2 s), waiting up to that long
for the answers. A dead worker's poll fails (ActorDiedError), and a rank whose
peer died fails in its next collective: the failure is handled at the poll
after it, so the interval is how late a crash can be seen. A poll that does
not answer (a stopped or wedged process) is kept and awaited again; once it
has hung for `RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S` (default 600 s) the
worker is declared dead (`WorkerHealthCheckTimeoutError`). The same poll
collects `ray.train.report` results, so it is also when a reported checkpoint
is registered (worker_group/worker.py `poll_status`).

The settings used here (`RAY_SETTINGS`, set for the controller Ray Train
starts, which hands them on):

* `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` = HEALTH_CHECK_S = 0.1 s, the fastest
  that still buys anything: below it, detection is bounded by Ray's own
  ActorDiedError latency (40-90 ms on this machine, the crash_detect_ms
  baseline), while each poll is one actor call per worker. Kuangchao has no
  such period for a crash: its controller waits on the ranks' calls
  (`ray.wait`) and sees a death as soon as Ray reports it.
* `RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S` = kuangchao's
  `heartbeat_timeout_s` at its default (10 s): the same budget for a worker
  that stops answering, the hang case.

`RAY_TRAIN_V2_ENABLED=1` must be set before `ray.train` is first imported;
bench/recovery.py sets it at its top, and `ray.train` is only imported inside
`ray_trainer`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchCluster, _env, log
from bench.recovery_common import (
    OURS_DEFAULTS,
    RANK,
    WAIT_S,
    Background,
    Recovery,
    Signalled,
    TraceTail,
    analyse,
    describe,
    drive_kills,
    recovery_spec,
    release,
    signal_at,
    wait_until,
)

HEALTH_CHECK_S = 0.1  # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; Ray's default is 2
# Ray Train's failure-detection settings for every Ray Train run of bench/recovery.py.
RAY_SETTINGS = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": HEALTH_CHECK_S,
    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": float(OURS_DEFAULTS["heartbeat_timeout_s"]),
}
LEFT_RUNNING = ("RunningState",)  # controller states of a healthy run


def ray_env():
    """The environment `fit()` must run in for RAY_SETTINGS to reach its controller."""
    return _env(**{k: str(v) for k, v in RAY_SETTINGS.items()})


def ray_trainer(cluster: BenchCluster, doc: dict[str, Any], trace: Path, name: str,
                max_failures: int):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.recovery_ray import ray_train_loop
    from bench.resize_rt import ControllerTrace  # by name: it runs in the controller actor

    # As in bench/overhead.py: 1 CPU per worker like kuangchao's ranks, no GPU
    # (use_gpu would switch to NCCL), kept off the head node by the label selector.
    # A name of its own per run: Ray Train v2 resumes a run whose name it has seen.
    return TorchTrainer(
        ray_train_loop,
        train_loop_config={"spec": doc, "trace": str(trace)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     label_selector={"kc.io/leaf": "leaf-0"}),  # type: ignore[call-arg]
        run_config=RunConfig(storage_path=str(cluster.tmp / "ray-train"), name=name,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             callbacks=[ControllerTrace(str(trace / "controller.jsonl"))]),
    )


def controller_states(folder: Path) -> list[dict[str, Any]]:
    from bench.resize_rt import read_jsonl

    return read_jsonl(folder / "controller.jsonl")


def left_running(folder: Path, after: float) -> float | None:
    """When Ray Train's controller first left RunningState after `after` (it
    handled a failure: RestartingState, or ShuttingDownState when out of retries)."""
    return next((c["t"] for c in controller_states(folder)
                 if c["t"] > after and c["from"] in LEFT_RUNNING and c["to"] not in LEFT_RUNNING),
                None)


def ray_mttr(cluster: BenchCluster, targets: list[int], steps: int, every: int,
             tag: str = "ray-mttr") -> list[Recovery]:
    folder = cluster.tmp / tag
    folder.mkdir(parents=True, exist_ok=True)
    doc = recovery_spec(steps, folder, every, len(targets), "bench-recovery")
    trainer = ray_trainer(cluster, doc, folder, tag, max_failures=len(targets))
    tail = TraceTail(folder)
    with ray_env():
        run = Background(trainer.fit, "ray-train-fit")
        kills = drive_kills(tail, targets, run)
        run.join(WAIT_S, "Ray Train's fit()")
    if run.error is not None:
        raise run.error
    recs = analyse(tail, kills)
    describe("ray-train", recs)
    seen = [left_running(folder, r.kill.t) for r in recs]
    log("ray-train SIGKILL -> controller handles the failure (s): "
        + ", ".join("-" if t is None else f"{t - r.kill.t:.2f}" for t, r in zip(seen, recs, strict=True)))
    for r in recs:
        if r.resumed < r.acked:
            log(f"ray-train resumed from step {r.resumed} although report(checkpoint=) for step "
                f"{r.acked} had returned before the kill")
    return recs


def ray_hang(cluster: BenchCluster, at_step: int, every: int, bound_s: float,
             tag: str = "ray-hang") -> float | None:
    """SIGSTOP rank 1; seconds until Ray Train's controller handles it as a failure
    (leaves RunningState, or fit() ends), None if not within bound_s."""
    folder = cluster.tmp / tag
    folder.mkdir(parents=True, exist_ok=True)
    doc = recovery_spec(100_000, folder, every, 0, "bench-hang")
    trainer = ray_trainer(cluster, doc, folder, tag, max_failures=0)  # the default
    tail = TraceTail(folder)
    stop: Signalled | None = None
    with ray_env():
        run = Background(trainer.fit, "ray-train-fit")
        try:
            stop = signal_at(tail, at_step, 0.0, signal.SIGSTOP, run.alive)
            log(f"  SIGSTOP rank {RANK} pid {stop.pid} after step {at_step}")
            s = stop

            def reacted() -> float | None:
                t = left_running(folder, s.t)
                if t is not None:
                    return t
                return run.ended_at if not run.alive() else None  # fit() raised
            t = wait_until(reacted, bound_s, "Ray Train to notice", poll_s=0.05)
            if t is None:
                log(f"ray-train: hang not detected within {bound_s:.0f}s (worker health-check "
                    f"timeout {RAY_SETTINGS['RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S']}s)")
                return None
            log(f"ray-train: SIGSTOP -> controller handled the failure {t - stop.t:.2f}s "
                f"(health-check timeout {RAY_SETTINGS['RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S']}s "
                f"+ up to one {HEALTH_CHECK_S}s poll)")
            return t - stop.t
        finally:
            if stop is not None:
                release(stop.pid)
            try:
                run.join(120, "Ray Train's fit() after the kill")
            except TimeoutError as exc:
                log(f"{exc}; the cluster teardown will stop it")
            if run.error is not None:
                log(f"ray-train hang run ended with {type(run.error).__name__} (expected: "
                    "FailureConfig(max_failures=0))")


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
