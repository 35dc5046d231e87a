"""The benchmarks' output: result lines, progress, medians, and waiting for a quiet machine.

Light on purpose (no torch, no Ray): a script that only simulates (placement.py)
starts in a fraction of a second; `bench.harness` re-exports all of it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, TextIO

from bench import check

REDIS_URL = os.environ.get("KCBENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


# -- output ----------------------------------------------------------------

def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


_results: TextIO | None = None  # where result lines go once keep_stdout_for_results() ran


def keep_stdout_for_results() -> None:
    """Keep stdout for the JSON result lines alone; everything else goes to stderr.

    Ray's driver prints what raylets report (a killed raylet's last log lines,
    say) on file descriptor 1, which would mix with the results.
    """
    global _results
    _results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(bench: str, metric: str, unit: str, ours: float | None, baseline: float | None,
         target: Any, *, better: str, target_on: str,
         spread: dict[str, list[float]] | None = None, **extra: Any) -> None:
    """Print one result line (the contract is in bench/check.py).

    `better` is "lower" or "higher"; `target_on` is "ratio", "ours" or the field a
    non-numeric target must equal. `spread` is {"ours": [...], "baseline": [...]}
    of the runs' values: their min and max go in the line. A side that failed is
    None, with `error=` saying why. A malformed line raises: a benchmark that
    cannot say what it measured is a bug."""
    line: dict[str, Any] = {
        "bench": bench, "metric": metric, "unit": unit,
        "ours": _significant(ours, 7), "baseline": _significant(baseline, 7),
        "ratio": _significant(check.ratio_of(ours, baseline)), "target": target,
        "better": better, "target_on": target_on}
    if spread:
        line["spread"] = {side: [_significant(min(v), 7), _significant(max(v), 7)]
                          for side, v in spread.items() if v}
        line["runs"] = {side: len(v) for side, v in spread.items()}
    line.update(extra)
    wrong = check.problems(line)
    if wrong:
        raise ValueError(f"bench {bench} metric {metric}: malformed result line: {'; '.join(wrong)}")
    print(json.dumps(line), file=_results or sys.stdout, flush=True)


def _significant(v: float | None, digits: int = 5) -> float | None:
    """`digits` significant digits: a tiny ratio (a cache hit against a full
    tokenization) keeps its value where fixed decimals would round it to 0."""
    return None if v is None else float(f"{v:.{digits}g}")


def spread_of(xs: list[float]) -> str:
    """'median (min-max, n runs)' for stderr."""
    if not xs:
        return "no runs"
    return f"{median(xs):.4g} ({min(xs):.4g}-{max(xs):.4g}, {len(xs)} runs)"


def log(msg: str) -> None:
    """Progress for humans; stdout is reserved for the JSON lines."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(max_busy: float = 0.3, window_s: float = 1.0, timeout_s: float = 30.0) -> float:
    """Block until the machine's CPUs are at most `max_busy` busy over `window_s`.

    Benchmarks call it between runs: processes of the previous run (and Ray's
    own start-up work) exit or settle asynchronously, and on a small machine
    their CPU use would be billed to the next run. Gives up after `timeout_s`
    (another tenant may keep the machine busy) and logs it. Returns the last
    busy fraction measured. `KCBENCH_QUIET_TIMEOUT_S` caps `timeout_s` (0: do not
    wait at all, as `make test`'s quick runs do: they check that a script works,
    not how fast).
    """
    cap = os.environ.get("KCBENCH_QUIET_TIMEOUT_S")
    if cap is not None:
        timeout_s = min(timeout_s, float(cap))
        if timeout_s <= 0:
            return 0.0
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = _cpu_times()
        time.sleep(window_s)
        b1, t1 = _cpu_times()
        busy = (b1 - b0) / max(1, t1 - t0)
        if busy <= max_busy:
            return busy
        if time.monotonic() > deadline:
            log(f"machine still {busy:.0%} busy after {timeout_s:.0f}s; timings may be noisy")
            return busy


