"""Runs a few training steps of the built-in model under each of a list of layouts
(spawned by test_layouts.py).

Every rank runs `kuangchao.workers.parallel.engine.Engine` over real gloo process groups,
with the data a single process would see split by data-parallel rank; rank 0
writes the per-step losses (and gradient norms) as JSON.
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
from kuangchao.workers.models.moe import moe_stats
from kuangchao.workers.parallel.engine import Engine
from kuangchao.workers.trainer.job_model import build_job_model, dims

STEPS = 5
# A case whose rank failed times its peers out after this long, instead of hanging.
GROUP_TIMEOUT_S = 60


def global_batches(spec, steps: int, vocab: int) -> list[torch.Tensor]:
    """Each step's whole batch of token rows, [G, seq_len + 1], the same for every layout."""
    p, m = spec.parallel, spec.model
    rows = p.data_parallel_size * p.micro_batch_size * p.gradient_accumulation_steps
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (rows, m.seq_len + 1), generator=gen) for _ in range(steps)]


def _logits_error(spec, engine: Engine, vocab: int) -> dict | None:
    """This rank's step-0 logits of the first global batch against transformers' own
    forward of the model folder; None on a rank that holds no logits (an early stage)."""
    from kuangchao.workers.models.hf import load_hf

    batch = global_batches(spec, 1, vocab)[0]
    x = batch[:, :-1]
    with torch.no_grad():
        if engine.schedule is None:
            got = engine.wrapped[0](x)
        else:  # the schedule's loss wants targets; its output is the last stage's logits
            args = (x,) if engine.holds_first else ()
            kwargs = {"target": batch[:, 1:], "losses": []} if engine.holds_last else {}
            got = engine.schedule.eval(*args, **kwargs)
        if not engine.holds_last:
            return None
        want = load_hf(spec.model.hf_folder, pretrained=spec.model.pretrained,
                       seed=spec.training.seed)(x).logits
    return {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max())}


def micro_steps(spec, batch: torch.Tensor) -> list[torch.Tensor]:
    """The rows of each forward a single process runs on the global batch: all of them at
    once, or, for a mixture of experts, whose expert capacity is counted over the global
    micro-batch, the i-th micro-batch of every data-parallel rank together, as the ranks
    run them (accumulated: the mean of the micro-batches' losses, as the ranks' is)."""
    p = spec.parallel
    n, mb = p.gradient_accumulation_steps, p.micro_batch_size
    if spec.model.type != "moe" or n == 1:
        return [batch]
    per = mb * n
    return [torch.cat([batch[d * per + i * mb:d * per + (i + 1) * mb]
                       for d in range(p.data_parallel_size)]) for i in range(n)]


def reference(doc: dict, steps: int = STEPS) -> dict:
    """Single-process training on the whole global batch: the losses every layout must match
    (and, for a mixture of experts, its last step's routing statistics)."""
    spec = validate_spec(doc)
    torch.manual_seed(spec.training.seed)
    model = build_job_model(spec)
    from kuangchao.workers.parallel.data_parallel import make_optimizer

    opt = make_optimizer(model, spec)
    losses, norms = [], []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if spec.parallel.precision == "bf16" \
        else torch.autocast("cpu", enabled=False)
    for batch in global_batches(spec, steps, dims(spec, model)[2]):
        parts = micro_steps(spec, batch)
        if hasattr(model, "moe_state"):  # the auxiliary losses' gradients scale as the loss's
            model.reset_moe_stats()
            model.moe_state.grad_scale = 1.0 / len(parts)
        total = 0.0
        for rows in parts:
            with ctx:
                if getattr(model, "opaque", False):  # a whole HF model: logits only
                    from kuangchao.workers.parallel.pipeline import lm_loss

                    loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
                else:
                    _, loss = model(rows[:, :-1], rows[:, 1:])
            (loss / len(parts) if len(parts) > 1 else loss).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                          spec.optimizer.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total / len(parts))
    out = {"losses": losses, "norms": norms}
    if hasattr(model, "moe_stats"):
        out["moe"] = model.moe_stats()
    return out


