"""A Hugging Face model folder, read as plain files: what it holds and whether the job can use it.

The spec names the folder (platform/spec/model.py); this module opens it. It
reads `config.json` as JSON and lists the weight and tokenizer files, with no
torch or transformers import, so the API server can refuse a job whose folder
is missing or cannot take the layout before the job is queued. The worker runs
the same checks when the job starts (and `model.params` against the weights it
loaded), because the API server need not share the cluster's disks: an
operator whose API cannot see the model folders sets
`KC_MODEL_FOLDER_CHECK=start`, and the check waits for the ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kuangchao.platform.errors import SpecError
from kuangchao.platform.spec.model import HFShape, ModelSection, hf_config_errors

# What `from_pretrained` reads weights from, in the order it prefers them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")
# config.json is small; a bigger one is not a model config.
CONFIG_LIMIT = 4 << 20


def folder_field(m: ModelSection) -> str:
    """The spec field that names the folder, for error messages."""
    return "model.checkpoint" if m.type == "llama" else "model.path"


def read_config(folder: str | Path, field: str = "model.path") -> dict[str, Any]:
    """`config.json` of a model folder as a dict.

    Raises:
        SpecError: The folder or its config.json is missing, too big, or not a JSON object.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise SpecError([(field, f"{str(folder)!r} is not a folder; give a local Hugging Face "
                                 "model folder (config.json, weights, tokenizer), e.g. one "
                                 "written by save_pretrained")])
    config = path / "config.json"
    try:
        if config.stat().st_size > CONFIG_LIMIT:
            raise SpecError([(field, f"{config} is larger than {CONFIG_LIMIT >> 20} MiB; "
                                     "it is not a model config")])
        doc = json.loads(config.read_text())
    except FileNotFoundError:
        raise SpecError([(field, f"{str(folder)!r} holds no config.json; it is not a Hugging "
                                 "Face model folder")]) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError([(field, f"cannot read {config}: {exc}")]) from None
    if not isinstance(doc, dict):
        raise SpecError([(field, f"{config} does not hold a JSON object")])
    return doc


def shape_of(folder: str | Path, field: str = "model.path") -> HFShape:
    """The model shape from the folder's config.json; `SpecError` naming `field` otherwise."""
    try:
        return HFShape.of(read_config(folder, field))
    except ValueError as exc:
        raise SpecError([(field, f"{folder}: {exc}")]) from None


def has_weights(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def folder_errors(spec: Any) -> list[tuple[str, str]]:
    """Everything the folder says against the job; [] for a job without one.

    `spec` is a JobSpec (typed loosely: this module sits below jobspec.py)."""
    m = spec.model
    folder = m.hf_folder
    if folder is None:
        return []
    field = folder_field(m)
    try:
        shape = shape_of(folder, field)
    except SpecError as exc:
        return list(exc.errors)
    p = spec.parallel
    errs = hf_config_errors(m, shape, p.tensor_parallel_size, p.pipeline_parallel_size,
                            p.pipeline_parallel_size * p.virtual_stages)
    if m.pretrained and not has_weights(folder):
        errs.append((field, f"{folder!r} holds no weights ({', '.join(WEIGHT_FILES[:3])}); "
                            "set model.pretrained: false to train from a seeded random init"))
    tokenizer = spec.data.tokenizer or folder
    where = "data.tokenizer" if spec.data.tokenizer else field
    if not has_tokenizer(tokenizer):
        errs.append((where, f"{tokenizer!r} holds no tokenizer (tokenizer.json); the data is "
                            "tokenized with the model's tokenizer"))
    elif (vocab := tokenizer_vocab_size(tokenizer)) is not None and vocab > shape.vocab_size:
        errs.append((where, f"the tokenizer's vocabulary ({vocab:,}) exceeds the model's "
                            f"embeddings ({shape.vocab_size:,}): its ids past them would index "
                            "nothing; use the model's own tokenizer, or resize the embeddings"))
    return errs


def tokenizer_vocab_size(folder: str | Path) -> int | None:
    """The ids a `tokenizer.json` can produce (its vocabulary and added tokens), read as
    JSON; None when there is none, or it is too big or not understood (the ranks check)."""
    path = Path(folder) / "tokenizer.json"
    try:
        if path.stat().st_size > 64 << 20:
            return None
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = [v for v in vocab.values() if isinstance(v, int)] if isinstance(vocab, dict) else []
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = list(range(len(vocab)))
    added = doc.get("added_tokens") or []
    ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    return max(ids) + 1 if ids else None


def check_model_folder(spec: Any) -> None:
    """At submission: refuse a job whose model folder or data files cannot serve it.

    Skipped when the operator set `KC_MODEL_FOLDER_CHECK=start` (the API server
    does not see the model folders); the ranks check it at start either way.

    Raises:
        SpecError: One `(field, message)` per problem.
    """
    if os.environ.get("KC_MODEL_FOLDER_CHECK", "submit") == "start":
        return
    from kuangchao.platform.spec.data_files import data_file_errors

    errs = folder_errors(spec) + data_file_errors(spec)
    if errs:
        raise SpecError(errs)
