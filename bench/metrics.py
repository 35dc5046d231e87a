"""Worker metrics: what a rank's Prometheus instrumentation costs a training step.

  metrics_overhead   median step time of the built-in trainer (`workers/trainer/loop.py`
                     `train`) with the rank's `WorkerTelemetry` over the same run
                     without it (`telemetry=None`, what `KC_WORKER_METRICS=0`
                     gives). 2 gloo ranks on this machine, one torch thread each,
                     no Ray, no Redis. Instrumented: the trainer configures the
                     telemetry and calls begin_step/observe_numerics/end_step,
                     DDP's all-reduce goes through the timed comm hook, the
                     rank's own collectives are timed, and each rank serves its
                     /metrics on 127.0.0.1, scraped once a second (as Prometheus
                     does: gzip, OpenMetrics accepted) by a thread of this
                     process. Step time = the gap between rank 0's consecutive
                     `report` calls, median after WARMUP_STEPS; the two variants
                     alternate (instrumented first on even repeats), and the
                     medians over the repeats are reported. Target 1.02. A
                     scrape lands in about one step a second, which the median
                     skips; stderr also gives the ratio of mean step times.
  metrics_scrape_ms  one scrape of a rank's /metrics while it trains, against a
                     scrape of an empty prometheus_client registry served by the
                     same rank process at the same time (the HTTP floor). Both
                     come from one extra instrumented run, scraped alternately
                     every SCRAPE_GAP_S; medians. Informative, no target.

About 90 s on 2 cores. Step times move by ~3% (sd) from run to run here even
on a quiet machine, so with 5 repeats the ratio is good to about +-2-3%;
stderr says per run how many cores other processes kept busy meanwhile.

Run: .venv/bin/python bench/metrics.py [--repeats 5] [--steps 120]   (JSON lines on stdout)
"""

from __future__ import annotations

import argparse
import gzip
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.harness import emit, log, median, wait_for_quiet  # noqa: E402
from kuangchao.platform.runtime.procs import free_port  # noqa: E402
from kuangchao.platform.spec.jobspec import validate_spec  # noqa: E402
from kuangchao.workers.runtime.context import TrainContext  # noqa: E402

RANKS = 2
STEPS = 120
WARMUP_STEPS = 10
REPEATS = 5
SCRAPE_EVERY_S = 1.0  # Prometheus's usual interval for the overhead runs
SCRAPE_GAP_S = 0.05  # between scrapes (worker, empty, worker, ...) in the scrape run
JOB = "bench-metrics"
STEP_GAUGE = "kc_worker_step"  # set by end_step: the trainer did configure and drive the telemetry
# What Prometheus 2.x sends (scrape_protocols default); prometheus_client then
# answers in OpenMetrics, gzipped.
PROM_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
              "application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
}


def spec_doc(steps: int, ckpt: str) -> dict[str, Any]:
    """The tiny-gpt job: a step takes a few tens of ms on one CPU thread per rank."""
    return {
        "task": {"name": JOB},
        "model": {"type": "gpt", "n_layers": 2, "n_heads": 4, "d_model": 64, "seq_len": 64},
        "data": {"max_bytes": 300_000},
        "parallel": {"data_parallel_size": RANKS, "micro_batch_size": 16,
                     "gradient_accumulation_steps": 1},
        "optimizer": {"lr": 0.003, "warmup_steps": 10},
        "training": {"steps": steps, "seed": 1234, "log_interval": 10, "torch_threads": 1},
        # No periodic checkpoint; the trainer's final one comes after the last
        # report, so no timed step contains it.
        "checkpoint": {"interval_steps": steps + 1, "keep_last": 1, "path": ckpt},
    }


class _TimedContext(TrainContext):
    """A TrainContext that notes when each step is reported (the end of its optimizer step)."""

    stamps: list[float]

    def report(self, step: int, **metrics: Any) -> None:
        self.stamps.append(time.perf_counter())
        super().report(step, **metrics)


