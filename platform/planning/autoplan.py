"""`parallel: auto`: the planner (platform/planning/planner.py) picks a job's layout at submission.

`resolve(doc, cluster)` turns a spec document whose `parallel.auto` is true into
the concrete document the workers run, plus the plan record the job JSON shows.
Pure: no Ray, no Redis; the control plane hands in the cluster it knows.

The rules (docs/parallelism.md, "parallel: auto", states the same):

* Ranks: `parallel.gpus`, else one node's worth: the GPUs of the largest alive
  node (most GPUs, then first by name) divided by `parallel.gpus_per_rank`.
  Without a known node, `parallel.gpus` is required.
* Ranks per node (the planner's NVLink domain, where TP must stay): that same
  count; without a known node (or with `gpus_per_rank: 0`), the catalogue's
  usual node for the accelerator. More ranks than one node must fill whole nodes.
* Accelerator: `parallel.gpu`, else the type Ray detected on that node when the
  catalogue knows it (`A100` -> a100-40gb, the smaller and so the safer one;
  `A100-80G` -> a100-80gb; `H100` -> h100-80gb; `H200` -> h200-141gb), else
  `cpu`: clusters with fake GPU counts on CPU machines (the local and test
  clusters) report no type, and their ranks are CPU processes.
* Global batch (sequences per optimizer step): `parallel.global_batch`, else
  `micro_batch_size x gradient_accumulation_steps x gpus` as the spec gives them
  (defaults 8 x 1): what plain data parallelism over all ranks would train on.
* Search: every layout the planner finds that fits in memory (90% of HBM),
  fastest first, ties to less memory. The first one the worker can run wins:
  the spec's own layout rules (`parallel_errors`: TP divides `model.n_heads`,
  `pp x virtual_stages` divides `model.n_layers`, interleaved 1F1B needs the
  micro-batches per step to be a multiple of pp, no ZeRO-1 with TP, and what
  the spec's precision, offload, compression and hierarchical all-reduce
  allow), at least pp micro-batches per step for any pipeline, and the rest of
  the spec's rules (`validate_spec` must pass on the result): a custom model
  type keeps to layouts without TP and PP, `elastic.resize: live` to plain
  data parallelism (no TP, PP or ZeRO).
* Mixture of experts (`model.type: moe`): every expert-parallel size that
  divides the replicas and `model.n_experts` is tried (a size above 1 that the
  spec sets is kept), and sequence parallelism where tp > 1 and a layout would
  not fit without it. `parallel.sequence_parallel: true` asks for it on every
  layout (any built-in model: one without TP is refused). Dense models get
  neither unless asked, so their layouts are what they were.
* Collectives: a pipeline sends and receives, expert parallelism runs
  `all_to_all`; `permission.collectives` equal to the default list gets them
  added, a list of the user's own must already allow what the layout runs
  (other layouts are skipped).
* Written back: `data_parallel_size`, `tensor_parallel_size`,
  `pipeline_parallel_size`, `micro_batch_size`, `gradient_accumulation_steps`
  (the plan's micro-batches per step), `zero_stage`, `recompute`, `schedule`
  (the planner's "none", for pp = 1, becomes the default "1f1b"),
  `virtual_stages` and `shard_group_size` (HSDP's sharding group, null unless
  the plan shards within groups), and `expert_parallel_size` and
  `sequence_parallel` where the plan uses them or the spec asked; `auto: false`; `gpus`, `gpu` and
  `global_batch` removed.
  Every other field (precision, offload, compression, ...) stays the user's.
* Elastic jobs (`elastic.min_replicas`/`max_replicas`) are refused: their
  data-parallel range is the user's to choose against a hand-written layout.
* No runnable layout: a `SpecError` on `parallel.auto` saying why (memory,
  a batch the ranks cannot split, or a layout rule) and what to change.

The plan record is `Plan.to_json()` plus `gpu`, `gpus`, `gpus_per_node`,
`global_batch`, `candidates` (fitting layouts the planner ranked) and `rank`
(the chosen one's place among them, 1 = the planner's first choice).

A spec whose `resources.gpu_types` lists several types (and no `parallel.gpu`)
is planned across the cluster's pools of those types instead, alone or, with
`resources.heterogeneous: true`, mixed (platform/planning/autopools.py); the
resolved layout is as concrete as any other, and the record adds `pools` and
the balanced and even splits' predicted step times.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from kuangchao.platform.cluster.hardware import CATALOG, Accelerator, get_accelerator
from kuangchao.platform.cluster.topology import ClusterTopology, NodeInfo
from kuangchao.platform.errors import SpecError
from kuangchao.platform.planning import autopools
from kuangchao.platform.planning.planner import plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan
from kuangchao.platform.spec.jobspec import JobSpec, validate_spec
from kuangchao.platform.spec.model import HFShape, hf_config_errors
from kuangchao.platform.spec.model_folder import folder_field, read_config
from kuangchao.platform.spec.parallel import (
    DEFAULT_COLLECTIVES,
    expand_auto,
    parallel_errors,
    trainer_collectives,
)

FIELD = "parallel.auto"
PLANNER_ONLY = ("gpus", "gpu", "global_batch")
# Ray's `accelerator_type:X` names (ray.util.accelerators) -> catalogue entries.
RAY_ACCELERATORS = {"A100": "a100-40gb", "A100-40G": "a100-40gb", "A100-80G": "a100-80gb",
                    "H100": "h100-80gb", "H200": "h200-141gb"}
PIPELINE_COLLECTIVES = frozenset({"send", "recv"})


def topology_from_view(info: dict[str, Any] | None) -> ClusterTopology | None:
    """The registry's node view in Redis (`store.info("nodes")`) as a topology; None if absent."""
    if not info or not info.get("nodes"):
        return None
    return ClusterTopology("registry", tuple(NodeInfo.from_json(n) for n in info["nodes"]))


