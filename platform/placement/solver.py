"""Placement: map a job's ranks onto free GPUs. Pure, deterministic, no Ray.

Rank order follows the parallel layout, tensor-parallel fastest:
`rank = (dp_index * pp + stage) * tp + tp_index`, so data-parallel replica i
(one pipeline) holds ranks `[i*pp*tp, (i+1)*pp*tp)`.

Rules, from hard to soft:

0. GPU types (pools.py): ranks go only to nodes of a type the job lists
   (`resources.gpu_types`); a one-type job (`heterogeneous: false`, the default)
   is placed inside one pool, the first in its order of preference that fits;
   per-type quota room (`caps`) is never exceeded (hard);
1. every tensor-parallel group sits inside one NVLink island (hard); a single
   rank (tp=1) with more GPUs than an island needs one node. A group is
   therefore always of one GPU type, even in a mixed job;
2. every pipeline sits inside one leaf switch when capacity allows, unless the
   job's traffic says that packing its replicas into fewer leaves (letting a
   pipeline straddle a leaf boundary) moves fewer bytes across leaves;
3. the data-parallel rings cross as few leaves as possible: replicas are
   packed into the fewest leaves (under one spine when possible) and laid out
   leaf by leaf, so a ring changes leaf only once per leaf it spans;
4. best fit: the tightest leaf, node and island that fits is used first, so
   the free capacity left behind stays in large, usable blocks;
5. in a mixed job, each pipeline's stages come from nodes of one type when
   capacity allows: a pipeline runs at its slowest stage's pace, and stages
   of one type balance by layer count alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.placement.index import FreeIndex, GroupSlot, Scope
from kuangchao.platform.placement.pools import Pool, no_pool_reason, preference
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.spec.stored import spec_of


@dataclass(frozen=True)
class JobShape:
    """A job's parallel layout, and the GPU types its ranks may use.

    Attributes:
        gpu_types: Catalogue types the job accepts, in its order of preference
            (empty: any node, untyped ones included).
        heterogeneous: Whether its ranks may mix types; else all go to one pool.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    gpus_per_rank: int = 1
    gpu_types: tuple[str, ...] = ()
    heterogeneous: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def group_gpus(self) -> int:
        """GPUs one tensor-parallel group needs inside one island."""
        return self.tp * self.gpus_per_rank


@dataclass(frozen=True)
class Traffic:
    """Bytes one optimizer step moves, used to weigh layouts against each other.

    Attributes:
        grad_bytes: The model's gradient size; a data-parallel ring all-reduce
            moves about `2 * (dp - 1) / dp * grad_bytes / (tp * pp)` over each
            ring edge.
        activation_bytes: Activations forward plus gradients backward over one
            pipeline stage boundary, for all micro-batches of a step.
    """

    grad_bytes: float = 0.0
    activation_bytes: float = 0.0


def traffic_from_spec(spec_doc: dict) -> Traffic:
    """Estimate per-step traffic from a stored spec document (fp32 gradients)."""
    return traffic_of(spec_of(spec_doc))


def traffic_of(spec: JobSpec) -> Traffic:
    """Estimate per-step traffic of a typed spec (fp32 gradients)."""
    m, par = spec.model, spec.parallel
    params = 12 * m.n_layers * m.d_model * m.d_model + m.vocab_size * m.d_model
    micro = par.micro_batch_size * par.gradient_accumulation_steps
    return Traffic(grad_bytes=4.0 * params, activation_bytes=2.0 * micro * m.seq_len * m.d_model * 4)


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node: str
    node_id: str
    leaf: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class PlacementPlan:
    slots: tuple[RankSlot, ...]


@dataclass(frozen=True)
class Infeasible:
    reason: str


def _cover(leaves: list[str], cap: dict[str, int], need: int) -> list[str] | None:
    """Fewest leaves whose capacities add up to `need`; the last one best-fit."""
    order = sorted((lf for lf in leaves if cap[lf] > 0), key=lambda lf: (-cap[lf], lf))
    chosen: list[str] = []
    got = 0
    for leaf in order:
        rest = need - got
        fitting = [lf for lf in order if lf not in chosen and cap[lf] >= rest]
        if fitting:
            return chosen + [min(fitting, key=lambda lf: (cap[lf], lf))]
        chosen.append(leaf)
        got += cap[leaf]
    return None


def _choose_leaves(cap: dict[str, int], need: int, spine: dict[str, str | None]) -> list[str] | None:
    by_spine: dict[str | None, list[str]] = defaultdict(list)
    for leaf in cap:
        by_spine[spine.get(leaf)].append(leaf)
    options = []
    for sp, leaves in by_spine.items():
        sel = _cover(leaves, cap, need)
        if sel is not None:
            options.append((len(sel), sum(cap[lf] for lf in sel) - need, str(sp), sel))
    if options:
        return min(options)[3]
    return _cover(list(cap), cap, need)


