"""Heartbeats at scale: 16,384 ranks beating at 1 Hz into one Redis while the controller scans.

What is simulated:

* Ranks. `--ranks` (16,384) ranks each beat once per second, spread evenly
  over the second, from `--writers` (4) forked processes that each own a
  contiguous shard. Every beat is what `workers/runtime/heartbeat.py` sends: one
  round trip of `SET {prefix}job:{id}:hb:{rank} <Beat.encode()> PX 10000`,
  `GET {prefix}job:{id}:stackreq:{rank}` (keys from `beat_key` /
  `stack_request_key`), `EXISTS` of the job's preempt and cancel flags, and
  on rank 0 an `HSET` of the job's progress. By default each rank has its own TCP connection (as
  every real rank has its own client), so Redis sees one read and one reply
  per beat, not one pipeline per batch of ranks; `--connections` lowers that.
  A few ranks misbehave: dead ranks stop beating 1.5 s in, hung ranks beat
  on with their step and `progress_ts` frozen (phase `collective`), and
  slow-start ranks stay in phase `init` with frozen progress (must NOT be
  flagged: start-up is untimed).
* The controller. In this process, every 0.5 s (`JobController.poll_s`):
  `read_beats` (pipelined MGETs over the store client `redis_client.connect` gives
  the controller) + `Classifier.observe` for all ranks; heartbeat timeout
  10 s (the spec default), hang timeout shortened to 5 s so hangs show up
  within the run. The classifier must flag exactly the dead ranks (expired)
  and the hung ones (hung), else the script exits 1. The import-time heap
  is frozen out of the GC's way first.
* Redis. A private `redis-server` on a free port (no persistence, bind
  127.0.0.1, maxclients raised for one connection per rank), stopped at the
  end; without the binary, the shared Redis at KCBENCH_REDIS_URL with a unique
  key prefix (Redis CPU then includes whatever else uses it).

Reported (after 2 s of warm-up, `--seconds` of steady state, then a shorter
phase where the controller scans naively instead):

  heartbeat_scan_ms_p99  p99 of one controller scan; baseline: one non-pipelined
                         GET per rank (same decode and classifier); target: ours < 100 ms
  redis_cpu_fraction     Redis CPU (INFO cpu, user + sys) over wall time in steady state;
                         baseline: the same load with the naive scan; target: ours < 0.5 cores

Layout: the simulated ranks (writer processes) and the private redis-server
are in bench/heartbeats_sim.py; the controller's scans, the naive baseline,
the measurements and the metrics are here.

Run: .venv/bin/python bench/heartbeats.py [--seconds 25] [--ranks 16384]
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis

from kuangchao.platform.execution.heartbeat import Classifier, Verdict
from kuangchao.platform.jobs import redis_client
from kuangchao.platform.jobs.beats import read_beats
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.protocol.heartbeat import Beat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.heartbeats_sim import (  # noqa: E402
    DEAD,
    HEARTBEAT_TIMEOUT_S,
    HUNG,
    JOB,
    SLOW_INIT,
    WARMUP_S,
    WriterConfig,
    WriterShared,
    beat_writer,
    delete_keys,
    pick_roles,
    raise_fd_limit,
    redis_server,
)
from bench.report import emit, log, median, wait_for_quiet  # noqa: E402
from kuangchao.platform.jobs import keys

BENCH = "heartbeats"
HANG_TIMEOUT_S = 5.0  # spec default is 300 s; shortened so hung ranks are caught in the run
POLL_S = 0.5  # JobController.poll_s
IDLE_S = 3.0  # Redis CPU measured idle, for reference (stderr)
SEGMENTS = 3  # alternating windows of our scan and the naive one
MIN_RATE = 0.95  # achieved beats/s below this share of the nominal rate fails the run


class GcPauses:
    """Collector pauses in this process (full collections, and all of them), seconds."""

    def __init__(self) -> None:
        self.gen2: list[float] = []
        self.total = 0.0
        self._t = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        took = time.perf_counter() - self._t
        self.total += took
        if info["generation"] == 2:
            self.gen2.append(took)

    def reset(self) -> None:
        self.gen2, self.total = [], 0.0


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def redis_cpu(client: redis.Redis) -> float:
    """Redis's CPU seconds so far (user + sys, all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# -- the controller ----------------------------------------------------------------

def naive_read(client: redis.Redis, prefix: str, ranks: list[int]) -> dict[int, Beat | None]:
    """What a straightforward controller does: one GET per rank, one round trip each."""
    out: dict[int, Beat | None] = {}
    for r in ranks:
        raw = client.get(keys.beat(prefix, JOB, r))
        out[r] = Beat.decode(r, raw) if raw is not None else None
    return out


