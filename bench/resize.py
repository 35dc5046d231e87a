"""Resize: kuangchao's elastic jobs against Ray Train v2 elastic training.

The same job on the same fake cluster (head + 3 worker nodes of 4 logical
GPUs and 2 CPUs, one rank per node): the GPT of bench/harness.py, a global
batch of 48 samples kept at every size by gradient accumulation, a
checkpoint every 5 steps. Two events, on a cluster of its own per system and
run:

- shrink: the node of rank 2 loses its raylet (SIGKILL, what
  `Cluster.remove_node` does); the job must go on at 2 ranks;
- grow: a new node joins; the job must grow back to 3.

Each configuration runs --repeats (3) times, alternating which system goes
first (ours first on even repeats); each line gives the median over every
sample, their min and max (`spread`) and the runs that failed or did not
resize (`failed_runs`, also on stderr). Both sides are stamped at the same
event: the first step at the new size completed on every rank.

  resize_s              event -> that first step, the median over both
                        events; ours with `elastic.resize: live` against Ray
                        Train v2's `ScalingConfig(num_workers=(1, 3))`. Target 0.5.
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

Ray Train runs with every setting that bounds its resize at its fastest
working value (`bench.resize_rt.SETTINGS`, printed at the start and put in
each line): health check 0.1 s, worker-group start timeout 2 s, resize
monitor 0 s, autoscaling-coordinator tick 0.5 s (bench/resize_rt.py says
what each does and why that value).

--quick: one run a side, the grow only (2 -> 3 nodes), both on one cluster,
no restart path, one step at the new size before each run ends: a smoke test of
the script and its lines.

Run: .venv/bin/python bench/resize.py [--repeats N] [--quick]   (JSON lines on stdout)
"""

from __future__ import annotations

import os

# Must precede any import of ray.train: selects the Train v2 API.
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.harness import (  # noqa: E402
    connect,
    emit,
    keep_stdout_for_results,
    local_cluster,
    log,
    median,
    spread_of,
    wait_for_quiet,
)
from bench.resize_common import leaf_nodes, retire_node  # noqa: E402
from bench.resize_kc import kc_resize, kc_spec  # noqa: E402
from bench.resize_rt import SETTINGS, TICK_S, fast_coordinator, ray_resize  # noqa: E402

NODES, GPUS, CPUS = 3, 4, 2
# --quick: both sides train this many steps at the new size before a run ends (the
# full mode, a checkpoint interval: CKPT_EVERY), and our side reads the job record
# every QUICK_POLL_S, not every 10 ms (the record's stamps time the resize, not the
# poll; each read is a request the API serves from Redis).
QUICK_AFTER_STEPS, QUICK_POLL_S = 1, 0.25
EVENTS = ("shrink", "grow")  # in this order: the shrink leaves the 2 nodes the grow starts from


@dataclass
class Runs:
    """One event of one configuration over the repeats: the results of the runs
    that resized, and why the others did not (reported, never dropped)."""

    ok: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    unresized: list[dict[str, Any]] = field(default_factory=list)  # ran, did not resize

    def values(self, key: str = "resize_s") -> list[float]:
        return [r[key] for r in self.ok if r.get(key) is not None]


def _failed(what: str, exc: BaseException) -> str:
    log(f"{what} failed:\n{''.join(traceback.format_exception(exc))}")
    return f"{what}: {type(exc).__name__}: {str(exc)[:200]}"


def run_kc(mode: str, events: tuple[str, ...], nodes: int, quick: bool,
           into: dict[str, Runs], audits: list[dict[str, Any]]) -> None:
    t0 = time.monotonic()
    if not quick:
        wait_for_quiet()
    res: dict[str, Any] = {}
    try:
        with local_cluster(nodes=nodes, gpus=GPUS, cpus=CPUS) as cluster:
            kc_resize(cluster, mode, events=events, out=res)
        log(f"kuangchao {mode} ({time.monotonic() - t0:.0f}s): {json.dumps(res)}")
    except Exception as exc:
        why = _failed(f"kuangchao {mode}", exc)
        for kind in events:  # the events measured before the failure still count
            if kind in res:
                into[kind].ok.append(res[kind])
            else:
                into[kind].errors.append(why)
        return
    for kind in events:
        into[kind].ok.append(res[kind])
    audits.append(res)