def place(nodes: tuple[NodeInfo, ...], used: dict[str, set[int]], shape: JobShape,
          traffic: Traffic | None = None,
          caps: Mapping[str, int] | None = None) -> PlacementPlan | Infeasible:
    """Place every rank of `shape`, or explain why not.

    Args:
        nodes: The cluster's nodes.
        used: GPU ids already taken, by node name.
        shape: The job's parallel layout and the GPU types it accepts.
        traffic: The job's per-step traffic. When given, keeping pipelines
            whole is weighed against packing into fewer leaves, and the layout
            that moves fewer bytes across leaves wins; without it, pipelines
            stay whole whenever some leaves can hold them.
        caps: GPUs of each type the job may still take (its queue's per-type
            quota room); a type not named is not limited here.

    Returns:
        A plan with one slot per rank in rank order, or `Infeasible` with a
        reason that names the capacity that is missing.
    """
    if shape.gpus_per_rank == 0:
        return _place_cpu_only(tuple(n for n in nodes if not shape.gpu_types
                                     or n.gpu_type in shape.gpu_types), shape)
    return place_on(FreeIndex(nodes, used), shape, traffic, caps)


def place_on(index: FreeIndex, shape: JobShape, traffic: Traffic | None = None,
             caps: Mapping[str, int] | None = None) -> PlacementPlan | Infeasible:
    """`place` over a kept `FreeIndex`: the same plan, without rescanning every node.

    A scheduling cycle keeps one index over what its decisions have taken and
    calls this for each job, so a solve costs what changed since the last one
    plus the job's own size, not the cluster's.
    """
    if shape.gpus_per_rank == 0:
        return place(index.nodes, {}, shape)
    pools = index.pools(shape.gpu_types)
    if not pools and shape.gpu_types:
        return Infeasible(no_pool_reason(index.nodes, shape.gpu_types))
    if shape.heterogeneous or len(pools) <= 1:
        scope = index.scope(pools)
        whole = len(scope.nodes) == len(index.live)
        return _place_within(index, scope, shape, traffic, caps,
                             "the cluster" if whole else _scope(pools))
    reasons = []
    for pool in pools:  # one type for all ranks: the first pool, in preference order, that fits
        plan = _place_within(index, index.scope([pool]), shape, traffic, caps, _scope([pool]))
        if isinstance(plan, PlacementPlan):
            return plan
        reasons.append(plan.reason)
    return Infeasible("no single GPU type can hold all ranks: " + "; ".join(reasons))


def _scope(pools: list[Pool]) -> str:
    return f"the {'/'.join(p.name for p in pools)} pool{'s' if len(pools) > 1 else ''}"


