"""Resize: kuangchao's elastic jobs against Ray Train v2 elastic training.

The same job on the same fake cluster (head + 3 worker nodes of 4 logical
GPUs and 2 CPUs, one rank per node): the GPT of bench/harness.py, a global
batch of 48 samples kept at every size by gradient accumulation, a
checkpoint every 5 steps. Two events, on a cluster of its own per system:

- shrink: the node of rank 2 loses its raylet (SIGKILL, what
  `Cluster.remove_node` does); the job must go on at 2 ranks;
- grow: a new node joins; the job must grow back to 3.

  resize_s              event -> the first optimizer step at the new size, the
                        median over both events (and over --repeats); ours with
                        `elastic.resize: live` against Ray Train v2's
                        `ScalingConfig(num_workers=(1, 3))`. Target 0.5.
  resize_shrink_s,      the same, per event.
  resize_grow_s
  resize_decision_s     the platform's own decision (failure seen, grow asked)
                        -> that first step; Ray Train's decision is its
                        controller's scheduling/resizing state. No target.
  live_vs_restart_s     our live path against our full-restart path
                        (`elastic.resize: restart`: checkpoint, requeue,
                        restore), both measured here: the default keeps the
                        faster. Target 1.0.
  samples_lost          global samples never trained on across the resizes,
                        from the job's sample record (data.record_samples);
                        Ray Train's from its traces. Must be 0.

Ray Train runs with its resize monitor at 1 s and its health check at 0.5 s,
the fastest its settings allow (see bench/resize_rt.py for why a shrink still
takes it over a minute). One repeat takes about 8 minutes on 2 cores.

Run: .venv/bin/python bench/resize.py [--repeats N]   (JSON lines on stdout)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import (  # noqa: E402
    emit,
    keep_stdout_for_results,
    local_cluster,
    log,
    median,
    wait_for_quiet,
)
from bench.resize_kc import kc_resize  # noqa: E402
from bench.resize_rt import ray_resize  # noqa: E402

NODES, GPUS, CPUS = 3, 4, 2


def run_kc(mode: str) -> dict:
    wait_for_quiet()
    with local_cluster(nodes=NODES, gpus=GPUS, cpus=CPUS) as cluster:
        res = kc_resize(cluster, mode)
    log(f"kuangchao {mode}: {json.dumps(res)}")
    return res


def run_rt() -> dict:
    wait_for_quiet()
    out = {}
    with local_cluster(nodes=NODES, gpus=GPUS, cpus=CPUS) as cluster:
        # Shrink first: its 3 -> 2 leaves the 2 worker nodes the grow starts from.
        # The grow trains at 2 workers until Ray Train notices the new node (up to ~22 s).
        for kind, steps in (("shrink", 40), ("grow", 170)):
            out[kind] = ray_resize(cluster, kind, steps=steps)
            log(f"ray-train {kind}: {json.dumps(out[kind])}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-restart", action="store_true",
                    help="skip our full-restart path (live_vs_restart_s)")
    args = ap.parse_args()
    keep_stdout_for_results()  # killed raylets make Ray's driver print on stdout
    live, restart, rt = [], [], []
    for _ in range(args.repeats):
        live.append(run_kc("live"))
        if not args.no_restart:
            restart.append(run_kc("restart"))
        rt.append(run_rt())

    def ours(kind: str, runs=live) -> list[float]:
        return [r[kind]["resize_s"] for r in runs]

    def theirs(kind: str, key: str = "resize_s") -> list[float]:
        return [r[kind][key] for r in rt if r[kind].get(key) is not None]

    both = ours("shrink") + ours("grow")
    emit("resize", "resize_s", "s", median(both), median(theirs("shrink") + theirs("grow")), 0.5)
    emit("resize", "resize_shrink_s", "s", median(ours("shrink")), median(theirs("shrink")), 0.5)
    emit("resize", "resize_grow_s", "s", median(ours("grow")), median(theirs("grow")), 0.5)
    decided = [r[k]["decision_s"] for r in live for k in ("shrink", "grow")]
    rt_decided = theirs("shrink", "decision_s") + theirs("grow", "decision_s")
    if rt_decided:
        emit("resize", "resize_decision_s", "s", median(decided), median(rt_decided), None)
    if restart:
        emit("resize", "live_vs_restart_s", "s", median(both),
             median(ours("shrink", restart) + ours("grow", restart)), 1.0)
    lost = sum(r["samples_lost"] + r["samples_repeated"] for r in live + restart)
    rt_lost = sum(r[k]["samples_lost"] for r in rt for k in ("shrink", "grow"))
    emit("resize", "samples_lost", "samples", lost, rt_lost, 0)


if __name__ == "__main__":
    main()