def run_rt(events: tuple[str, ...], nodes: int, quick: bool, into: dict[str, Runs]) -> None:
    t0 = time.monotonic()
    if not quick:
        wait_for_quiet()
    done: set[str] = set()
    try:
        with local_cluster(nodes=nodes, gpus=GPUS, cpus=CPUS) as cluster:
            connect(cluster)
            tick = fast_coordinator()
            if tick != TICK_S:
                log(f"the AutoscalingCoordinator ticks every {tick}s, not {TICK_S}s")
            for kind in events:
                done.add(kind)
                try:
                    out = ray_resize(cluster, kind)
                except Exception as exc:
                    into[kind].errors.append(_failed(f"ray-train {kind}", exc))
                    continue
                log(f"ray-train {kind} ({time.monotonic() - t0:.0f}s): {json.dumps(out)}")
                if out.get("resize_s") is None:
                    into[kind].errors.append(f"ray-train {kind}: {out.get('note') or out.get('error')}")
                    into[kind].unresized.append(out)
                else:
                    into[kind].ok.append(out)
    except Exception as exc:
        why = _failed("ray-train cluster", exc)
        for kind in events:
            if kind not in done:
                into[kind].errors.append(why)


def run_quick(live: dict[str, Runs], rt: dict[str, Runs], audits: list[dict[str, Any]]) -> None:
    """--quick: both sides' grow on ONE cluster (head + 2 nodes), ours first: our job
    grows onto a third node, which is then stopped the orderly way (dead at once)
    before Ray Train starts on the 2 left and grows onto a fourth. Saves a
    cluster's start and stop."""
    t0 = time.monotonic()
    with local_cluster(nodes=NODES - 1, gpus=GPUS, cpus=CPUS) as cluster:
        connect(cluster)
        before = {n["NodeID"] for n in leaf_nodes()}
        res: dict[str, Any] = {}
        try:
            kc_resize(cluster, "live", events=("grow",), out=res, after_steps=QUICK_AFTER_STEPS,
                      poll_s=QUICK_POLL_S)
            log(f"kuangchao live ({time.monotonic() - t0:.0f}s): {json.dumps(res)}")
            live["grow"].ok.append(res["grow"])
            audits.append(res)
        except Exception as exc:
            why = _failed("kuangchao live", exc)
            if "grow" in res:  # measured before the failure: it counts
                live["grow"].ok.append(res["grow"])
            else:
                live["grow"].errors.append(why)
        for node in leaf_nodes():
            if node["NodeID"] not in before:
                log(f"node {node['Labels'].get('kc.io/node')} stopped in "
                    f"{retire_node(node['NodeID']):.1f}s")
        try:
            fast_coordinator()
            out = ray_resize(cluster, "grow", after_steps=QUICK_AFTER_STEPS)
        except Exception as exc:
            rt["grow"].errors.append(_failed("ray-train grow", exc))
            return
        log(f"ray-train grow ({time.monotonic() - t0:.0f}s): {json.dumps(out)}")
        if out.get("resize_s") is None:
            rt["grow"].errors.append(f"ray-train grow: {out.get('note') or out.get('error')}")
            rt["grow"].unresized.append(out)
        else:
            rt["grow"].ok.append(out)


