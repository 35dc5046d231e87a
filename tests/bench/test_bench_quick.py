"""Every benchmark script runs, in its quick mode, and says what it measured.

A benchmark that breaks (an API it calls moves, a cluster it starts needs a
token it does not present) is otherwise noticed only when someone runs it by
hand. Each `bench/*.py` here runs as a user runs it (`python bench/X.py
--quick`: the shortest run that still goes through every phase), and each
line it prints must be well formed (bench/check.py), carry both sides as
numbers, and name the metrics the script documents (`bench/run_all.py`'s
`METRICS`). Timing targets are not judged here: quick runs are too short, and
speed goals live in bench/.

The scripts run in the background while the tests that need no Ray stack run
(tests/bench/quick.py says how and why); this module comes last among those and
collects what they printed. `make test` leaves out the scripts that start a Ray
cluster of their own and the heavy ones (`quick.LEFT_TO_BENCH_QUICK`, for the
suite's time budget); `make bench-quick` (KC_BENCH_QUICK=all) runs every one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import check, run_all
from kuangchao.platform.runtime import netns
from tests.bench import quick

ROOT = Path(__file__).resolve().parents[2]
METRICS = {script: set(metrics) for script, metrics in run_all.METRICS.items()}
NEEDS_NETNS = quick.NEEDS_NETNS


@pytest.fixture(scope="module")
def quick_runs(request) -> dict[str, subprocess.CompletedProcess]:
    return quick.results(quick.selected_scripts(request.session.items))


def test_every_bench_script_is_covered():
    runnable = {p.stem for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text()}
    helpers = {"api_load", "heartbeats_sim", "hf_rt", "hf_tokenize", "overhead_raw",
               "placement_sim", "recovery_common", "recovery_kc", "recovery_ray", "recovery_rt",
               "resize_common", "resize_kc", "resize_rt", "harness", "run_all", "check",
               "goodput_chaos", "goodput_ray", "goodput_runs", "goodput_torchft",
               # a pass/fail check of the CUDA and NCCL paths, run on a GPU machine only
               "gpu_check",
               # a simulator with its own unit tests (tests/unit/test_goodput_sim.py)
               "goodput_sim"}
    assert runnable - helpers == set(METRICS), "a bench script without a quick-mode test"


def test_cluster_scripts_are_bench_scripts():
    assert quick.LEFT_TO_BENCH_QUICK <= set(METRICS), "a name left to bench-quick that is no bench script"


@pytest.mark.parametrize("script", quick.scripts())
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
