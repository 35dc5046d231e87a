"""The user's own data, tokenized once and cached: text, jsonl, parquet and chat files.

``load_tokenized`` reads ``data.path`` (``readers.py``), tokenizes every document with a
Hugging Face tokenizer folder, packs the documents end to end into one flat stream of
uint32 token ids (``[bos] + ids + [eos]`` each; the eos is the document boundary) and
writes it, with the held-out split (``data.eval_fraction``: whole documents, chosen by a
hash of ``(seed, document index)``), into ``.kc-tokenized/<key>/`` beside the data, or
under ``$XDG_CACHE_HOME/kuangchao/tokenized/`` when that folder cannot be written. The
key covers the tokenizer's files, the settings and each input file's name, size and
mtime, so a restart or a second job memory-maps the cache instead of tokenizing again,
and an edited file makes a new one. The cache is built in a temp folder and renamed into
place with ``meta.json`` written last: no reader ever sees half of it.

Chat rows are rendered with the tokenizer's chat template, and a uint8 mask marks the
assistant's tokens (the template's ``{% generation %}`` blocks): ``MaskedBatchSource``
sets the targets of the other tokens to -100, so the loss counts only the answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kuangchao.platform.errors import TokenError
from kuangchao.workers.data import encode
from kuangchao.workers.data.corpus import _cache_dir, check_int, permit_read
from kuangchao.workers.data.readers import (
    CACHE_FOLDER,
    Documents,
    Sources,
    infer_format,
    list_sources,
)
from kuangchao.workers.data.sampling import BatchSource
from kuangchao.workers.errors import DataError

if TYPE_CHECKING:
    from kuangchao.platform.spec.jobspec import DataSection

# Bump when the layout or the tokenization rules change: old caches stop matching.
FORMAT_VERSION = 1
# The cross-entropy ignore index: a target the loss skips.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedData:
    """A tokenized dataset, memory-mapped from its cache.

    ``tokens``: every training document's tokens, packed (1-D uint32); ``mask``: same
    length, 1 where the token counts as a target of the loss (None: all count);
    ``eval_tokens``/``eval_mask``: the held-out split (None without data.eval_fraction);
    ``meta``: what the cache key was built from, and the counts.
    """

    tokens: np.ndarray
    mask: np.ndarray | None
    eval_tokens: np.ndarray | None
    eval_mask: np.ndarray | None
    meta: dict
    cache_dir: Path


def tokenizer_vocab(tokenizer_dir: str, *, tokenizer_field: str = "data.tokenizer") -> int:
    """The tokenizer's vocabulary, added tokens included (``len(tokenizer)``).

    Raises:
        DataError: When the folder holds no loadable tokenizer (named by ``tokenizer_field``).
    """
    return len(encode.load_tokenizer(tokenizer_dir, tokenizer_field))


def load_tokenized(data: DataSection, tokenizer_dir: str, seq_len: int, *,
                   vocab_limit: int | None, roots: tuple[str, ...] | None, seed: int = 0,
                   tokenizer_field: str = "data.tokenizer") -> TokenizedData:
    """Tokenize ``data.path`` with the tokenizer in ``tokenizer_dir``, or reuse its cache.

    Args:
        data: The job's data section (path, format, field, eval_fraction, max_bytes);
            ``data.format`` None: inferred from the path's extension.
        tokenizer_dir: A Hugging Face tokenizer folder (tokenizer.json ...).
        seq_len: Tokens per sample: each split must hold at least ``seq_len + 2``.
        vocab_limit: The model's embedding rows; a larger tokenizer is refused. None: no check.
        roots: The folders jobs may read on this node (see ``corpus.load_corpus``).
        seed: Chooses the held-out documents (``training.seed``).
        tokenizer_field: The setting that named the tokenizer, for messages
            (``model.path`` when the tokenizer is the model's own).

    Raises:
        DataError: For anything wrong with the data, the tokenizer or the settings.
        PermissionError: In a rank whose data_loader token does not grant dataset_read.
    """
    check_int(seq_len, "model.seq_len", minimum=1)
    check_int(seed, "training.seed", minimum=0)
    if not data.path:
        raise DataError(f"data.path: data.format {data.format} reads your own files; set "
                        "data.path to a file, a folder or a glob")
    fmt = data.format or infer_format(data.path)
    permit_read(data.path)
    sources = list_sources(data.path, fmt, roots)
    ident = _identity(sources, fmt, data, seed, encode.tokenizer_digest(tokenizer_dir, tokenizer_field))
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    parents = (sources.base / CACHE_FOLDER, _cache_dir() / "tokenized")
    found = _find_cache(parents, key)
    if found is None:
        found = _build(parents, key, ident, sources, fmt, data, tokenizer_dir, tokenizer_field,
                       vocab_limit, seed)
    place, meta = found
    _check_vocab(meta["tokenizer_vocab"], vocab_limit, tokenizer_field)
    _check_length(meta["tokens"], seq_len, "data: the tokenized training split",
                  "use more data (data.path, data.max_bytes)")
    if meta["eval_documents"]:
        _check_length(meta["eval_tokens"], seq_len, "data.eval_fraction: the held-out split",
                      "raise data.eval_fraction or use more data")
    return _open(place, meta)



def _check_vocab(vocab: int, limit: int | None, field: str) -> None:
    if limit is not None and vocab > limit:
        raise DataError(f"{field}: the tokenizer's vocabulary ({vocab}) exceeds the model's "
                        f"embeddings ({limit}); use the model's own tokenizer, or a model with at "
                        f"least {vocab} token embeddings")


def _check_length(n_tokens: int, seq_len: int, what: str, fix: str) -> None:
    if n_tokens < seq_len + 2:
        raise DataError(f"{what} has {n_tokens} tokens, fewer than model.seq_len + 2 = "
                        f"{seq_len + 2}; {fix}, or lower model.seq_len")


# --- cache -----------------------------------------------------------------------------


def _identity(sources: Sources, fmt: str, data: DataSection, seed: int, digest: str) -> dict:
    """What the cache key is a hash of (and what meta.json records of it)."""
    split = data.eval_fraction > 0
    return {"version": FORMAT_VERSION, "tokenizer": digest, "format": fmt,
            "field": data.field if fmt in ("jsonl", "parquet") else None,
            "eval_fraction": data.eval_fraction, "seed": seed if split else None,
            "max_bytes": data.max_bytes, "files": sources.stamp()}


def _sizes(meta: dict) -> dict[str, int]:
    sizes = {"tokens.u32": 4 * meta["tokens"]}
    if meta["eval_documents"]:
        sizes["eval_tokens.u32"] = 4 * meta["eval_tokens"]
    if meta["masked"]:
        sizes["mask.u8"] = meta["tokens"]
        if meta["eval_documents"]:
            sizes["eval_mask.u8"] = meta["eval_tokens"]
    return sizes


def _read_meta(place: Path) -> dict | None:
    """The cache's meta when it is complete (meta.json there, every file its size)."""
    try:
        meta = json.loads((place / "meta.json").read_text())
        if meta.get("version") != FORMAT_VERSION:
            return None
        for name, size in _sizes(meta).items():
            if (place / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def _find_cache(parents: tuple[Path, ...], key: str) -> tuple[Path, dict] | None:
    for parent in parents:
        meta = _read_meta(parent / key)
        if meta is not None:
            return parent / key, meta
    return None


def _open(place: Path, meta: dict) -> TokenizedData:
    def mapped(name: str, dtype: type, n: int) -> np.ndarray:
        return np.memmap(place / name, dtype=dtype, mode="r", shape=(n,))

    n, n_eval, masked = meta["tokens"], meta["eval_tokens"], meta["masked"]
    has_eval = bool(meta["eval_documents"])
    return TokenizedData(
        tokens=mapped("tokens.u32", np.uint32, n),
        mask=mapped("mask.u8", np.uint8, n) if masked else None,
        eval_tokens=mapped("eval_tokens.u32", np.uint32, n_eval) if has_eval else None,
        eval_mask=mapped("eval_mask.u8", np.uint8, n_eval) if has_eval and masked else None,
        meta=meta, cache_dir=place)


@contextlib.contextmanager
def _lock(parents: tuple[Path, ...], key: str) -> Iterator[Path]:
    """The first of ``parents`` that can be written, held under a lock for ``key``: ranks
    building the same cache wait for the first instead of all tokenizing."""
    for parent in parents:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            handle = open(parent / f".{key}.lock", "a")
        except OSError:
            continue
        break
    else:
        raise DataError(f"data.path: cannot write the tokenized cache in {parents[0]} nor in "
                        f"{parents[1]}; make one of them writable (XDG_CACHE_HOME)")
    with handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no locks (another OS, some network file systems)
            pass
        yield parent


def _build(parents: tuple[Path, ...], key: str, ident: dict, sources: Sources, fmt: str,
           data: DataSection, tokenizer_dir: str, tokenizer_field: str, vocab_limit: int | None,
           seed: int) -> tuple[Path, dict]:
    with _lock(parents, key) as parent:
        found = _find_cache(parents, key)  # built by another rank while this one waited
        if found is not None:
            return found
        tok = encode.load_tokenizer(tokenizer_dir, tokenizer_field)
        _check_vocab(len(tok), vocab_limit, tokenizer_field)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent))
        try:
            docs = Documents(sources, fmt, data.field, data.max_bytes)
            counts = encode.tokenize(tok, docs, fmt, data.eval_fraction, seed, tmp, tokenizer_field)
            meta = {**ident, **counts, "key": key, "source": data.path,
                    "tokenizer_vocab": len(tok), "bytes_read": docs.bytes_read,
                    "max_bytes_reached": docs.limit_reached}
            _check_counts(meta, data)
            _write_meta(tmp, meta)
            final = parent / key
            try:
                os.replace(tmp, final)
            except OSError:  # a folder in the way
                existing = _read_meta(final)
                if existing is not None:  # another builder won the race: use its cache
                    return final, existing
                shutil.rmtree(final, ignore_errors=True)  # a broken one
                os.replace(tmp, final)
        except OSError as exc:
            if isinstance(exc, TokenError):  # the rank's token refused a read
                raise
            raise DataError(f"data.path: cannot write the tokenized cache in '{parent}': {exc}; "
                            "free space there, or set XDG_CACHE_HOME to a writable folder") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
        return final, meta


