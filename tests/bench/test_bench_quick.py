"""Every benchmark script runs, in its quick mode, and says what it measured.

A benchmark that breaks (an API it calls moves, a cluster it starts needs a
token it does not present) is otherwise noticed only when someone runs it by
hand. Each `bench/*.py` here runs as a user runs it (`python bench/X.py
--quick`: the shortest run that still goes through every phase), and each
line it prints must be well formed (bench/check.py), carry both sides as
numbers, and name the metrics the script documents (`bench/run_all.py`'s
`METRICS`). Timing targets are not judged here: quick runs are too short, and
speed goals live in bench/.

The scripts run a few at a time: most of a quick run is waiting (a Ray cluster
coming up, ranks importing torch), and each uses its own ports, Redis key
prefix, cluster and temporary folders, so they do not see each other. Longest
first, so the slow ones overlap the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import check, run_all
from kuangchao.platform.runtime import netns

ROOT = Path(__file__).resolve().parents[2]
METRICS = {script: set(metrics) for script, metrics in run_all.METRICS.items()}
# Roughly longest first (quick-mode wall time on 2 cores).
ORDER = ["hf", "topology_live", "recovery", "resize", "overhead", "heartbeats", "planner", "metrics",
         "tokens", "api", "ckpt_io", "placement"]
# Scripts that build a netns cluster (root, iproute2): elsewhere they print their lines
# with an error saying why, and their test is skipped.
NEEDS_NETNS = {"topology_live"}
AT_ONCE = 3


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KCBENCH_QUIET_TIMEOUT_S": "0"}  # no waiting for an idle machine
    started = time.monotonic()
    out = subprocess.run([sys.executable, f"bench/{script}.py", *run_all.ARGS.get(script, []),
                          "--quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    out.wall_s = round(time.monotonic() - started, 1)  # type: ignore[attr-defined]
    return out


def _selected(request) -> set[str]:
    """The scripts whose tests this session runs (`-k topology` runs one script, not all)."""
    out = set()
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and "script" in spec.params:
            out.add(spec.params["script"])
    return out


@pytest.fixture(scope="module")
def quick_runs(request) -> dict[str, subprocess.CompletedProcess]:
    chosen = _selected(request) - {s for s in NEEDS_NETNS if netns.unavailable()}  # skipped anyway
    scripts = [s for s in [*ORDER, *sorted(set(METRICS) - set(ORDER))] if s in chosen]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(scripts, pool.map(_run, scripts), strict=True))


def test_every_bench_script_is_covered():
    runnable = {p.stem for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text()}
    helpers = {"api_load", "heartbeats_sim", "hf_rt", "hf_tokenize", "overhead_raw",
               "placement_sim", "recovery_common", "recovery_kc", "recovery_ray", "recovery_rt",
               "resize_common", "resize_kc", "resize_rt", "harness", "run_all", "check",
               # a pass/fail check of the CUDA and NCCL paths, run on a GPU machine only
               "gpu_check",
               # a simulator with its own unit tests (tests/unit/test_goodput_sim.py)
               "goodput_sim"}
    assert runnable - helpers == set(METRICS), "a bench script without a quick-mode test"


@pytest.mark.parametrize("script", sorted(METRICS))
def test_quick_mode_prints_well_formed_lines_with_both_sides(script, quick_runs, record_property):
    if script in NEEDS_NETNS and (why := netns.unavailable()):
        pytest.skip(f"bench/{script}.py needs a netns cluster: {why}")
    out = quick_runs[script]
    record_property("wall_s", out.wall_s)  # each script's share of the suite's time (--junitxml)
    assert out.returncode == 0, f"bench/{script}.py --quick exited {out.returncode}:\n" \
                                f"{out.stderr[-4000:]}"
    lines = [json.loads(raw) for raw in out.stdout.splitlines() if raw.strip()]
    for line in lines:
        assert check.problems(line) == [], (line, check.problems(line))
        assert isinstance(line["ours"], int | float) and isinstance(line["baseline"], int | float), \
            f"{line['metric']}: a side is missing: {line}"
        assert check.verdict(line) in ("met", "missed", "informative")
        assert line["bench"] == script
    assert {ln["metric"] for ln in lines} == METRICS[script] - run_all.QUICK_SKIPS.get(script, set())
