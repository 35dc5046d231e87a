"""The platform for a user's own train function: `ctx.prepare_model`, `ctx.prepare_data`,
`ctx.resume`, `ctx.check_numerics` and `ctx.step_done`.

The built-in trainer's machinery, offered call by call (Ray Train's names in
brackets):

- `prepare_model(model)` [`prepare_model`]: the spec's layout on any module
  (workers/parallel/prepare.py);
- `prepare_data(dataset)` [`prepare_data_loader`]: this rank's share of every
  step, in one global seeded order that survives restarts and resizes
  (workers/data/rank_data.py); with no dataset, the job's own `data` section;
- `resume(model, optimizer, scheduler)` [`train.get_checkpoint()` + your own
  loading]: the newest checkpoint that verifies, with the optimizer, the LR
  schedule, the data position and every RNG; returns the step to start at;
- `check_numerics(step, loss, grad_norm)`: NaN, Inf and gradient-norm spikes
  (and the `fault_tolerance.inject_nan_at_batches` drill), before the optimizer
  applies anything;
- `step_done(step, loss=...)` [`train.report`]: progress, the periodic and the
  final checkpoint, and the scheduler's preemption or resize request (True:
  stop, the checkpoint is saved).

A function declares what else it supports with `@supports(...)`:

- `numeric_guard`: a numeric fault rolls the job back in place (the function
  runs again, its `resume` restores the last good checkpoint and `prepare_data`
  skips the batch), as the built-in trainer does. Undeclared, the fault fails
  the attempt and the controller restarts it from the checkpoint.
- `live_resize` (with `elastic.resize: live`): a resize or a lost peer keeps the
  survivors' processes; each carries its model, optimizer and LR schedule in
  memory into the next process group, runs the function again there, and its
  `resume` takes that state up (a rank that just joined receives it from them).
  Undeclared, resizes go by a checkpoint and a restart (`resize: restart`).

The worker starts every user function through `run_entrypoint` (it names it as
it names the built-in trainer), which hands the context this kit.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kuangchao.workers.data.rank_data import RankData
from kuangchao.workers.elastic.generation import is_collective_failure
from kuangchao.workers.errors import CheckpointError, NumericFault, ResizeNow, TrainingError
from kuangchao.workers.parallel import prepare
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer import live_resize
from kuangchao.workers.trainer.checkpoints import settles_checkpoints
from kuangchao.workers.trainer.job_model import manifest_model
from kuangchao.workers.trainer.loop import global_mean
from kuangchao.workers.trainer.numerics import GradNormGuard, data_index, data_position
from kuangchao.workers.trainer.resume import Position, _agree, _record, rank_state, set_rng_state

FEATURES = frozenset({"numeric_guard", "live_resize"})
SUPPORTS_ATTR = "kc_supports"


def supports(*features: str) -> Callable[[Callable], Callable]:
    """Declare what the platform may do around this train function: `numeric_guard`
    (roll back in place), `live_resize` (resize with `elastic.resize: live`)."""
    unknown = sorted(set(features) - FEATURES)
    if unknown:
        raise ValueError(f"supports: {', '.join(unknown)} unknown; choose from {', '.join(sorted(FEATURES))}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, SUPPORTS_ATTR, frozenset(features))
        return fn
    return mark


class OwnKit:
    """One rank's platform calls for its train function; kept across a rollback's re-run."""

    def __init__(self, ctx: TrainContext) -> None:
        self.ctx = ctx
        ft = ctx.spec.fault_tolerance
        self.guard = GradNormGuard(ft.grad_norm_spike_factor, ft.grad_norm_window)
        self.pos = Position()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.preempted_at: int | None = None  # the step a preemption (or resize) stopped at
        # A live resize between two runs of the function: the survivor's state and the old
        # layout, taken up by the next `resume` once the function built its model again.
        self.carried: tuple[nn.Module, Any, Any, Position, tuple[int, int, int]] | None = None

    # -- the model and the data ------------------------------------------------

    def prepare_model(self, model: nn.Module, tp_plan: dict[str, str] | None = None) -> nn.Module:
        ctx = self.ctx
        torch.manual_seed(ctx.spec.training.seed)  # the same on every rank, as a restart's
        with ctx.phase("init"):
            prepared = prepare.prepare_model(ctx.spec, model, world_size=ctx.world_size,
                                             device=ctx.device, tp_plan=tp_plan)
        self.model = prepared
        return prepared

    def prepare_data(self, dataset: Any = None, collate: Callable | None = None) -> RankData:
        ctx = self.ctx
        if dataset is None:  # the job's own data section, tokenized as the built-in trainer's
            from kuangchao.workers.trainer.job_data import job_sources

            with ctx.phase("data"):
                dataset, ctx.eval_source = job_sources(ctx.spec, prepare.unwrap(self.model)
                                                       if self.model is not None else nn.Module())
        return RankData(dataset, lambda: (ctx.dp_rank, ctx.dp_size, ctx.accum_steps),
                        ctx.spec.parallel.micro_batch_size, ctx.spec.training.seed,
                        lambda step: data_index(step, self.pos.skipped), collate)

    # -- checkpoints -------------------------------------------------------------

    def _states(self, model: nn.Module | None, optimizer: Any, scheduler: Any) -> tuple:
        self.model = model if model is not None else self.model
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        self.scheduler = scheduler if scheduler is not None else self.scheduler
        if self.model is None or self.optimizer is None:
            raise TrainingError("resume/save: give the model and the optimizer "
                                "(ctx.resume(model, optimizer, scheduler))")
        return prepare.unwrap(self.model), self.optimizer, self.scheduler

    def resume(self, model: nn.Module | None = None, optimizer: Any = None,
               scheduler: Any = None) -> int:
        ctx = self.ctx
        module, opt, sched = self._states(model, optimizer, scheduler)
        if self.carried is not None or ctx.joining:
            return self._take_live_state(module, opt, sched)
        ctx.checkpoint.wait()
        ctx.checkpoint.prepare_group()  # now, while every rank is here (manager.prepare_group)
        with ctx.phase("restore"):
            for path in reversed(ctx.checkpoint.list()):
                try:
                    manifest = ctx.checkpoint.verify(path)
                except CheckpointError as exc:
                    ctx.log(f"skipped checkpoint {path.name}: {exc.message}", level="WARNING")
                    continue
                state = ctx.checkpoint.load(path, module, opt)
                if "rng" in state:  # a converted checkpoint holds weights alone
                    set_rng_state(state["rng"])
                self.guard.load_state(state.get("grad_norms"))
                if sched is not None and state.get("scheduler") is not None:
                    sched.load_state_dict(state["scheduler"])
                skipped = sorted({*state.get("skipped_batches", []), *self.pos.skipped})
                self.pos = Position(int(manifest["step"]), skipped)
                live_resize.forget_samples_from(ctx, self.pos.step)
                ctx.log(f"restored checkpoint {path} at step {self.pos.step}"
                        + (f"; skipping batches {skipped}" if skipped else ""))
                ctx.expect_first_step()
                return self.pos.step
        self.pos = Position(0, self.pos.skipped)
        live_resize.forget_samples_from(ctx, 0)
        return 0

    def _take_live_state(self, module: nn.Module, opt: Any, sched: Any) -> int:
        """After a live resize: a survivor loads what it carried into the model it just
        built, then every rank of the new group agrees on the newest state (a rank that
        just joined receives it)."""
        ctx = self.ctx
        carried, self.carried = self.carried, None
        pos, old = None, None
        if carried is not None:
            old_module, old_opt, old_sched, pos, old = carried
            module.load_state_dict(old_module.state_dict())
            opt.load_state_dict(old_opt.state_dict())
            if sched is not None and old_sched is not None:
                sched.load_state_dict(old_sched.state_dict())
        ctx.joining = False
        self.pos = live_resize.finish_rejoin(ctx, module, opt, self.guard, pos, old, sched)
        return self.pos.step

    def rejoin(self) -> bool:
        """A resize or a lost peer: join the next generation carrying this rank's state.
        False when this rank is not in it."""
        assert self.model is not None and self.optimizer is not None
        module = prepare.unwrap(self.model)
        self.model = None  # the DDP wrapper's hooks belong to the group going away
        gc.collect()
        old = live_resize.join_next(self.ctx, self.pos)
        if old is None:
            return False
        self.carried = (module, self.optimizer, self.scheduler, self.pos, old)
        self.optimizer = self.scheduler = None
        return True

    def save(self, step: int, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, sync: bool = True) -> Any:
        ctx = self.ctx
        module, opt, sched = self._states(model, optimizer, scheduler)
        state = rank_state(step, self.pos.skipped, self.guard)
        state["scheduler"] = sched.state_dict() if sched is not None else None
        extra = {"parallel": ctx.spec.parallel.model_dump(),
                 "data_position": data_position(step, self.pos.skipped),
                 "model": _model_entry(ctx)}
        with ctx.phase("checkpoint"):
            if sync:
                return ctx.checkpoint.save(step, module, opt, rank_state=state, extra=extra)
            return ctx.checkpoint.save_async(step, module, opt, rank_state=state, extra=extra)

    # -- each step ------------------------------------------------------------------

    def check_numerics(self, step: int, loss: torch.Tensor | float, grad_norm: float) -> torch.Tensor | float:
        """Raise `NumericFault` for a NaN/Inf loss or gradient norm, or a spike; the
        drill's batches get a NaN loss on rank 0. Returns the loss (poisoned or not)."""
        ctx = self.ctx
        index = data_index(step, self.pos.skipped)
        if ctx.is_chief and index in ctx.spec.fault_tolerance.inject_nan_at_batches:
            loss, grad_norm = loss * float("nan"), float("nan")
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        problem = self.guard.check(_agreed_norm(ctx, grad_norm if math.isfinite(value) else math.nan))
        if problem:
            raise NumericFault(step, index, problem)
        return loss

    def step_done(self, step: int, loss: float | None = None, **metrics: Any) -> bool:
        """After optimizer step `step` (1-based: steps done). True: stop now (preempted
        or resized; the checkpoint is saved)."""
        ctx = self.ctx
        spec = ctx.spec
        live_resize.record_samples(ctx, step - 1, self.pos)  # `data.record_samples`
        self.pos.step = step
        if loss is not None:
            loss = global_mean(float(loss), ctx)
            ctx.report(step, loss=loss, **metrics)
        else:
            ctx.report(step, **metrics)
        if step >= spec.training.steps:
            self.save(step)
            return True
        if step % spec.checkpoint.interval_steps == 0:
            self.save(step, sync=not spec.checkpoint.async_save)
        if ctx.live_resize:  # one collective for both; a resize moves this rank in place
            preempt, gen = ctx.control()
            if gen:
                raise ResizeNow(gen)
        else:
            preempt = ctx.preemption_requested()
        if preempt:
            self.save(step)
            self.preempted_at = step
            ctx.log(f"stopping at step {step} for the scheduler; checkpoint saved")
            return True
        return False