def poll_loop(scan: Callable[[], list[Verdict]], seconds: float, min_scans: int = 1,
              on_verdicts: Callable[[list[Verdict]], None] | None = None,
              check: Callable[[], None] | None = None) -> list[float]:
    """Scan every POLL_S (back to back when a scan takes longer) for `seconds`
    and at least `min_scans` scans; returns each scan's duration in seconds."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(times) < min_scans:
        t = time.perf_counter()
        verdicts = scan()
        times.append(time.perf_counter() - t)
        if on_verdicts is not None:
            on_verdicts(verdicts)
        if check is not None:
            check()
        time.sleep(max(0.0, POLL_S - (time.perf_counter() - t)))
    return times


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + sys) a live process has used, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Load:
    """Redis CPU and beats over one measured window."""

    wall_s: float
    redis_cpu_s: float
    beats: int
    commands: int
    writers_cpu_s: float = 0.0
    controller_cpu_s: float = 0.0

    @property
    def cores(self) -> float:
        return self.redis_cpu_s / self.wall_s

    @property
    def beat_rate(self) -> float:
        return self.beats / self.wall_s


@contextmanager
def measure(client: redis.Redis, sent: mp.Array, writer_pids: list[int]) -> Iterator[list[Load]]:
    """Yields a list that holds the window's Load once the block is done."""
    out: list[Load] = []

    def writers_cpu() -> float:
        return sum(proc_cpu_s(pid) for pid in writer_pids)

    t, cpu, wcpu, ccpu = time.monotonic(), redis_cpu(client), writers_cpu(), time.process_time()
    beats, cmds = sum(sent), int(client.info("stats")["total_commands_processed"])
    yield out
    out.append(Load(time.monotonic() - t, redis_cpu(client) - cpu, sum(sent) - beats,
                    int(client.info("stats")["total_commands_processed"]) - cmds,
                    writers_cpu() - wcpu, time.process_time() - ccpu))



def combined(windows: list[Load]) -> Load:
    """Several measured windows as one (sums of seconds, CPU, beats and commands)."""
    return Load(sum(w.wall_s for w in windows), sum(w.redis_cpu_s for w in windows),
                sum(w.beats for w in windows), sum(w.commands for w in windows),
                sum(w.writers_cpu_s for w in windows), sum(w.controller_cpu_s for w in windows))


def check_verdicts(first: dict[int, Verdict], final: list[Verdict], roles: dict[int, int]) -> bool:
    """Did the classifier flag exactly the dead (expired) and hung (hung) ranks?"""
    want = {r: "expired" if role == DEAD else "hung" for r, role in roles.items()
            if role in (DEAD, HUNG)}
    got_ever = {r: v.kind for r, v in first.items()}
    got_final = {v.rank: v.kind for v in final}
    for r in sorted(want):
        v = first.get(r)
        log(f"  rank {r}: {v.kind} after {v.detected_after_s:.1f}s" if v else f"  rank {r}: not flagged")
    ok = got_ever == want and got_final == want
    if not ok:
        def differ(got: dict[int, str]) -> str:
            missed = {r: k for r, k in want.items() if got.get(r) != k}
            extra = sorted(r for r in got if r not in want)
            return f"missed {missed or 'none'}, {len(extra)} others flagged {extra[:10]}"

        log(f"CLASSIFIER CHECK FAILED: expected {want}; over the run: {differ(got_ever)}; "
            f"in the last scan: {differ(got_final)}")
    else:
        log(f"classifier flagged exactly the {len(want)} dead/hung ranks; "
            f"slow-start ranks {sorted(r for r, x in roles.items() if x == SLOW_INIT)} untouched")
    return ok


# -- the run -------------------------------------------------------------------------

