"""The built-in trainer: a GPT/Llama decoder on a byte-level corpus, with DDP.

AdamW (or SGD), linear warmup then cosine decay, gradient clipping, gradient
accumulation, batches prefetched while the model computes, and checkpoints
every `checkpoint.interval_steps` plus a final one. For a given seed the run is
deterministic: it resumes at the exact step with data position and RNG states
restored. How each checkpoint is taken is checkpoints.py's.
"""

from __future__ import annotations

import gc
import hashlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.collectives import permit
from kuangchao.workers.data.sampling import BatchSource
from kuangchao.workers.elastic.generation import is_collective_failure, mark_ready
from kuangchao.workers.errors import NumericFault, ResizeNow, TrainingError
from kuangchao.workers.parallel.engine import Engine
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.runtime.telemetry import model_flops_per_token
from kuangchao.workers.trainer import balanced, debug_step, links
from kuangchao.workers.trainer import live_resize as resize
from kuangchao.workers.trainer.checkpoints import push_to_peers, save_step, settles_checkpoints
from kuangchao.workers.trainer.feed import Feed, even_shares, loss_weight
from kuangchao.workers.trainer.job_data import eval_loss, job_sources
from kuangchao.workers.trainer.job_model import build_job_model, dims
from kuangchao.workers.trainer.numerics import GradNormGuard, data_index
from kuangchao.workers.trainer.resume import Position, restore_latest, roll_back, seed_everything


def lr_factor(step: int, spec: JobSpec) -> float:
    """Multiplier on the base LR after `step` optimizer steps."""
    o, total = spec.optimizer, spec.training.steps
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * decay


def global_mean(value: float, ctx: TrainContext) -> float:
    """`value` averaged over every rank (one all-reduce; the token decides)."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    permit("all_reduce")
    with ctx.collective("all_reduce (mean loss)"):
        dist.all_reduce(t)
    return float(t.item()) / ctx.world_size


class _Throughput:
    """Tokens per second over the steps since the last report."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step, self.t0, self.steps = tokens_per_step, time.perf_counter(), 0

    def tick(self) -> None:
        self.steps += 1

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        rate = self.steps * self.tokens_per_step / dt if dt > 0 and self.steps else 0.0
        self.t0, self.steps = time.perf_counter(), 0
        return rate


@settles_checkpoints
def train(ctx: TrainContext) -> dict[str, Any]:
    """Run the built-in training loop. Returns the final loss and checkpoint.

    A numeric fault (NaN/Inf or a spiking gradient norm) rolls the run back
    to its last good checkpoint in place and skips the batch that caused it.
    """
    spec = ctx.spec
    seed_everything(spec.training.seed)
    whole = build_job_model(spec).to(ctx.device)
    n_params = whole.num_params()
    # A pipeline is cut by its stages' speeds, so they are exchanged first; without one
    # the exchange waits for the top of the generation (a rank joining a live resize
    # takes the state before any other collective).
    speeds = balanced.exchange_speeds(ctx) if spec.parallel.pipeline_parallel_size > 1 else None
    engine = build_engine(ctx, whole, balanced.layer_split(ctx, whole, speeds) if speeds else None)
    model, optimizer = engine.holder, engine.optimizer
    ft = spec.fault_tolerance
    guard = GradNormGuard(ft.grad_norm_spike_factor, ft.grad_norm_window)
    if ctx.joining:  # a rank added to a running job: its peers hand it the state
        pos = resize.sync_state(ctx, model, optimizer, guard, None)
        ctx.generation_start = pos.step
        ctx.checkpoint.prepare_group()  # as the survivors do in finish_rejoin
        mark_ready(ctx.group_store, ctx.rank)
        ctx.expect_first_step("resize")
    else:
        pos = restore_latest(ctx, model, optimizer, guard) or Position()
        resize.forget_samples_from(ctx, pos.step)
        ctx.generation_start = pos.step
        # Now, not at the first save, where a rank lost meanwhile would hang the others.
        ctx.checkpoint.prepare_group()
    with ctx.phase("data"):
        source, ctx.eval_source = job_sources(spec, whole)
    if ctx.telemetry is not None:
        n_layers, d_model, _ = dims(spec, whole)
        ctx.telemetry.attach(model, optimizer)
        ctx.telemetry.configure(model_flops_per_token(n_params, n_layers, d_model,
                                                      spec.model.seq_len), ctx.device)
    ctx.log(f"training {n_params:,} parameters from step {pos.step} to {spec.training.steps} on "
            f"{ctx.world_size} rank(s): {engine.describe()}")
    while True:
        wire(ctx, engine)
        balanced.form(ctx, engine, speeds)
        speeds = None  # a later group exchanges them again
        moving = False
        try:
            return _train_from(ctx, pos, engine, source, guard)
        except NumericFault as fault:
            pos = roll_back(ctx, fault, model, optimizer, guard, pos.skipped)
            resize.forget_samples_from(ctx, pos.step)
        except Exception as exc:
            # A planned resize, or (elastic jobs) a peer lost mid-collective: the
            # survivors keep their state and move to the controller's next group.
            if not ctx.live_resize or not (isinstance(exc, ResizeNow)
                                           or is_collective_failure(exc)):
                raise
            if not isinstance(exc, ResizeNow):
                ctx.log(f"process group broke at step {pos.step}: {str(exc).splitlines()[0]}; "
                        "waiting for the controller to re-form it", level="WARNING")
            moving = True
        if moving:
            # The old DDP wrapper's gradient hooks belong to the old group: free it
            # (and the failed frames that hold it) before the next one is made.
            engine.unwrap()
            gc.collect()
            rejoined = resize.rejoin(ctx, model, optimizer, guard, pos)
            if rejoined is None:
                return {"left": True, "steps": pos.step}
            pos = rejoined
            engine.regroup(ctx.rank, ctx.world_size, ctx.accum_steps)


