"""Shared pieces of kuangchao's benchmarks.

* `local_cluster()`: a throwaway fake multi-node Ray cluster with kuangchao's
  control plane (via `localcluster.up`), always torn down again;
* `connect()`: joins it as the Ray driver, with the repository importable on
  every worker so that both kuangchao and Ray Train can run `bench.harness`;
* `tiny_spec()`: the job spec of the small GPT every benchmark trains;
* `bench_loop()`: ONE training loop, run unchanged by kuangchao (through
  `kc_entry`) and by Ray Train (through `ray_train_loop`), so a comparison
  measures the orchestration and not two different loops;
* `emit()` / `median()`: the JSON-lines result format.

Timestamps are `time.time()`: all "nodes" of the fake cluster are processes on
this one machine, so their wall clocks agree with the benchmark's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.nn.parallel import DistributedDataParallel

from kuangchao.platform.runtime import localcluster
from kuangchao.platform.settings import RAY_NAMESPACE, Settings, read_credentials
from kuangchao.platform.spec.jobspec import JobSpec, load_spec_document, validate_spec
from kuangchao.workers.data.sampling import BatchSource, batch_indices, load_corpus
from kuangchao.workers.models.factory import build_model
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.job_model import model_config

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def emit(bench: str, metric: str, unit: str, ours: float, baseline: float,
         target: float | None) -> None:
    """Print one result line; `ratio` is ours over baseline (lower is better)."""
    # A zero baseline (samples_lost) gives ratio 0 when ours is zero too.
    ratio = ours / baseline if baseline else (0.0 if ours == 0 else float("inf"))
    print(json.dumps({"bench": bench, "metric": metric, "unit": unit, "ours": round(ours, 6),
                      "baseline": round(baseline, 6), "ratio": round(ratio, 4),
                      "target": target}), file=_results or sys.stdout, flush=True)


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
    busy fraction measured.
    """
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


# -- the cluster -------------------------------------------------------------

@dataclass(frozen=True)
class BenchCluster:
    state: dict[str, Any]  # what localcluster.up recorded (ray_address, temp_dir, ...)
    settings: Settings
    tmp: Path  # scratch space removed at teardown: KC_HOME, checkpoints, outputs

    @property
    def ray_address(self) -> str:
        return self.state["ray_address"]


def settle(timeout_s: float = 30.0) -> None:
    """Wait until the previous run released its Ray resources and the CPUs are quiet."""
    import ray

    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources()
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            break
        time.sleep(0.5)
    wait_for_quiet()


def _topology_yaml(nodes: int, gpus: int, cpus: int) -> str:
    lines = ["name: bench", "nodes:"]
    for i in range(nodes):
        lines.append(f"  - {{name: node-{i}, gpus: {gpus}, cpus: {cpus}, leaf: leaf-0}}")
    return "\n".join(lines) + "\n"


@contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the block, restoring the old values after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _delete_keys(prefix: str) -> None:
    """Remove this run's Redis keys; the shared server is never flushed."""
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])


@contextmanager
def local_cluster(nodes: int = 2, gpus: int = 4, cpus: int = 4) -> Iterator[BenchCluster]:
    """A fresh kuangchao stack on a fake `nodes`-node Ray cluster.

    Uses the shared Redis with a unique key prefix, a temporary `KC_HOME` and
    free ports, so it never touches a developer's own `kc up`. Everything is
    stopped on exit, even when the block raises; the logs are kept (and their
    folder printed) only when it does.
    """
    from kuangchao.platform.runtime.procs import free_port

    tmp = Path(tempfile.mkdtemp(prefix="kcbench-"))
    prefix = f"kcbench-{secrets.token_hex(4)}:"
    topo = tmp / "cluster.yaml"
    topo.write_text(_topology_yaml(nodes, gpus, cpus))
    opts = localcluster.UpOptions(cluster=topo, api_port=free_port(), dashboard_port=free_port(),
                                  redis_prefix=prefix)
    failed = False
    # KC_HOME is read by `up` and `down` (cluster.json); the Redis settings are
    # handed to the raylets, hence to every actor and worker.
    with _env(KC_HOME=str(tmp / "home"), KC_REDIS_URL=REDIS_URL, KC_REDIS_PREFIX=prefix):
        t0 = time.monotonic()
        try:
            state = localcluster.up(opts)
            log(f"cluster up in {time.monotonic() - t0:.1f}s ({state['ray_address']})")
            settings = Settings(redis_url=state["redis_url"], redis_prefix=prefix,
                                ray_address=state["ray_address"], api_url=state.get("api_url", ""),
                                api_key=read_credentials().get("api_key"))
            yield BenchCluster(state=state, settings=settings, tmp=tmp)
        except BaseException:
            failed = True
            raise
        finally:
            _teardown(tmp, prefix, keep=failed)


