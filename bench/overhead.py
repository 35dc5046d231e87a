"""Orchestration overhead: kuangchao against Ray Train v2's TorchTrainer, and the limit.

Three sides run `bench.harness.bench_loop` (same model, data, seed and steps; 2
data-parallel ranks, gloo on CPU, one torch thread a rank), in turn, REPEATS
times each (the order rotates each repeat):

  kuangchao   `run_as_driver` (the `kc train` path), on a fake 2-node Ray cluster
  ray-train   Ray Train v2's `TorchTrainer` on the same cluster
  torchrun    bare `torch.distributed` started by `torchrun --standalone` (no Ray,
              no platform: what no orchestrator can beat), `bench/overhead_raw.py`

Every side is stamped at the same events: each rank records the time after each
of its optimizer steps, and a run's "first step" is when the LAST rank finished
its first step. Reported, as medians over the repeats (min and max on stderr):

  step_time_ratio            steady-state step time, ours / Ray Train
  time_to_first_step_ratio   submit -> first step on every rank, ours / Ray Train
  step_time_vs_raw           steady-state step time, ours / torchrun
  time_to_first_step_vs_raw  submit -> first step on every rank, ours / torchrun

Run: .venv/bin/python bench/overhead.py [--repeats 3] [--steps 60] [--quick]
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import (  # noqa: E402
    BenchCluster,
    connect,
    emit,
    keep_stdout_for_results,
    local_cluster,
    log,
    median,
    read_rank_files,
    settle,
    spread_of,
    tiny_spec,
)

STEPS = 60  # 55 steady-state steps per run
WARMUP_STEPS = 5
REPEATS = 3
SIDES = ("kuangchao", "ray-train", "torchrun")
RANKS = 2

@dataclass(frozen=True)
class Run:
    submitted: float  # time.time() just before submitting
    ranks: list[dict]  # each rank's {"start", "steps": [time after each optimizer step]}

    @property
    def start(self) -> float:
        """When the last rank entered the training loop."""
        return max(r["start"] for r in self.ranks)

    @property
    def time_to_first_step(self) -> float:
        """Submit -> the first optimizer step completed on every rank."""
        return max(r["steps"][0] for r in self.ranks) - self.submitted

    @property
    def step_time(self) -> float:
        # The step ends when its last rank is done: per step, the latest stamp over
        # ranks, then differences from step WARMUP_STEPS on (the first steps carry
        # allocator warm-up and DDP's first-iteration bucketing).
        ends = [max(r["steps"][k] for r in self.ranks) for k in range(len(self.ranks[0]["steps"]))]
        steady = ends[WARMUP_STEPS:]
        return median([b - a for a, b in zip(steady, steady[1:], strict=False)])


def _read_run(submitted: float, out: Path) -> Run:
    ranks = read_rank_files(out)
    if len(ranks) != RANKS:
        raise RuntimeError(f"{len(ranks)} of {RANKS} ranks wrote their timing for {out}")
    return Run(submitted=submitted, ranks=ranks)


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


def run_torchrun(cluster: BenchCluster, out: Path, steps: int) -> Run:
    """The same loop under bare torchrun: `--standalone` (a local rendezvous, one
    node), one process a rank, and torchrun's own OMP_NUM_THREADS=1 default."""
    spec_file = out.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(tiny_spec(steps)))
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", str(RANKS),
           str(Path(__file__).resolve().parent / "overhead_raw.py"), str(spec_file), str(out)]
    submitted = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}: {done.stderr[-2000:]}")
    return _read_run(submitted, out)


def _describe(who: str, run: Run) -> None:
    log(f"{who:10s} submit->loop {run.start - run.submitted:6.2f}s  "
        f"first step {run.time_to_first_step:6.2f}s  step {run.step_time * 1000:6.1f}ms  "
        f"total {max(r['steps'][-1] for r in run.ranks) - run.submitted:6.2f}s")


