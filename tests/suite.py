"""`make test`: the whole suite as two pytest processes, partly at once.

The modules that use a Ray stack (their own, or the session's shared one: most
of the suite's wall time) spend much of it waiting: clusters coming up, ranks
importing torch, heartbeats timing out. On 2 cores a quarter to a half of the
CPU stayed idle while they ran, and the tier without a stack (unit, process,
layout, deploy and security tests, and the light benchmarks' quick runs) ran
on its own between them. So:

* the stack tiers run in the foreground, at normal priority, in the order
  tests/conftest.py gives them: own stacks first, then the shared stack;
* the tier without a stack starts when the shared-stack tier begins (the
  foreground creates a file this script names, SHARED_BEGAN_ENV), and runs
  beside it at `nice` NICE; its quick benchmark runs go lower still
  (tests/bench/quick.py).

Whichever stack tier the other runs beside runs about 30% longer (the CPUs,
Redis and the disk are shared; `nice` settles only the CPUs, and even at nice
19 the own-stack tier took 834 s instead of 658), so the overlap saves less
than the idle CPU suggests: on 2 cores the suite took 1,504 s instead of 1,695
run one tier after the other, 1,509 s with both parts started at once at nice
19, 1,545 s at once at nice 10. Beside the shared-stack tier, not the own-stack
one: the own-stack modules are the most timing-sensitive (detection within a
heartbeat timeout, drains against a deadline), and they keep a quiet machine.

KC_SUITE_NICE and KC_SUITE_START=begin (start both at once) change the two
choices, for measuring them.

Each pytest process is what `pytest tests --tiers=stack|nostack` runs by hand
(tests/conftest.py). The foreground's output streams; the background's is
kept in a file and printed when both are done, so the two do not interleave.
The exit status is the first non-zero of the two. Arguments are passed to
both (`-x`, `-k ...`). With KC_SUITE_JUNIT=PATH each writes a JUnit file,
PATH-stack.xml and PATH-nostack.xml.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NICE = int(os.environ.get("KC_SUITE_NICE", "10"))  # out of the stack tier's way, not starved
# "shared": the tier without a stack starts as the shared-stack tier begins; "begin": at once.
START = os.environ.get("KC_SUITE_START", "shared")
POLL_S = 1.0
SHARED_BEGAN_ENV = "KC_SUITE_SHARED_BEGAN"  # tests/conftest.py creates the file it names
STOP_GRACE_S = 60


def pytest_args(tier: str, extra: list[str]) -> list[str]:
    args = [sys.executable, "-m", "pytest", "-q", "--durations=20" if tier == "stack" else
            "--durations=10", f"--tiers={tier}", "tests", *extra]
    if junit := os.environ.get("KC_SUITE_JUNIT"):
        args.append(f"--junitxml={junit}-{tier}.xml")
    return args


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Ctrl-C for the process group `proc` leads (a pytest run's fixtures, a benchmark's
    `finally`, bring their clusters down), then SIGKILL for what is left after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM (CI's, say) stops both processes as Ctrl-C does


def main(extra: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    # Caught here, so the children start with SIGINT's default, which `stop` relies on, even
    # where this script was started with it ignored (a background job of a shell script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kc-suite-") as tmp, \
            open(Path(tmp) / "nostack.log", "w+") as log:
        began = Path(tmp) / "shared-tier-began"
        foreground = subprocess.Popen(pytest_args("stack", extra), cwd=ROOT, start_new_session=True,
                                      env={**os.environ, SHARED_BEGAN_ENV: str(began)})
        background: subprocess.Popen | None = None
        try:
            while START == "shared" and foreground.poll() is None and not began.exists():
                time.sleep(POLL_S)
            background = subprocess.Popen(["nice", "-n", str(NICE), *pytest_args("nostack", extra)],
                                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            codes = [foreground.wait(), background.wait()]
        except KeyboardInterrupt:
            return 130
        finally:  # interrupted, or an exception above: leave nothing running
            for proc in (foreground, background):
                if proc is not None and proc.poll() is None:
                    stop(proc)
        log.seek(0)
        print(f"\n== the tier without a Ray stack, run beside the above at nice {NICE} ==",
              flush=True)
        sys.stdout.write(log.read())
    print(f"\n== suite: {time.monotonic() - started:.0f} s; exit {codes[0]} (stack tiers), "
          f"{codes[1]} (tier without a stack) ==", flush=True)
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
