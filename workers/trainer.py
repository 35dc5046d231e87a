"""The built-in trainer: a GPT/Llama decoder on a byte-level corpus, with DDP.

AdamW (or SGD), linear warmup then cosine decay, gradient clipping, gradient
accumulation, batches prefetched while the model computes, and checkpoints
every `checkpoint.interval_steps` plus a final one. For a given seed the run is
deterministic: it resumes at the exact step with data position and RNG states
restored.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kuangchao.platform.spec import JobSpec
from kuangchao.workers.context import TrainContext
from kuangchao.workers.data import BatchSource, Prefetcher, batch_indices, load_corpus
from kuangchao.workers.errors import TrainingError
from kuangchao.workers.model import ModelConfig, build_model


def model_config(spec: JobSpec) -> ModelConfig:
    m = spec.model
    return ModelConfig(type=m.type, n_layers=m.n_layers, n_heads=m.n_heads, d_model=m.d_model,
                       seq_len=m.seq_len, vocab_size=m.vocab_size, dropout=m.dropout, d_ff=m.d_ff)


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


def make_optimizer(model: torch.nn.Module, spec: JobSpec) -> torch.optim.Optimizer:
    o = spec.optimizer
    # Biases and norm weights (1-D) are not decayed, as is usual for transformers.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if o.type == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _batches(source: BatchSource, spec: JobSpec, ctx: TrainContext,
             start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    p = spec.parallel
    for step in range(start_step, spec.training.steps):
        for micro in range(p.gradient_accumulation_steps):
            idx = batch_indices(step, micro, ctx.dp_rank, ctx.dp_size, p.micro_batch_size,
                                p.gradient_accumulation_steps)
            yield source.get(idx)


def _global_mean(value: float, ctx: TrainContext) -> float:
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
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


def train(ctx: TrainContext) -> dict[str, Any]:
    """Run the built-in training loop. Returns the final loss and checkpoint."""
    spec = ctx.spec
    p, t = spec.parallel, spec.training
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    model = build_model(model_config(spec)).to(ctx.device)
    ddp: torch.nn.Module = model
    if ctx.world_size > 1:
        ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model, spec)
    start_step = 0
    restored = ctx.checkpoint.latest_verified()
    if restored is not None:
        path, manifest = restored
        state = ctx.checkpoint.load(path, model, optimizer)
        set_rng_state(state["rng"])
        start_step = int(manifest["step"])
        ctx.log(f"restored checkpoint {path} at step {start_step}")
    corpus = load_corpus(spec.data.path, spec.data.max_bytes, spec.model.vocab_size)
    source = BatchSource(corpus, spec.model.seq_len, t.seed)
    tokens_per_step = p.micro_batch_size * p.gradient_accumulation_steps * ctx.dp_size * spec.model.seq_len
    meter = _Throughput(tokens_per_step)
    ctx.log(f"training {model.num_params():,} parameters from step {start_step} "
            f"to {t.steps} on {ctx.world_size} rank(s)")
    loss_value = float("nan")
    with Prefetcher(_batches(source, spec, ctx, start_step), depth=max(1, spec.data.prefetch)) as it:
        for step in range(start_step, t.steps):
            loss_value = _train_step(ddp, model, optimizer, it, spec, step, ctx.device)
            meter.tick()
            done = step + 1
            if done % t.log_interval == 0 or done == t.steps or step == start_step:
                global_loss = _global_mean(loss_value, ctx)
                rate = meter.rate()
                ctx.report(done, loss=global_loss, tokens_per_s=rate)
                if ctx.is_chief:
                    ctx.log(f"step {done}/{t.steps} loss {global_loss:.4f} tokens/s {rate:.0f}",
                            step=done, loss=global_loss)
            else:
                ctx.report(done)
            if done % spec.checkpoint.interval_steps == 0 and done != t.steps:
                _save(ctx, done, model, optimizer)
            if done != t.steps and ctx.preemption_requested():
                info = _save(ctx, done, model, optimizer)
                ctx.log(f"preempted at step {done}; checkpoint saved, yielding the GPUs")
                return {"preempted": True, "steps": done, "checkpoint": info.to_json()}
    final_loss = _global_mean(loss_value, ctx)
    digest = check_replicas_in_sync(model, ctx)
    info = _save(ctx, t.steps, model, optimizer)
    return {"final_loss": final_loss, "steps": t.steps, "checkpoint": info.to_json(),
            "params_sha256": digest}


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_replicas_in_sync(model: torch.nn.Module, ctx: TrainContext) -> str:
    """Compare every data-parallel replica's parameters bit for bit.

    Replicas that drift apart (a non-deterministic kernel, a skipped
    all-reduce) would otherwise go unnoticed until the checkpoint, which
    keeps only one copy.

    Raises:
        TrainingError: When any two ranks hold different parameters.
    """
    digest = params_digest(model)
    ctx.log(f"final parameter sha256 {digest}", params_sha256=digest)
    if ctx.world_size > 1:
        digests: list[str] = [""] * ctx.world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise TrainingError(f"data-parallel replicas diverged: parameter digests {digests}")
    return digest


def _train_step(ddp: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                it: Iterator, spec: JobSpec, step: int, device: torch.device) -> float:
    accum = spec.parallel.gradient_accumulation_steps
    for group in optimizer.param_groups:
        group["lr"] = spec.optimizer.lr * lr_factor(step, spec)
    total = 0.0
    for micro in range(accum):
        x, y = (b.to(device, non_blocking=True) for b in next(it))
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        sync = micro == accum - 1 or not isinstance(ddp, DistributedDataParallel)
        with nullcontext() if sync else ddp.no_sync():
            _, loss = ddp(x, y)
            (loss / accum).backward()
        total += float(loss.detach())
    if spec.optimizer.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / accum


def _save(ctx: TrainContext, step: int, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer):
    t0 = time.perf_counter()
    info = ctx.checkpoint.save(step, model, optimizer, rank_state={"rng": rng_state(), "step": step},
                               extra={"parallel": ctx.spec.parallel.model_dump()})
    if ctx.is_chief:
        ctx.log(f"checkpoint step {step} -> {info.path} ({info.bytes} bytes, "
                f"{time.perf_counter() - t0:.2f}s)", step=step)
    return info
