"""Hugging Face model folders: what model a checkpoint holds, its tensors checked
against a config, and the folder written.

A checkpoint's manifest says what its model is ("model"): `{"kind": "hf",
"config", "folder", "tokenizer"}` (tensors under the trainer's wrapper names,
workers/models/hf_names.py) or `{"kind": "builtin", "type": "llama", ...shape}`
(as the HF LlamaConfig computing the same); the built-in GPT and checkpoints
without the entry have no HF form here (`hf_source`).

`match_layout` checks every tensor against the model a config describes, built
by transformers on the meta device (no memory): a name missing or left over, or
a shape that differs, is refused naming the tensor; tied weights are kept once.
`write_hf_folder` writes config.json, the safetensors (sharded with
`model.safetensors.index.json` above `max_shard_bytes`), generation_config.json
and the tokenizer's files beside `out`, then renames the folder into place.
Files are copied from a folder a job's manifest names by plain file name, never
through a symlink. convert.py's `export_hf` puts it together for a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuangchao.workers.checkpoint.paths import plain_name
from kuangchao.workers.errors import CheckpointError
from kuangchao.workers.models import hf_names

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # "5GB", transformers' own long-standing default
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# The files of a tokenizer (fast or slow, BPE or sentencepiece), by name.
_TOKENIZER_FILE = re.compile(
    r"^(tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.(json|txt)|merges\.txt|spiece\.model|sentencepiece\.bpe\.model|.*\.tiktoken"
    r"|chat_template\.(jinja|json)|additional_chat_templates)$")


# -- what a checkpoint's model is -----------------------------------------------

def model_entry(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's "model" entry, or None for checkpoints written before it existed."""
    entry = manifest.get("model")
    return entry if isinstance(entry, dict) else None