def line(metric: str, target: float | None, ours: list[Runs], theirs: list[Runs],
         settings: dict[str, Any], key: str = "resize_s", what: str = "") -> None:
    """One result line: the median over every sample of both sides, min and max as
    the spread, and the runs that failed; a side without samples is None with `error`."""
    xs = [x for r in ours for x in r.values(key)]
    ys = [y for r in theirs for y in r.values(key)]
    failed = {"ours": sum(len(r.errors) for r in ours), "baseline": sum(len(r.errors) for r in theirs)}
    log(f"{metric}{what}: ours {spread_of(xs)}; baseline {spread_of(ys)}; failed runs: "
        f"ours {failed['ours']}, baseline {failed['baseline']}")
    for side, runs in (("ours", ours), ("baseline", theirs)):
        for err in (e for r in runs for e in r.errors):
            log(f"  failed ({side}): {err}")
    extra: dict[str, Any] = {}
    errors = [f"{side}: no run resized" + (f" ({'; '.join(e for r in runs for e in r.errors)})"
                                           if failed[side] else "")
              for side, samples, runs in (("ours", xs, ours), ("baseline", ys, theirs)) if not samples]
    if errors:
        extra["error"] = "; ".join(errors)
    target_args = {"better": "lower", "target_on": "ratio"}
    emit("resize", metric, "s", median(xs) if xs else None, median(ys) if ys else None, target,
         spread={"ours": xs, "baseline": ys}, failed_runs=failed, settings=settings,
         **target_args, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each configuration, alternating which system goes first")
    ap.add_argument("--no-restart", action="store_true",
                    help="skip our full-restart path (live_vs_restart_s)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: one run a side, the grow only (2 -> 3 nodes), no restart path")
    args = ap.parse_args()
    keep_stdout_for_results()  # killed raylets make Ray's driver print on stdout
    events, nodes = EVENTS, NODES
    if args.quick:
        args.repeats, args.no_restart, events, nodes = 1, True, ("grow",), NODES - 1
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    import ray

    ft = kc_spec("live", GPUS)["fault_tolerance"]
    ours_settings = {"elastic.resize": "live", "fault_tolerance": ft}
    baseline = {"ray": ray.__version__, **SETTINGS}
    log(f"kuangchao: elastic {{min_replicas: 1, max_replicas: 3}}, fault_tolerance {ft}")
    log(f"Ray Train baseline: ray {ray.__version__}, ScalingConfig(num_workers=(1, 3)), "
        + ", ".join(f"{k}={v}" for k, v in SETTINGS.items()))
    log(f"{args.repeats} repeat(s), alternating which system goes first; events {list(events)}")
    t0 = time.monotonic()
    live = {k: Runs() for k in events}
    restart = {k: Runs() for k in events}
    rt = {k: Runs() for k in events}
    audits: list[dict[str, Any]] = []
    for rep in range(0 if args.quick else args.repeats):
        order = [lambda: run_kc("live", events, nodes, args.quick, live, audits)]
        if not args.no_restart:
            order.append(lambda: run_kc("restart", events, nodes, args.quick, restart, audits))
        order.append(lambda: run_rt(events, nodes, args.quick, rt))
        for go in (order if rep % 2 == 0 else order[::-1]):
            go()
    if args.quick:
        run_quick(live, rt, audits)

    both = {"ours": ours_settings, "baseline": baseline}
    line("resize_s", 0.5, list(live.values()), list(rt.values()), both, what=" (all events)")
    for kind in events:
        line(f"resize_{kind}_s", 0.5, [live[kind]], [rt[kind]], both)
    line("resize_decision_s", None, list(live.values()), list(rt.values()), both, key="decision_s")
    if not args.no_restart:
        line("live_vs_restart_s", 1.0, list(live.values()), list(restart.values()),
             {"ours": ours_settings, "baseline": {**ours_settings, "elastic.resize": "restart"}})
    # Every run that trained counts, resized or not.
    lost = sum(a["samples_lost"] + a["samples_repeated"] for a in audits) if audits else None
    rt_runs = [x for r in rt.values() for x in r.ok + r.unresized]
    rt_lost = sum(x["samples_lost"] for x in rt_runs) if rt_runs else None
    missing = [f"{side}: no run trained to the end" for side, v in (("ours", lost), ("baseline", rt_lost))
               if v is None]
    emit("resize", "samples_lost", "samples", lost, rt_lost, 0, better="lower", target_on="ours",
         runs={"ours": len(audits), "baseline": len(rt_runs)}, settings=both,
         **({"error": "; ".join(missing)} if missing else {}))
    log(f"total wall time {time.monotonic() - t0:.1f}s")
    failed = [e for runs in (live, restart, rt) for r in runs.values() for e in r.errors]
    if failed:
        log(f"{len(failed)} failed run(s), reported in the lines' failed_runs; exit 1")
        sys.exit(1)


if __name__ == "__main__":
    main()