def build_engine(ctx: TrainContext, whole: torch.nn.Module,
                 layer_split: tuple[int, ...] | None = None) -> Engine:
    """Wire the layout; the token must allow every collective it will run.

    Plain data parallelism is left unwrapped here: DDP's constructor is
    collective, and a rank joining a running job must first take its state in
    `sync_state`, which the survivors run before they re-wrap. `wire` wraps it
    at the top of each generation. The other layouts never resize in place
    and are wired at once (their optimizer needs the sharded parameters).
    """
    plain = not ctx.spec.parallel.hybrid
    engine = Engine(ctx.spec, whole, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                    node_of=None if plain else _nodes(ctx), microbatches=ctx.accum_steps,
                    clock=ctx.telemetry.clock if ctx.telemetry is not None else None, log=ctx.log,
                    wrap=not plain, layer_split=layer_split, emulation=balanced.emulation_of(ctx))
    if ctx.world_size > 1:
        for interface in engine.collectives():
            permit(interface)
    return engine


def wire(ctx: TrainContext, engine: Engine) -> None:
    """Wrap plain data parallelism for this generation (a no-op for the other layouts)."""
    if engine.wired:
        return
    engine.node_of = _nodes(ctx) or {}
    engine.wrapped = engine.wrap()
    engine.wired = True
    if engine.hierarchy is not None:
        permit("reduce_scatter")
        ctx.log(f"data-parallel all-reduce is hierarchical over {engine.hierarchy.nodes} nodes "
                f"of {engine.hierarchy.local_size} rank(s)")


def _nodes(ctx: TrainContext) -> dict[int, str] | None:
    """Every rank's node, for the hierarchical all-reduce (None when it cannot apply)."""
    allowed = ctx.spec.permission.collectives
    if (ctx.world_size == 1 or ctx.spec.parallel.hierarchical_allreduce == "off"
            or "reduce_scatter" not in allowed):
        return None
    nodes: list[str] = [""] * ctx.world_size
    permit("all_gather")
    dist.all_gather_object(nodes, ctx.node)
    return dict(enumerate(nodes))