def run(ranks: int, seconds: float, writers: int, connections: int) -> int:
    fds = raise_fd_limit()
    # The benchmark's import-time heap would make
    # every full collection during a scan walk ~200k objects the controller
    # does not have; freeze it so GC pauses come from the scan's own garbage.
    gc.collect()
    gc.freeze()
    pauses = GcPauses()
    if connections > fds - 256:
        log(f"open-file limit {fds}: {connections} connections cut to {fds - 256}")
        connections = fds - 256
    ctx = mp.get_context("fork")
    prefix = f"kcbench-{random.randbytes(4).hex()}:"
    roles = pick_roles(ranks)
    all_ranks = list(range(ranks))
    with redis_server(maxclients=connections + 64) as (url, private):
        ctl = redis_client.connect(url)  # the controller's client: decode_responses=True
        stats = redis.Redis.from_url(url)
        job_keys = JobStore(ctl, prefix)  # the worker's names for the job's flags and progress
        flag_keys = [keys.preempt(job_keys.p, JOB), keys.cancel(job_keys.p, JOB)]
        if not private:  # leave room for the shared server's other clients
            try:
                maxclients = int(next(iter(stats.config_get("maxclients").values()), 10000))
            except redis.ResponseError:  # CONFIG may be disabled on a shared server
                maxclients = 10000
            room = maxclients - int(stats.info("clients")["connected_clients"]) - 200
            if connections > room:
                log(f"shared Redis has room for {room} connections; using that many")
                connections = max(writers, room)
        log(f"{ranks} ranks at 1 Hz from {writers} writer processes over {connections} connections; "
            f"controller scan every {POLL_S}s; {seconds:.0f}s steady state")
        host, port = urlparse(url).hostname or "127.0.0.1", urlparse(url).port or 6379
        shared = WriterShared(ready=ctx.Queue(), go=ctx.Event(), stop=ctx.Event(),
                              t_start=ctx.Value("d", 0.0, lock=False),
                              sent=ctx.Array("q", writers, lock=False),
                              lag=ctx.Array("d", writers, lock=False),
                              skipped=ctx.Array("q", writers, lock=False))
        procs = []
        try:
            wait_for_quiet(timeout_s=10)
            with measure(stats, shared.sent, []) as idle:
                time.sleep(IDLE_S)
            for w in range(writers):
                lo, hi = w * ranks // writers, (w + 1) * ranks // writers
                conns = max(1, (w + 1) * connections // writers - w * connections // writers)
                cfg = WriterConfig(w, all_ranks[lo:hi], roles, host, port, prefix, min(conns, hi - lo),
                                   flag_keys, keys.progress(job_keys.p, JOB))
                procs.append(ctx.Process(target=beat_writer, args=(cfg, shared), daemon=True))
                procs[-1].start()
            t = time.monotonic()
            for _ in procs:
                msg = shared.ready.get(timeout=60)
                if msg != "ok":
                    raise RuntimeError(msg)
            log(f"writers connected in {time.monotonic() - t:.1f}s; "
                f"{stats.info('clients')['connected_clients']} Redis clients")

            def writers_alive() -> None:
                dead = [p.pid for p in procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"writer processes {dead} died")

            shared.t_start.value = time.time()
            shared.go.set()
            clf = Classifier(all_ranks, HEARTBEAT_TIMEOUT_S, HANG_TIMEOUT_S)
            clf.start(time.monotonic())
            first: dict[int, Verdict] = {}
            final: list[Verdict] = []

            reads: list[float] = []  # read_beats alone, for the breakdown on stderr
            parsed: dict = {}  # kept between scans, as RankWatch does

            def ours() -> list[Verdict]:
                t = time.perf_counter()
                beats = read_beats(ctl, prefix, JOB, all_ranks, cache=parsed)
                reads.append(time.perf_counter() - t)
                return clf.observe(beats, time.monotonic(), time.time())

            def keep(verdicts: list[Verdict]) -> None:
                final[:] = verdicts
                for v in verdicts:
                    first.setdefault(v.rank, v)

            poll_loop(ours, WARMUP_S, on_verdicts=keep, check=writers_alive)
            # The two scans alternate, SEGMENTS times each, under the same beat load, so
            # drift (the writers' pace, the machine's other work) favours neither.
            ours_seg, naive_seg = seconds / SEGMENTS, max(5.0, seconds / SEGMENTS / 3)
            log(f"steady state: {SEGMENTS} x ({ours_seg:.1f}s of pipelined scans, "
                f"{naive_seg:.1f}s of per-rank GET scans)")
            reads.clear()
            pauses.reset()
            pids = [p.pid for p in procs if p.pid is not None]
            naive_clf = Classifier(all_ranks, HEARTBEAT_TIMEOUT_S, HANG_TIMEOUT_S)
            naive_clf.start(time.monotonic())
            steady, naive, ours_runs, naive_runs = [], [], [], []
            gc_gen2, gc_total = [], 0.0
            for _ in range(SEGMENTS):
                with measure(stats, shared.sent, pids) as window:
                    ours_runs.append(poll_loop(ours, ours_seg, on_verdicts=keep,
                                               check=writers_alive))
                steady += window
                gc_gen2 += pauses.gen2
                gc_total += pauses.total
                with measure(stats, shared.sent, pids) as window:
                    naive_runs.append(poll_loop(
                        lambda: naive_clf.observe(naive_read(ctl, prefix, all_ranks),
                                                  time.monotonic(), time.time()),
                        naive_seg, min_scans=3, check=writers_alive))
                naive += window
                pauses.reset()
            load_avg = os.getloadavg()[0]
            ok = check_verdicts(first, final, roles)
            lag, skipped = max(shared.lag), sum(shared.skipped)
        finally:
            shared.stop.set()
            shared.go.set()  # writers still waiting for the start must see the stop
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            if not private:
                delete_keys(url, prefix)

    (idle_load,) = idle
    steady_load, naive_load = combined(steady), combined(naive)
    ours_s = [t for run in ours_runs for t in run]
    naive_times = [t for run in naive_runs for t in run]
    nominal = ranks - sum(x == DEAD for x in roles.values())  # beats/s once the dead stopped
    p99_runs = [percentile(run, 99) * 1e3 for run in ours_runs]
    np99_runs = [percentile(run, 99) * 1e3 for run in naive_runs]
    p50, p99 = percentile(ours_s, 50) * 1e3, median(p99_runs)
    np50, np99 = percentile(naive_times, 50) * 1e3, median(np99_runs)
    log(f"scan p99 per segment: pipelined {', '.join(f'{x:.1f}' for x in p99_runs)} ms; "
        f"naive {', '.join(f'{x:.0f}' for x in np99_runs)} ms")
    log(f"pipelined scan: {len(ours_s)} scans, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"max {max(ours_s) * 1e3:.1f} ms (read_beats alone: p50 {percentile(reads, 50) * 1e3:.1f}, "
        f"p99 {percentile(reads, 99) * 1e3:.1f} ms; the rest is Classifier.observe)")
    log(f"GC in the controller during the steady state: {gc_total * 1e3:.0f} ms in all, "
        f"{len(gc_gen2)} full collections, longest {max(gc_gen2, default=0) * 1e3:.0f} ms")
    log(f"naive scan: {len(naive_times)} scans, p50 {np50:.0f} ms, p99 {np99:.0f} ms")
    log(f"beats: {steady_load.beat_rate:,.0f}/s achieved over {steady_load.wall_s:.1f}s "
        f"(nominal {nominal:,}/s), "
        f"Redis {steady_load.commands / steady_load.wall_s:,.0f} commands/s; "
        f"worst writer batch lateness {lag * 1e3:.0f} ms, {skipped} ticks skipped")
    log(f"Redis CPU: steady {steady_load.cores:.3f} cores, naive-scan phase {naive_load.cores:.3f} "
        f"cores ({naive_load.beat_rate:,.0f} beats/s), idle {idle_load.cores:.4f} cores")
    st = steady_load
    own = (st.redis_cpu_s + st.writers_cpu_s + st.controller_cpu_s) / st.wall_s
    log(f"CPU in steady state: writers {st.writers_cpu_s / st.wall_s:.2f}, controller "
        f"{st.controller_cpu_s / st.wall_s:.2f}, Redis {st.cores:.2f} cores: {own:.2f} of "
        f"{os.cpu_count()} CPUs; 1-min load average at its end {load_avg:.1f} (well above "
        f"{own:.1f} means other work shared the machine)")
    emit(BENCH, "heartbeat_scan_ms_p99", "ms", p99, np99, 100, better="lower", target_on="ours",
         spread={"ours": p99_runs, "baseline": np99_runs},
         settings="baseline: one GET per rank key (no pipelining), the same Beat.decode and "
                  "Classifier, alternating with ours under the same beat load")
    emit(BENCH, "redis_cpu_fraction", "cores", median([w.cores for w in steady]),
         median([w.cores for w in naive]), 0.5, better="lower", target_on="ours",
         spread={"ours": [w.cores for w in steady], "baseline": [w.cores for w in naive]})
    if steady_load.beat_rate < MIN_RATE * nominal:
        log(f"LOAD NOT REACHED: {steady_load.beat_rate:,.0f} beats/s < {MIN_RATE:.0%} of {nominal:,}")
        ok = False
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0,
                        help="steady-state seconds (>= 12, so dead ranks expire within them)")
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--connections", type=int, default=None,
                        help="Redis connections over all writers (default: one per rank)")
    parser.add_argument("--quick", action="store_true",
                        help="1,024 ranks, 2 writers, the shortest steady state: checks the "
                             "script works (about 25 s)")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.writers, args.seconds = 1024, 2, 12.0
    if args.seconds < 12:
        parser.error("--seconds must be at least 12: dead ranks expire 10 s after their last beat")
    if args.ranks < 16 or args.writers < 1:
        parser.error("need --ranks >= 16 and --writers >= 1")
    sys.exit(run(args.ranks, args.seconds, args.writers, args.connections or args.ranks))


if __name__ == "__main__":
    main()
