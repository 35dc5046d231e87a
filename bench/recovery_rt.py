"""The Ray half of bench/recovery.py: Ray Train v2's `TorchTrainer` under the
same kills (`ray_mttr`) and hang (`ray_hang`), and Ray's own ActorDiedError
latency for a plain actor (`ray_actor_died_ms`, the crash_detect_ms baseline).

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

from bench.harness import BenchCluster, log
from bench.recovery_common import (
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
