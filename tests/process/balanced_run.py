"""Runs a few training steps of the built-in model with uneven data-parallel shares and a
speed-balanced layer split, on 4 real gloo ranks (spawned by test_balanced.py).

Like tests/layouts/layout_run.py, but each rank takes its share of every step's
global batch from `Shares` (workers/data/shares.py) and the engine is told the
shares (`Engine.set_shares`) and the pipeline's layers per stage; rank 0 writes the
per-step global loss, the loss of each rank weighted by its share.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.workers.checkpoint.manager import CheckpointManager
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.parallel.engine import Engine
from kuangchao.workers.trainer.job_model import build_job_model, dims
from tests.layouts.layout_run import GROUP_TIMEOUT_S, STEPS, global_batches


def _train_case(rank: int, world: int, case: dict) -> None:
    spec = validate_spec(case["doc"])
    p = spec.parallel
    torch.manual_seed(spec.training.seed)
    model = build_job_model(spec)
    vocab = dims(spec, model)[2]
    split = tuple(case["split"]) if case.get("split") else None
    engine = Engine(spec, model, rank=rank, world_size=world, device=torch.device("cpu"),
                    layer_split=split)
    shares = (Shares(tuple(case["counts"]), p.micro_batch_size, p.gradient_accumulation_steps,
                     case["cut"]) if case.get("counts")
              else Shares.even(engine.layout.dp, p.micro_batch_size, p.gradient_accumulation_steps))
    engine.set_shares(shares)
    ckpt, first = case.get("ckpt") or {}, 0
    manager = None
    if ckpt:
        manager = CheckpointManager(ckpt["dir"], "balanced", rank, world, spec.spec_hash())
        if ckpt.get("resume"):
            path, _ = manager.latest_verified()
            manager.load(path, engine.holder, engine.optimizer)
            first = ckpt["at"]
    d = engine.coords.dp
    losses, sizes = [], [len(s) for s in shares.spans(0, d)]
    for step, batch in enumerate(global_batches(spec, STEPS, vocab)):
        if step < first:
            continue
        # index 0: the spans of one block, as rows of this step's global batch
        micro = [(batch[s.start:s.stop, :-1], batch[s.start:s.stop, 1:]) for s in shares.spans(0, d)]
        loss = engine.forward_backward(micro)
        engine.clip(spec.optimizer.grad_clip)
        engine.step()
        t = torch.tensor([loss * shares.weight(d)], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        if manager is not None and not ckpt.get("resume") and step + 1 == ckpt["at"]:
            manager.save(step + 1, engine.holder, engine.optimizer, rank_state={})
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "sizes": sizes,
                                      "blocks": sorted(engine.holder.blocks.keys(), key=int)})
    if rank == 0:
        with open(case["out"], "w") as fh:
            json.dump({"losses": losses, "ranks": gathered, "describe": engine.describe(),
                       "microbatches": engine.microbatches}, fh)
    dist.barrier()


def _rank(rank: int, world: int, cases: list[dict], rendezvous: str) -> None:
    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/case-{i}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            _train_case(rank, world, case)
        except Exception:
            with open(f"{case['out']}.rank{rank}.error", "w") as fh:
                fh.write(traceback.format_exc())
        finally:
            dist.destroy_process_group()
            gc.collect()
    os._exit(0)  # gloo objects torn down at exit can wait on peers that are gone


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    mp.start_processes(_rank, args=(args["world"], args["cases"], args["rendezvous"]),
                       nprocs=args["world"], start_method="spawn")