def _train_from(ctx: TrainContext, pos: Position, engine: Engine, source: BatchSource,
                guard: GradNormGuard) -> dict[str, Any]:
    spec = ctx.spec
    model, optimizer = engine.holder, engine.optimizer
    t = spec.training
    global_batch = spec.elastic_range.global_batch  # the same at every size
    meter = _Throughput(global_batch * spec.model.seq_len)
    loss_value = float("nan")
    first = pos.step
    watch = links.LinkWatch(ctx)  # a slow node's link: a straggler event (links.py)
    with Feed(source, ctx, pos) as it:
        for step in range(first, t.steps):
            if ctx.telemetry is not None:
                ctx.telemetry.begin_step()
            if ctx.capture is not None and ctx.capture.req.kind == "profile":
                debug_step.profile(ctx, step)
            # Weighted by this step's share: the plain mean over ranks is the global batch's.
            loss_value = _train_step(engine, it, step, ctx, pos, guard) * loss_weight(ctx)
            resize.record_samples(ctx, step, pos)
            done = pos.step = step + 1  # applied: a rejoin continues after it
            meter.tick()
            if ctx.telemetry is not None:
                samples = (ctx.shares or even_shares(ctx)).counts[ctx.dp_rank]
                ctx.telemetry.end_step(done, samples, samples * spec.model.seq_len)
            watch.after_step(done)
            if balanced.after_step(ctx, engine):  # re-balanced by measured speeds
                it.restart()  # the batches prefetched for the old shares are made again
            if ctx.capture is not None and ctx.capture.profiler is not None:
                debug_step.profiled(ctx, done == t.steps)
            evaluated = {}
            if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
                with ctx.phase("eval"):
                    evaluated = {"eval_loss": global_mean(eval_loss(engine, ctx) * loss_weight(ctx), ctx)}
                if ctx.is_chief:
                    ctx.log(f"step {done} eval loss {evaluated['eval_loss']:.4f}", step=done,
                            **evaluated)
            if done % t.log_interval == 0 or done == t.steps or done == first + 1 or evaluated:
                global_loss = global_mean(loss_value, ctx)
                rate = meter.rate()
                ctx.report(done, loss=global_loss, tokens_per_s=rate, **evaluated,
                           **_progress_extras(ctx, optimizer, model))
                if ctx.is_chief:
                    ctx.log(f"step {done}/{t.steps} loss {global_loss:.4f} tokens/s {rate:.0f}",
                            step=done, loss=global_loss)
            else:
                ctx.report(done)
            if done % spec.checkpoint.interval_steps == 0 and done != t.steps:
                save_step(ctx, done, model, optimizer, pos, guard)
            if done != t.steps:
                push_to_peers(ctx, done, model, optimizer, pos, guard)
            if done == t.steps:
                continue
            preempt, rejoin = ctx.control()
            if rejoin:
                raise ResizeNow(rejoin)
            if preempt:
                info = save_step(ctx, done, model, optimizer, pos, guard, sync=True)
                ctx.log(f"preempted at step {done}; checkpoint saved, yielding the GPUs")
                return {"preempted": True, "steps": done, "checkpoint": info.to_json()}
    final_loss = global_mean(loss_value, ctx)
    digest = check_replicas_in_sync(engine, ctx)
    info = save_step(ctx, t.steps, model, optimizer, pos, guard, sync=True)
    return {"final_loss": final_loss, "steps": t.steps, "checkpoint": info.to_json(),
            "params_sha256": digest, "skipped_batches": pos.skipped}