def _write_meta(folder: Path, meta: dict) -> None:
    with open(folder / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _check_counts(meta: dict, data: DataSection) -> None:
    n_docs = meta["documents"] + meta["eval_documents"]
    if n_docs == 0:
        raise DataError(f"data.path: '{data.path}' holds no documents (all empty); point "
                        "data.path at your data")
    if meta["masked"] and meta["targets"] + meta["eval_targets"] == 0:
        raise DataError("data.format chat: no row has an assistant message, so nothing would be "
                        "trained; add the answers, or set data.format to jsonl")
    if data.eval_fraction > 0 and not (meta["documents"] and meta["eval_documents"]):
        raise DataError(f"data.eval_fraction: {data.eval_fraction} of {n_docs} documents holds "
                        f"out {meta['eval_documents']}, and each split needs at least one "
                        "document; change data.eval_fraction or add documents")


# --- batches ---------------------------------------------------------------------------


class MaskedBatchSource(BatchSource):
    """``BatchSource`` over a tokenized stream whose mask says which targets count.

    ``get`` returns ``(x, y)`` as ``BatchSource`` does, with ``y[:, t] = -100`` (the
    cross-entropy ignore index) where the target token's mask is 0. ``mask`` None: every
    target counts.

    Raises:
        DataError: When ``mask`` is not as long as ``tokens``, or ``BatchSource`` refuses.
    """

    def __init__(self, tokens: np.ndarray, mask: np.ndarray | None, seq_len: int,
                 seed: int) -> None:
        super().__init__(tokens, seq_len, seed)
        if mask is not None and mask.shape != tokens.shape:
            raise DataError(f"data: the loss mask has shape {mask.shape}, the tokens "
                            f"{tokens.shape}; rebuild the tokenized cache (delete {CACHE_FOLDER})")
        self.mask = mask

    def get(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.fromiter((self.order.offset(g) for g in indices), dtype=np.int64)
        at = (starts[:, None] + self._span).reshape(len(indices), self.seq_len + 1)
        windows = np.asarray(self.corpus[at], dtype=np.int64)
        x, y = windows[:, :-1], windows[:, 1:]
        if self.mask is not None:
            y = np.where(np.asarray(self.mask[at[:, 1:]]) != 0, y, IGNORE_INDEX)
        return (torch.from_numpy(np.ascontiguousarray(x)),
                torch.from_numpy(np.ascontiguousarray(y)))
