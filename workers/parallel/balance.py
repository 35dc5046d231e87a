"""Work in proportion to speed on mixed GPU generations (`resources.balance: speed`).

Whale (USENIX ATC'22) balances one job's work over heterogeneous GPUs by their
speed; this module is that arithmetic, without torch:

- a rank's speed (`rank_speeds`): its node's `emulated_speed` on a fake cluster
  (a fraction of full speed), else its GPU type's achieved FLOP/s from the
  catalogue (`peak_flops x mfu_ceiling`), else unknown. Only ratios matter;
- a data-parallel replica runs at its slowest rank's speed (`replica_speeds`), and
  replicas get samples in proportion (`dp_shares`, workers/data/shares.py);
- a pipeline stage runs at its slowest rank's speed (`stage_speeds`), and stages
  get layers in proportion (`stage_split`): the split minimising the slowest
  stage's time `layers / speed`, every stage at least one layer;
- after a few steps each rank's measured compute time per sample re-balances
  the replicas once (`measured_shares`, used by workers/trainer/balanced.py).

ZeRO shards stay even (FSDP2 shards every parameter evenly over its group), and
the micro-batch size is the same on every rank, so activation memory per rank is
the same; a slow GPU gets fewer micro-batches, not smaller ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from kuangchao.workers.data.shares import Shares, split_counts
from kuangchao.workers.parallel.layout import Coords, Layout

# A measured re-balance happens only when some replica's share would move by more
# than this fraction of it: equal GPUs measure within a few percent of each other.
REBALANCE_THRESHOLD = 0.1


def catalogue_speed(gpu_type: str | None) -> float | None:
    """A GPU type's achieved FLOP/s (`peak_flops x mfu_ceiling`); None when unknown."""
    if not gpu_type:
        return None
    from kuangchao.platform.cluster.hardware import get_accelerator

    try:
        acc = get_accelerator(gpu_type)
    except ValueError:
        return None
    return acc.peak_flops * acc.mfu_ceiling


def own_speed(gpu_type: str | None, emulated_speed: float | None) -> tuple[float, float]:
    """What a rank contributes to the exchange: (emulated speed, catalogue speed), 0 for none."""
    return (float(emulated_speed or 0.0), float(catalogue_speed(gpu_type) or 0.0))


def rank_speeds(pairs: Sequence[tuple[float, float]]) -> list[float]:
    """Every rank's speed from every rank's `own_speed`.

    On a fake cluster where any node is emulated, every rank is a CPU process and
    the emulated speeds alone compare them (a rank without one runs at full
    speed, 1.0). Otherwise the catalogue's FLOP/s; a rank of unknown type counts
    as the slowest known one (it gets no more work than that; the measured
    re-balance corrects it), and with no type known every rank is equal.
    """
    if any(e > 0 for e, _ in pairs):
        return [e if e > 0 else 1.0 for e, _ in pairs]
    known = [c for _, c in pairs if c > 0]
    if not known:
        return [1.0] * len(pairs)
    slowest = min(known)
    return [c if c > 0 else slowest for _, c in pairs]


def replica_speeds(speeds: Sequence[float], layout: Layout) -> list[float]:
    """Each data-parallel replica's speed: its slowest rank's (a pipeline or a
    tensor-parallel group moves at the pace of its slowest member)."""
    out = [math.inf] * layout.dp
    for rank, s in enumerate(speeds):
        d = layout.coords(rank).dp
        out[d] = min(out[d], s)
    return out


def stage_speeds(speeds: Sequence[float], layout: Layout) -> list[float]:
    """Each pipeline stage's speed: its slowest rank's, over every replica (all
    replicas cut the model alike, so their gradients can be averaged)."""
    out = [math.inf] * layout.pp
    for rank, s in enumerate(speeds):
        c = layout.coords(rank)
        out[c.pp] = min(out[c.pp], s)
    return out


