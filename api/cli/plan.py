"""`kc plan`: the planner's ranked layouts for a model on a cluster (platform/planning/planner.py).

`--model` takes a job spec, a model YAML, a Hugging Face model folder (its
config.json), or such a config.json itself; a job spec whose model is a
Hugging Face folder is planned from that folder.

`--gpus` takes a count of one `--gpu` type, or pools of several types
(`16xh100-80gb,16xa100-80gb`): each pool is planned alone and the pools
mixed (platform/planning/pools.py), every plan with its pools and, for a mix,
each type's share of the global batch and the balanced and even step times.

A mixture of experts (`type: moe`) is also planned with expert parallelism
(`ep=` in the text, `expert_parallel_size`, `all_to_all_s` and
`expert_weights_gb_per_gpu` in the JSON) and, where memory needs it, sequence
parallelism (`sp`, `sequence_parallel`); `--sequence-parallel` asks for SP on
every layout with TP, for any model.

Runs locally: no API, no cluster. Exit 0 with plans, 1 when no layout fits,
2 for bad input (a missing or malformed model file or config.json, an unknown
GPU or pool, a batch that no data-parallel size divides).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kuangchao.api.cli.common import Json, fail
from kuangchao.platform.cluster.hardware import CATALOG, get_accelerator
from kuangchao.platform.errors import SpecError
from kuangchao.platform.planning.planner import describe, plan
from kuangchao.platform.planning.pools import (
    Pool,
    describe_pools,
    parse_pools,
    plan_pools,
    plan_single,
)
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape
from kuangchao.platform.spec.jobspec import resolve_extends, validate_spec
from kuangchao.platform.spec.model_folder import CONFIG_LIMIT, folder_field, read_config

POOL_EXAMPLE = "16xh100-80gb,16xa100-80gb"


def _hf_config(path: Path) -> dict[str, Any] | None:
    """A Hugging Face config: a folder's config.json, or a JSON file with `model_type`
    (and no `model`, which a job spec would have); None for anything else."""
    if path.is_dir():
        return read_config(path, "--model")
    if path.suffix != ".json" or not path.is_file() or path.stat().st_size > CONFIG_LIMIT:
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # left to the YAML reader, which says what is wrong
    return doc if isinstance(doc, dict) and "model_type" in doc and "model" not in doc else None


def _hf_shape(config: dict[str, Any], where: str, seq_len: int | None) -> ModelShape:
    try:
        return ModelShape.from_hf_config(config, seq_len)
    except ValueError as exc:
        fail(f"{where}: {exc}")


def _is_folder_model(section: dict[str, Any]) -> bool:
    return section.get("type") == "hf" or bool(section.get("checkpoint") or section.get("path"))


def _model(path: Path, seq_len: int | None) -> tuple[ModelShape, dict[str, Any]]:
    """A job spec (its `model`), a bare model document (`params: 175e9` for a size only),
    or a Hugging Face folder or config.json."""
    try:
        config = _hf_config(path)
        if config is not None:
            return _hf_shape(config, str(path), seq_len), {}
        doc = resolve_extends(path)
        if isinstance(doc.get("model"), dict) and ("params" not in doc["model"]
                                                   or _is_folder_model(doc["model"])):
            spec = validate_spec(doc)  # a job spec: its defaults filled in
            par = spec.parallel
            rank_batch = par.micro_batch_size * par.gradient_accumulation_steps
            doc = {"model": spec.model.model_dump(),
                   "global_batch": par.data_parallel_size * rank_batch}
            if par.auto:  # as `parallel: auto` decides it (platform/planning/autoplan.py)
                doc = {"model": doc["model"], "global_batch": par.global_batch,
                       "rank_batch": rank_batch}
            if spec.model.is_hf:  # planned from the folder, as parallel: auto plans it
                folder = spec.model.hf_folder
                config = read_config(folder, folder_field(spec.model))  # type: ignore[arg-type]
                return _hf_shape(config, f"{folder_field(spec.model)} {folder}",
                                 seq_len or spec.model.seq_len), doc
    except SpecError as exc:
        fail("; ".join(f"{p or path}: {m}" for p, m in exc.errors))
    section = doc.get("model") if isinstance(doc.get("model"), dict) else doc
    try:
        if section.get("params") is not None:  # a dumped job spec's model has params: None
            model = ModelShape.from_param_count(float(section["params"]),
                                                int(seq_len or section.get("seq_len", 2048)),
                                                int(section.get("vocab_size", 50257)))
        else:
            model = ModelShape.from_spec_model({**section, **({"seq_len": seq_len} if seq_len
                                                                else {})})
    except (ValueError, TypeError) as exc:
        fail(f"{path}: {exc}. Give n_layers, d_model, n_heads, seq_len and vocab_size "
             "(as a job spec's `model:`), or `params: 7e9`")
    return model, doc


def plan_command(
        model_file: Annotated[Path, typer.Option("--model", help=(
            "A job spec, a model YAML (n_layers, d_model, n_heads, seq_len, vocab_size; "
            "or params: 175e9), or a Hugging Face model folder or its config.json."))],
        gpus: Annotated[str, typer.Option("--gpus", help=(
            "GPUs to use, all of them: a count (of --gpu), or pools of COUNTxTYPE joined by "
            "commas (16xh100-80gb,16xa100-80gb), planned alone and mixed."))],
        gpu: Annotated[str | None, typer.Option(
            "--gpu", help=f"With a plain count: one of {', '.join(CATALOG)} (default h100-80gb).")] = None,
        gpus_per_node: Annotated[int | None, typer.Option(
            "--gpus-per-node", min=1, help="Default: the GPU's usual node (8).")] = None,
        global_batch: Annotated[int | None, typer.Option(
            "--global-batch", min=1, help=(
                "Sequences per step (default: a job spec's dp x micro-batch x accumulation; "
                "for parallel: auto its global_batch, else micro-batch x accumulation x "
                "--gpus; else 512)."))] = None,
        seq_len: Annotated[int | None, typer.Option("--seq-len", min=1,
                                                    help="Override the model's.")] = None,
        top: Annotated[int, typer.Option("--top", min=1, help="Plans to print.")] = 10,
        sequence_parallel: Annotated[bool | None, typer.Option(
            "--sequence-parallel/--no-sequence-parallel", help=(
                "Sequence parallelism on every layout with TP, or on none (default: a "
                "mixture of experts' layouts where memory needs it)."))] = None,
        as_json: Json = False) -> None:
    """Rank the feasible DP/TP/PP/ZeRO layouts by predicted step time."""
    count, pools = _gpus(gpus, gpu, gpus_per_node)
    model, doc = _model(model_file, seq_len)
    total = count or sum(p.gpus for p in pools)
    if global_batch is None:
        global_batch = int(doc.get("global_batch") or doc.get("rank_batch", 0) * total or 512)
    if count is None and len(pools) > 1:
        return _plan_pools(model, pools, global_batch, top, as_json)
    if count is None:  # one typed pool: the plain count of that type
        count, gpu = pools[0].gpus, pools[0].acc.name
    gpu = gpu or "h100-80gb"
    acc = get_accelerator(gpu)
    per_node = gpus_per_node or acc.gpus_per_node
    try:
        cluster = ClusterShape(count, per_node)
        plans = plan(model, cluster, acc, global_batch, top=top, sequence_parallel=sequence_parallel)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps([p.to_json() for p in plans], indent=1))
    else:
        typer.echo(f"{_size(model)} on {count} x {gpu} ({per_node} per node), global batch {global_batch}")
        for i, p in enumerate(plans, 1):
            typer.echo(f"{i:>3}. {describe(p)}")
    if not plans:
        typer.echo(f"no layout fits {count} x {gpu}: even the leanest needs more than "
                   f"{acc.hbm_bytes / 1e9:.0f} GB per GPU; add GPUs or use a larger GPU", err=True)
        raise typer.Exit(1)


def _size(model: ModelShape) -> str:
    n = model.params
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    kv = f" ({model.kv_heads} key/value)" if model.kv_heads != model.n_heads else ""
    moe = ""
    if model.is_moe:
        active = model.active_params
        moe = (f", {model.n_experts} experts top-{model.top_k}, "
               + (f"{active / 1e9:.3g}B" if active >= 1e9 else f"{active / 1e6:.3g}M") + " active")
    return (f"{size} parameters ({model.n_layers} layers, d_model {model.d_model}, "
            f"{model.n_heads} heads{kv}, seq {model.seq_len}{moe})")


def _gpus(text: str, gpu: str | None, per_node: int | None) -> tuple[int | None, list[Pool]]:
    """`--gpus`: a plain count (of `--gpu`), or pools of COUNTxTYPE; exits 2 on bad input."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            fail(f"--gpus {text}: give at least 1 GPU, or pools such as {POOL_EXAMPLE}")
        if gpu is not None:
            try:
                get_accelerator(gpu)
            except ValueError as exc:
                fail(str(exc))
        return int(text), []
    if gpu is not None:
        fail(f"--gpus {text} names the GPU types; drop --gpu {gpu}, or give --gpus a plain count")
    try:
        pools = parse_pools(text, per_node)
    except ValueError as exc:
        fail(f"--gpus: {exc}")
    return None, pools


def _plan_pools(model: ModelShape, pools: list[Pool], global_batch: int, top: int, as_json: bool) -> None:
    try:
        plans = plan_pools(model, pools, global_batch, top=top)
    except ValueError as exc:
        fail(str(exc))
    where = " + ".join(p.label for p in pools)
    if as_json:
        typer.echo(json.dumps([p.to_json() for p in plans], indent=1))
    else:
        typer.echo(f"{_size(model)} on {where}, alone or mixed, global batch {global_batch}")
        for i, p in enumerate(plans, 1):
            typer.echo(f"{i:>3}. {describe(p.plan)}\n       {describe_pools(p)}")
        alone = [(pool, plan_single(model, pool, global_batch, top=1)) for pool in pools]
        typer.echo("best on one pool: " + "; ".join(
            f"{pool.label} {best[0].plan.predicted_step_s:.3g} s/step" if best else f"{pool.label} none fits"
            for pool, best in alone))
    if not plans:
        typer.echo(f"no layout fits {where}, alone or mixed: even the leanest needs more memory per "
                   "GPU than a type has; add GPUs or use a larger GPU", err=True)
        raise typer.Exit(1)
