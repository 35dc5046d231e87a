"""Planner: how well its cost model predicts a step here, and how fast it searches.

  planner_step_time_error  median relative error |predicted - measured| / measured
                           of `evaluate(...).predicted_step_s` against the step
                           time of the built-in trainer (`workers/trainer/loop.py`
                           `train`), measured on this machine's CPU as
                           bench/metrics.py measures it: gloo ranks on 127.0.0.1
                           spawned with torch.multiprocessing, a TrainContext
                           built directly (no Ray, no Redis), one torch thread
                           per rank, step time = the gap between rank 0's
                           consecutive `report` calls, median after the warm-up.
                           The layouts: DDP over gloo with dp in {1, 2} x
                           micro_batch in {4, 8, 16} on GPT "A" (4 layers,
                           d_model 256, seq 128, 3.2M parameters) plus dp in
                           {1, 2} at micro_batch 8 on GPT "B" (2 layers, d_model
                           384, 3.7M parameters: wider GEMMs, half the depth),
                           and four on two ranks beyond plain DDP, on "A": tp 2,
                           a 2-stage 1F1B pipeline with 4 micro-batches of 4,
                           ZeRO-1 and ZeRO-2 (FSDP2) at dp 2.
                           Target: `ours` <= 0.2 (absolute; the ratio is
                           informative).
  planner_search_ms        wall time of `plan()` for a 175B GPT
                           (`ModelShape.from_param_count(175e9, 2048, 51200)`)
                           on 4,096 h100-80gb (8 per node), global batch 1,536;
                           median of SEARCH_REPEATS. Baseline: the exhaustive
                           search without the planner's pruning (it skips a
                           (tp, pp, ZeRO) whose static memory cannot fit and
                           stops growing the micro-batch at the first one that
                           does not): `evaluate()` on every (tp, pp,
                           micro_batch, ZeRO, recompute, schedule,
                           virtual_stages, HSDP group) that `plan()` would
                           enumerate (3,796 of them), timed
                           the same way, interleaved with `plan()`. Target:
                           `ours` <= 1000 ms (the issue's "a second or less";
                           the ratio is informative).

Calibration, all measured in the same run, on this machine:

  (a) peak_flops: fp32 `torch.mm` with one thread on the calibration model's
      forward GEMM shapes at the calibration micro-batch (tokens x d_model into
      d_model, 4 d_model and vocab, 4 d_model into d_model): their total FLOPs
      over their total time.
  (b) latency and bandwidth: the median time of a gloo `all_reduce` between 2
      processes on 127.0.0.1 of one float (the per-call latency, handed to
      `calibrated()` as `base_latency_s`, with no per-hop term: 2 ranks) and of
      each model's float32 gradients (one buffer of `params` floats, what DDP's
      buckets add up to). The planner counts gradients in fp32 as the engine
      sends them, so the bus bandwidth is 4 * params over the time beyond the
      latency (for 2 ranks the ring term 2(n-1)/n is 1): the predicted
      all-reduce then takes exactly the measured time.
  (c) efficiency (`mfu_ceiling`), the one free parameter, fitted on ONE layout
      (CALIBRATION: A, dp 1, micro_batch 8) so that the prediction there equals
      the measurement (no communication at dp 1, so it is closed form). The
      planner has no fixed per-step overhead term (Python, the optimizer, the
      data loader), so nothing else is fitted. The calibration layout is left
      out of the median.

Baseline of planner_step_time_error: the naive predictor "step time
proportional to training FLOPs per rank" (`flops_per_token(False)` x tokens
per rank, so tokens per rank within one model), scaled from the same
calibration layout's measured time: no communication term, no size-dependent
GEMM efficiency. Stderr also gives the error of "FLOPs / measured matmul peak"
(no fitted efficiency at all).

Last runs (2 cores shared with other work; stderr has the busy fraction
before each layout). With the cost model that prices the engine's collectives
(issue 24): error 14.7% against 23.4% for the naive predictor over 11 layouts,
load 2 at the start rising to 8, several layouts measured on a busy machine;
the worst are tp 2 (79% under) and the layouts measured busiest. An earlier
run at load 13 gave nonsense (its calibration layout took 5x its quiet time).
plan() 38 ms against 163 ms for the 3,796 layouts without pruning (HSDP's
sharding groups tripled the ZeRO 2/3 layouts). The previous model's run on a
quiet machine: 5.8% against 8.3%.

About 3 to 6 minutes on a 2-core machine. Every measurement waits briefly
for the CPUs to go quiet; stderr notes the load average at the start and end.

--quick (the bench tests run it): the calibration layout (A, dp 1, micro-batch
2, in this process) and A at dp 2, 13 steps each, 5 all-reduce repeats, one
search repeat, no waiting for quiet CPUs. 38-50 s on the loaded 2-core box,
mostly the two-process start-ups; its error is informative only.

Run: .venv/bin/python bench/planner.py [--quick] [--steps 30] [--search-repeats 10]   (JSON lines on stdout)
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.harness import emit, log, median, wait_for_quiet  # noqa: E402
from bench.metrics import WARMUP_STEPS, _TimedContext, spec_doc, step_times  # noqa: E402
from kuangchao.platform.cluster.hardware import CATALOG, Accelerator, calibrated  # noqa: E402
from kuangchao.platform.planning.planner import (  # noqa: E402
    SCHEDULES,
    _hsdp_options,
    _schedules,
    _tp_options,
    evaluate,
    plan,
)
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape  # noqa: E402
from kuangchao.platform.runtime.procs import free_port  # noqa: E402
from kuangchao.platform.spec.jobspec import validate_spec  # noqa: E402
from kuangchao.workers.parallel.layout import Layout as Layout3D  # noqa: E402

JOB = "bench-planner"
STEPS = 30  # WARMUP_STEPS (bench/metrics.py) skipped, then the gaps of 20 reports
MODELS: dict[str, dict[str, Any]] = {
    "A": {"type": "gpt", "n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 128, "vocab_size": 256},
    "B": {"type": "gpt", "n_layers": 2, "d_model": 384, "n_heads": 6, "seq_len": 128, "vocab_size": 256},
}
# (model, dp, micro_batch, tp, pp, accumulation, zero stage)
Layout = tuple[str, int, int, int, int, int, int]
CALIBRATION: Layout = ("A", 1, 8, 1, 1, 1, 0)
LAYOUTS: list[Layout] = [
    CALIBRATION, ("A", 1, 4, 1, 1, 1, 0), ("A", 1, 16, 1, 1, 1, 0), ("A", 2, 4, 1, 1, 1, 0),
    ("A", 2, 8, 1, 1, 1, 0), ("A", 2, 16, 1, 1, 1, 0), ("B", 1, 8, 1, 1, 1, 0),
    ("B", 2, 8, 1, 1, 1, 0),
    # Beyond plain DDP, two ranks each: TP, a 1F1B pipeline, ZeRO-1, ZeRO-2 (FSDP2).
    ("A", 1, 8, 2, 1, 1, 0), ("A", 1, 4, 1, 2, 4, 0), ("A", 2, 8, 1, 1, 1, 1),
    ("A", 2, 8, 1, 1, 1, 2)]


def name_of(layout: Layout) -> str:
    m, dp, mb, tp, pp, accum, zero = layout
    extra = (f" tp={tp}" if tp > 1 else "") + (f" pp={pp}x{accum}" if pp > 1 else "") + \
        (f" zero{zero}" if zero else "")
    return f"{m} dp={dp} mb={mb}{extra}"
ALLREDUCE_REPS = 20
SEARCH_REPEATS = 10
# --quick: the calibration layout and one two-rank layout, so both sides of the line exist.
# The first is the calibration layout; micro-batch 2 keeps each step short.
QUICK_LAYOUTS: list[Layout] = [("A", 1, 2, 1, 1, 1, 0), ("A", 2, 2, 1, 1, 1, 0)]
QUICK_ALLREDUCE_REPS = 5
TARGET_ERROR = 0.2
TARGET_SEARCH_MS = 1000


# -- processes -------------------------------------------------------------

def _spawn(world: int, target: Any, *args: Any, what: str) -> Any:
    """Run `target(rank, world, port, *args, out)` in `world` spawned processes;
    returns what rank 0 puts on `out` (the others put nothing)."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        while True:
            try:
                result = out.get(timeout=5)
                break
            except queue.Empty:
                if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                    raise RuntimeError(f"a rank of {what} exited with {dead[0]}") from None
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank of {what} exited with {p.exitcode}")
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _group(rank: int, world: int, port: int) -> None:
    """Join the gloo group on 127.0.0.1 (no-op for one process: the trainer skips DDP)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _allreduce_rank(rank: int, world: int, port: int, sizes: list[int], reps: int, out: Any) -> None:
    """Median seconds of an all_reduce of `n` float32 values, for each n in `sizes`."""
    _group(rank, world, port)
    times = []
    for n in sizes:
        t = torch.ones(n)
        for _ in range(3):  # warm-up: connections, buffers
            dist.all_reduce(t)
        samples = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - t0)
        times.append(median(samples))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _train_rank(rank: int, world: int, port: int, doc: dict[str, Any], out: Any) -> None:
    """One rank of the built-in trainer, its TrainContext built as a worker builds it."""
    from kuangchao.platform.security.tokens import Minter, Scope, generate_key
    from kuangchao.workers import collectives
    from kuangchao.workers.checkpoint.manager import CheckpointManager
    from kuangchao.workers.runtime.joblog import JobLogSink
    from kuangchao.workers.trainer.loop import train

    _group(rank, world, port)
    spec = validate_spec(doc)
    path = doc["checkpoint"]["path"]
    if world > 1:  # the trainer's own collectives (the loss mean) ask the capability token
        scope = Scope(devices=(), groups=("world",), checkpoint_prefix=path, redis_prefix="")
        collectives.set_token(Minter(generate_key()).mint(
            f"{JOB}/rank-{rank}", JOB, "trainer", scope, spec.permission.collectives, 3600)[1])
    if world == 1:  # DCP's final save without a process group says so on every run
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sink = JobLogSink(None, JOB, rank)
    ckpt = CheckpointManager(path, JOB, rank, world, spec.spec_hash(), spec.checkpoint.keep_last)
    layout = Layout3D.of(spec.parallel, world)
    ctx = _TimedContext(job_id=JOB, rank=rank, world_size=world, local_rank=0, spec=spec,
                        device=torch.device("cpu"), checkpoint=ckpt, sink=sink,
                        dp_rank=layout.coords(rank).dp, dp_size=layout.dp,
                        accum_steps=spec.parallel.gradient_accumulation_steps)
    ctx.stamps = []
    train(ctx)
    if rank == 0:
        out.put(ctx.stamps)
    sink.close()
    if world > 1:
        dist.destroy_process_group()


class _Box:
    """A one-slot stand-in for the result queue when a single rank runs in this process."""

    def put(self, value: Any) -> None:
        self.value = value


def measure_step(layout: Layout, steps: int, in_process: bool = False) -> float:
    """Median step time of the built-in trainer for one layout; `in_process` runs a
    one-rank layout here instead of in a spawned process (--quick: no start-up)."""
    model, dp, mb, tp, pp, accum, zero = layout
    tmp = tempfile.mkdtemp(prefix="kcbench-planner-")
    try:
        doc = spec_doc(steps, tmp)
        doc["task"]["name"] = JOB
        doc["model"] = dict(MODELS[model])
        doc["parallel"] = {"data_parallel_size": dp, "micro_batch_size": mb,
                           "gradient_accumulation_steps": accum, "tensor_parallel_size": tp,
                           "pipeline_parallel_size": pp, "zero_stage": zero}
        doc.pop("permission", None)  # the layout's default collectives
        world, doc = dp * tp * pp, validate_spec(doc).model_dump(mode="json")
        if in_process and world == 1:
            box = _Box()
            _train_rank(0, 1, 0, doc, box)
            stamps = box.value
        else:
            stamps = _spawn(world, _train_rank, doc, what=name_of(layout))
        return step_times(stamps)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- calibration -----------------------------------------------------------

def matmul_flops(shape: ModelShape, tokens: int, reps: int = 5) -> float:
    """FLOP/s of one-thread fp32 torch.mm over the model's forward GEMM shapes."""
    torch.set_num_threads(1)
    h, f, v = shape.d_model, shape.ffn, shape.vocab_size
    flops = secs = 0.0
    for k, n in ((h, h), (h, f), (f, h), (h, v)):
        a, b = torch.randn(tokens, k), torch.randn(k, n)
        inner = max(3, int(5e8 / (2 * tokens * k * n)))  # ~0.5 GFLOP a sample
        for _ in range(3):
            torch.mm(a, b)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            samples.append((time.perf_counter() - t0) / inner)
        flops += 2 * tokens * k * n
        secs += median(samples)
    return flops / secs