def _train_case(rank: int, world: int, case: dict) -> None:
    """One layout's STEPS steps on the current process group; rank 0 writes case["out"]."""
    doc, nodes, ckpt = case["doc"], case.get("nodes") or [], case.get("ckpt") or {}
    spec = validate_spec(doc)
    torch.manual_seed(spec.training.seed)
    model = build_job_model(spec)
    vocab = dims(spec, model)[2]
    engine = Engine(spec, model, rank=rank, world_size=world, device=torch.device("cpu"),
                    node_of=dict(enumerate(nodes)) if nodes else None)
    if case.get("logits"):
        err = _logits_error(spec, engine, vocab)
        if err is not None:
            with open(f"{case['out']}.logits{rank}", "w") as fh:
                json.dump(err, fh)
    manager = None
    first = 0
    if ckpt:
        manager = CheckpointManager(ckpt["dir"], "layouts", rank, world, spec.spec_hash())
        if ckpt.get("resume"):
            path, _ = manager.latest_verified()
            manager.load(path, engine.holder, engine.optimizer)
            first = ckpt["at"]
    p = spec.parallel
    d = engine.coords.dp
    per = p.micro_batch_size * p.gradient_accumulation_steps
    losses, norms = [], []
    for step, batch in enumerate(global_batches(spec, STEPS, vocab)):
        if step < first:
            continue
        mine = batch[d * per:(d + 1) * per]
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(p.micro_batch_size)]
        loss = engine.forward_backward(micro)
        norms.append(engine.clip(spec.optimizer.grad_clip))
        engine.step()
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        if manager is not None and not ckpt.get("resume") and step + 1 == ckpt["at"]:
            manager.save(step + 1, engine.holder, engine.optimizer, rank_state={})
    if rank == 0:
        with open(case["out"], "w") as fh:
            json.dump({"losses": losses, "norms": norms, "moe": moe_stats(engine.holder),
                       "hierarchy": engine.hierarchy is not None, "describe": engine.describe(),
                       "placements": str(getattr(next(engine.holder.parameters()), "placements", "")),
                       "wrapped": [type(w).__name__ for w in engine.wrapped],
                       "optimizer": type(engine.optimizer).__name__}, fh)
    dist.barrier()


def _forget_meshes() -> None:
    """Drop DTensor's sharding caches between cases. A case's device mesh can equal an
    earlier case's (mesh equality ignores process groups), and the caches would hand it
    specs holding the earlier mesh, whose groups are gone, or named alike only when the
    cases happened to create their groups in the same order."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def _rank(rank: int, world: int, cases: list[dict], rendezvous: str) -> None:
    """Run every case in turn, each on a process group of its own.

    Importing torch and spawning the ranks is most of a case's cost on a small
    machine, so one set of ranks runs them all. A fresh group per case (a file
    rendezvous each, so no port can be taken) keeps the cases apart, as the
    elastic worker re-forms its group in-process. A failing case leaves its
    traceback in `<out>.rank<r>.error` and the ranks go on with the next one;
    its peers' collectives time out rather than hang.
    """
    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        size = case.get("world") or world  # a case may run on the first ranks only
        if rank >= size:
            continue
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/case-{i}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            _train_case(rank, size, case)
        except Exception:
            with open(f"{case['out']}.rank{rank}.error", "w") as fh:
                fh.write(traceback.format_exc())
        finally:
            dist.destroy_process_group()
            _forget_meshes()
            gc.collect()
    # Gloo and DDP objects torn down at interpreter exit can wait on peers that are gone.
    os._exit(0)


def run(cases: list[dict], world: int, rendezvous: str) -> None:
    """Train STEPS steps of each case on `world` ranks.

    A case is {"doc", "out", "nodes"?, "ckpt"?, "world"?}; "world" runs it on the first
    that many ranks (the others go on to the next case); `ckpt` = {"dir", "at"} saves after
    step `at`, and with "resume": true restores that checkpoint and trains the steps
    after it (so the saving case must come earlier in `cases`).
    """
    mp.start_processes(_rank, args=(world, cases, rendezvous), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    run(args["cases"], args["world"], args["rendezvous"])