def _model_entry(ctx: TrainContext) -> dict[str, Any]:
    """The manifest's `model`: a Hugging Face model (the spec's folder), saved under its own
    names; else only that the function built its own (export then needs `--config`)."""
    if ctx.spec.model.is_hf:
        return {**manifest_model(ctx.spec), "names": "hf"}
    return {"kind": "own"}


def _agreed_norm(ctx: TrainContext, norm: float) -> float:
    """The largest norm any rank saw (NaN if any saw NaN): every rank judges alike even
    when a function computed the norm before its gradients were reduced."""
    if ctx.world_size == 1:
        return norm
    import torch.distributed as dist

    from kuangchao.workers.collectives import permit

    t = torch.tensor([norm if math.isfinite(norm) else math.inf], dtype=torch.float64)
    permit("all_reduce")
    with ctx.collective("all_reduce (numerics)"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    value = float(t.item())
    return value if math.isfinite(value) else math.nan


def run_entrypoint(ctx: TrainContext, fn: Callable[[TrainContext], Any]) -> Any:
    """Run a user's train function with this kit; roll back in place on a numeric fault
    when it declared `numeric_guard`."""
    kit = OwnKit(ctx)
    ctx.kit = kit
    declared = getattr(fn, SUPPORTS_ATTR, frozenset())
    if ctx.live_resize and ctx.spec.parallel.hybrid:
        raise TrainingError("elastic.resize: live keeps plain data-parallel replicas only; with "
                            "tensor or pipeline parallelism or ZeRO use resize: restart")
    if ctx.live_resize and "live_resize" not in declared:
        raise TrainingError("elastic.resize: live needs a train function that declares "
                            "@supports('live_resize') (and calls ctx.step_done every step); "
                            "declare it, or use resize: restart")

    @settles_checkpoints
    def attempt(ctx: TrainContext) -> Any:
        while True:
            try:
                result = fn(ctx)
                if kit.preempted_at is not None:  # the controller requeues it, not finishes it
                    result = {**(result if isinstance(result, dict) else {"result": result}),
                              "preempted": True, "steps": kit.preempted_at}
                return result
            except NumericFault as fault:
                if "numeric_guard" not in declared:
                    raise
                message = f"numeric fault at {fault}; rolling back and skipping batch {fault.data_index}"
                if not _agree(_record(ctx, message), ctx):
                    raise TrainingError(f"{message}; gave up after fault_tolerance.max_restarts "
                                        "restarts") from None
                kit.pos.skipped = sorted({*kit.pos.skipped, fault.data_index})
                ctx.log(f"{message}; running the train function again from its last checkpoint",
                        level="WARNING")
            except Exception as exc:
                # A resize, or a peer lost mid-collective: this rank keeps its state in memory,
                # joins the next group, and runs the function again to take it up there.
                if not (ctx.live_resize and (isinstance(exc, ResizeNow) or is_collective_failure(exc))):
                    raise
                if not isinstance(exc, ResizeNow):
                    ctx.log(f"process group broke at step {kit.pos.step}: {str(exc).splitlines()[0]}; "
                            "waiting for the controller to re-form it", level="WARNING")
                if not kit.rejoin():
                    return {"left": True, "steps": kit.pos.step}
    return attempt(ctx)