def _progress_extras(ctx: TrainContext, optimizer: torch.optim.Optimizer,
                     model: torch.nn.Module) -> dict[str, Any]:
    """What `kc train` and `kc submit --wait` show beside the loss: the learning rate,
    this rank's memory and the communication share of its last step; for a mixture of
    experts, its routing (`moe`: the metrics' per-expert load, dropped tokens, losses)."""
    from kuangchao.workers.runtime.telemetry import memory

    mem = memory()
    out: dict[str, Any] = {"lr": float(optimizer.param_groups[0]["lr"]),
                           "mem_bytes": mem.get("cuda_allocated", mem["rss"])}
    if ctx.spec.model.type == "moe":
        from kuangchao.platform.observability.routing import progress_fields
        from kuangchao.workers.models.moe import moe_stats

        out.update(progress_fields(moe_stats(model)))
    if ctx.telemetry is not None:
        from kuangchao.platform.observability import metrics as m

        share = ctx.telemetry.values.get(m.WORKER_COMM_SHARE.name)
        if share is not None:
            out["comm_share"] = float(share)
    return out


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameters and buffers (its own shard of a sharded tensor)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_replicas_in_sync(engine: Engine, ctx: TrainContext) -> str:
    """Compare every data-parallel replica's parameters bit for bit.

    Replicas that drift apart (a non-deterministic kernel, a skipped
    all-reduce) would otherwise go unnoticed until the checkpoint, which
    keeps only one copy. Ranks holding the same shard of the model (same
    pipeline stage and tensor-parallel index, and with expert parallelism the
    same experts) must agree; under ZeRO 2 and 3
    each holds a different slice, so there is nothing to compare, except under
    HSDP, where each slice is held once in every sharding group.

    Returns:
        This rank's digest with plain data parallelism; otherwise one digest
        of every shard of the first replica, in rank order.

    Raises:
        TrainingError: When two ranks that should hold the same parameters do not.
    """
    digest = params_digest(engine.holder)
    if ctx.world_size == 1:
        ctx.log(f"final parameter sha256 {digest}", params_sha256=digest)
        return digest
    digests: list[str] = [""] * ctx.world_size
    permit("all_gather")
    dist.all_gather_object(digests, digest)
    layout = engine.layout
    # The ranks that must hold equal parameters: a whole dp group without FSDP (with expert
    # parallelism, the ranks holding the same experts); under HSDP the ranks holding the
    # same shard, one in each sharding group.
    same = layout.replica_group_of if engine.fsdp else layout.expert_dp_group
    if not engine.fsdp or layout.shard_group:
        for r in range(layout.world_size):
            peers = {digests[q] for q in same(r)}
            if len(peers) != 1:
                raise TrainingError(f"data-parallel replicas diverged: ranks {same(r)} "
                                    f"hold parameter digests {[digests[q] for q in same(r)]}")
    if layout.world_size // layout.dp > 1 or engine.fsdp or layout.ep > 1:
        # One copy of every shard: the first replica's ranks (the first expert-parallel
        # group's), or the first sharding group's.
        first = layout.shard_group or layout.dp if engine.fsdp else layout.ep
        shards = [digests[r] for r in range(layout.world_size) if layout.coords(r).dp < first]
        digest = hashlib.sha256("".join(shards).encode()).hexdigest()
    ctx.log(f"final parameter sha256 {digest}", params_sha256=digest)
    return digest


def _train_step(engine: Engine, it: Iterator, step: int, ctx: TrainContext, pos: Position,
                guard: GradNormGuard) -> float:
    """One optimizer step; raises `NumericFault` instead of applying bad gradients."""
    spec = ctx.spec
    optimizer = engine.optimizer
    index = data_index(step, pos.skipped)
    poison = ctx.is_chief and index in spec.fault_tolerance.inject_nan_at_batches
    for group in optimizer.param_groups:
        group["lr"] = spec.optimizer.lr * lr_factor(step, spec)
    with ctx.phase("data"):
        batches = [tuple(b.to(ctx.device, non_blocking=True) for b in micro) for micro in next(it)]
    # Forward and backward; the data-parallel gradient all-reduce runs inside backward.
    with ctx.phase("forward"):
        loss = engine.forward_backward(batches, poison=poison)  # a fault drill: NaN on rank 0
    with ctx.phase("optimizer"):
        # After the all-reduce every rank holds the same gradients, hence the same norm
        # and the same verdict: no extra collective is needed to agree on a fault.
        if ctx.capture is not None and ctx.capture.gradients_due(step + 1):
            debug_step.gradients(ctx, engine.holder, step + 1)  # as the all-reduce left them
        norm = engine.clip(spec.optimizer.grad_clip)
        if ctx.telemetry is not None:
            ctx.telemetry.observe_numerics(loss, norm, optimizer.param_groups[0]["lr"])
        if engine.precision.overflowed(norm):  # fp16: skip the step, lower the loss scale
            engine.skip()
            return loss
        problem = guard.check(norm)
        if problem:
            optimizer.zero_grad(set_to_none=True)
            raise NumericFault(step, index, problem)
        engine.step()
    return loss