def hf_source(entry: dict[str, Any] | None, where: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, the naming of the checkpoint's tensors) for a manifest's
    "model" entry.

    Raises:
        CheckpointError: No entry, the built-in GPT, or an entry that is not well formed.
    """
    if entry is None:
        raise CheckpointError(
            f"{where}: the checkpoint was written before checkpoints recorded their model (its "
            "manifest has no \"model\"), so the Hugging Face architecture is unknown; name it: "
            f"`kc checkpoint convert {where} --out DIR --to hf --config HF_FOLDER`, or export "
            "--format safetensors")
    kind = entry.get("kind")
    if kind == "hf":
        config = entry.get("config")
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise CheckpointError(f"{where}: the manifest's model config is not a config.json "
                                  "(no model_type)")
        # A user's own train function saves the Hugging Face model itself, under its own names.
        names = {"hf": hf_names.HF, "whole": hf_names.WHOLE}.get(entry.get("names"), hf_names.KC)
        return dict(config), names
    if kind == "own":
        raise CheckpointError(
            f"{where}: a custom train function's own model; kc does not know its architecture: "
            f"`kc checkpoint convert {where} --out DIR --to hf --config HF_FOLDER` names it, or "
            "export --format safetensors")
    if kind == "builtin":
        if entry.get("type") == "llama":
            try:
                return hf_names.builtin_llama_hf_config(entry), hf_names.BUILTIN_LLAMA
            except ValueError as exc:
                raise CheckpointError(f"{where}: the manifest's model: {exc}") from None
        raise CheckpointError(
            f"{where}: a built-in {entry.get('type')!r} model has no Hugging Face equivalent "
            "(only the built-in llama does); export it with --format safetensors or torch")
    raise CheckpointError(f"{where}: the manifest's model kind {kind!r} is neither 'hf' nor "
                          "'builtin'")


def read_config(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """A config.json named by a folder holding one or by the file: (the dict, its folder or None).

    Raises:
        CheckpointError: Missing, not JSON, or without model_type.
    """
    path = Path(path).expanduser()
    folder = path if path.is_dir() else None
    file = path / CONFIG if folder is not None else path
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {CONFIG}; name a Hugging Face model folder or its "
                              f"{CONFIG}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{file} is not a Hugging Face config (no model_type)")
    return config, folder


# -- what the config says the weights are ----------------------------------------

@dataclass
class Layout:
    """The tensors of the model a config describes.

    Attributes:
        shapes: Every tensor of its state dict (HF names), with its shape.
        tied: {name: the name it shares its tensor with}, the second one of each
            pair (`lm_head.weight` -> `model.embed_tokens.weight`).
        buffers: Non-persistent buffers (rotary tables): never in a state dict,
            but some old files hold them; they are dropped.
        checked: False when transformers could not build the model (an
            architecture it does not know): only the tied pairs are known then.
        note: Why it was not checked.
    """

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    buffers: set[str] = field(default_factory=set)
    checked: bool = True
    note: str = ""


def expected_layout(config: dict[str, Any]) -> Layout:
    """Build the model `config` describes on the meta device and read its tensors."""
    cfg = dict(config)
    model_type = cfg.pop("model_type")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoConfig, AutoModelForCausalLM

            hf_config = AutoConfig.for_model(model_type, **cfg)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # an unknown or malformed architecture fails in many ways
        pairs = {"lm_head.weight": "model.embed_tokens.weight"} \
            if cfg.get("tie_word_embeddings", False) else {}
        return Layout(tied=pairs, checked=False,
                      note=f"transformers cannot build a {model_type!r} model from this config "
                           f"({type(exc).__name__}: {str(exc)[:200]}), so the tensors were not "
                           "checked against it")
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    state = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()} - set(state)
    return Layout(shapes={n: tuple(t.shape) for n, t in state.items()}, tied=tied, buffers=buffers)


def match_layout(tensors: dict[str, torch.Tensor], layout: Layout, where: str,
                 warn: Callable[[str], None], fill_tied: bool = False) -> dict[str, torch.Tensor]:
    """`tensors` (HF names) checked against `layout`, tied copies dropped (or filled in).

    Args:
        fill_tied: Add the second name of each tied pair when missing (a checkpoint
            holds both), instead of dropping it (a HF folder holds one).

    Raises:
        CheckpointError: Naming the tensor that is missing, left over, or of another shape.
    """
    out = dict(tensors)
    for name in sorted(layout.buffers & set(out)):
        warn(f"{where}: dropped {name}, a buffer the model computes itself")
        del out[name]
    for dup, kept in layout.tied.items():
        if kept not in out:
            continue
        if dup in out and not fill_tied:
            if out[dup].shape != out[kept].shape or not torch.equal(out[dup], out[kept]):
                raise CheckpointError(f"{where}: {dup} and {kept} are tied in the config "
                                      "(tie_word_embeddings) but hold different values")
            del out[dup]
        elif fill_tied and dup not in out:
            out[dup] = out[kept]
    if not layout.checked:
        return out
    want = dict(layout.shapes)
    if not fill_tied:
        for dup in layout.tied:
            want.pop(dup, None)
    missing = sorted(set(want) - set(out))
    extra = sorted(set(out) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_some(missing)}")
        if extra:
            parts.append(f"not in the model: {_some(extra)}")
        raise CheckpointError(f"{where}: the tensors do not match the config's model: "
                              + "; ".join(parts))
    for name in sorted(want):
        if tuple(out[name].shape) != want[name]:
            raise CheckpointError(f"{where}: {name} has shape {list(out[name].shape)}, the "
                                  f"config's model has {list(want[name])}")
    return out


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# -- the folder -----------------------------------------------------------------

def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The names of each shard, in order: none above `max_shard_bytes` unless one tensor is."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=_natural):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _float_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    sizes: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    if not sizes:
        return None
    return str(max(sizes, key=lambda d: sizes[d])).removeprefix("torch.")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                     metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    plain = {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()  # safetensors refuses tensors sharing memory
        seen.add(ptr)
        plain[name] = t
    save_file(plain, str(path), metadata={"format": "pt", **(metadata or {})})


def copy_named_files(src: Path, dst: Path, match: Callable[[str], bool], follow: bool,
                     ) -> tuple[list[str], list[str]]:
    """Copy the regular files of `src` whose name `match`es into `dst`.

    Args:
        follow: Follow symlinks (a folder the operator named); False for a folder a
            job's manifest named: a symlink there is skipped.

    Returns:
        (names copied, names skipped because they are symlinks).
    """
    copied, skipped = [], []
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if not plain_name(entry.name) or not match(entry.name):
            continue
        if entry.is_symlink() and not follow:
            skipped.append(entry.name)
            continue
        fd = os.open(os.path.join(src, entry.name), os.O_RDONLY | nofollow | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fin:
            if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
                continue
            with open(dst / entry.name, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        copied.append(entry.name)
    return copied, skipped


def is_tokenizer_file(name: str) -> bool:
    return bool(_TOKENIZER_FILE.match(name))


def has_tokenizer(folder: str | Path | None) -> bool:
    if not folder or not Path(folder).is_dir():
        return False
    return any(is_tokenizer_file(p.name) and p.is_file() for p in Path(folder).iterdir())


def check_out_folder(out: Path) -> None:
    """Refuse an `out` folder that cannot be written, before the (slow) reading.

    Raises:
        CheckpointError: Saying what to change.
    """
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CheckpointError(f"--out {out} exists and is not a folder; choose a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} is a folder that is not empty; choose a new folder "
                              "(or remove it)")
    parent = out.parent
    if not parent.is_dir():
        raise CheckpointError(f"--out {out}: folder {parent} does not exist; create it or choose "
                              "another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"--out {out}: folder {parent} is not writable; choose another --out")


def write_hf_folder(out: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], *,
                    tokenizer: Path | None = None, tokenizer_follow: bool = True,
                    generation: Path | None = None, generation_follow: bool = True,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    warn: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    """Write a Hugging Face model folder at `out`, atomically (beside it, then renamed).

    Args:
        tensors: Checked tensors under HF names (`match_layout`).
        config: config.json; its `dtype` is set to the weights' floating dtype.
        tokenizer: The folder to copy the tokenizer's files from (None: none).
        generation: The folder whose generation_config.json to copy (None: none).
        tokenizer_follow, generation_follow: False for a folder a job's manifest named.
        warn: Called with what the folder lacks (a tokenizer).

    Returns:
        {"out", "tensors", "bytes", "shards", "dtype", "tokenizer": [files copied]}.

    Raises:
        CheckpointError: `out` exists and is not an empty folder.
        OSError: It cannot be written.
    """
    out = Path(out)
    check_out_folder(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        config = dict(config)
        dtype = _float_dtype(tensors)
        if dtype is not None:
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shards = shard_plan(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_safetensors(tensors, tmp / WEIGHTS)
        else:
            weight_map = {}
            for i, names in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_safetensors({n: tensors[n] for n in names}, tmp / file)
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / WEIGHTS_INDEX).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        if generation is not None and (generation / GENERATION_CONFIG).exists():
            copy_named_files(generation, tmp, lambda n: n == GENERATION_CONFIG, generation_follow)
        copied: list[str] = []
        if tokenizer is not None:
            copied, skipped = copy_named_files(tokenizer, tmp, is_tokenizer_file, tokenizer_follow)
            if skipped:
                warn(f"tokenizer files {', '.join(skipped)} in {tokenizer} are symlinks, which "
                     "are not followed in a folder a checkpoint names; pass --tokenizer DIR")
            if not copied:
                warn(f"{tokenizer} holds no tokenizer files; {out} has no tokenizer: pass "
                     "--tokenizer DIR")
        else:
            warn(f"{out} has no tokenizer; pass --tokenizer DIR to add one")
        os.rename(tmp, out)  # onto an empty folder, or where nothing is
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    return {"out": str(out), "tensors": len(tensors), "bytes": size, "shards": len(shards),
            "dtype": dtype, "tokenizer": sorted(copied)}
