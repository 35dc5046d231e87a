"""`kc checkpoint convert`: between a checkpoint of any layout, a Hugging Face folder and
one weights file (workers/checkpoint/convert.py does the work). Registered on
`checkpoint_app` by api/cli/checkpoint.py, which holds the shared options and checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kuangchao.api.cli.checkpoint import (
    MANIFEST,
    Json,
    MaxShard,
    Tokenizer,
    _check_writable,
    _shard_bytes,
    _verified_step,
    _warn,
    checkpoint_app,
    fail,
    step_of,
    written,
)
from kuangchao.workers.errors import CheckpointError


def kind_of(path: Path) -> str | None:
    """What `path` is: a checkpoint (a step folder, or a job's folder of them), a Hugging
    Face folder (config.json), a safetensors or torch file; None: none of them."""
    from kuangchao.workers.checkpoint import convert as conv

    if path.is_dir():
        if ((path / MANIFEST).exists() or (path / ".metadata").exists()
                or step_of(path) is not None
                or any(step_of(p) is not None and p.is_dir() for p in path.iterdir())):
            return conv.CHECKPOINT
        if (path / "config.json").is_file():
            return conv.HF
        return None
    if path.is_file():
        if path.suffix == ".safetensors":
            return conv.SAFETENSORS
        if path.suffix in conv.TORCH_SUFFIXES:
            return conv.TORCH
    return None


def target_for(kind: str, out: Path) -> str:
    """The target `--to` defaults to: a file's by its suffix, else a folder: the other kind."""
    from kuangchao.workers.checkpoint import convert as conv

    if out.suffix == ".safetensors":
        return conv.SAFETENSORS
    if out.suffix in conv.TORCH_SUFFIXES:
        return conv.TORCH
    return conv.CHECKPOINT if kind == conv.HF else conv.HF


@checkpoint_app.command("convert")
def convert(src: Annotated[str, typer.Argument(metavar="SRC", help=(
                "A checkpoint (job id, job folder or step folder), a Hugging Face folder "
                "(config.json), or a .safetensors / .pt file."))],
            out: Annotated[Path, typer.Option("--out", help="The folder or file to write.")],
            to: Annotated[str | None, typer.Option("--to", help=(
                "hf, safetensors, torch or checkpoint (default: by --out's suffix, else hf, "
                "or checkpoint from a Hugging Face folder)."))] = None,
            config: Annotated[Path | None, typer.Option("--config", help=(
                "A Hugging Face folder or config.json: the architecture of a file's weights "
                "(or of a checkpoint that records none)."))] = None,
            tokenizer: Tokenizer = None,
            max_shard_size: MaxShard = "5GB",
            as_json: Json = False) -> None:
    """Convert between a checkpoint of any layout, a Hugging Face folder, and one weights file.

    A checkpoint goes to hf, safetensors or torch (as export does). A Hugging Face
    folder goes to a checkpoint (step_00000000 of the job folder --out, model weights
    only, under kuangchao's names), or to one safetensors or torch file under its own
    names. A safetensors or torch file goes to hf or a checkpoint (with --config
    naming the architecture; every tensor is checked against it), or to the other
    file format.
    """
    from kuangchao.workers.checkpoint import convert as conv

    if to is not None and to not in conv.TARGETS:
        fail(f"unknown --to {to!r}; choose one of: {', '.join(conv.TARGETS)}")
    shard_bytes = _shard_bytes(max_shard_size)
    out = out.expanduser()
    for name, folder in (("--config", config), ("--tokenizer", tokenizer)):
        if folder is not None and not folder.expanduser().exists():
            fail(f"{name} {folder} does not exist")
    if tokenizer is not None and not tokenizer.expanduser().is_dir():
        fail(f"--tokenizer {tokenizer} is not a folder; name the folder holding tokenizer.json")
    path = Path(src).expanduser()
    if path.exists():
        kind = kind_of(path)
        if kind is None:
            fail(f"{path} is neither a checkpoint (a step folder, or a job's folder of them), a "
                 "Hugging Face folder (with config.json), nor a .safetensors / .pt / .bin file")
    else:
        kind = conv.CHECKPOINT  # a job id, or a path that resolve() reports missing
    to = to or target_for(kind, out)
    if to not in conv.DIRECTIONS[kind]:
        fail(f"cannot convert {conv.SOURCE_NAMES[kind]} to {to}; the conversions are: "
             f"{conv.directions()}")
    try:
        if to in conv.FILES:
            _check_writable(out)
        elif to == conv.HF:
            from kuangchao.workers.checkpoint.hf_export import check_out_folder

            check_out_folder(out)
        else:
            conv.checkpoint_folder(out)
    except CheckpointError as exc:
        fail(exc.message)
    if kind == conv.CHECKPOINT:
        path = _verified_step(src, "converting")
    result = written(lambda: conv.convert(path, kind, out, to, config=config, tokenizer=tokenizer,
                                          max_shard_bytes=shard_bytes,
                                          warn=None if as_json else _warn), out)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"converted {conv.SOURCE_NAMES[kind]} {result['src']} to {to} at {result['out']}: "
               f"{result['tensors']} tensors, {result['bytes']:,} bytes")
