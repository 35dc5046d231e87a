"""The half of bench/recovery.py that runs inside Ray workers.

It lives in its own module (not the `__main__` of the benchmark script) so
that kuangchao's workers (`entrypoint: bench.recovery_ray:kc_entry`), Ray
Train's workers (`ray_train_loop`) and the crash-probe actor import it by name.

* `resumable_loop()`: ONE training loop for both systems: the model, data,
  optimizer and steps of `bench.harness.bench_loop`, plus resuming from a
  checkpoint and saving one every `checkpoint.interval_steps` steps. Only the
  three hooks differ: kuangchao restores and saves through `ctx.checkpoint`
  (sharded DCP with a verified manifest) and reports each step with
  `ctx.report`; Ray Train restores from `ray.train.get_checkpoint()` and saves
  with `ray.train.report(checkpoint=...)`, its documented idiom.
* `Trace`: each rank appends one JSON line per event to `{dir}/rank{r}.jsonl`
  (`start` with its pid and resumed step, `step` after each optimizer step,
  `ckpt` once a save returned), so the benchmark finds the pid to kill and
  the times from the outside, the same way for both systems.
* `CrashProbe`: a plain Ray actor, for Ray's own ActorDiedError latency.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.harness import build_loop_parts
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.workers.data.sampling import batch_indices

Hook = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


class Trace:
    """Append-only event log of one rank: one JSON object per line, flushed at once."""

    def __init__(self, folder: str | Path, rank: int) -> None:
        self.rank = rank
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self._f = (path / f"rank{rank}.jsonl").open("a", buffering=1)

    def write(self, ev: str, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        self._f.write(json.dumps({"ev": ev, "pid": os.getpid(), "rank": self.rank, **fields}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def resumable_loop(spec: JobSpec, rank: int, world_size: int, trace: Trace,
                   restore: Callable[[torch.nn.Module, torch.optim.Optimizer], int],
                   save: Hook, after_step: Callable[[int], None] | None = None,
                   finish: Callable[[torch.nn.Module, torch.optim.Optimizer], Any] | None = None,
                   ) -> int:
    """Train to `spec.training.steps` from wherever `restore` says; return that step.

    The process group must exist when `world_size > 1`. `save(step, model,
    optimizer)` runs on every rank after each `checkpoint.interval_steps`-th
    step (not after the last); `finish(model, optimizer)` after the last step,
    outside the timing (kuangchao's mandatory final checkpoint).
    """
    t_start = time.time()
    model, ddp, optimizer, source = build_loop_parts(spec, world_size)
    micro = spec.parallel.micro_batch_size
    t_built = time.time()
    start_step = restore(model, optimizer)
    trace.write("start", step=start_step, t=t_start, built=t_built, restored=time.time())
    every, steps = spec.checkpoint.interval_steps, spec.training.steps
    for step in range(start_step, steps):
        x, y = source.get(batch_indices(step, 0, rank, world_size, micro, 1))
        _, loss = ddp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        trace.write("step", step=done)
        if after_step is not None:
            after_step(done)
        if done % every == 0 and done != steps:
            t0 = time.time()
            save(done, model, optimizer)
            trace.write("ckpt", step=done, save_s=time.time() - t0)
    if finish is not None:
        finish(model, optimizer)
    return start_step


# -- kuangchao ---------------------------------------------------------------------

def kc_entry(ctx: Any) -> dict[str, Any]:
    """Kuangchao entrypoint (`bench.recovery_ray:kc_entry`); `spec.args.trace` is the trace folder."""
    trace = Trace(ctx.spec.args["trace"], ctx.rank)
    phase = getattr(ctx, "phase", None)  # names the phase for hang detection, where supported

    def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        latest = ctx.checkpoint.latest_verified()
        if latest is None:
            return 0
        path, manifest = latest
        ctx.checkpoint.load(path, model, optimizer)
        return int(manifest["step"])

    def save(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if phase is not None:
            with phase("checkpoint"):
                ctx.checkpoint.save(step, model, optimizer, rank_state={"step": step})
        else:
            ctx.checkpoint.save(step, model, optimizer, rank_state={"step": step})

    saved: dict[str, Any] = {}

    def finish(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Kuangchao marks a job SUCCEEDED only with a verified final checkpoint.
        steps = ctx.spec.training.steps
        saved.update(ctx.checkpoint.save(steps, model, optimizer, rank_state={"step": steps}).to_json())

    try:
        start = resumable_loop(ctx.spec, ctx.rank, ctx.world_size, trace, restore, save,
                               after_step=ctx.report, finish=finish)
    finally:
        trace.close()
    return {"resumed_from": start, "checkpoint": saved}


# -- Ray Train -------------------------------------------------------------------

def ray_restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load Ray Train's latest checkpoint (`state.pt`), if any; the step to continue from."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return int(state["step"])


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`. config: {"spec": spec document, "trace": folder}."""
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    trace = Trace(config["trace"], rank)

    def save(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Ray Train's idiom: every rank reports (it is a barrier), rank 0 with the
        # checkpoint, which Ray persists to storage_path before report returns.
        if rank != 0:
            ray.train.report({"step": step})
            return
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step},
                       Path(d) / "state.pt")
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))

    try:
        resumable_loop(validate_spec(config["spec"]), rank, ctx.get_world_size(), trace,
                       ray_restore, save)
    finally:
        trace.close()


# -- plain Ray actor --------------------------------------------------------------

class CrashProbe:
    """An actor that busy-waits in `spin`, for timing Ray's ActorDiedError after a SIGKILL."""

    def pid(self) -> int:
        return os.getpid()

    def spin(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.01)