def largest_node(cluster: ClusterTopology | None) -> NodeInfo | None:
    """The alive node with the most GPUs (first by name on a tie), or None."""
    nodes = [n for n in (cluster.nodes if cluster else ()) if n.alive and n.gpus > 0]
    return min(nodes, key=lambda n: (-n.gpus, n.name), default=None)


def default_global_batch(spec: JobSpec, gpus: int) -> int:
    """`parallel.global_batch`, else micro_batch_size x gradient_accumulation_steps x gpus."""
    p = spec.parallel
    return p.global_batch or p.micro_batch_size * p.gradient_accumulation_steps * gpus


def accelerator_for(spec: JobSpec, node: NodeInfo | None) -> Accelerator:
    """`parallel.gpu`, else the node's detected type when catalogued, else `cpu`."""
    if spec.parallel.gpu is not None:
        try:
            return get_accelerator(spec.parallel.gpu)
        except ValueError as exc:
            raise SpecError([("parallel.gpu", str(exc))]) from None
    name = RAY_ACCELERATORS.get(node.accelerator or "") if node is not None else None
    return CATALOG[name or "cpu"]


def cluster_for(spec: JobSpec, node: NodeInfo | None, acc: Accelerator) -> ClusterShape:
    """The ranks to lay out and how many share a node."""
    per_rank = spec.parallel.gpus_per_rank
    per_node = max(1, node.gpus // per_rank) if node is not None and per_rank > 0 \
        else acc.gpus_per_node
    gpus = spec.parallel.gpus
    if gpus is None:
        if node is None:
            raise SpecError([("parallel.gpus", "the control plane knows no node with GPUs yet, "
                              "so it cannot take one node's worth; give parallel.gpus")])
        gpus = per_node
    if gpus > per_node and gpus % per_node:
        raise SpecError([("parallel.gpus", f"{gpus} ranks do not fill whole nodes of {per_node}; "
                          f"use at most {per_node} or a multiple of it")])
    return ClusterShape(gpus, per_node)


def _brought(p: Plan) -> set[str]:
    """Collectives a layout brings to the default list: a pipeline's, expert parallelism's."""
    return (set(PIPELINE_COLLECTIVES) if p.pp > 1 else set()) | (
        {"all_to_all"} if p.expert_parallel_size > 1 else set())


def _allowed(spec: JobSpec, p: Plan) -> set[str]:
    listed = set(spec.permission.collectives)
    if listed == set(DEFAULT_COLLECTIVES):
        listed |= _brought(p)
    return listed


def _layout(p: Plan, spec: JobSpec | None = None) -> dict[str, Any]:
    """The spec's layout fields for plan `p`; EP and SP only where the plan uses them or
    `spec` asked for them (a dense model's document stays as it was)."""
    out = {**p.to_spec_parallel(), "zero_stage": p.zero_stage, "recompute": p.recompute,
           "schedule": "1f1b" if p.schedule == "none" else p.schedule,
           "virtual_stages": p.virtual_stages, "shard_group_size": p.shard_group_size}
    asked = spec.parallel if spec is not None else None
    if p.expert_parallel_size > 1 or (asked and asked.expert_parallel_size > 1):
        out["expert_parallel_size"] = p.expert_parallel_size
    if p.sequence_parallel or (asked and asked.sequence_parallel):
        # A spec's `true` stays: a layout without TP is then refused, not run without it.
        out["sequence_parallel"] = True
    return out


def hf_shapes(spec: JobSpec) -> tuple[ModelShape, HFShape]:
    """A Hugging Face model's shapes (the planner's, the platform's) from its folder's config.json.

    Raises:
        SpecError: On model.path (model.checkpoint): the folder or its config.json is
            missing or unreadable, or the config lacks what the shape needs.
    """
    m = spec.model
    folder, field = m.hf_folder, folder_field(m)
    config = read_config(folder, field)  # type: ignore[arg-type]
    try:
        return ModelShape.from_hf_config(config, m.seq_len), HFShape.of(config)
    except ValueError as exc:
        raise SpecError([(field, f"{folder}: {exc}")]) from None


def layout_errors(spec: JobSpec, p: Plan, hf: HFShape | None = None) -> list[tuple[str, str]]:
    """Why the worker cannot run plan `p` with the rest of `spec`; empty when it can.

    `hf`: a Hugging Face model's shape (`hf_shapes`), whose layers and heads the
    layout must split; a spec naming a folder is read here when it is not given."""
    par = spec.parallel.model_copy(update={**_layout(p, spec), "auto": False, "gpus": None,
                                           "gpu": None, "global_batch": None})
    builtin = spec.entrypoint is None
    if spec.model.is_hf and hf is None:
        hf = hf_shapes(spec)[1]
    if hf is not None:
        errs = parallel_errors(par, hf.n_layers, hf.n_heads, builtin_trainer=builtin)
        # Only what the layout decides: the folder's other complaints are the submission's.
        errs += [e for e in hf_config_errors(spec.model, hf, p.tp, p.pp, p.pp * p.virtual_stages)
                 if e[0].startswith("parallel.")]
    else:
        errs = parallel_errors(par, spec.model.n_layers, spec.model.n_heads,
                               builtin_trainer=builtin, seq_len=spec.model.seq_len,
                               builtin_model=spec.model.is_builtin)
    if p.pp > 1 and p.num_microbatches < p.pp:
        errs.append(("parallel.gradient_accumulation_steps",
                     f"{p.num_microbatches} micro-batches per step cannot fill {p.pp} stages"))
    if builtin:
        if missing := sorted(trainer_collectives(par) - _allowed(spec, p)):
            errs.append(("permission.collectives", f"the layout needs {', '.join(missing)}"))
        if not spec.model.is_builtin and not spec.model.is_hf and (p.tp > 1 or p.pp > 1):
            errs.append(("model.type", "a custom model runs without tensor or pipeline parallelism"))
        if spec.elastic.resize == "live" and par.hybrid:
            errs.append(("elastic.resize", "live resizes need plain data parallelism"))
    return errs


def concrete_doc(doc: dict[str, Any], spec: JobSpec, p: Plan) -> dict[str, Any]:
    """`doc` with plan `p`'s layout written into `parallel` (see the module docstring)."""
    out = copy.deepcopy(doc)
    par = {k: v for k, v in (out.get("parallel") or {}).items() if k not in PLANNER_ONLY}
    par.update(_layout(p, spec), auto=False)
    out["parallel"] = par
    if _brought(p) and set(spec.permission.collectives) == set(DEFAULT_COLLECTIVES):
        perm = dict(out.get("permission") or {})
        perm["collectives"] = sorted(set(DEFAULT_COLLECTIVES) | _brought(p))
        out["permission"] = perm
    return out


def resolve(doc: dict[str, Any], cluster: ClusterTopology | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The concrete spec document and the plan record for an auto spec.

    Args:
        doc: A spec document with `parallel.auto: true` (or `parallel: auto`).
        cluster: The nodes the control plane knows, or None when it knows none.

    Returns:
        The document to validate and store, and the plan record for the job JSON.

    Raises:
        SpecError: For an invalid spec, or when no layout fits or can run,
            with the field to change.
        ValueError: When `doc` does not ask for the planner.
    """
    doc = expand_auto(doc)
    spec = validate_spec(doc)
    if not spec.parallel.auto:
        raise ValueError("resolve() takes a spec with parallel.auto: true")
    if spec.elastic.min_replicas is not None or spec.elastic.max_replicas is not None:
        raise SpecError([(FIELD, "an elastic job's replica range goes with a hand-written "
                                 "layout; remove elastic.min_replicas and elastic.max_replicas, "
                                 "or set the layout and parallel.auto: false")])
    if autopools.applies(spec):
        return _resolve_pools(doc, spec, *_model_of(spec), cluster)
    node = largest_node(cluster)
    acc = accelerator_for(spec, node)
    shape = cluster_for(spec, node, acc)
    global_batch = default_global_batch(spec, shape.gpus)
    model, hf = _model_of(spec)
    # `true` and an EP size above 1 are requests; the defaults leave the choice to the planner.
    par = spec.parallel
    ranked = plan(model, shape, acc, global_batch, sequence_parallel=par.sequence_parallel or None,
                  expert_parallel=par.expert_parallel_size if par.expert_parallel_size > 1 else None)
    taken, first_errs = _first_runnable(doc, spec, ranked, hf)
    if taken is not None:
        out, i = taken
        p = ranked[i]
        return out, {**p.to_json(), "gpu": acc.name, "gpus": shape.gpus, "gpus_per_node": shape.node_size,
                     "global_batch": global_batch, "candidates": len(ranked), "rank": i + 1}
    raise SpecError([(FIELD, no_fit_message(model, shape, acc, global_batch, ranked, first_errs,
                                            folder_field(spec.model) if hf else None))])


def _model_of(spec: JobSpec) -> tuple[ModelShape, HFShape | None]:
    """The planner's shape of the spec's model, and a Hugging Face model's own shape."""
    if spec.model.is_hf:
        return hf_shapes(spec)
    try:
        return ModelShape.from_spec_model(spec.model.model_dump()), None
    except ValueError as exc:
        raise SpecError([("model", str(exc))]) from None


def _first_runnable(doc: dict[str, Any], spec: JobSpec, ranked: Iterable[Plan], hf: HFShape | None
                    ) -> tuple[tuple[dict[str, Any], int] | None, list[tuple[str, str]]]:
    """The first plan the spec can run, as (concrete document, its index); else the
    first plan's reasons."""
    first_errs: list[tuple[str, str]] = []
    for i, p in enumerate(ranked):
        errs = layout_errors(spec, p, hf)
        if not errs:
            out = concrete_doc(doc, spec, p)
            try:
                validate_spec(out)
            except SpecError as exc:
                errs = exc.errors
            else:
                return (out, i), []
        first_errs = first_errs or [(f, m) for f, m in errs]
    return None, first_errs


def _resolve_pools(doc: dict[str, Any], spec: JobSpec, model: ModelShape, hf: HFShape | None,
                   cluster: ClusterTopology | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`resolve` for a spec that accepts several GPU types (platform/planning/autopools.py):
    the record adds `pools` (each type's GPUs, replicas and share of the batch) and the
    balanced and even splits' step times; `gpu` joins a mix's types with '+'."""
    ranked, global_batch, on = autopools.ranked(spec, model, cluster)
    taken, errs = _first_runnable(doc, spec, (c.make().plan for c in ranked), hf)
    if taken is not None:
        out, i = taken
        p = ranked[i].make()
        # The layout was sized and its memory checked for these pools: the scheduler
        # must place it there, not on another accepted type (a different count of
        # GPUs, perhaps less memory). A mix keeps its types and may mix them.
        out["resources"] = {**(out.get("resources") or {}),
                            "gpu_types": [s.pool.acc.name for s in p.shares]}
        return out, {**p.to_json(), "gpu": p.gpu, "gpus": p.gpus, "gpus_per_node": p.gpus_per_node,
                     "global_batch": global_batch, "candidates": len(ranked), "rank": i + 1}
    if ranked:
        why = "; ".join(f"{f}: {m}" for f, m in errs[:2])
        msg = (f"the planner found {len(ranked)} layout(s) that fit {on}, but none this spec can run "
               f"(the fastest: {why}); change what the message names, or give another parallel.gpus")
    else:
        msg = (f"no layout of this model fits {on} (90% of each type's memory) with a global batch "
               f"of {global_batch} that its replicas split evenly; give more GPUs (parallel.gpus), "
               "another parallel.global_batch, bigger GPU types (resources.gpu_types) or a smaller model")
    raise SpecError([(FIELD, msg)])


def _batch_splits(model: ModelShape, shape: ClusterShape, global_batch: int) -> bool:
    """Whether some (tp, pp) leaves a data-parallel size that divides the global batch."""
    tps = [t for t in (1 << i for i in range(7)) if t <= shape.node_size
           and shape.node_size % t == 0 and model.tp_divides(t)]
    return any(shape.gpus % (t * pp) == 0 and global_batch % (shape.gpus // (t * pp)) == 0
               for t in tps for pp in range(1, model.n_layers + 1) if model.n_layers % pp == 0)


def no_fit_message(model: ModelShape, shape: ClusterShape, acc: Accelerator, global_batch: int,
                   ranked: list[Plan], errs: list[tuple[str, str]],
                   folder: str | None = None) -> str:
    """Why no layout was taken, and what to change; `folder`: the field naming a
    Hugging Face model's folder, whose shape is the folder's to change."""
    on = f"{shape.gpus} x {acc.name}"
    if ranked:
        best = ranked[0]
        why = "; ".join(f"{f}: {m}" for f, m in errs[:2])
        return (f"the planner found {len(ranked)} layout(s) that fit {on}, but none this spec "
                f"can run (the fastest, dp={best.dp} tp={best.tp} pp={best.pp} micro_batch="
                f"{best.micro_batch} x{best.num_microbatches} zero={best.zero_stage}: {why}); "
                "change what the message names, raise parallel.global_batch so that pipelines "
                "get more micro-batches, or give another parallel.gpus")
    if not _batch_splits(model, shape, global_batch):
        return (f"a global batch of {global_batch} sequences does not split evenly over the "
                f"data-parallel replicas of any layout of {shape.gpus} ranks; set "
                f"parallel.global_batch to a multiple of {shape.gpus}, or change parallel.gpus")
    state, n = 16 * model.params / 1e9, model.params
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    return (f"no layout of this model ({size} parameters) fits {on} "
            f"({acc.hbm_bytes / 1e9:.0f} GB each, 90% usable): weights, gradients and Adam "
            f"state alone take {state:.1f} GB, at least {state / shape.gpus:.2f} GB per rank "
            "(ZeRO-3 over all of them), before activations; give more GPUs (parallel.gpus), a bigger GPU "
            "(parallel.gpu, e.g. h200-141gb), a smaller micro batch or global batch "
            "(parallel.micro_batch_size, parallel.global_batch), or a smaller model "
            + (f"(a smaller folder in {folder}, or a shorter model.seq_len)" if folder
               else "(model.n_layers, model.d_model, model.seq_len)"))