def _teardown(tmp: Path, prefix: str, keep: bool) -> None:
    import ray

    temp_dir = (localcluster.read_cluster_state() or {}).get("temp_dir")
    # Each step runs even if an earlier one fails: a leak here outlives the run.
    for step in (ray.shutdown, localcluster.down, lambda: _delete_keys(prefix)):
        try:
            step()
        except Exception as exc:
            log(f"teardown step {getattr(step, '__name__', step)} failed: {exc}")
    if keep:
        log(f"logs kept in {tmp}/home/logs and {temp_dir}")
        return
    shutil.rmtree(tmp, ignore_errors=True)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def connect(cluster: BenchCluster) -> None:
    """Join the cluster as the Ray driver.

    Kuangchao's controller runs in this process (`run_as_driver`) and Ray Train's
    `fit()` too, so the worker actors of both belong to this Ray job and inherit
    its runtime env: PYTHONPATH puts the repository root on their sys.path,
    making `bench.harness` importable there. (The stdlib `platform` module still
    wins over the repo's namespace folder of that name: regular modules beat
    namespace packages regardless of path order.)
    """
    import ray

    if ray.is_initialized():
        return
    ray.init(address=cluster.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False,
             logging_level=logging.ERROR,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})


# -- the job -----------------------------------------------------------------

def tiny_spec(steps: int = 60, out: str | Path | None = None, name: str = "bench") -> dict[str, Any]:
    """The benchmark job as a spec document (validated, ready to submit).

    Starts from examples/tiny-gpt.yaml (2 data-parallel ranks) and widens the
    model to d_model/seq_len 128 with micro-batch 16, so a step does enough
    compute for orchestration overhead to show up against it.
    """
    doc = load_spec_document(REPO_ROOT / "examples" / "tiny-gpt.yaml")
    doc["task"]["name"] = name
    doc["model"].update(d_model=128, seq_len=128)
    # One micro-batch per step keeps the shared loop free of gradient accumulation.
    doc["parallel"].update(micro_batch_size=16, gradient_accumulation_steps=1)
    doc["training"].update(steps=steps, torch_threads=1)
    doc["checkpoint"].update(interval_steps=steps, keep_last=1)
    doc["entrypoint"] = "bench.harness:kc_entry"
    doc["args"] = {"out": str(out) if out else None}
    validate_spec(doc)
    return doc


def build_loop_parts(spec: JobSpec, world_size: int) -> tuple[Any, Any, Any, BatchSource]:
    """The model, its DDP wrapper, AdamW and the batch source every benchmark loop uses,
    with one torch thread per rank on both sides."""
    torch.set_num_threads(1)
    torch.manual_seed(spec.training.seed)
    model = build_model(model_config(spec))
    ddp = DistributedDataParallel(model) if world_size > 1 else model
    o = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas,
                                  weight_decay=o.weight_decay)
    source = BatchSource(load_corpus(None, spec.data.max_bytes, spec.model.vocab_size),
                         spec.model.seq_len, spec.training.seed)
    return model, ddp, optimizer, source


def bench_loop(spec: JobSpec, rank: int, world_size: int,
               after_steps: Callable[[torch.nn.Module, torch.optim.Optimizer], Any] | None = None,
               ) -> dict[str, Any]:
    """Train `spec.training.steps` DDP steps on CPU; return the timing.

    The process group must already exist when `world_size > 1` (kuangchao's
    worker and Ray Train both create it before calling the train function).
    `after_steps(model, optimizer)` runs after the last timed step, for work
    that must not count (kuangchao's mandatory final checkpoint).

    Returns:
        {"start": time the loop began, "steps": time after each optimizer step}.
    """
    start = time.time()
    model, ddp, optimizer, source = build_loop_parts(spec, world_size)
    micro = spec.parallel.micro_batch_size
    stamps = []
    for step in range(spec.training.steps):
        x, y = source.get(batch_indices(step, 0, rank, world_size, micro, 1))
        _, loss = ddp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if after_steps is not None:
        after_steps(model, optimizer)
    return {"start": start, "steps": stamps}


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data))


def kc_entry(ctx: TrainContext) -> dict[str, Any]:
    """Kuangchao entrypoint (`bench.harness:kc_entry`) running `bench_loop`."""
    saved: dict[str, Any] = {}

    def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Kuangchao marks a job SUCCEEDED only with a verified final checkpoint.
        info = ctx.checkpoint.save(ctx.spec.training.steps, model, optimizer, rank_state={})
        saved.update(info.to_json())

    timing = bench_loop(ctx.spec, ctx.rank, ctx.world_size, after_steps=save)
    if ctx.is_chief:
        _write_json(ctx.spec.args.get("out"), timing)
    return {"timing": timing, "checkpoint": saved}


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker` running `bench_loop`.

    config: {"spec": spec document, "out": where rank 0 writes its timing}.
    """
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    timing = bench_loop(validate_spec(config["spec"]), rank, ctx.get_world_size())
    if rank == 0:
        _write_json(config["out"], timing)
