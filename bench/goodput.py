"""Goodput under chaos: kuangchao against Ray Train v2 with a fault every minute.

The same small job (the GPT and batch of bench/recovery.py: 2 data-parallel ranks,
one per node of a fake cluster of 3 one-GPU nodes plus the head, gloo on CPU) runs
under each system while a seeded fault schedule hits it: one fault every --interval
(60) s after the job's first step, for as long as the job runs, cycling through a
rank SIGKILLed, a rank SIGSTOPped (left stopped: the system must find the hang), a
raylet killed (the node back 30 s later), a NaN injected, and a node drained with a
20 s deadline (back 30 s after it went). The job's length is set so that a
fault-free run would last --duration (600) s, so each system is under fire for at
least that long. Both are stamped by the same per-step trace (bench/goodput_ray.py);
bench/goodput_chaos.py holds the schedule, the faults and the analysis,
bench/goodput_runs.py the two systems and their settings.

  ettr                kept steps x the run's own median step time / wall time from
                      the first step to the last step's completion; ours against
                      Ray Train's. Target: ours >= 0.93.
  ettr_vs_ray_train   the same two numbers; target: ratio >= 1.10.
  steps_redone        steps trained twice in the chaos run (rank 0's completions of
                      a step beyond its first). Target: ours 0.
  survivor_stall_s    median over --kills (10) SIGKILLs of rank 1 in a run of their
                      own, each once the job is back at full strength (8 steps
                      trained by rank 1's new process and, for kuangchao, every warm
                      spare up again): how long the surviving rank stalled, for both systems the
                      longest gap between a surviving rank's consecutive steps around
                      the kill, minus a normal step (kuangchao's own restart entry
                      figure, which starts at the failure's declaration and so leaves
                      out detection, rides along as `platform_ours`).
                      Target: ours <= 2 s.
  final_loss_rel_err  |final loss of the chaos run - that of a fault-free run of
                      the same job| / the latter, each system against its own
                      fault-free run. Target: ours <= 1e-6.

One seeded run per system (the issue's exception to the three-repeat rule).

--quick: the cheapest two kinds of fault (a rank SIGKILLed, a NaN), once each, 5 s
apart, on a short job, with the survivors' stall taken from the chaos run's kill: a smoke test
of every phase and line (its numbers mean nothing).

Run: .venv/bin/python bench/goodput.py [--interval 60] [--duration 600] [--kills 10]
     [--seed 28] [--quick] [--only kc|rt] [--kinds ...] [--faults N] [--steps N]
     (JSON lines on stdout, settings and progress on stderr; `--only` runs one
     system's runs alone, for a diagnosis: the lines then name the other side missing)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
# Each fault stands for one isolated failure: kuangchao would otherwise quarantine a node
# after its third failure in 10 minutes, which a fault a minute on 3 nodes reaches by
# design (read when the harness builds the Settings; bench/recovery.py does the same).
os.environ.setdefault("KC_QUARANTINE_FAILURES", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.goodput_chaos import KINDS, Trace, schedule, step_gaps  # noqa: E402
from bench.goodput_runs import (  # noqa: E402
    IN_MEMORY,
    OURS_FT,
    QUIET_WAIT_S,
    RT_ENV,
    RT_MAX_RERUNS,
    TORCHFT_PATH_ENV,
    Kuangchao,
    RayTrain,
    Run,
    connect,
    in_memory_accepted,
    job_doc,
    kc_entry_stalls,
    kill_series,
    rt_configs,
    run_job,
    stalls,
    torchft_path,
)
from bench.harness import emit, keep_stdout_for_results, local_cluster, log, median  # noqa: E402
from bench.node_start import WINDOW_S as NODE_WINDOW_S  # noqa: E402
from kuangchao.platform.spec.checkpoint import CheckpointSection  # noqa: E402

BENCH = "goodput"
NODES, GPUS, CPUS = 3, 1, 2
QUICK_KINDS = ("kill_rank", "nan")  # once each
QUICK_INTERVAL_S = 5.0
QUICK_STEPS = 100
# kuangchao's disk checkpoints. With a peer-memory copy at every step no recovery path
# reads the disk (it serves only the loss of every copy at once), so docs/fault-tolerance.md
# sizes its interval by Young's rule on that rarer loss, not by the faults: 200 steps here
# (about 35-40 s at this job's step; the rule's answer for one such loss every 3 hours at
# the 76 ms a save costs the steps on 2 cores). Without peer memory: the spec's default.
# Ray Train's checkpoint is its recovery point: --ckpt-every.
KC_CKPT_DEFAULT = CheckpointSection.model_fields["interval_steps"].default
KC_CKPT_PEER_MEMORY = 200
TORCHFT_NOTE = (
    "torchft (Ray Train's replica-group recovery, ray/train/v2/torch/torchft_config.py) runs "
    "on CPU/gloo: torchft 0.2.0, installed in a scratch venv beside this one, kept one "
    "replica stepping while another was SIGKILLed, and a new one joined with the survivor's "
    "state")


def settings_lines(args: argparse.Namespace, in_mem: bool, why_not: str,
                   torchft: bool) -> dict[str, Any]:
    import ray

    ours = {**OURS_FT, "checkpoint.interval_steps": args.kc_ckpt_every, "checkpoint.async_save": True,
            "checkpoint.in_memory": IN_MEMORY if in_mem else None,
            "trainer": "built-in (model factory bench.goodput_ray:gpt)",
            "KC_QUARANTINE_FAILURES": os.environ.get("KC_QUARANTINE_FAILURES")}
    theirs = {"ray": ray.__version__, "mode": "torchft" if torchft else "plain", **RT_ENV,
              **rt_configs(args.ckpt_every, torchft),
              "fit_reruns": f"up to {RT_MAX_RERUNS}, same run name (resumes from its newest "
                            "checkpoint) when fit() raises before the run is told to stop"}
    log(f"kuangchao (docs/fault-tolerance.md's fast-recovery settings): {json.dumps(ours)}")
    log(f"kuangchao's disk checkpoints every {args.kc_ckpt_every} steps ({args.kc_ckpt_why})"
        + f"; Ray Train's every {args.ckpt_every} (its recovery point, --ckpt-every)")
    if not in_mem:
        log("kuangchao runs without peer-memory copies: " + (
            why_not if why_not == "--no-in-memory" else
            f"checkpoint.in_memory is not accepted by this checkout's spec ({why_not})"))
    log(f"Ray Train baseline: {json.dumps(theirs)}")
    log("detection budget: a silent rank or worker is failed after "
        f"{OURS_FT['heartbeat_timeout_s']:g} s on both sides; kuangchao's peer_wait_timeout_s "
        f"({OURS_FT['peer_wait_timeout_s']:g} s) fails a silent rank sooner when every other "
        "rank waits on it without progress, a rule Ray Train has no counterpart of")
    if torchft:
        log(TORCHFT_NOTE + "; torchft is importable here, so the baseline uses it (a failed "
            "replica group is replaced while the other goes on; Ray Train turns its drain "
            "watcher off with replica groups, so a drained node is a failure at its deadline)")
    else:
        log(TORCHFT_NOTE + f". It is not installed here (not a dependency of this project; "
            f"`--ray-mode torchft` with `pip install torchft==0.2.0`, or {TORCHFT_PATH_ENV} "
            "naming a site-packages folder that holds it), so this baseline is Ray Train's best "
            "setting without it: whole-group restart from the newest checkpoint")
    log("one seeded run per system: an exception to the three-repeat rule, as issue 28 allows")
    log(f"between runs: the machine quiet again first (at most {QUIET_WAIT_S:.0f}s); a node that "
        f"comes back: Ray's start-up of it in a CPU group weighing one niceness-19 task for "
        f"{NODE_WINDOW_S:.0f}s, each actor it runs (either system's) back in the normal group as "
        "it begins, its niceness as Ray set it (bench/node_start.py), since on one machine that "
        "start-up would take the cores of the ranks on the other nodes")
    return {"ours": ours, "baseline": theirs}


def rel_err(chaos: Run, ref: Run) -> tuple[float | None, str | None]:
    a, b = chaos.final_loss, ref.final_loss
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None, f"final losses {a} (chaos) and {b} (fault-free)"
    return abs(a - b) / abs(b), None


def safe(label: str, fn, failed: list[str]) -> Run | None:
    t0 = time.monotonic()
    log(f"== {label}")
    try:
        return fn()
    except Exception:
        failed.append(label)
        log(f"{label} failed:\n{traceback.format_exc()}")
        return None
    finally:
        log(f"== {label}: {time.monotonic() - t0:.1f}s")


def describe(run: Run | None) -> None:
    """A run's facts, and how long after each fault every rank stepped again."""
    if run is None:
        return
    log(f"{run.system} {run.label}: {json.dumps(run.facts.to_json())}"
        + (f"; redone steps {run.facts.redone_by_step}" if run.facts.redone_by_step else "")
        + (f"; error {run.error}" if run.error else ""))
    gaps = sorted(step_gaps(run.steps))
    if gaps:  # where a run's time per step goes beyond its median: the ETTR a fault-free run can reach
        def q(p: float) -> float:
            return gaps[min(len(gaps) - 1, int(p * len(gaps)))]
        mean = sum(gaps) / len(gaps)
        log(f"{run.system} {run.label}: step time p50 {q(0.5):.4f}s mean {mean:.4f}s p90 {q(0.9):.4f}s "
            f"p99 {q(0.99):.4f}s max {gaps[-1]:.3f}s (median/mean {q(0.5) / mean:.3f})")
    origin = run.facts.first_t or run.start
    for f in run.injected:
        back = None
        if f.t:
            firsts = [next((s.t for s in run.steps if s.rank == r and s.t > f.t and s.pid != f.pid),
                           None) for r in (0, 1)]
            back = None if None in firsts else max(firsts) - f.t
        log(f"  {f.kind} rank {f.rank} at +{(f.t or f.due) - origin:.0f}s: every rank stepped again "
            + ("-" if back is None else f"after {back:.2f}s") + (f" ({f.note})" if f.note else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test of every phase and line")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--duration", type=float, default=600.0,
                    help="seconds a fault-free run of the chaos job would take, per system")
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs for survivor_stall_s")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--ckpt-every", type=int, default=20,
                    help="steps between Ray Train's checkpoints (its recovery point)")
    ap.add_argument("--kc-ckpt-every", type=int, default=None, dest="kc_ckpt_chosen", metavar="STEPS",
                    help="steps between kuangchao's disk checkpoints (default: "
                         f"{KC_CKPT_PEER_MEMORY} with peer memory, its recovery point; "
                         f"without it the spec's default, {KC_CKPT_DEFAULT})")
    ap.add_argument("--ray-mode", choices=("auto", "plain", "torchft"), default="auto",
                    help="Ray Train with torchft replica groups, or whole-group restarts "
                         "(auto: torchft when it can be imported)")
    ap.add_argument("--no-in-memory", action="store_true",
                    help="kuangchao without checkpoint.in_memory (peer-memory copies)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the fault kinds to cycle through (comma-separated)")
    ap.add_argument("--faults", type=int, default=0,
                    help="stop after this many faults (default: faults while the job runs)")
    ap.add_argument("--steps", type=int, default=0,
                    help="steps of the chaos job (default: --duration at the measured step time)")
    ap.add_argument("--keep-trace", default=None, metavar="DIR",
                    help="copy every process's step lines to DIR (a diagnosis)")
    ap.add_argument("--only", choices=("kc", "rt"), default=None,
                    help="run one system's runs alone (a diagnosis: the lines then say the "
                         "other side is missing)")
    args = ap.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}")
    count = args.faults or 1000  # by default faults keep coming while the job runs
    in_mem, why_not = in_memory_accepted()
    if args.no_in_memory:
        in_mem, why_not = False, "--no-in-memory"
    # kuangchao's disk interval and where it comes from, for stderr.
    if args.kc_ckpt_chosen is not None:
        if args.kc_ckpt_chosen < 1:
            ap.error("--kc-ckpt-every: at least 1 step")
        args.kc_ckpt_every, args.kc_ckpt_why = args.kc_ckpt_chosen, "--kc-ckpt-every"
    elif in_mem:
        args.kc_ckpt_every, args.kc_ckpt_why = KC_CKPT_PEER_MEMORY, (
            "docs/fault-tolerance.md's interval with peer memory at every step: every "
            "recovery path reads the copies in memory, and the disk serves only the loss "
            "of all of them")
    else:
        args.kc_ckpt_every, args.kc_ckpt_why = KC_CKPT_DEFAULT, "the spec's default"
    if args.quick:
        args.interval, args.kills, args.ckpt_every = QUICK_INTERVAL_S, 0, 10
        args.kc_ckpt_every, args.kc_ckpt_why = min(args.kc_ckpt_every, 10), "--quick: at most 10"
        args.steps = args.steps or QUICK_STEPS
        kinds, count = QUICK_KINDS, args.faults or len(QUICK_KINDS)
    ft_path = torchft_path() if args.ray_mode != "plain" else None
    if args.ray_mode == "torchft" and ft_path is None:
        ap.error(f"--ray-mode torchft: torchft is not importable (install torchft==0.2.0, or set "
                 f"{TORCHFT_PATH_ENV})")
    keep_stdout_for_results()
    settings = settings_lines(args, in_mem, why_not, ft_path is not None)
    plan = schedule(args.seed, args.interval, kinds, count=count)
    log(f"fault schedule (seed {args.seed}): every {args.interval:.0f}s after the first step, "
        + ", ".join(f"{f.kind}(rank {f.rank})" for f in plan[:len(kinds)])
        + (", then again while the job runs" if count > len(kinds) else ""))
    t0 = time.monotonic()
    failed: list[str] = []
    runs: dict[str, Run | None] = {}
    with contextlib.redirect_stdout(sys.stderr), \
            local_cluster(nodes=NODES, gpus=GPUS, cpus=CPUS) as cluster:
        folder = Path(tempfile.mkdtemp(prefix="trace-", dir=cluster.tmp))
        trace = Trace(folder)
        connect(cluster, folder, ft_path)
        kc, rt = (Kuangchao(cluster, folder, args.kc_ckpt_every),
                  RayTrain(cluster, folder, args.ckpt_every, torchft=ft_path is not None))

        def doc(steps: int, name: str, skip: list[int] | None = None) -> dict[str, Any]:
            return job_doc(steps, args.kc_ckpt_every, name, in_mem, skip)  # RT: its loop's own

        wanted = ("kc", "rt") if args.only is None else (args.only,)
        if args.kills and "kc" in wanted:
            runs["kc_kills"] = safe("kuangchao: rank 1 SIGKILLed", lambda: kill_series(
                kc, trace, doc(1_000_000, "goodput-kills"), "kills", args.kills), failed)
        if args.kills and "rt" in wanted:
            runs["rt_kills"] = safe("Ray Train: rank 1 SIGKILLed", lambda: kill_series(
                rt, trace, doc(1_000_000, "goodput-kills"), "kills", args.kills), failed)
        steps = args.steps
        if not steps:
            measured = [r.facts.median_step_s for r in runs.values() if r and r.facts.median_step_s]
            step_s = min(measured) if measured else 0.15
            steps = max(50, math.ceil(args.duration / step_s))
            log(f"chaos job: {steps} steps ({args.duration:.0f}s at {step_s:.3f}s a step, the "
                "faster system's median in the kill series)")
        for key, system in (("kc", kc), ("rt", rt)):
            if key not in wanted:
                continue
            runs[f"{key}_chaos"] = safe(f"{key}: chaos run", lambda s=system: run_job(
                s, trace, doc(steps, "goodput-chaos"), "chaos", plan, CPUS, GPUS), failed)
        # The fault-free runs; kuangchao's skips the batches its chaos run skipped (its
        # numeric rollback skips a batch that gave a NaN; Ray Train's restart retries it).
        skip = runs["kc_chaos"].skipped if runs.get("kc_chaos") else []
        if "kc" in wanted:
            runs["kc_ref"] = safe("kc: fault-free run", lambda: run_job(
                kc, trace, doc(steps, "goodput-ref", skip), "reference"), failed)
        if "rt" in wanted:
            runs["rt_ref"] = safe("rt: fault-free run", lambda: run_job(
                rt, trace, doc(steps, "goodput-ref"), "reference"), failed)
        if args.keep_trace:
            shutil.copytree(folder, args.keep_trace, dirs_exist_ok=True)
    for r in runs.values():
        describe(r)
    lines(runs, settings, args)
    log(f"total wall time {time.monotonic() - t0:.1f}s")
    if failed:
        log(f"failed: {', '.join(failed)}")
        sys.exit(1)


