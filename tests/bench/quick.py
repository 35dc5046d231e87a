"""The benchmarks' quick runs, started in the background while other tests run.

A quick run is mostly waiting: a Ray cluster coming up, ranks importing torch,
a job's controller polling. Run alone, the dozen scripts took over five minutes
of the suite's wall time with the CPUs half idle. So tests/conftest.py starts
them as soon as the modules with a Ray stack of their own are done (those are the
timing-sensitive ones, run on a quiet machine) and the tier of modules that need
no stack begins; tests/bench/test_bench_quick.py, ordered last in that tier, only
collects what they printed. (Under `make test` that tier is a pytest process of its
own, started beside the stack tiers at a lower priority, tests/suite.py: the quick
runs then begin with the suite, at the lower priority plus NICE.)

The scripts run at a lower CPU priority (`nice`), so the tests running beside
them keep theirs: a quick run's timings are not judged (speed goals live in
bench/), its lines and exit status are. Each script uses its own ports, Redis key
prefix, cluster and temporary folders, so they do not see each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bench import run_all
from tests.suite import stop as interrupt  # Ctrl-C for its group, then SIGKILL

ROOT = Path(__file__).resolve().parents[2]
# Roughly longest first (quick-mode wall time on 2 cores), so the slow ones overlap the rest.
ORDER = ["hf", "topology_live", "goodput", "recovery", "resize", "overhead", "heartbeats", "planner",
         "metrics", "tokens", "api", "ray_limits", "memory", "ckpt_io", "placement"]
# Scripts that build a netns cluster (root, iproute2): elsewhere they print their lines
# with an error saying why, and their test is skipped.
NEEDS_NETNS = {"topology_live"}
# The scripts that bring up a Ray cluster of their own and train on it under both systems.
# Each quick run is several minutes of a 2-core machine, and together they held the suite
# well past its time budget (issue 27), so `make test` leaves them to `make bench-quick`
# (KC_BENCH_QUICK=all), which runs every script's quick mode. What they drive is tested on
# its own in the suite: recovery, resizes, peer memory, drains and netns clusters in
# tests/integration, the HF path in tests/layouts and tests/integration/test_own_model.py.
CLUSTER_SCRIPTS = {"overhead", "recovery", "resize", "hf", "goodput", "topology_live", "ray_limits"}
# Quick runs that start no cluster but still cost 10-30 s of CPU each, or keep servers and
# writer processes busy for half a minute (CPU seconds measured on 2 cores: hetero 33, metrics
# 21, tokens 20, ckpt_io 10 with 40 s of an object store, heartbeats 35 s of Redis writers).
# Beside the no-stack tier they cost the suite about a minute; `make bench-quick` keeps them.
HEAVY_SCRIPTS = {"hetero", "metrics", "tokens", "ckpt_io", "heartbeats"}
LEFT_TO_BENCH_QUICK = CLUSTER_SCRIPTS | HEAVY_SCRIPTS
ALL_ENV = "KC_BENCH_QUICK"
AT_ONCE = 3
NICE = 5  # below the tests beside them, not so low that a busy tier starves them
TIMEOUT_S = 1200


def scripts() -> list[str]:
    """The scripts whose quick modes this test session runs: every one with
    KC_BENCH_QUICK=all, else all but the cluster-starting and heavy ones."""
    every = sorted(run_all.METRICS)
    if os.environ.get(ALL_ENV, "").strip().lower() == "all":
        return every
    return [s for s in every if s not in LEFT_TO_BENCH_QUICK]


_pool: ThreadPoolExecutor | None = None
_runs: dict[str, Future] = {}


_running: dict[str, subprocess.Popen] = {}


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KCBENCH_QUIET_TIMEOUT_S": "0"}  # no waiting for an idle machine
    started = time.monotonic()
    args = ["nice", "-n", str(NICE), sys.executable, f"bench/{script}.py",
            *run_all.ARGS.get(script, []), "--quick"]
    with subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        _running[script] = proc
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            interrupt(proc)
            stdout, stderr = proc.communicate()
            stderr += f"\n[quick runs] killed after {TIMEOUT_S}s"
        finally:
            _running.pop(script, None)
    out = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    out.wall_s = round(time.monotonic() - started, 1)  # type: ignore[attr-defined]
    return out


def stop() -> None:
    """At the session's end: runs never collected (a test run stopped early) are interrupted."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
    for proc in list(_running.values()):
        interrupt(proc)


def selected_scripts(items) -> set[str]:
    """The scripts whose tests this session runs (`-k topology` runs one script, not all),
    less those skipped anyway (no netns here)."""
    from kuangchao.platform.runtime import netns

    out = set()
    for item in items:
        spec = getattr(item, "callspec", None)
        if item.path.name == "test_bench_quick.py" and spec is not None and "script" in spec.params:
            out.add(spec.params["script"])
    return out - {s for s in NEEDS_NETNS if netns.unavailable()}


def launch(scripts: set[str]) -> None:
    """Start the quick runs of `scripts` not started yet, longest first, a few at a time."""
    global _pool
    todo = [s for s in [*ORDER, *sorted(set(scripts) - set(ORDER))] if s in scripts and s not in _runs]
    if not todo:
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(AT_ONCE, thread_name_prefix="bench-quick")
    for script in todo:
        _runs[script] = _pool.submit(_run, script)


def results(scripts: set[str]) -> dict[str, subprocess.CompletedProcess]:
    """Every script's finished run (started now where the background start did not)."""
    launch(scripts)
    return {s: _runs[s].result() for s in scripts}
