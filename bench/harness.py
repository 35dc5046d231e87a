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
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# -- output (bench/report.py, re-exported) -----------------------------------

from bench.report import (  # noqa: E402,F401
    REDIS_URL,
    _cpu_times,
    emit,
    keep_stdout_for_results,
    log,
    median,
    spread_of,
    wait_for_quiet,
)

# -- the cluster -------------------------------------------------------------

@dataclass(frozen=True)
class BenchCluster:
    state: dict[str, Any]  # what localcluster.up recorded (ray_address, temp_dir, ...)
    settings: Settings
    tmp: Path  # scratch space removed at teardown: KC_HOME, checkpoints, outputs

    @property
    def ray_address(self) -> str:
        return self.state["ray_address"]


def settle(timeout_s: float = 30.0, quiet: bool = True) -> None:
    """Wait until the previous run released its Ray resources and, with `quiet`, the
    CPUs are quiet (quick modes skip that: their numbers mean nothing)."""
    import ray

    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources()
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            break
        time.sleep(0.5)
    if quiet:
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

    from kuangchao.platform.runtime import ray_connect

    if ray.is_initialized():
        return
    # The stack takes Ray's token (`kc up` turns token authentication on); this
    # presents the one its cluster.json records, as `kc` itself does.
    ray_connect.connect(cluster.ray_address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
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


def rank_file(out: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its timing for a run whose output is `out`."""
    return Path(f"{out}.rank{rank}.json")


def read_rank_files(out: str | Path) -> list[dict[str, Any]]:
    """Every rank's timing of one run (rank order)."""
    files = sorted(Path(out).parent.glob(f"{Path(out).name}.rank*.json"),
                   key=lambda p: int(p.name.rsplit(".rank", 1)[1].split(".")[0]))
    return [json.loads(p.read_text()) for p in files]


def kc_entry(ctx: TrainContext) -> dict[str, Any]:
    """Kuangchao entrypoint (`bench.harness:kc_entry`) running `bench_loop`."""
    saved: dict[str, Any] = {}

    def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Kuangchao marks a job SUCCEEDED only with a verified final checkpoint.
        info = ctx.checkpoint.save(ctx.spec.training.steps, model, optimizer, rank_state={})
        saved.update(info.to_json())

    timing = bench_loop(ctx.spec, ctx.rank, ctx.world_size, after_steps=save)
    if ctx.spec.args.get("out"):
        _write_json(str(rank_file(ctx.spec.args["out"], ctx.rank)), timing)
    return {"timing": timing, "checkpoint": saved}


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker` running `bench_loop`.

    config: {"spec": spec document, "out": the run's output (each rank writes `rank_file`)}.
    """
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    timing = bench_loop(validate_spec(config["spec"]), rank, ctx.get_world_size())
    _write_json(str(rank_file(config["out"], rank)), timing)