def _rank(rank: int, port: int, variant: str, steps: int, tmp: str, out: Any,
          release: Any) -> None:
    """One rank: join the gloo group, build the TrainContext as a worker does, train.

    `variant`: "on" (telemetry), "scrape" (telemetry and an empty registry beside it),
    "off" (no telemetry), or for bench/tokens.py, with no telemetry either,
    "unguarded" (the capability-token check skipped: every `permit` allowed
    unasked) and "counted" (the check made, and counted)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from kuangchao.platform.security.tokens import Minter, Scope, generate_key
    from kuangchao.workers import collectives
    from kuangchao.workers.checkpoint.manager import CheckpointManager
    from kuangchao.workers.runtime.joblog import JobLogSink
    from kuangchao.workers.runtime.telemetry import WorkerTelemetry
    from kuangchao.workers.trainer.loop import train

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spec = validate_spec(spec_doc(steps, tmp))
    torch.set_num_threads(spec.training.torch_threads)
    store = dist.TCPStore("127.0.0.1", port, RANKS, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    # The trainer's own collectives ask the capability token, as in a real rank.
    _, claims = Minter(generate_key()).mint(
        f"{JOB}/rank-{rank}", JOB, "trainer",
        Scope(devices=(), groups=("world",), checkpoint_prefix=tmp, redis_prefix=""),
        spec.permission.collectives, 3600)
    collectives.set_token(claims)
    calls = [0]
    if variant == "unguarded":
        collectives._guard.allow = lambda interface, group: None  # type: ignore[method-assign]
    elif variant == "counted":
        allow = collectives._guard.allow

        def counted(interface: str, group: str) -> None:
            calls[0] += 1
            allow(interface, group)
        collectives._guard.allow = counted  # type: ignore[method-assign]

    tel: WorkerTelemetry | None = None
    addrs: dict[str, str] = {}
    empty = None
    if variant in ("on", "scrape"):
        tel = WorkerTelemetry(JOB, rank, "bench")
        addrs["worker"] = tel.serve("127.0.0.1")
    if variant == "scrape":  # the floor: an empty registry, same process, same HTTP server
        empty, _ = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
        addrs["empty"] = f"127.0.0.1:{empty.server_port}"
    out.put(("ready", rank, addrs))

    sink = JobLogSink(None, JOB, rank)
    rng = spec.elastic_range
    ckpt = CheckpointManager(tmp, JOB, rank, RANKS, spec.spec_hash(), spec.checkpoint.keep_last)
    ctx = _TimedContext(job_id=JOB, rank=rank, world_size=RANKS, local_rank=0, spec=spec,
                        device=torch.device("cpu"), checkpoint=ckpt, sink=sink, store=None,
                        dp_rank=rank, dp_size=RANKS, heartbeat=None, started_at=time.time(),
                        accum_steps=rng.accumulation(RANKS // rng.ranks_per_replica),
                        telemetry=tel)
    ctx.stamps = []
    train(ctx)
    if rank == 0:
        if variant == "counted":
            out.put(("guard_calls", rank, calls[0]))
        out.put(("steps", rank, ctx.stamps))
    # A rank that finishes first must not close its endpoint under the scraper,
    # which stops only once rank 0's stamps arrive: wait to be released.
    release.wait(120)
    if tel is not None:
        tel.close()
    if empty is not None:
        empty.shutdown()
        empty.server_close()
    sink.close()
    dist.destroy_process_group()


def scrape_once(addr: str) -> tuple[float, bytes]:
    """One Prometheus-like GET of http://addr/metrics: its seconds, and the (gzipped) body."""
    req = urllib.request.Request(f"http://{addr}/metrics", headers=PROM_HEADERS)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"scrape of {addr} answered {resp.status}")
    return time.perf_counter() - t0, body


class Scraper(threading.Thread):
    """Scrapes each target in turn, `gap_s` apart, until stopped; keeps the times per kind."""

    def __init__(self, targets: list[tuple[str, str]], gap_s: float) -> None:
        super().__init__(daemon=True, name="bench-scraper")
        self.targets, self.gap_s = targets, gap_s
        self.times: dict[str, list[float]] = {kind: [] for kind, _ in targets}
        self.last: dict[str, bytes] = {}  # the latest body by kind
        self.stop = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        i = 0
        while not self.stop.wait(self.gap_s):
            kind, addr = self.targets[i % len(self.targets)]
            i += 1
            try:
                took, self.last[kind] = scrape_once(addr)
                self.times[kind].append(took)
            except Exception as exc:  # noqa: BLE001 -- reported by the main thread
                self.error = exc
                return

    def check(self) -> None:
        """Fail unless every scrape answered and the worker endpoint served the trainer's gauges."""
        if self.error is not None:
            raise RuntimeError(f"scrape failed: {self.error}")
        body = self.last.get("worker")
        if body is not None:
            text = gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body
            if STEP_GAUGE.encode() not in text:
                raise RuntimeError(f"the worker endpoint served no {STEP_GAUGE}: {text[:300]!r}")


