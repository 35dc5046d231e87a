"""A communication self-test: `entrypoint: kuangchao.workers.comm_check:train`.

Runs each collective named in `args.collectives` (default: every one the
job's token whitelists) a few times over the world group through the guarded
SDK (`kuangchao.workers.collectives`), checks each result, and reports the
median time per collective. A collective outside the whitelist is refused
with `PermissionError`, so the job fails and its events say why: it is also
the smallest demonstration of the permission layer.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kuangchao.workers import collectives as kc
from kuangchao.workers.runtime.context import TrainContext

ROUNDS = 5


def _run(name: str, ctx: TrainContext, group: kc.CommGroup, numel: int) -> None:
    rank, world = ctx.rank, ctx.world_size
    t = torch.full((numel,), float(rank + 1))
    if name == "all_reduce":
        kc.all_reduce(t, group=group, op="sum")
        expect = world * (world + 1) / 2
        assert torch.all(t == expect), f"all_reduce gave {t[0].item()}, expected {expect}"
    elif name == "broadcast":
        kc.broadcast(t, src=0, group=group)
        assert torch.all(t == 1.0), f"broadcast gave {t[0].item()}, expected 1.0"
    elif name == "all_gather":
        out = [torch.empty_like(t) for _ in range(world)]
        kc.all_gather(out, t, group=group)
        assert [o[0].item() for o in out] == [r + 1.0 for r in range(world)]
    elif name == "reduce_scatter":
        out = torch.empty(numel)
        kc.reduce_scatter(out, [t.clone() for _ in range(world)], group=group, op="sum")
        assert torch.all(out == world * (world + 1) / 2)
    elif name == "barrier":
        kc.barrier(group=group)
    elif name in ("send", "recv"):
        # Pairs (0, 1), (2, 3), ...: the even rank sends, the odd one receives.
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer < world:
            if rank % 2 == 0:
                kc.send(t, dst=peer, group=group)
            else:
                kc.recv(t, src=peer, group=group)
                assert torch.all(t == float(peer + 1))
    else:
        raise ValueError(f"args.collectives: {name!r} is not a collective")


def train(ctx: TrainContext) -> dict[str, Any]:
    names = ctx.spec.args.get("collectives") or sorted(ctx.spec.permission.collectives)
    numel = int(ctx.spec.args.get("numel", 1024))
    group = kc.CommGroup(timeout_ms=60_000)
    timings: dict[str, float] = {}
    for step, name in enumerate(names, start=1):
        samples = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            _run(name, ctx, group, numel)
            samples.append(time.perf_counter() - t0)
        timings[name] = statistics.median(samples) * 1e6
        ctx.log(f"{name}: median {timings[name]:.0f} us over {ROUNDS} rounds, {numel} floats",
                collective=name, median_us=timings[name])
        ctx.report(step, loss=0.0)
    # A job succeeds with its final checkpoint on disk; the self-test's state is its timings.
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx.checkpoint.save(len(names), model, opt, rank_state={"timings_us": timings})
    return {"timings_us": timings}
