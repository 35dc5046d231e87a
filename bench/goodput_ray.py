"""The half of bench/goodput.py that runs inside Ray workers: kuangchao's ranks and
Ray Train's workers import it by name.

* `gpt(cfg)`: the job's model factory (`model.type: bench.goodput_ray:gpt`, a
  user factory the built-in trainer accepts): the built-in GPT with two bench
  hooks and nothing else changed (same parameters, same init, same maths):
  - a NaN on demand: when the file `{dir}/nan` exists, the next forward pass
    of the model's head in any process takes it (an atomic rename, so exactly
    one does) and returns NaN logits; the loss and, after the gradient all-reduce, every rank's
    gradients are NaN. This is how the chaos schedule injects a NaN at a time
    of its choosing (`fault_tolerance.inject_nan_at_batches` names batches, not
    times);
  - a per-step trace: a global optimizer step post-hook appends one line per
    optimizer step to `{dir}/p{pid}.jsonl`: `t` (time.time()), `pid`, `rank`
    (torch.distributed's, at that step; -1 outside a process group) and `step`, AdamW's own step count,
    which checkpoints and live regroups restore with the optimizer state, so
    it is the training step the update belongs to. The step with LR 0 that
    torch.distributed.checkpoint takes to create the optimizer state before a
    load is no training step and is not traced. Both systems are stamped by
    this same hook.
  `{dir}` is `KCBENCH_GOODPUT_DIR`, set in the bench driver's runtime env, which
  every worker of both systems inherits.
* `rt_loop(config)`: Ray Train's `train_loop_per_worker`: the GPT, data and
  optimizer of `bench.harness.build_loop_parts` with the built-in trainer's LR
  schedule and gradient clipping, a checkpoint every `ckpt_every` steps
  (`ray.train.report`, rank 0 with the state, upload mode ASYNC), a NaN
  gradient norm raised as an error (Ray Train then restarts from the newest
  checkpoint: it has no numeric guard of its own), the documented reaction to
  a drain notice (`ray.train.get_preemption_info()`: a just-in-time
  checkpoint), and a stop file for open-ended runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kuangchao.workers.models.gpt import GPT

DIR_ENV = "KCBENCH_GOODPUT_DIR"
NAN_FILE = "nan"

_lock = threading.Lock()
_trace: Any = None  # this process's trace file, opened at its first step
_hooked = False
# The rank to trace instead of torch.distributed's: under torchft each worker is a process
# group of its own (its rank there is always 0), so its Ray Train world rank stands in.
rank_override: int | None = None


def trace_dir() -> Path | None:
    d = os.environ.get(DIR_ENV)
    return Path(d) if d else None


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: one trace line per applied step."""
    global _trace
    d = trace_dir()
    if d is None:
        return
    if all(float(g.get("lr", 1.0)) == 0.0 for g in optimizer.param_groups):
        return  # torch.distributed.checkpoint initialising the state before a load, no step
    first = optimizer.param_groups[0]["params"][0]
    st = optimizer.state.get(first) or {}
    if "step" not in st:
        return
    step = int(st["step"])
    dist = torch.distributed
    # -1: a process outside any process group, not a rank of the job.
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    if rank_override is not None:
        rank = rank_override
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "rank": rank, "step": step})
    with _lock:
        if _trace is None:
            d.mkdir(parents=True, exist_ok=True)
            _trace = (d / f"p{os.getpid()}.jsonl").open("a", buffering=1)
        _trace.write(line + "\n")
        _trace.flush()


def _take_nan() -> bool:
    """Whether this forward pass takes the pending NaN (at most one process does)."""
    d = trace_dir()
    if d is None:
        return False
    src = d / NAN_FILE
    if not src.exists():
        return False
    try:
        os.rename(src, d / f"{NAN_FILE}.taken.{os.getpid()}.{time.time():.3f}")
    except OSError:
        return False  # another process took it
    return True


def _poison(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook on the model's head: NaN logits when this pass takes the pending NaN."""
    return output * float("nan") if _take_nan() else None


def gpt(cfg: Any) -> torch.nn.Module:
    """Model factory (`model.type: bench.goodput_ray:gpt`): the built-in GPT with the NaN
    hook on its head, and the step trace hook. The hook sits on the head module, not on
    `forward`: kuangchao's engine runs the model's blocks and head through its own
    chunks (workers/parallel/pipeline.py), never `GPT.forward`."""
    global _hooked
    if not _hooked:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_after_step)
        _hooked = True
    model = GPT(cfg)
    model.lm_head.register_forward_hook(_poison)
    return model


# -- Ray Train ----------------------------------------------------------------------

def _save(rank: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Ray Train's idiom: every rank reports (a barrier), rank 0 with the checkpoint,
    uploaded in the background (`CheckpointUploadMode.ASYNC`, which deletes the local
    folder once uploaded)."""
    import ray.train
    from ray.train import CheckpointUploadMode

    if rank != 0:
        ray.train.report({"step": step})
        return
    d = tempfile.mkdtemp(prefix="kcbench-rt-ckpt-")
    try:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step},
                   Path(d) / "state.pt")
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise


def stop_at(path: str | None) -> int | None:
    """The step the bench asked an open-ended run to end at, if it did."""
    if not path:
        return None
    try:
        return int(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def forward_backward(step: int, spec: Any, optimizer: torch.optim.Optimizer, ddp: Any,
                     model: torch.nn.Module, source: Any, rank: int,
                     world: int) -> tuple[torch.Tensor, float]:
    """One step's forward and backward as the built-in trainer does it (its LR schedule,
    this rank's share of the step's batch, gradient clipping): the loss and the
    gradient norm before clipping. The optimizer step is the caller's."""
    from kuangchao.workers.data.sampling import batch_indices
    from kuangchao.workers.trainer.loop import lr_factor

    for group in optimizer.param_groups:
        group["lr"] = spec.optimizer.lr * lr_factor(step, spec)
    x, y = source.get(batch_indices(step, 0, rank, world, spec.parallel.micro_batch_size, 1))
    _, loss = ddp(x, y)
    loss.backward()
    clip = spec.optimizer.grad_clip or math.inf
    return loss, float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))