def stage_split(n_layers: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage minimising max(layers / speed), each stage at least one.

    Greedy by marginal cost: start at one layer each, give each next layer to the
    stage whose time after taking it is least (ties to the first). For times
    increasing in the layer count this minimises the slowest stage's time (each
    step keeps the running maximum as low as any split of that many layers can);
    exact comparisons (fractions). Equal speeds give the even split.

    Raises:
        ValueError: With fewer layers than stages, or a speed that is not positive.
    """
    if len(speeds) > n_layers:
        raise ValueError(f"{n_layers} layers cannot give {len(speeds)} pipeline stages one each")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(f"stage speeds must be positive, got {list(speeds)}")
    exact = [Fraction(s) for s in speeds]
    layers = [1] * len(speeds)
    for _ in range(n_layers - len(speeds)):
        i = min(range(len(layers)), key=lambda i: ((layers[i] + 1) / exact[i], i))
        layers[i] += 1
    return tuple(layers)


def speeds_differ(speeds: Sequence[float]) -> bool:
    """Whether a group's ranks run at different speeds (types or emulated speeds): only
    then is its compute measured and its data-parallel split re-balanced by it."""
    return len(speeds) > 1 and max(speeds) - min(speeds) > 1e-9 * max(speeds)


def split_applies(parallel, pp: int) -> bool:
    """Whether stages are balanced: a plain pipeline (an interleaved one keeps even chunks,
    each rank holding several, which one split per rank cannot describe)."""
    return pp > 1 and parallel.virtual_stages == 1 and parallel.schedule != "interleaved_1f1b"


def share_cut(parallel, layout: Layout) -> str | None:
    """How replicas' runs are cut into micro-batches (workers/data/shares.py); None when
    replicas cannot be balanced and stay even.

    A pipeline takes whole micro-batches, and under FSDP its gradients are reduced
    before the schedule scales them by its micro-batch count, so FSDP with a
    pipeline (or an interleaved schedule) stays even.
    """
    fsdp = parallel.zero_stage >= 2
    if layout.pp > 1:
        return None if fsdp or parallel.schedule == "interleaved_1f1b" else "units"
    return "common" if fsdp else "own"


def dp_shares(speeds: Sequence[float], layout: Layout, parallel, accum: int,
              balance: str = "speed") -> Shares:
    """The data-parallel split for every rank's speed (`rank_speeds`)."""
    mb = parallel.micro_batch_size
    even = Shares.even(layout.dp, mb, accum)
    cut = share_cut(parallel, layout)
    reps = replica_speeds(speeds, layout)
    if balance != "speed" or cut is None or layout.dp == 1 or len(set(reps)) == 1:
        return even
    return shares_for(reps, mb, accum, cut, layout.pp) or even


def shares_for(reps: Sequence[float], mb: int, accum: int, cut: str, pp: int = 1) -> Shares | None:
    """Shares proportional to replica speeds `reps`; None when the cut cannot honour them
    (a pipeline needs at least `pp` micro-batches per replica: 1F1B's warm-up)."""
    unit, minimum = (mb, pp) if cut == "units" else (1, 1)
    total = mb * accum * len(reps)
    if minimum * len(reps) * unit > total:
        return None
    return Shares(split_counts(reps, total, unit, minimum), mb, accum, cut)


def measured_shares(current: Shares, per_sample_s: Sequence[float], layout: Layout, cut: str,
                    threshold: float = REBALANCE_THRESHOLD) -> tuple[Shares, list[float]] | None:
    """The shares the measured compute times call for, when they differ enough.

    Args:
        current: The shares in use.
        per_sample_s: Every rank's compute seconds per sample of its replica.
        layout: The job's layout.
        cut: How replicas' runs are cut (`share_cut`).
        threshold: Re-balance only when a replica's proportional count differs from its
            current one by more than this fraction of it (noise between equal GPUs
            stays below it).

    Returns:
        (new shares, measured replica speeds), or None to keep the current ones.
    """
    reps = [1.0 / t if t > 0 else math.inf for t in replica_times(per_sample_s, layout)]
    if any(not math.isfinite(s) for s in reps):
        return None  # a rank measured nothing: keep what we have
    # Judged on the exact proportional counts, not the rounded ones: rounding alone can
    # move a small share by a whole sample.
    whole = sum(reps)
    quota = [current.global_batch * s / whole for s in reps]
    if max(abs(q - c) / c for q, c in zip(quota, current.counts, strict=True)) <= threshold:
        return None
    new = shares_for(reps, current.micro_batch_size, current.accum_steps, cut, layout.pp)
    if new is None or new.counts == current.counts:
        return None
    if new.is_even:
        new = Shares.even(layout.dp, current.micro_batch_size, current.accum_steps)
    return new, reps


def replica_times(per_sample_s: Sequence[float], layout: Layout) -> list[float]:
    """Each replica's seconds per sample: its slowest rank's."""
    out = [0.0] * layout.dp
    for rank, t in enumerate(per_sample_s):
        d = layout.coords(rank).dp
        out[d] = max(out[d], t)
    return out


def stage_times(per_sample_s: Sequence[float], layout: Layout) -> list[float]:
    """Each pipeline stage's seconds per sample: its slowest rank's."""
    out = [0.0] * layout.pp
    for rank, t in enumerate(per_sample_s):
        c: Coords = layout.coords(rank)
        out[c.pp] = max(out[c.pp], t)
    return out
