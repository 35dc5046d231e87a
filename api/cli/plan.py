"""`kc plan`: the planner's ranked layouts for a model on a cluster (platform/planning/planner.py).

`--model` takes a job spec, a model YAML, a Hugging Face model folder (its
config.json), or such a config.json itself; a job spec whose model is a
Hugging Face folder is planned from that folder.

Runs locally: no API, no cluster. Exit 0 with plans, 1 when no layout fits,
2 for bad input (a missing or malformed model file or config.json, an unknown
GPU, a batch that no data-parallel size divides).
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
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape
from kuangchao.platform.spec.jobspec import resolve_extends, validate_spec
from kuangchao.platform.spec.model_folder import CONFIG_LIMIT, folder_field, read_config


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
        gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs to use, all of them.")],
        gpu: Annotated[str, typer.Option("--gpu", help=f"One of {', '.join(CATALOG)}.")] = "h100-80gb",
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
        as_json: Json = False) -> None:
    """Rank the feasible DP/TP/PP/ZeRO layouts by predicted step time."""
    try:
        acc = get_accelerator(gpu)
    except ValueError as exc:
        fail(str(exc))
    model, doc = _model(model_file, seq_len)
    per_node = gpus_per_node or acc.gpus_per_node
    if global_batch is None:
        global_batch = int(doc.get("global_batch") or doc.get("rank_batch", 0) * gpus or 512)
    try:
        cluster = ClusterShape(gpus, per_node)
        plans = plan(model, cluster, acc, global_batch, top=top)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps([p.to_json() for p in plans], indent=1))
    else:
        n = model.params
        size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
        kv = f" ({model.kv_heads} key/value)" if model.kv_heads != model.n_heads else ""
        typer.echo(f"{size} parameters ({model.n_layers} layers, d_model "
                   f"{model.d_model}, {model.n_heads} heads{kv}, seq {model.seq_len}) on {gpus} x {gpu} "
                   f"({per_node} per node), global batch {global_batch}")
        for i, p in enumerate(plans, 1):
            typer.echo(f"{i:>3}. {describe(p)}")
    if not plans:
        typer.echo(f"no layout fits {gpus} x {gpu}: even the leanest needs more than "
                   f"{acc.hbm_bytes / 1e9:.0f} GB per GPU; add GPUs or use a larger GPU", err=True)
        raise typer.Exit(1)