def lines(runs: dict[str, Run | None], settings: dict[str, Any], args: argparse.Namespace) -> None:
    def side(key: str) -> Run | None:
        r = runs.get(key)
        return r if r is not None and r.error is None else None

    def err(**why: str | None) -> dict[str, Any]:
        text = "; ".join(f"{k}: {v}" for k, v in why.items() if v)
        return {"error": text} if text else {}

    kc, rt = side("kc_chaos"), side("rt_chaos")
    missing = {"ours": None if kc else "the kuangchao chaos run failed",
               "baseline": None if rt else "the Ray Train chaos run failed"}
    common = {"settings": settings, "runs": {"ours": int(kc is not None), "baseline": int(rt is not None)},
              "seed": args.seed, "interval_s": args.interval,
              "faults": {"ours": len(kc.injected) if kc else 0, "baseline": len(rt.injected) if rt else 0}}
    e_ours = kc.facts.ettr if kc else None
    e_base = rt.facts.ettr if rt else None
    facts = {"ours": kc.facts.to_json() if kc else None, "baseline": rt.facts.to_json() if rt else None}
    # Each side's ETTR counts its kept steps at its own median step time: per-step costs of
    # its fault tolerance (peer-memory copies, reports) count as training. `same_step`
    # prices both at the faster system's fault-free step instead, for comparison.
    refs = [r.facts.median_step_s for r in (side("kc_ref"), side("rt_ref")) if r and r.facts.median_step_s]
    fastest = min(refs) if refs else None

    def at_fastest(r: Run | None) -> float | None:
        if r is None or fastest is None or not r.facts.wall_s:
            return None
        return round(min(1.0, r.facts.kept * fastest / r.facts.wall_s), 4)

    step_s = {k: (runs[k].facts.median_step_s if runs.get(k) else None)
              for k in ("kc_chaos", "rt_chaos", "kc_ref", "rt_ref")}
    log(f"median step times (s): {json.dumps(step_s)}; ETTR with both priced at the faster "
        f"fault-free step ({fastest}): ours {at_fastest(kc)}, Ray Train {at_fastest(rt)}")
    emit(BENCH, "ettr", "fraction", e_ours, e_base, 0.93, better="higher", target_on="ours",
         facts=facts, step_s=step_s, same_step={"ours": at_fastest(kc), "baseline": at_fastest(rt)},
         **common, **err(**missing))
    emit(BENCH, "ettr_vs_ray_train", "fraction", e_ours, e_base, 1.10, better="higher",
         target_on="ratio", **common, **err(**missing))
    emit(BENCH, "steps_redone", "steps", kc.facts.redone if kc else None,
         rt.facts.redone if rt else None, 0, better="lower", target_on="ours", **common,
         **err(**missing))
    # survivor_stall_s: the kill series, or (quick) the chaos runs' kills.
    ks, rs = (runs.get("kc_kills"), runs.get("rt_kills")) if args.kills else (kc, rt)
    entry = kc_entry_stalls(ks) if ks else []
    traced = stalls(ks) if ks else []
    base = stalls(rs) if rs else []
    log(f"survivor stalls (s): kuangchao restart entries {[round(x, 3) for x in entry]}, "
        f"kuangchao traced {[round(x, 3) for x in traced]}, Ray Train traced "
        f"{[round(x, 3) for x in base]}")
    # Both sides from the same trace, the same way: the platform's own figure starts at
    # the failure's declaration, so it leaves out the detection before it.
    ours = traced
    emit(BENCH, "survivor_stall_s", "s", median(ours) if ours else None,
         median(base) if base else None, 2.0, better="lower", target_on="ours",
         spread={"ours": ours, "baseline": base}, source="trace",
         platform_ours=median(entry) if entry else None, settings=settings,
         **err(ours=None if ours else "no kill with a surviving rank's steps on both sides",
               baseline=None if base else "no kill with a surviving rank's steps on both sides"))
    kr, rr = side("kc_ref"), side("rt_ref")
    o, o_why = rel_err(kc, kr) if kc and kr else (None, "a kuangchao run failed")
    b, b_why = rel_err(rt, rr) if rt and rr else (None, "a Ray Train run failed")
    emit(BENCH, "final_loss_rel_err", "relative", o, b, 1e-6, better="lower", target_on="ours",
         losses={"ours": [kc.final_loss if kc else None, kr.final_loss if kr else None],
                 "baseline": [rt.final_loss if rt else None, rr.final_loss if rr else None]},
         settings=settings, **err(ours=None if o is not None else o_why,
                                  baseline=None if b is not None else b_why))


if __name__ == "__main__":
    main()
