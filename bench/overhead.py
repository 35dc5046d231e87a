"""Orchestration overhead: kuangchao against Ray Train v2's TorchTrainer.

Both run `bench.harness.bench_loop` (same model, data, seed and steps; 2
data-parallel ranks, gloo on CPU) on the same fake Ray cluster, alternately,
REPEATS times each. Reported, as medians over the repeats:

  step_time_ratio          steady-state step time (median step after WARMUP_STEPS)
  time_to_first_step_ratio submit -> rank 0's first completed optimizer step

Run: .venv/bin/python bench/overhead.py   (prints one JSON object per line)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

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

STEPS = 60  # 55 steady-state steps per run
WARMUP_STEPS = 5
REPEATS = 3


@dataclass(frozen=True)
class Run:
    submitted: float  # time.time() just before submitting
    start: float  # rank 0 entered the training loop
    steps: list[float]  # rank 0's time after each optimizer step

    @property
    def time_to_first_step(self) -> float:
        return self.steps[0] - self.submitted

    @property
    def step_time(self) -> float:
        # Differences of consecutive stamps from step WARMUP_STEPS on: the first
        # steps carry allocator warm-up and DDP's first-iteration bucketing.
        steady = self.steps[WARMUP_STEPS:]
        return median([b - a for a, b in zip(steady, steady[1:], strict=False)])


def _read_run(submitted: float, out: Path) -> Run:
    data = json.loads(out.read_text())
    return Run(submitted=submitted, start=data["start"], steps=data["steps"])


def run_kuangchao(cluster: BenchCluster, out: Path, steps: int) -> Run:
    """The real `kc train` path: queue with the scheduler, wait, run the controller here."""
    from kuangchao.platform.runtime.driver import run_as_driver

    doc = tiny_spec(steps, out=out, name="bench-overhead")
    submitted = time.time()
    job = run_as_driver(doc, cluster.settings)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"kuangchao job {job['id']} ended {job['state']}: {job.get('message')}")
    return _read_run(submitted, out)


def run_ray_train(cluster: BenchCluster, out: Path, name: str, steps: int) -> Run:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.harness import ray_train_loop

    # Resources: 1 CPU per worker, as kuangchao's ranks (cpus_per_rank 1).
    # Kuangchao ranks also take 1 logical GPU each (its default gpus_per_rank);
    # logical GPUs of the fake nodes cost nothing on a CPU machine, so Ray Train
    # asks for none (use_gpu would switch it to NCCL). The label selector keeps
    # Ray Train's workers off the head node, where kuangchao never places ranks.
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"spec": tiny_spec(steps), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     # v2-only field; mypy sees the v1 class
                                     label_selector={"kc.io/leaf": "leaf-0"}),  # type: ignore[call-arg]
        run_config=RunConfig(storage_path=str(cluster.tmp / "ray-train"), name=name),
    )
    submitted = time.time()
    trainer.fit()  # raises TrainingFailedError when a worker fails
    return _read_run(submitted, out)


def _describe(who: str, run: Run) -> None:
    log(f"{who:10s} submit->loop {run.start - run.submitted:6.2f}s  "
        f"first step {run.time_to_first_step:6.2f}s  step {run.step_time * 1000:6.1f}ms  "
        f"total {run.steps[-1] - run.submitted:6.2f}s")


def _settle(timeout_s: float = 30.0) -> None:
    """Wait until the previous run has released its resources and the CPUs are quiet.

    Its actor processes exit asynchronously; starting the next run while they
    still burn CPU would bill their teardown to whoever goes second.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources()
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total[k] for k in ("CPU", "GPU")):
            break
        time.sleep(0.5)
    wait_for_quiet()


def measure(cluster: BenchCluster, repeats: int, steps: int) -> tuple[list[Run], list[Run]]:
    ours, theirs = [], []
    for i in range(repeats):
        # Alternate who goes first so warm caches and drift favour neither side.
        order = ("kuangchao", "ray-train") if i % 2 == 0 else ("ray-train", "kuangchao")
        for who in order:
            _settle()
            out = cluster.tmp / f"{who}-{i}.json"
            if who == "kuangchao":
                run = run_kuangchao(cluster, out, steps)
                ours.append(run)
            else:
                run = run_ray_train(cluster, out, f"overhead-{i}", steps)
                theirs.append(run)
            _describe(f"{who}#{i}", run)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    t0 = time.monotonic()
    # Libraries may print; keep stdout for the JSON lines alone.
    with contextlib.redirect_stdout(sys.stderr), local_cluster(nodes=2, gpus=4, cpus=4) as cluster:
        connect(cluster)
        ours, theirs = measure(cluster, args.repeats, args.steps)
    for metric, attr, target in (("step_time_ratio", "step_time", 1.03),
                                 ("time_to_first_step_ratio", "time_to_first_step", 1.2)):
        emit("overhead", metric, "s", median([getattr(r, attr) for r in ours]),
             median([getattr(r, attr) for r in theirs]), target)
    log(f"total wall time {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
