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

Layout: this script holds the CLI, the metrics and their output; the
kuangchao runs are in bench/recovery_kc.py, the Ray Train and plain-actor runs
in bench/recovery_rt.py, what both share (traces, signalling, analysis, the
job spec) in bench/recovery_common.py, and the loop the workers run in
bench/recovery_ray.py.

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
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench import harness  # noqa: E402
from bench.harness import (  # noqa: E402
    connect,
    emit,
    local_cluster,
    log,
    median,
)
from bench.recovery_common import FAULT_TOLERANCE, RANK, Recovery  # noqa: E402
from bench.recovery_kc import kc_hang, kc_mttr  # noqa: E402
from bench.recovery_rt import ray_actor_died_ms, ray_hang, ray_mttr  # noqa: E402

CKPT_EVERY = 10  # checkpoint interval, steps, both systems
KILL_OFFSET = 5  # kill this many steps after a checkpoint
REPEATS = 4  # kills per run
DETECT_SAMPLES = 10  # kills of a plain Ray actor for the ActorDiedError baseline
DETECT_KILLS = 4  # kuangchao kills after the MTTR ones, for crash_detect_ms only
HANG_WAIT_S = 120.0
BENCH = "recovery"


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); q in [0, 100]."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)



# -- orchestration -----------------------------------------------------------------------

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
            harness.settle()
            detect_ray = ray_actor_died_ms(args.detect_samples)
            log("ActorDiedError after SIGKILL (ms): " + ", ".join(f"{x:.0f}" for x in detect_ray))
        with res.phase("kuangchao MTTR"):
            harness.settle()
            ours, detect_ours = kc_mttr(cluster, targets, steps, every, args.detect_kills)
            log("kuangchao SIGKILL -> marked failed (ms): " + ", ".join(f"{x:.0f}" for x in detect_ours))
        with res.phase("Ray Train MTTR"):
            harness.settle()
            theirs = ray_mttr(cluster, targets, steps, every)
        if not args.skip_hang:
            hang_ours = hang_ray = None
            with res.phase("kuangchao hang"):
                harness.settle()
                hang_ours = kc_hang(cluster, targets[0], every, args.hang_wait)
            with res.phase("Ray Train hang"):
                harness.settle()
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