def measure(cluster: BenchCluster, repeats: int, steps: int,
            quick: bool = False) -> tuple[dict[str, list[Run]], dict[str, int]]:
    """Run every side `repeats` times; a run that fails is logged and counted, not dropped.
    `quick` (a smoke test whose numbers mean nothing) does not wait for quiet CPUs."""
    runs: dict[str, list[Run]] = {side: [] for side in SIDES}
    failed = {side: 0 for side in SIDES}
    for i in range(repeats):
        # Rotate who goes first so warm caches and drift favour no side.
        order = SIDES[i % len(SIDES):] + SIDES[:i % len(SIDES)]
        for who in order:
            settle(quiet=not quick)
            out = cluster.tmp / f"{who}-{i}"
            try:
                if who == "kuangchao":
                    run = run_kuangchao(cluster, out, steps)
                elif who == "ray-train":
                    run = run_ray_train(cluster, out, f"overhead-{i}", steps)
                else:
                    run = run_torchrun(cluster, out, steps)
            except Exception:
                failed[who] += 1
                log(f"{who}#{i} FAILED:\n{traceback.format_exc()}")
                continue
            runs[who].append(run)
            _describe(f"{who}#{i}", run)
    return runs, failed


def report(runs: dict[str, list[Run]], failed: dict[str, int]) -> None:
    """The four lines; a side with no successful run gives a line with an error."""
    lines = (("step_time_ratio", "step_time", "ray-train", 1.03),
             ("time_to_first_step_ratio", "time_to_first_step", "ray-train", 1.2),
             ("step_time_vs_raw", "step_time", "torchrun", 1.01),
             ("time_to_first_step_vs_raw", "time_to_first_step", "torchrun", 1.5))
    for metric, attr, base, target in lines:
        ours = [getattr(r, attr) for r in runs["kuangchao"]]
        theirs = [getattr(r, attr) for r in runs[base]]
        log(f"{metric}: kuangchao {spread_of(ours)} s, {base} {spread_of(theirs)} s")
        missing = [side for side, xs in (("kuangchao", ours), (base, theirs)) if not xs]
        extra = {"error": f"every {' and '.join(missing)} run failed"} if missing else {}
        emit("overhead", metric, "s", median(ours) if ours else None,
             median(theirs) if theirs else None, target, better="lower", target_on="ratio",
             spread={"ours": ours, "baseline": theirs},
             failed_runs={"ours": failed["kuangchao"], "baseline": failed[base]},
             settings=SETTINGS[base], **extra)


SETTINGS = {
    "ray-train": "Ray Train v2 TorchTrainer (RAY_TRAIN_V2_ENABLED=1), ScalingConfig(num_workers=2, "
                 "use_gpu=False, resources_per_worker={CPU: 1}), gloo, defaults otherwise",
    "torchrun": "torchrun --standalone --nnodes 1 --nproc-per-node 2 (OMP_NUM_THREADS=1, "
                "torchrun's default for several ranks), gloo init from env://",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--quick", action="store_true",
                        help="one short run a side on a one-node cluster (seconds of training): "
                             "checks the script works")
    args = parser.parse_args()
    if args.quick:
        # Two steps past the warm-up: the fewest that give a steady-state step time.
        args.repeats, args.steps = 1, WARMUP_STEPS + 2
    keep_stdout_for_results()
    import ray

    t0 = time.monotonic()
    log(f"Ray {ray.__version__}, torch {__import__('torch').__version__}; baselines: "
        + "; ".join(f"{k}: {v}" for k, v in SETTINGS.items()))
    # Libraries may print; keep stdout for the JSON lines alone.
    # The quick mode saves starting the second node: both ranks of every side fit on one.
    nodes = 1 if args.quick else 2
    with contextlib.redirect_stdout(sys.stderr), local_cluster(nodes=nodes, gpus=4, cpus=4) as cluster:
        connect(cluster)
        runs, failed = measure(cluster, args.repeats, args.steps, quick=args.quick)
    report(runs, failed)
    log(f"total wall time {time.monotonic() - t0:.1f}s")
    if not all(runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
