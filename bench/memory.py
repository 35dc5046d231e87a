"""Sequence parallelism: the activation memory it saves per rank.

  sp_activation_memory_ratio      the bytes autograd's saved tensors hold on one rank
                                  after the forward pass of one micro-batch, with
                                  `parallel.sequence_parallel` (ours) against plain
                                  tensor parallelism (baseline), at tp 4 and seq 2048.
                                  Target <= 0.6; Megatron's accounting (Korthikanti et
                                  al. 2022, platform/planning/activations.py) gives 0.53.
  sp_activation_memory_ratio_tp2  the same at tp 2, beside Megatron's 0.77. Informative.

Each side is the built-in trainer's own wiring (`Engine`, as a job's rank builds it)
on 4 gloo processes on this machine: dp1 x tp4, then dp2 x tp2 (the data-parallel
replica does not change a rank's activations). The CPU has no device allocator
whose peak could be read, so the bytes are counted where they are held: a pair of
saved-tensor hooks around the forward pass and loss records every tensor autograd
saves for backward, and the unique storages they live in are summed (a DTensor by
its local shard; parameters, which autograd also saves, left out). Both sides then
run backward, and their losses must agree (rel 1e-5): the memory is saved, not the
arithmetic changed.

The model is the built-in GPT (LayerNorm, GELU MLP, learned positions; dropout 0,
so none of the dropout masks Megatron counts; attention by PyTorch's fused kernel,
which keeps no seq x seq matrix), fp32, micro-batch 1: 4 layers, d_model 512,
8 heads, vocabulary 256 (its logits are the same on both sides and small beside
the layers). It holds at most about 180 MB of saved activations per rank (tp 2
without sequence parallelism); the whole run takes about 30 s on 2 cores.

Run: .venv/bin/python bench/memory.py [--quick] [--seq 2048] [--layers 4] [--d-model 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

from bench.report import emit, keep_stdout_for_results, log  # noqa: E402
from kuangchao.platform.planning.activations import sp_memory_ratio  # noqa: E402

WORLD = 4
TARGET = 0.6
LOSS_RTOL = 1e-5
# Each measured layout: (name, tensor-parallel size); data-parallel fills the 4 ranks.
LAYOUTS = (("tp4", 4), ("tp2", 2))


def _doc(args: argparse.Namespace, tp: int, sp: bool) -> dict:
    model = {"type": "gpt", "n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
             "seq_len": args.seq, "vocab_size": 256}
    return {"model": model, "parallel": {"data_parallel_size": WORLD // tp, "tensor_parallel_size": tp,
                                         "micro_batch_size": 1, "sequence_parallel": sp}}


def saved_bytes(engine, x, y) -> tuple[float, float]:
    """(bytes of the unique storages autograd saved in one forward + loss, the loss), then
    backward (so both sides also run it)."""
    import torch
    from torch.distributed.tensor import DTensor

    from kuangchao.workers.parallel.pipeline import lm_loss

    def storage(t: torch.Tensor):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    params = {storage(p.data).data_ptr() for p in engine.holder.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage(t)
        if s.data_ptr() not in params:
            held[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(engine.wrapped[0](x), y)
    total = float(sum(held.values()))
    loss.backward()
    return total, float(loss.detach())


def _rank(rank: int, args: argparse.Namespace, rendezvous: str, out: str) -> None:
    started = time.monotonic()  # the parent's clock is another process's: time the imports here
    import torch
    import torch.distributed as dist

    from kuangchao.platform.spec.jobspec import validate_spec
    from kuangchao.workers.parallel.engine import Engine
    from kuangchao.workers.trainer.job_model import build_job_model

    torch.set_num_threads(1)
    start_s = time.monotonic() - started
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    results: dict[str, Any] = {"start_s": start_s}
    try:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (1, args.seq + 1), generator=gen)
        for name, tp in LAYOUTS:
            for sp in (False, True):
                spec = validate_spec(_doc(args, tp, sp))
                torch.manual_seed(spec.training.seed)
                engine = Engine(spec, build_job_model(spec), rank=rank, world_size=WORLD,
                                device=torch.device("cpu"))
                t0 = time.monotonic()
                held, loss = saved_bytes(engine, tokens[:, :-1], tokens[:, 1:])
                side = "sp" if sp else "tp"
                results[f"{name}.{side}"] = {"bytes": held, "loss": loss, "s": time.monotonic() - t0}
                del engine
                dist.barrier()
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kc-bench-memory-") as tmp:
        out = f"{tmp}/results.json"
        t0 = time.monotonic()
        mp.start_processes(_rank, args=(args, f"{tmp}/rendezvous", out), nprocs=WORLD,
                           start_method="spawn")
        got = json.loads(Path(out).read_text())
        log(f"{WORLD} ranks started, measured and stopped in {time.monotonic() - t0:.1f}s "
            f"(of which the ranks' imports and first group {got.pop('start_s'):.1f}s)")
        return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--quick", action="store_true",
                    help="seq 256, 2 layers of width 128: checks the script works (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.seq, args.layers, args.d_model, args.heads = 256, 2, 128, 4
    keep_stdout_for_results()
    log(f"model: gpt, {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq "
        f"{args.seq}, vocab 256, micro-batch 1, fp32; {WORLD} gloo ranks")
    t0 = time.monotonic()
    got = measure(args)
    for name, tp in LAYOUTS:
        sp, plain = got[f"{name}.sp"], got[f"{name}.tp"]
        rel = abs(sp["loss"] - plain["loss"]) / abs(plain["loss"])
        megatron = sp_memory_ratio(args.seq, args.d_model, args.heads, tp, scores=False)
        log(f"{name}: saved activations per rank {sp['bytes'] / 2**20:.1f} MiB with sequence "
            f"parallelism, {plain['bytes'] / 2**20:.1f} MiB without (ratio "
            f"{sp['bytes'] / plain['bytes']:.3f}; Megatron's accounting {megatron:.2f}); losses "
            f"{sp['loss']:.6f} and {plain['loss']:.6f} (rel {rel:.1e}); forward+backward "
            f"{sp['s']:.1f} s and {plain['s']:.1f} s")
        metric = "sp_activation_memory_ratio" + ("" if tp == 4 else f"_tp{tp}")
        extra = {"megatron_ratio": round(megatron, 3), "loss_rel_diff": rel,
                 "settings": f"tp {tp}, seq {args.seq}, gpt {args.layers} layers d_model "
                             f"{args.d_model}, micro-batch 1, fp32; baseline: the same without "
                             "sequence parallelism"}
        if rel > LOSS_RTOL:
            extra["error"] = (f"the losses differ by {rel:.1e} > {LOSS_RTOL}: sequence parallelism "
                              "changed the arithmetic")
        emit("memory", metric, "bytes", sp["bytes"], plain["bytes"], TARGET if tp == 4 else None,
             better="lower", target_on="ratio", **extra)
    log(f"total wall time {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