def _machine_busy_s() -> float:
    """CPU seconds every process on this machine has used since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _own_busy_s() -> float:
    """CPU seconds of this process and its children that have been waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def one_run(variant: str, steps: int, extras: dict[str, Any] | None = None,
            ) -> tuple[list[float], dict[str, list[float]], float]:
    """Train once with `variant` (see `_rank`); what rank 0 reports beside its
    step stamps (the guard's call count) goes into `extras`.

    Returns rank 0's report stamps, the scrape times by kind, and how many
    cores other processes on the machine kept busy meanwhile (on a shared
    machine they, not the metrics, are what moves step times most).
    """
    t0, machine0, own0 = time.monotonic(), _machine_busy_s(), _own_busy_s()
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="kcbench-metrics-")
    port = free_port()
    release = ctx.Event()  # set once scraping has stopped: the ranks may close their endpoints
    procs = [ctx.Process(target=_rank, args=(r, port, variant, steps, tmp, out, release))
             for r in range(RANKS)]
    scraper: Scraper | None = None
    try:
        for p in procs:
            p.start()
        ready: dict[int, dict[str, str]] = {}
        stamps: list[float] | None = None
        while stamps is None:
            try:
                kind, rank, payload = out.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with {dead[0]} ({variant} run)") from None
                continue
            if kind == "ready":
                ready[rank] = payload
                if len(ready) == RANKS and variant in ("on", "scrape"):
                    if variant == "on":  # each rank's endpoint once a second, as Prometheus
                        targets = [("worker", ready[r]["worker"]) for r in range(RANKS)]
                        gap = SCRAPE_EVERY_S / len(targets)
                    else:
                        targets = [(k, ready[r][k]) for r in range(RANKS)
                                   for k in ("worker", "empty")]
                        gap = SCRAPE_GAP_S
                    scraper = Scraper(targets, gap)
                    scraper.start()
            elif kind == "steps":
                stamps = payload
            elif extras is not None:
                extras[kind] = payload
        if scraper is not None:
            scraper.stop.set()
            scraper.join()
        release.set()
        if scraper is not None:
            scraper.check()
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with {p.exitcode} ({variant} run)")
        others = (_machine_busy_s() - machine0) - (_own_busy_s() - own0)
        return stamps, (scraper.times if scraper is not None else {}), \
            max(0.0, others) / (time.monotonic() - t0)
    finally:
        if scraper is not None:
            scraper.stop.set()
        release.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)


def step_times(stamps: list[float]) -> tuple[float, float]:
    """Median and mean gap between consecutive reports from step WARMUP_STEPS on.

    The median is the metric. A scrape lands in about one step a second, so the
    median all but ignores what it costs; the mean (stderr only) counts it,
    along with everything else that lengthens a step now and then.
    """
    steady = stamps[WARMUP_STEPS:]
    gaps = [b - a for a, b in zip(steady, steady[1:], strict=False)]
    return median(gaps), sum(gaps) / len(gaps)


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.2f}..{max(xs) * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--quick", action="store_true",
                    help="one short run of each variant: checks the script works (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, WARMUP_STEPS + 6
    if args.steps < WARMUP_STEPS + 3:
        ap.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    t0 = time.monotonic()
    times: dict[str, list[float]] = {"on": [], "off": []}
    means: dict[str, list[float]] = {"on": [], "off": []}
    scrapes: list[float] = []
    for i in range(args.repeats):
        # Alternate who goes first so drift and warm caches favour neither side.
        for variant in ("on", "off") if i % 2 == 0 else ("off", "on"):
            wait_for_quiet()
            stamps, scraped, others = one_run(variant, args.steps)
            med, mean = step_times(stamps)
            times[variant].append(med)
            means[variant].append(mean)
            scrapes += scraped.get("worker", [])
            log(f"repeat {i} metrics {variant:3s}: step median {med * 1e3:.2f} ms, "
                f"mean {mean * 1e3:.2f} ms"
                + (f", {len(scraped['worker'])} scrapes" if scraped else "")
                + f"; other processes busy {others:.2f} cores")
    ours, base = median(times["on"]), median(times["off"])
    log(f"step time with metrics {ours * 1e3:.2f} ms ({spread(times['on'])}), "
        f"without {base * 1e3:.2f} ms ({spread(times['off'])}) over {args.repeats} repeats")
    mean_on, mean_off = median(means["on"]), median(means["off"])
    log(f"mean step time (scrapes included): with {mean_on * 1e3:.2f} ms, without "
        f"{mean_off * 1e3:.2f} ms, ratio {mean_on / mean_off:.4f}")
    if scrapes:
        log(f"scrapes during the overhead runs: {len(scrapes)}, median "
            f"{median(scrapes) * 1e3:.2f} ms, max {max(scrapes) * 1e3:.2f} ms")
    emit("metrics", "metrics_overhead", "s", ours, base, 1.02, better="lower", target_on="ratio",
         spread={"ours": times["on"], "baseline": times["off"]})

    wait_for_quiet()
    _, scraped, others = one_run("scrape", args.steps)
    worker, floor = scraped.get("worker", []), scraped.get("empty", [])
    if worker and floor:
        log(f"scrape run: {len(worker)} worker scrapes ({spread(worker)}), "
            f"{len(floor)} empty-registry scrapes ({spread(floor)}); other processes busy "
            f"{others:.2f} cores")
        emit("metrics", "metrics_scrape_ms", "ms", median(worker) * 1e3, median(floor) * 1e3,
             None, better="lower", target_on="ratio")
    else:
        log("scrape run too short for a scrape of each kind; metrics_scrape_ms not reported")
    log(f"total wall time {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