def _place_within(index: FreeIndex, scope: Scope, shape: JobShape, traffic: Traffic | None,
                  caps: Mapping[str, int] | None, name: str) -> PlacementPlan | Infeasible:
    """Place on the scope's live nodes (the accepted ones); `name` names them in reasons."""
    where = "" if name == "the cluster" else f" in {name}"
    total = scope.gpus
    total_free = index.free_in(scope)
    need = shape.world_size * shape.gpus_per_rank
    if need > total:
        return Infeasible(f"needs {need} GPUs, {name} has {total}")
    if need > total_free:
        return Infeasible(f"needs {need} GPUs, {total_free} of {total}{where} are free")
    k = shape.group_gpus
    if shape.tp > 1:
        if k > scope.largest_island:
            return Infeasible(f"a tensor-parallel group needs {k} GPUs in one NVLink island; "
                              f"the largest island{where} has {scope.largest_island}")
    elif k > scope.largest_node:
        return Infeasible(f"a rank needs {k} GPUs on one node; the largest node{where} has "
                          f"{scope.largest_node}")
    slots = index.leaf_slots(k, shape.tp, scope)
    trimmed = False
    if caps:
        slots, trimmed = _within_caps(slots, caps, k)
    if shape.pp > 1 and len(scope.types) > 1:
        slots = {lf: _one_type_pipelines(s, shape) for lf, s in slots.items()}
    groups = shape.dp * shape.pp
    n_slots = sum(len(s) for s in slots.values())
    if n_slots < groups:
        if trimmed:
            return Infeasible(f"needs {groups} groups of {k} GPUs; the queue's per-type GPU "
                              f"quota leaves room for {n_slots}{where}")
        return Infeasible(f"needs {groups} groups of {k} GPUs inside one NVLink island; only "
                          f"{n_slots} are free{where} ({total_free} GPUs free but fragmented)")
    spine = scope.spine
    cap = {leaf: len(s) // shape.pp for leaf, s in slots.items()}
    leaves = _choose_leaves(cap, shape.dp, spine)
    whole = _pipelines_within_leaves(slots, sorted(leaves), shape) if leaves is not None else None
    packed = None
    if whole is None or (traffic is not None and shape.pp > 1):
        # Groups packed leaf by leaf into the fewest leaves; a pipeline may then
        # straddle a leaf boundary, but the rings cross fewer leaves.
        fewest = _choose_leaves({lf: len(s) for lf, s in slots.items()}, groups, spine)
        if fewest is not None:
            packed = [g for lf in sorted(fewest) for g in slots[lf]][:groups]
    if whole is None or (packed is not None and traffic is not None
                         and _cross_leaf_bytes(packed, shape, traffic)
                         < _cross_leaf_bytes(whole, shape, traffic)):
        assert packed is not None
        whole = packed
    return PlacementPlan(slots=tuple(_ranks(whole, shape)))


def _within_caps(slots: dict[str, list[GroupSlot]], caps: Mapping[str, int],
                 k: int) -> tuple[dict[str, list[GroupSlot]], bool]:
    """Drop the group slots of each capped type beyond its room; and whether any went."""
    left = {t: c // k for t, c in caps.items()}
    out: dict[str, list[GroupSlot]] = {}
    trimmed = False
    for leaf in sorted(slots):
        keep = []
        for g in slots[leaf]:
            t = g.node.gpu_type
            if t in left:
                if left[t] <= 0:
                    trimmed = True
                    continue
                left[t] -= 1
            keep.append(g)
        out[leaf] = keep
    return out, trimmed


def _one_type_pipelines(slots: list[GroupSlot], shape: JobShape) -> list[GroupSlot]:
    """A leaf's slots reordered so that each run of `pp` (one pipeline) is of one type
    where a type has enough: whole one-type runs first, by the job's preference of
    types, best fit kept within a type; the remainder, mixed, last."""
    by_type: dict[str | None, list[GroupSlot]] = defaultdict(list)
    for g in slots:
        by_type[g.node.gpu_type].append(g)
    runs: list[GroupSlot] = []
    rest: list[GroupSlot] = []
    for t in sorted(by_type, key=lambda t: preference(shape.gpu_types, t)):
        cut = len(by_type[t]) // shape.pp * shape.pp
        runs += by_type[t][:cut]
        rest += by_type[t][cut:]
    return runs + rest


def _cross_leaf_bytes(groups: list[GroupSlot], shape: JobShape, traffic: Traffic) -> float:
    """Bytes per step crossing leaves, for groups in plan order (one per dp x stage)."""
    dp, pp, tp = shape.dp, shape.pp, shape.tp
    leaf = [g.node.leaf for g in groups]
    ring = sum(leaf[d * pp + s] != leaf[((d + 1) % dp) * pp + s]
               for s in range(pp) for d in range(dp)) if dp > 1 else 0
    stages = sum(leaf[d * pp + s] != leaf[d * pp + s + 1] for d in range(dp) for s in range(pp - 1))
    ring_bytes = 2 * (dp - 1) / dp * traffic.grad_bytes / (tp * pp) if dp > 1 else 0.0
    return tp * (ring * ring_bytes + stages * traffic.activation_bytes)


def _pipelines_within_leaves(slots: dict[str, list[GroupSlot]], leaves: list[str],
                             shape: JobShape) -> list[GroupSlot]:
    out: list[GroupSlot] = []
    remaining = shape.dp
    for leaf in leaves:
        take = min(remaining, len(slots[leaf]) // shape.pp)
        out += slots[leaf][:take * shape.pp]
        remaining -= take
    return out


def _ranks(groups: list[GroupSlot], shape: JobShape) -> list[RankSlot]:
    out = []
    g = shape.gpus_per_rank
    for gi, slot in enumerate(groups):
        for t in range(shape.tp):
            out.append(RankSlot(rank=gi * shape.tp + t, node=slot.node.name,
                                node_id=slot.node.node_id, leaf=slot.node.leaf,
                                gpus=slot.gpus[t * g:(t + 1) * g]))
    return out


def _place_cpu_only(nodes: tuple[NodeInfo, ...], shape: JobShape) -> PlacementPlan | Infeasible:
    live = [n for n in nodes if n.alive]
    if not live:
        return Infeasible("no live nodes")
    slots = tuple(RankSlot(rank=r, node=live[r % len(live)].name, node_id=live[r % len(live)].node_id,
                           leaf=live[r % len(live)].leaf, gpus=()) for r in range(shape.world_size))
    return PlacementPlan(slots=slots)