def rt_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`.

    config: {"spec": the job's spec document, "ckpt_every": steps between checkpoints,
    "preempt_every": steps between `get_preemption_info()` calls (0: never),
    "stop": a file holding a step to end at (optional), "final": where rank 0 writes
    the final loss (optional)}.
    """
    import ray.train
    import torch.distributed as dist

    from bench.harness import build_loop_parts
    from bench.recovery_ray import ray_restore
    from kuangchao.platform.spec.jobspec import validate_spec

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    spec = validate_spec(config["spec"])
    every, poll = int(config["ckpt_every"]), int(config.get("preempt_every") or 0)
    model, ddp, optimizer, source = build_loop_parts(spec, world)
    start = ray_restore(model, optimizer)
    steps = spec.training.steps
    loss = torch.tensor(float("nan"))
    saved_for_drain = False
    done = start
    for step in range(start, steps):
        loss, norm = forward_backward(step, spec, optimizer, ddp, model, source, rank, world)
        if not math.isfinite(norm):
            # No numeric guard in Ray Train: the worker fails, and FailureConfig restarts
            # the group from the newest checkpoint (every rank sees the same NaN norm).
            raise FloatingPointError(f"gradient norm {norm} at step {step + 1}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        stop = stop_at(config.get("stop"))
        if done == steps or (stop is not None and done >= stop):
            break
        if done % every == 0:
            _save(rank, done, model, optimizer)
        elif poll and done % poll == 0 and not saved_for_drain:
            # Ray Train's documented reaction to a drain notice: a just-in-time checkpoint,
            # then keep training until the node goes (a barrier: every rank calls it).
            if ray.train.get_preemption_info() is not None:
                _save(rank, done, model, optimizer)
                saved_for_drain = True
    value = torch.tensor([float(loss.detach())], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(value)
    if rank == 0 and config.get("final"):
        Path(config["final"]).write_text(json.dumps({"step": done, "loss": float(value) / world}))


# -- Ray Train with torchft (replica-group recovery) -------------------------------------

def rt_torchft_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker` under `TorchftConfig`: each worker is a replica
    group of one (Ray Train's torchft layout), wrapped in torchft's Manager, DDP and
    Optimizer as Ray's own example (ray/train/v2/examples/pytorch/torchft_linear_example.py)
    does. A failed replica group is replaced while the others go on; a new one takes the
    state from a live peer (`PGTransport`). A NaN gradient norm is reported to the
    Manager (`report_error`), so that no replica commits that step. The step is the
    Manager's; a replica trains its shard of that step's batch, so while one is missing
    its shard is not trained. The trace's rank is the Ray Train world rank.
    Ray Train checkpoints (every `ckpt_every` steps, as `rt_loop`) cover the loss of
    every replica at once.

    config: as `rt_loop`, plus "timeout_s" (torchft's collective and should_commit
    timeout: how long a survivor waits on a lost peer).
    """
    from datetime import timedelta

    import ray.train
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from bench import goodput_ray
    from bench.harness import build_loop_parts
    from kuangchao.platform.spec.jobspec import validate_spec

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    goodput_ray.rank_override = rank
    spec = validate_spec(config["spec"])
    every = int(config["ckpt_every"])
    timeout = timedelta(seconds=float(config.get("timeout_s") or 5.0))
    model, _, inner, source = build_loop_parts(spec, 1)  # no torch DDP: torchft's below
    pg = ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))

    def load_state(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state, state_dict=state,
                      world_size=1, rank=0, replica_id=f"goodput_{rank}", timeout=timeout,
                      quorum_timeout=timedelta(seconds=60), checkpoint_transport=transport,
                      init_sync=False)  # every replica builds the same init from the seed
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = torch.load(Path(d) / "state.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])
        manager.load_state_dict(saved["torchft"])
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    steps = spec.training.steps
    loss = torch.tensor(float("nan"))
    while (step := manager.current_step()) < steps:
        stop = stop_at(config.get("stop"))
        if stop is not None and step >= stop:
            break
        optimizer.zero_grad(set_to_none=True)  # starts the quorum
        loss, norm = forward_backward(step, spec, optimizer, ddp, model, source, rank, world)
        if not math.isfinite(norm):
            # torchft's way to discard a corrupted step: no replica commits it, and the
            # step is trained again (its NaN does not come back).
            manager.report_error(FloatingPointError(f"gradient norm {norm} at step "
                                                    f"{step + 1}"))
        optimizer.step()  # applied only if every replica of the quorum committed
        done = manager.current_step()
        if (done != step and done % every == 0 and done < steps
                and manager.num_participants() == world):
            # As Ray's example: every replica reports (its report is a barrier of all
            # workers), here only rank 0 with the state. Only while every replica is in
            # the quorum (all see the same quorum): with one missing, the barrier would
            # wait for it (Ray's example notes reports need every worker).
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optim": inner.state_dict(),
                                "torchft": manager.state_dict(), "step": done},
                               Path(d) / "state.pt")
                ray.train.report({"step": done}, checkpoint=ray.train.Checkpoint.from_directory(d)
                                 if rank == 0 else None)
    if rank == 0 and config.get("final"):
        Path(config["final"]).write_text(json.dumps({"step": manager.current_step(),
                                                     "loss": float(loss.detach())}))
    manager.shutdown()