def shape_of(model: str) -> ModelShape:
    return ModelShape.from_spec_model(MODELS[model])


def predict(acc: Accelerator, layout: Layout) -> float:
    model, dp, mb, tp, pp, accum, zero = layout
    return evaluate(shape_of(model), ClusterShape(gpus=dp * tp * pp, gpus_per_node=2), acc,
                    dp * mb * accum, tp=tp, pp=pp, micro_batch=mb, zero_stage=zero,
                    recompute=False).predicted_step_s


def rank_flops(layout: Layout) -> float:
    """Training FLOPs one rank computes per step (its share of the model and batch)."""
    model, _, mb, tp, pp, accum, _ = layout
    s = shape_of(model)
    return s.flops_per_token(False) * mb * accum * s.seq_len / (tp * pp)


def step_time_error(steps: int, layouts: list[Layout], allreduce_reps: int, quick: bool = False) -> None:
    """The `planner_step_time_error` line; the first of `layouts` is the calibration layout."""
    cal = layouts[0]
    log(f"load average at start: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    t0 = time.monotonic()
    cal_model, cal_mb = cal[0], cal[2]
    wait_for_quiet(timeout_s=10)
    peak = matmul_flops(shape_of(cal_model), cal_mb * shape_of(cal_model).seq_len)
    log(f"(a) fp32 matmul, 1 thread, model {cal_model}'s GEMMs at {cal_mb} x "
        f"{shape_of(cal_model).seq_len} tokens: {peak / 1e9:.1f} GFLOP/s")
    names = sorted({layout[0] for layout in layouts})
    wait_for_quiet(timeout_s=10)
    # (b) one all-reduce of a single float gives the per-call latency; each model's
    # gradients, the bandwidth over what is left.
    small, *big = _spawn(2, _allreduce_rank, [1] + [shape_of(m).params for m in names],
                         allreduce_reps, what="all_reduce")
    ar = dict(zip(names, big, strict=True))
    log(f"(b) gloo all_reduce of one float between 2 processes: {small * 1e6:.0f} us (the "
        "per-call latency handed to calibrated())")
    accs: dict[str, Accelerator] = {}
    for m in names:
        p = shape_of(m).params
        bw = 4 * p / max(ar[m] - small, 1e-9)  # fp32 gradients, as the planner now counts them
        log(f"(b) model {m}: {p:,} parameters, gloo all_reduce of {4 * p / 1e6:.1f} MB fp32 "
            f"between 2 processes: {ar[m] * 1e3:.2f} ms (bus {bw / 1e9:.2f} GB/s after the latency)")
        accs[m] = calibrated(CATALOG["cpu"], peak_flops=peak, nvlink_bytes_per_s=bw,
                             internode_bytes_per_s=bw, efficiency=1.0, base_latency_s=small,
                             hop_latency_s=0.0, net_hop_latency_s=0.0)

    measured: dict[Layout, float] = {}
    for layout in layouts:
        busy = wait_for_quiet(timeout_s=10)
        measured[layout] = measure_step(layout, steps, in_process=quick)
        log(f"measured {name_of(layout)}: {measured[layout] * 1e3:.1f} ms "
            f"(CPUs {busy:.0%} busy before)")

    # (c) the one free parameter: efficiency, so that the calibration layout is exact.
    at_one = predict(accs[cal_model], cal)
    eff = at_one / measured[cal]
    if not 0 < eff <= 1:
        log(f"fitted efficiency {eff:.3f} is outside (0, 1]; clamped")
        eff = min(1.0, max(eff, 1e-6))
    log(f"(c) efficiency fitted on {name_of(cal)}: {eff:.3f}")
    accs = {m: calibrated(a, efficiency=eff) for m, a in accs.items()}

    log(f"{'layout':<28}{'measured s':>12}{'predicted s':>13}{'error':>8}"
        f"{'naive s':>10}{'naive err':>11}{'flops/peak err':>16}")
    ours, naive, raw = [], [], []
    for layout in layouts:
        m = layout[0]
        meas, pred = measured[layout], predict(accs[m], layout)
        base = measured[cal] * rank_flops(layout) / rank_flops(cal)
        ideal = rank_flops(layout) / peak  # training FLOPs of one rank over the matmul rate
        errs = [abs(x - meas) / meas for x in (pred, base, ideal)]
        mark = " (calibration)" if layout == cal else ""
        log(f"{name_of(layout):<28}{meas:>12.4f}{pred:>13.4f}{errs[0]:>8.1%}{base:>10.4f}"
            f"{errs[1]:>11.1%}{errs[2]:>16.1%}{mark}")
        if layout != cal:
            ours.append(errs[0])
            naive.append(errs[1])
            raw.append(errs[2])
    log(f"median error over {len(ours)} layouts: planner {median(ours):.1%}, naive {median(naive):.1%}, "
        f"FLOPs / matmul peak {median(raw):.1%}; max planner {max(ours):.1%}")
    log(f"load average at end: {os.getloadavg()[0]:.2f}; step-time part took {time.monotonic() - t0:.0f}s")
    emit("planner", "planner_step_time_error", "fraction", median(ours), median(naive), TARGET_ERROR,
         better="lower", target_on="ours")


# -- search ------------------------------------------------------------------

def layouts(model: ModelShape, cluster: ClusterShape, gb: int) -> Iterator[tuple[Any, ...]]:
    """(tp, pp, micro_batch, zero, recompute, schedule, v, shard) for every layout `plan()`
    enumerates, before its memory pruning; the interleaved schedule still needs
    micro-batches % pp == 0, and HSDP's sharding groups go with ZeRO 2 and 3."""
    stages = [p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0]
    for tp, pp in itertools.product(_tp_options(model, cluster), stages):
        dp, rest = divmod(cluster.gpus, tp * pp)
        if rest or gb % dp:
            continue
        zeros = (0,) if dp == 1 else (0, 1, 2, 3)
        mbs = [b for b in (1 << i for i in range(gb.bit_length())) if gb % (dp * b) == 0]
        hsdp = [None, *_hsdp_options(dp, tp, pp, cluster.node_size)]
        for zero, rec, (sched, v), b in itertools.product(zeros, (False, True),
                                                          _schedules(model, pp, SCHEDULES), mbs):
            if sched != "interleaved_1f1b" or (gb // (dp * b)) % pp == 0:
                for shard in (hsdp if zero >= 2 else [None]):
                    yield tp, pp, b, zero, rec, sched, v, shard


def exhaustive(model: ModelShape, cluster: ClusterShape, acc: Accelerator, gb: int) -> int:
    """`evaluate()` on every layout, pruning nothing; returns how many."""
    n = 0
    for tp, pp, b, zero, rec, sched, v, shard in layouts(model, cluster, gb):
        evaluate(model, cluster, acc, gb, tp=tp, pp=pp, micro_batch=b, zero_stage=zero,
                 recompute=rec, schedule=sched, virtual_stages=v, shard_group_size=shard)
        n += 1
    return n


def search_ms(repeats: int) -> None:
    model = ModelShape.from_param_count(175e9, 2048, 51200)
    cluster, acc, gb = ClusterShape(gpus=4096, gpus_per_node=8), CATALOG["h100-80gb"], 1536
    ours, base = [], []
    plans, n = plan(model, cluster, acc, gb), 0
    for _ in range(repeats):  # interleaved, so drift favours neither
        t0 = time.perf_counter()
        plan(model, cluster, acc, gb)
        t1 = time.perf_counter()
        n = exhaustive(model, cluster, acc, gb)
        t2 = time.perf_counter()
        ours.append((t1 - t0) * 1e3)
        base.append((t2 - t1) * 1e3)
    log(f"175B ({model.n_layers} layers, d_model {model.d_model}) on 4096 h100-80gb, global batch {gb}: "
        f"plan() {median(ours):.2f} ms ({len(plans)} fitting plans; best: dp={plans[0].dp} "
        f"tp={plans[0].tp} pp={plans[0].pp} {plans[0].schedule} mb={plans[0].micro_batch}), "
        f"exhaustive evaluate() of {n} layouts {median(base):.2f} ms; medians of {repeats}")
    emit("planner", "planner_search_ms", "ms", median(ours), median(base), TARGET_SEARCH_MS,
         better="lower", target_on="ours")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--search-repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true",
                    help=f"seconds, not minutes: {len(QUICK_LAYOUTS)} layouts of {WARMUP_STEPS + 3} steps, "
                         "one search repeat (both lines still printed, with both sides)")
    args = ap.parse_args()
    if args.quick:  # it checks that the script works, not how fast: no waiting for quiet CPUs
        os.environ.setdefault("KCBENCH_QUIET_TIMEOUT_S", "0")
    steps = args.steps or (WARMUP_STEPS + 3 if args.quick else STEPS)
    repeats = args.search_repeats or (1 if args.quick else SEARCH_REPEATS)
    if steps < WARMUP_STEPS + 3:
        ap.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    t0 = time.monotonic()
    step_time_error(steps, QUICK_LAYOUTS if args.quick else LAYOUTS,
                    QUICK_ALLREDUCE_REPS if args.quick else ALLREDUCE_REPS, quick=args.quick)
    search_ms(repeats)
    log(f"total wall time {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
