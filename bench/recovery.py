"""Recovery: kuangchao against Ray Train v2 when a worker is killed or hangs.

Both systems run the same loop (`bench.recovery_ray.resumable_loop`: the GPT,
data, optimizer and steps of `bench.harness.bench_loop`, plus a checkpoint
every CKPT_EVERY steps and resume from the newest one) with 2 data-parallel
ranks on the same fake Ray cluster. Every rank appends its events (start with
pid and resumed step, each step, each acknowledged checkpoint) to a trace
file; the benchmark SIGKILLs or SIGSTOPs rank 1 by that pid at the same step
for both systems and reads all timings from the traces and, for kuangchao,
from the job record's `restart_log` and events.

Kuangchao runs at the fault tolerance a user gets (the spec's defaults:
heartbeat every 1 s, a rank silent for 10 s is failed, no warm spares); Ray
Train with its health-check poll at 0.1 s (its fastest useful value; default
2 s) and its worker health-check timeout at our 10 s (default 600 s): see
bench/recovery_rt.py. Every comparison runs --repeats (3) times, alternating
which system goes first; lines give the median over all samples, their min
and max (`spread`), and the runs that failed (`failed_runs`).

  mttr_s               SIGKILL of rank 1 -> the first step after the restart
                       completed on every rank (median over the kills of all
                       runs); vs TorchTrainer with FailureConfig(max_failures=
                       kills). Target ratio 0.5.
  mttr_s_warm_spares   the same with `spare_workers: true`, against the same
                       Ray Train runs. Target ratio 0.5.
  crash_detect_ms      p99 of SIGKILL -> kuangchao marks the rank failed
                       (`failed_at` of the restart); vs Ray's own
                       ActorDiedError latency for a plain actor. Target 3.
  steps_redone         step reached at the kill - step resumed from (median);
                       vs Ray Train. Target 1.0.
  hang_detect_s        SIGSTOP of rank 1 -> kuangchao marks it failed; vs
                       SIGSTOP -> Ray Train's controller handles the failure,
                       both with a 10 s budget. Target ratio 1.0: at the same
                       budget, not later than Ray. A side that does not notice
                       within --hang-wait is null with `error`, never the bound.
  ckpt_save_throughput, async_ckpt_blocked_fraction
                       from bench/ckpt_io.py when it exists.

--quick: one run a side, one kill early in a short run (step 3 of 6), no warm
spares, hang or ckpt_io (a smoke test of the script and its lines: a few minutes
on a busy 2-core machine, nearly all of it process starts).

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
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench import harness  # noqa: E402
from bench.harness import (  # noqa: E402
    connect,
    emit,
    local_cluster,
    log,
    median,
    spread_of,
)
from bench.recovery_common import OURS_DEFAULTS, RANK, WARM_SPARES, Recovery  # noqa: E402
from bench.recovery_kc import kc_hang, kc_mttr  # noqa: E402
from bench.recovery_rt import RAY_SETTINGS, ray_actor_died_ms, ray_hang, ray_mttr  # noqa: E402

CKPT_EVERY = 10  # checkpoint interval, steps, both systems
KILL_OFFSET = 5  # kill this many steps after a checkpoint
REPEATS = 3  # runs of each configuration, alternating which system goes first
KILLS = 3  # kills per run
DETECT_SAMPLES = 9  # kills of a plain Ray actor for the ActorDiedError baseline, over all repeats
DETECT_KILLS = 0  # kuangchao kills per run after the MTTR ones, for crash_detect_ms only
HANG_WAIT_S = 60.0  # each side's bound for noticing the hang (6x the 10 s budget)
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
    lines: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, metric: str, unit: str, ours: float | None, baseline: float | None,
            target: float | None,
            bench: str = BENCH, better: str = "lower", target_on: str = "ratio",
            **extra: Any) -> None:
        self.lines.append(((bench, metric, unit, ours, baseline, target),
                           {"better": better, "target_on": target_on, **extra}))

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
              "baseline_bytes_per_s", 0.8, "higher"),
             ("async_ckpt_blocked_fraction", "measure_async_blocked", "fraction", "blocked_s",
              "sync_save_s", 0.1, "lower"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for metric, fn_name, unit, ours_key, base_key, target, better in table:
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
                            bench="ckpt_io", better=better)
                else:
                    res.failed.append(metric)
                    log(f"{fn_name}() returned no {ours_key}/{base_key}; {metric} not emitted")
    finally:
        torch.set_num_threads(threads)


@dataclass
class Runs:
    """What one configuration produced over the repeats: the runs that finished
    and why the others failed (reported in the line, never dropped)."""

    ok: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def attempt(self, res: Results, label: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        log(f"== {label}")
        try:
            self.ok.append(fn())
        except Exception as exc:
            self.errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            res.failed.append(label)
            log(f"{label} failed:\n{traceback.format_exc()}")
        finally:
            log(f"== {label}: {time.monotonic() - t0:.1f}s")


def settle(quick: bool) -> None:
    """Between runs: the previous run's Ray resources released and, except in quick
    mode (a smoke test whose numbers mean nothing), the CPUs quiet."""
    harness.settle(quiet=not quick)


def compare(res: Results, metric: str, unit: str, target: float | None, ours: Runs,
            theirs: Runs, values: Callable[[list[Any]], list[float]],
            stat: Callable[[list[float]], float] = median, what: str = "median",
            settings: dict[str, Any] | None = None, missing: dict[str, str] | None = None,
            **extra: Any) -> None:
    """One line from both sides' runs: `stat` over every sample of every run that
    finished (`values` turns a side's runs into samples), the samples' min and max
    as the spread, and how many runs failed. A side without samples is None, with
    `error` saying why (`missing[side]` when the caller knows better than "no run
    finished")."""
    xs, ys = values(ours.ok), values(theirs.ok)
    log(f"{metric} ({what}): ours {spread_of(xs)} from {len(ours.ok)} run(s); baseline "
        f"{spread_of(ys)} from {len(theirs.ok)} run(s); failed runs: ours {len(ours.errors)}, "
        f"baseline {len(theirs.errors)}")
    errors = []
    for side, samples, runs in (("ours", xs, ours), ("baseline", ys, theirs)):
        if not samples:
            why = (missing or {}).get(side) or "no run finished"
            errors.append(f"{side}: {why}" + (f" ({'; '.join(runs.errors)})" if runs.errors else ""))
    if errors:
        extra["error"] = "; ".join(errors)
        log(f"{metric}: {extra['error']}")
    res.add(metric, unit, stat(xs) if xs else None, stat(ys) if ys else None, target,
            spread={"ours": xs, "baseline": ys},
            runs={"ours": len(ours.ok), "baseline": len(theirs.ok)},
            samples={"ours": len(xs), "baseline": len(ys)},
            failed_runs={"ours": len(ours.errors), "baseline": len(theirs.errors)},
            **({"settings": settings} if settings else {}), **extra)


def kills_of(runs: list[tuple[list[Recovery], list[float]]] | list[list[Recovery]]) -> list[Recovery]:
    return [r for run in runs for r in (run[0] if isinstance(run, tuple) else run)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 run a side, 1 kill, short runs, no warm spares, "
                             "hang or ckpt_io")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="runs of each configuration, alternating which system goes first")
    parser.add_argument("--kills", type=int, default=KILLS, help="kills per MTTR run")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps of the MTTR runs (default: enough for the kills)")
    parser.add_argument("--ckpt-every", type=int, default=CKPT_EVERY)
    parser.add_argument("--kill-offset", type=int, default=KILL_OFFSET,
                        help="kill this many steps after a checkpoint")
    parser.add_argument("--detect-samples", type=int, default=DETECT_SAMPLES,
                        help="kills of a plain Ray actor (crash_detect_ms baseline), over all repeats")
    parser.add_argument("--detect-kills", type=int, default=DETECT_KILLS,
                        help="extra kuangchao kills per run for crash_detect_ms, after the MTTR ones")
    parser.add_argument("--hang-wait", type=float, default=HANG_WAIT_S,
                        help="how long each side may take to notice the hang")
    parser.add_argument("--skip-hang", action="store_true")
    parser.add_argument("--skip-spares", action="store_true",
                        help="no warm-spares runs (no mttr_s_warm_spares line)")
    parser.add_argument("--skip-ckpt-io", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.kills, args.detect_kills, args.detect_samples = 1, 1, 0, 1
        # A checkpoint every 2 steps, the kill 1 step after the first: the shortest run
        # (6 steps) that resumes from an acknowledged checkpoint and redoes a step.
        args.ckpt_every, args.kill_offset = 2, 1
        args.skip_hang = args.skip_spares = args.skip_ckpt_io = True
    every, offset = args.ckpt_every, args.kill_offset
    if not 0 < offset < every:
        parser.error("--kill-offset must be between 1 and --ckpt-every - 1")
    if args.repeats < 1 or args.kills < 1:
        parser.error("--repeats and --kills must be at least 1")
    targets = [every * (i + 1) + offset for i in range(args.kills)]
    steps = max(args.steps, every * (args.kills + 1) + 2)
    import ray

    ray_settings = {"ray": ray.__version__, **RAY_SETTINGS}
    mttr_settings = {"ours": OURS_DEFAULTS, "baseline": {
        **ray_settings, "FailureConfig.max_failures": args.kills,
        "CheckpointConfig.num_to_keep": 2}}
    log(f"kuangchao fault_tolerance (the spec's defaults): {OURS_DEFAULTS}; warm-spares line: "
        f"the same with {WARM_SPARES}")
    log(f"Ray Train baseline: ray {ray.__version__}, " + ", ".join(
        f"{k}={v}" for k, v in RAY_SETTINGS.items()) + f"; FailureConfig(max_failures="
        f"{args.kills}) for MTTR, max_failures=0 for the hang; CheckpointConfig(num_to_keep=2)")
    log(f"{args.repeats} repeat(s), alternating which system runs first; checkpoint every "
        f"{every} steps; SIGKILL rank {RANK} after steps {targets} of {steps}")
    t0 = time.monotonic()
    res = Results()
    ours, spares, theirs = Runs(), Runs(), Runs()
    probe = Runs()
    hang_ours, hang_ray = Runs(), Runs()
    probes = -(-args.detect_samples // args.repeats)  # per repeat, rounded up
    # Libraries may print; keep stdout for the JSON lines alone.
    # The quick mode saves starting the second node: both ranks of a job fit on one.
    nodes = 1 if args.quick else 2
    with contextlib.redirect_stdout(sys.stderr), local_cluster(nodes=nodes, gpus=4, cpus=4) as cluster:
        connect(cluster)

        def kc(rep: int, ft: dict[str, Any] | None, runs: Runs, tag: str) -> Callable[[], None]:
            def go() -> None:
                settle(args.quick)
                runs.attempt(res, f"kuangchao MTTR{' (warm spares)' if ft else ''} #{rep}",
                             lambda: kc_mttr(cluster, targets, steps, every, args.detect_kills,
                                             ft, tag=f"{tag}-{rep}"))
            return go

        def died_ms() -> list[float]:
            out = ray_actor_died_ms(probes)
            log("ActorDiedError after SIGKILL (ms): " + ", ".join(f"{x:.0f}" for x in out))
            return out

        def rt(rep: int) -> None:
            settle(args.quick)
            probe.attempt(res, f"Ray ActorDiedError latency #{rep}", died_ms)
            settle(args.quick)
            theirs.attempt(res, f"Ray Train MTTR #{rep}",
                           lambda: ray_mttr(cluster, targets, steps, every, tag=f"ray-mttr-{rep}"))

        for rep in range(args.repeats):
            order = [kc(rep, None, ours, "kc-mttr")]
            if not args.skip_spares:
                order.append(kc(rep, WARM_SPARES, spares, "kc-spares"))
            order.append(lambda rep=rep: rt(rep))
            for go in (order if rep % 2 == 0 else order[::-1]):
                go()
        if not args.skip_hang:
            for rep in range(args.repeats):
                def kc_h(rep: int = rep) -> None:
                    settle(args.quick)
                    hang_ours.attempt(res, f"kuangchao hang #{rep}", lambda: kc_hang(
                        cluster, targets[0], every, args.hang_wait, tag=f"kc-hang-{rep}"))

                def rt_h(rep: int = rep) -> None:
                    settle(args.quick)
                    hang_ray.attempt(res, f"Ray Train hang #{rep}", lambda: ray_hang(
                        cluster, targets[0], every, args.hang_wait, tag=f"ray-hang-{rep}"))
                for go in ((kc_h, rt_h) if rep % 2 == 0 else (rt_h, kc_h)):
                    go()

    def mttr(runs: list[Any]) -> list[float]:
        return [r.mttr_s for r in kills_of(runs)]

    def redone(runs: list[Any]) -> list[float]:
        return [float(r.redone) for r in kills_of(runs)]

    compare(res, "mttr_s", "s", 0.5, ours, theirs, mttr, settings=mttr_settings,
            kills={"ours": len(mttr(ours.ok)), "baseline": len(mttr(theirs.ok))})
    if not args.skip_spares:
        compare(res, "mttr_s_warm_spares", "s", 0.5, spares, theirs, mttr,
                settings={**mttr_settings, "ours": {**OURS_DEFAULTS, **WARM_SPARES}})
    compare(res, "crash_detect_ms", "ms", 3.0, ours, probe,
            lambda runs: [x for run in runs for x in (run[1] if isinstance(run, tuple) else run)],
            stat=lambda xs: percentile(xs, 99), what="p99",
            settings={"ours": OURS_DEFAULTS,
                      "baseline": {"ray": ray.__version__,
                                   "what": "ActorDiedError of a plain actor, defaults"}})
    log(f"steps_redone with a checkpoint every {every} steps, kill {offset} steps after one")
    compare(res, "steps_redone", "steps", 1.0, ours, theirs, redone, settings=mttr_settings)
    if not args.skip_hang:
        budget = RAY_SETTINGS["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"]
        hang_settings = {"ours": OURS_DEFAULTS, "baseline": {
            **ray_settings, "FailureConfig.max_failures": 0}}
        compare(res, "hang_detect_s", "s", 1.0, hang_ours, hang_ray,
                lambda runs: [x for x in runs if x is not None], settings=hang_settings,
                undetected={"ours": sum(x is None for x in hang_ours.ok),
                            "baseline": sum(x is None for x in hang_ray.ok)},
                bound_s=args.hang_wait,
                missing={"ours": f"kuangchao did not notice the stopped rank within "
                                 f"{args.hang_wait:.0f}s in any of {len(hang_ours.ok)} run(s)",
                         "baseline": f"Ray Train did not notice the stopped worker within "
                                     f"{args.hang_wait:.0f}s in any of {len(hang_ray.ok)} run(s) "
                                     f"(RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S={budget})"})
    if not args.skip_ckpt_io:
        with contextlib.redirect_stdout(sys.stderr):
            ckpt_io_metrics(res)
    for args_, kwargs in res.lines:
        emit(*args_, **kwargs)
    log(f"total wall time {time.monotonic() - t0:.1f}s")
    if res.failed:
        log(f"failed: {', '.join(res.failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
