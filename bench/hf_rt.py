"""The Ray Train half of bench/hf.py: the loop Ray Train v2's `TorchTrainer` runs.

A Ray Train user's fine-tuning loop for a Hugging Face causal LM, doing per step
what kuangchao's built-in trainer does with its defaults (workers/trainer/loop.py):
the same folder loaded with `AutoModelForCausalLM.from_pretrained` (fp32, sdpa),
wrapped by `ray.train.torch.prepare_model` (DDP over gloo on CPU), AdamW with the
spec's defaults (lr, betas, weight decay), linear warmup then cosine decay,
gradient clipping at `optimizer.grad_clip`, the mean cross-entropy of the logits,
and the loss read back every step. Rank 0 stamps `time.time()` after each
optimizer step and writes them to `config["out"]`; `ray.train.report` carries the
loss every `log_interval` steps, as kuangchao logs it.

The batches are the same samples kuangchao's job draws: the same packed token
stream (the job's tokenized cache, `tokens.u32`, memory-mapped), cut by
kuangchao's `BatchSource` and `batch_indices` (step, rank, world size,
micro-batch), so both sides compute on identical inputs.

Imported by name on Ray's workers (`bench.hf_rt:rt_loop`, the repository root on
their PYTHONPATH), never run as a script.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def lr_at(step: int, opt: dict[str, Any], total: int) -> float:
    """Linear warmup then cosine decay to `min_lr_ratio` (kuangchao's default schedule)."""
    base, warm, floor = opt["lr"], opt["warmup_steps"], opt["min_lr_ratio"]
    if warm and step < warm:
        return base * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return base * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def rt_loop(config: dict[str, Any]) -> None:
    """`train_loop_per_worker`.

    config: {"model": folder, "tokens": path of a uint32 token stream, "seq_len",
    "micro_batch", "steps", "seed", "threads", "log_interval", "optimizer": {lr,
    betas, weight_decay, warmup_steps, min_lr_ratio, grad_clip}, "out": file}.
    """
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from kuangchao.workers.data.sampling import BatchSource, batch_indices

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = time.time()
    torch.manual_seed(config["seed"])
    model = AutoModelForCausalLM.from_pretrained(config["model"], local_files_only=True,
                                                 dtype=torch.float32, attn_implementation="sdpa")
    ddp = ray.train.torch.prepare_model(model)
    o = config["optimizer"]
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=o["lr"], betas=tuple(o["betas"]),
                                  weight_decay=o["weight_decay"])
    tokens = np.memmap(config["tokens"], dtype=np.uint32, mode="r")
    source = BatchSource(tokens, config["seq_len"], config["seed"])
    micro, steps = config["micro_batch"], config["steps"]
    stamps: list[float] = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, o, steps)
        x, y = source.get(batch_indices(step, 0, rank, world, micro, 1))
        logits = ddp(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                               ignore_index=-100)
        loss.backward()
        if o["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.item())
        stamps.append(time.time())
        if (step + 1) % config["log_interval"] == 0 or step + 1 == steps:
            ray.train.report({"step": step + 1, "loss": value})
    if rank == 0:
        Path(config["out"]).write_text(json.dumps({"start": start, "steps": stamps}))
