"""`make bench`: every benchmark in its default mode, one results file, one table.

    python bench/run_all.py [--only overhead,placement] [--out bench/results]

Runs each script of `METRICS` in turn (as a user would: `python bench/X.py`),
collects the JSON lines they print into `<out>/<UTC time>.jsonl`, and writes the
table of bench/check.py (metric, ours, baseline, ratio, target, met) to
`<out>/<UTC time>.md`; both are copied to `latest.jsonl` and `latest.md`. A
script that crashes, or ends without a line it documents, gets a line per
missing metric with `"error"` (its exit code and last stderr lines): a broken
benchmark shows in the table as failed, never as a gap. Each script's stderr
goes to `<out>/<UTC time>.<script>.log`. It takes about an hour and a half on 2 cores
(bench/topology_live.py 30 minutes of it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench import check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Each script and the metrics it reports (bench/README.md). Order: the quick ones first.
METRICS: dict[str, dict[str, tuple[str, str, str]]] = {
    # metric: (unit, better, target_on) for the line written when a script does not print it
    "placement": {"solve_ms_p50": ("ms", "lower", "ours"), "tp_groups_split": ("groups", "lower", "ours"),
                  "tp_groups_split_4gpu_islands": ("groups", "lower", "ours"),
                  "cross_leaf_ring_edges": ("edges", "lower", "ratio"),
                  "optimality_gap": ("%", "lower", "ours"), "schedule_cycle_ms": ("ms", "lower", "ours"),
                  "solve_ms_p50_16k": ("ms", "lower", "ours"),
                  "schedule_cycle_ms_10k": ("ms", "lower", "ours")},
    "tokens": {"guarded_step_overhead": ("s", "lower", "ratio"),
               "token_verify_us": ("us", "lower", "ratio")},
    "memory": {"sp_activation_memory_ratio": ("bytes", "lower", "ratio"),
               "sp_activation_memory_ratio_tp2": ("bytes", "lower", "ratio")},
    "ckpt_io": {"ckpt_save_throughput": ("B/s", "higher", "ratio"),
                "async_ckpt_blocked_fraction": ("fraction", "lower", "ratio"),
                "s3_ckpt_throughput": ("B/s", "higher", "ratio"),
                "s3_async_blocked_fraction": ("fraction", "lower", "ours")},
    "metrics": {"metrics_overhead": ("s", "lower", "ratio"),
                "metrics_scrape_ms": ("ms", "lower", "ratio")},
    "api": {"submit_rps": ("req/s", "higher", "ratio"), "submit_p99_ms": ("ms", "lower", "ours"),
            "alias_bomb_ms": ("ms", "lower", "ours")},
    "ray_limits": {"pg_create_remove_per_s": ("groups/s", "higher", "ratio"),
                   "pg_burst_1000_s": ("s", "lower", "ours")},
    "heartbeats": {"heartbeat_scan_ms_p99": ("ms", "lower", "ours"),
                   "redis_cpu_fraction": ("cores", "lower", "ours"),
                   "heartbeat_scan_ms_p99_131k": ("ms", "lower", "ours")},
    "planner": {"planner_step_time_error": ("fraction", "lower", "ours"),
                "planner_search_ms": ("ms", "lower", "ours")},
    "overhead": {"step_time_ratio": ("s", "lower", "ratio"),
                 "time_to_first_step_ratio": ("s", "lower", "ratio"),
                 "step_time_vs_raw": ("s", "lower", "ratio"),
                 "time_to_first_step_vs_raw": ("s", "lower", "ratio")},
    "recovery": {"mttr_s": ("s", "lower", "ratio"), "mttr_s_warm_spares": ("s", "lower", "ratio"),
                 "crash_detect_ms": ("ms", "lower", "ratio"), "steps_redone": ("steps", "lower", "ratio"),
                 "hang_detect_s": ("s", "lower", "ratio")},
    "resize": {"resize_s": ("s", "lower", "ratio"), "resize_shrink_s": ("s", "lower", "ratio"),
               "resize_grow_s": ("s", "lower", "ratio"), "resize_decision_s": ("s", "lower", "ratio"),
               "live_vs_restart_s": ("s", "lower", "ratio"), "samples_lost": ("samples", "lower", "ours")},
    "hetero": {"hetero_speedup": ("x", "higher", "ours"),
               "hetero_loss_match": ("relative", "lower", "ratio"),
               "hetero_pipeline_ratio": ("s", "lower", "ratio")},
    "hf": {"tokenize_throughput": ("tokens/s", "higher", "ratio"),
           "tokenize_cache_hit_s": ("s", "lower", "ratio"),
           "hf_step_time_ratio": ("s", "lower", "ratio")},
    "goodput": {"ettr": ("fraction", "higher", "ours"),
                "ettr_vs_ray_train": ("fraction", "higher", "ratio"),
                "steps_redone": ("steps", "lower", "ours"),
                "survivor_stall_s": ("s", "lower", "ours"),
                "final_loss_rel_err": ("relative", "lower", "ours")},
    "topology_live": {"topology_step_time_ratio_dp4": ("s", "lower", "ratio"),
                      "topology_step_time_ratio_tp2dp2": ("s", "lower", "ratio"),
                      "topology_step_time_ratio": ("s", "lower", "ratio")},
}

# What a script's quick mode leaves out (the phases it skips to stay short).
QUICK_SKIPS = {"recovery": {"mttr_s_warm_spares", "hang_detect_s"},
               "resize": {"resize_shrink_s", "live_vs_restart_s"},
               "topology_live": {"topology_step_time_ratio_dp4"}}
# Arguments `make bench` adds: recovery.py can also time checkpoint I/O, which
# ckpt_io.py reports already.
ARGS = {"recovery": ["--skip-ckpt-io"]}


def run_script(script: str, stamp: str, out: Path, extra: list[str]) -> list[dict]:
    """One script's lines, with a failed line for each documented metric it did not print."""
    log = out / f"{stamp}.{script}.log"
    t0 = time.monotonic()
    with log.open("w") as err:
        done = subprocess.run([sys.executable, f"bench/{script}.py", *extra], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=err, text=True)
    print(f"[make bench] {script}: exit {done.returncode} in {time.monotonic() - t0:.0f}s "
          f"(stderr in {log})", file=sys.stderr, flush=True)
    lines = []
    for raw in done.stdout.splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            print(f"[make bench] {script}: not a result line: {raw[:200]}", file=sys.stderr)
    seen = {ln.get("metric") for ln in lines}
    tail = " | ".join(log.read_text().strip().splitlines()[-3:])[-400:]
    skipped = QUICK_SKIPS.get(script, set()) if "--quick" in extra else set()
    for metric, (unit, better, on) in METRICS[script].items():
        if metric not in seen and metric not in skipped:
            lines.append({"bench": script, "metric": metric, "unit": unit, "ours": None,
                          "baseline": None, "ratio": None, "target": None, "better": better,
                          "target_on": on, "error": f"bench/{script}.py exited {done.returncode} "
                                                    f"without this line: {tail}"})
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scripts (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true", help="every script's quick mode")
    args = ap.parse_args(argv)
    scripts = [s.strip() for s in args.only.split(",") if s.strip()] or list(METRICS)
    unknown = [s for s in scripts if s not in METRICS]
    if unknown:
        print(f"error: no benchmark {', '.join(unknown)}; choose from {', '.join(METRICS)}",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results = args.out / f"{stamp}.jsonl"
    lines: list[dict] = []
    for script in scripts:
        got = run_script(script, stamp, args.out,
                         ARGS.get(script, []) + (["--quick"] if args.quick else []))
        lines += got
        with results.open("a") as f:
            for ln in got:
                f.write(json.dumps(ln) + "\n")
    table = check.markdown(lines)
    (args.out / f"{stamp}.md").write_text(table)
    shutil.copyfile(results, args.out / "latest.jsonl")
    shutil.copyfile(args.out / f"{stamp}.md", args.out / "latest.md")
    print(table, end="")
    verdicts = [check.verdict(ln) for ln in lines]
    print(f"[make bench] {verdicts.count('met')} met, {verdicts.count('missed')} missed, "
          f"{verdicts.count('informative')} informative, {verdicts.count('failed')} failed; "
          f"{results}", file=sys.stderr)
    return 1 if "failed" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
