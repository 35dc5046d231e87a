"""The one line of the job log that says how a rank's engine is wired."""

from __future__ import annotations

from typing import Any


def describe(engine: Any) -> str:
    """An engine's layout in one line, for the job log."""
    p, lay = engine.p, engine.layout
    parts = [f"dp={lay.dp} tp={lay.tp} pp={lay.pp}"]
    if lay.pp > 1:
        parts.append(f"schedule {p.schedule}" + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else ""))
    dp_kind = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2 (FSDP2)", 3: "ZeRO-3 (FSDP2)"}[p.zero_stage]
    parts.append(dp_kind + (" + manual all-reduce" if engine.manual_dp else ""))
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
    return ", ".join(parts)
