"""The one line of the job log that says how a rank's engine is wired."""

from __future__ import annotations

from typing import Any


def describe(engine: Any) -> str:
    """An engine's layout in one line, for the job log."""
    p, lay = engine.p, engine.layout
    parts = [f"dp={lay.dp} tp={lay.tp} pp={lay.pp}"]
    moe = getattr(engine, "moe", None)
    if moe is not None and lay.ep > 1:
        held = sorted(int(name) for name in moe.layers[0].experts)
        parts.append(f"ep={lay.ep}: experts {held[0]}-{held[-1]} of {moe.layers[0].n_experts} "
                     "here, tokens by all_to_all")
    if p.sequence_parallel and lay.tp > 1:
        parts.append("sequence parallel (norms and dropout on sequence shards)")
    if lay.pp > 1:
        parts.append(f"schedule {p.schedule}" + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else ""))
        split = getattr(engine, "layer_split", None)
        if split is not None and len(set(split)) > 1:
            parts.append(f"layers per stage {list(split)} (by speed)")
    dp_kind = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2 (FSDP2)", 3: "ZeRO-3 (FSDP2)"}[p.zero_stage]
    parts.append(dp_kind + (" + manual all-reduce" if engine.manual_dp else ""))
    if lay.shard_group:
        parts.append(f"HSDP: {lay.shard_groups} sharding groups of {lay.shard_group} "
                     f"(ranks {shard_groups(lay, engine.rank)}), replicated across them")
    if p.offload:
        parts.append("offload")
    if engine.hierarchy is not None:
        parts.append("hierarchical all-reduce")
    if p.grad_compression != "none":
        parts.append(f"{p.grad_compression} compression")
    if p.precision != "fp32":
        parts.append(p.precision)
    if p.recompute:
        parts.append("recompute")
    emu = getattr(engine, "emulation", None)
    if emu is not None:
        parts.append(f"emulated at {emu.speed:g} of full speed")
    return ", ".join(parts)


def shard_groups(lay: Any, rank: int, most: int = 4) -> str:
    """`rank`'s data-parallel peers by sharding group, "0,1 | 2,3" (the first `most` groups
    and the last when there are more)."""
    dp = lay.dp_group(rank)
    groups = [",".join(map(str, lay.shard_group_of(r))) for r in dp[::lay.shard_group]]
    if len(groups) > most:
        groups = [*groups[:most - 1], "...", groups[-1]]
    return " | ".join(groups)
