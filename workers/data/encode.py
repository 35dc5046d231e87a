"""Tokenizing the user's documents into a packed stream (the build step of ``tokenized.py``).

``load_tokenizer`` loads a Hugging Face tokenizer folder (no hub: local files only) and
``tokenizer_digest`` hashes the files that decide its output. ``tokenize`` writes the
documents of a ``readers.Documents`` as ``[bos] + ids + [eos]`` each, packed end to end,
into ``tokens.u32`` (and ``mask.u8`` for chat), routing whole documents to the
``eval_`` files by ``held_out``; chat rows go through the tokenizer's chat template,
whose ``{% generation %}`` blocks mark the assistant's tokens in the mask.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kuangchao.workers.data.corpus import permit_read
from kuangchao.workers.data.readers import Document, Documents
from kuangchao.workers.errors import DataError

# A tokenizer call takes this many documents, or fewer when they hold more text than BATCH_CHARS.
BATCH_DOCS = 1000
BATCH_CHARS = 32_000_000
# The files of a tokenizer folder that decide its output (the cache key hashes them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt")


# --- the tokenizer ---------------------------------------------------------------------

_loaded: dict[tuple[str, str], Any] = {}


def tokenizer_digest(tokenizer_dir: str, field: str) -> str:
    folder = Path(tokenizer_dir)
    if not folder.is_dir():
        raise DataError(f"{field}: '{tokenizer_dir}' is not a folder on this node "
                        f"({socket.gethostname()}); point {field} at a tokenizer folder "
                        "(tokenizer.json, tokenizer_config.json)")
    digest = hashlib.sha256()
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        names += sorted(f"{extra.name}/{p.name}" for p in extra.iterdir() if p.is_file())
    if not names:
        raise DataError(f"{field}: '{tokenizer_dir}' holds no tokenizer files ("
                        f"{', '.join(TOKENIZER_FILES[:3])} ...); point {field} at a tokenizer folder")
    try:
        for name in names:
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    except OSError as exc:
        raise DataError(f"{field}: cannot read the tokenizer in '{tokenizer_dir}': {exc}") from exc
    return digest.hexdigest()


def load_tokenizer(tokenizer_dir: str, field: str) -> Any:
    digest = tokenizer_digest(tokenizer_dir, field)
    cached = (os.path.realpath(tokenizer_dir), digest)
    if cached in _loaded:
        return _loaded[cached]
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError("data.format: tokenized data needs transformers on the workers; install "
                        "kuangchao[hf] (pip install 'kuangchao[hf]')") from exc
    permit_read(tokenizer_dir)
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad folder
        raise DataError(f"{field}: cannot load a tokenizer from '{tokenizer_dir}': {exc}") from exc
    _loaded.clear()
    _loaded[cached] = tok
    return tok


# --- tokenizing ------------------------------------------------------------------------


def held_out(seed: int, index: int, fraction: float) -> bool:
    """Whether document ``index`` goes to the eval split: a hash of ``(seed, index)``
    under ``fraction``, so the split depends on nothing else (not the world size)."""
    digest = hashlib.blake2b(b"%d:%d" % (seed, index), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


class _Split:
    """One split's files in the temp folder, appended batch by batch."""

    def __init__(self, folder: Path, prefix: str, masked: bool) -> None:
        self.tokens_file = open(folder / f"{prefix}tokens.u32", "wb")
        self.mask_file = open(folder / f"{prefix}mask.u8", "wb") if masked else None
        self.documents = self.tokens = self.targets = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None, documents: int) -> None:
        np.asarray(tokens, dtype=np.uint32).tofile(self.tokens_file)
        if self.mask_file is not None and mask is not None:
            np.asarray(mask, dtype=np.uint8).tofile(self.mask_file)
            self.targets += int(np.count_nonzero(mask))
        self.documents += documents
        self.tokens += len(tokens)

    def close(self) -> None:
        for f in (self.tokens_file, self.mask_file):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def tokenize(tok: Any, docs: Documents, fmt: str, fraction: float, seed: int, folder: Path,
             tokenizer_field: str) -> dict:
    """Write the documents into ``folder`` (tokens.u32, mask.u8 for chat, and eval_ files
    for the documents ``held_out`` picks); return the counts for meta.json."""
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(f"{tokenizer_field}: the tokenizer defines no eos token, which marks where "
                        "a document ends; set eos_token in its tokenizer_config.json")
    bos = tok.bos_token_id if tok.bos_token_id not in (None, eos) else None
    masked = fmt == "chat"
    if masked and not getattr(tok, "chat_template", None):
        raise DataError(f"{tokenizer_field}: the tokenizer has no chat template, which "
                        "data.format chat needs; add chat_template.jinja to its folder, or set "
                        "data.format to jsonl")
    train, held = _Split(folder, "", masked), _Split(folder, "eval_", masked)
    top = -1
    index = 0
    try:
        for batch in _batches(docs, masked):
            texts = [doc for doc, _ in batch]
            if masked:
                tokens, mask, lengths = _encode_chat(tok, texts, [w for _, w in batch], bos, eos,
                                                     tokenizer_field)
            else:
                tokens, lengths = _encode_text(tok, texts, bos, eos)
                mask = None
            top = max(top, int(tokens.max()))
            to_eval = np.array([fraction > 0 and held_out(seed, i, fraction)
                                for i in range(index, index + len(batch))], dtype=bool)
            index += len(batch)
            at = np.repeat(to_eval, lengths)
            for split, pick, n in ((train, ~at, int((~to_eval).sum())), (held, at, int(to_eval.sum()))):
                if n:
                    split.add(tokens[pick], None if mask is None else mask[pick], n)
    finally:
        train.close()
        held.close()
    if not held.documents:
        for name in ("eval_tokens.u32", "eval_mask.u8"):
            with contextlib.suppress(OSError):
                (folder / name).unlink()
    return {"documents": train.documents, "tokens": train.tokens, "targets": train.targets,
            "eval_documents": held.documents, "eval_tokens": held.tokens,
            "eval_targets": held.targets, "masked": masked, "max_token_id": top,
            "bos_id": bos, "eos_id": eos}


def _batches(docs: Documents, masked: bool) -> Iterator[list[tuple[Document, str]]]:
    batch: list[tuple[Document, str]] = []
    chars = 0
    for doc, where in docs:
        if not masked and not doc:  # an empty text is no document
            continue
        batch.append((doc, where))
        chars += len(doc) if isinstance(doc, str) else sum(len(m["content"]) for m in doc)
        if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode_text(tok: Any, texts: list[str], bos: int | None,
                 eos: int) -> tuple[np.ndarray, np.ndarray]:
    """``[bos] + ids + [eos]`` of each text, packed; and each document's length."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # The fast tokenizer itself, without the offsets and conversions transformers adds
        # (packing needs the ids alone): the same ids, some 20% less CPU.
        ids = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        ids = tok(texts, add_special_tokens=False, return_attention_mask=False,
                  verbose=False)["input_ids"]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lens.sum()))
    lengths = lens + 1 + (bos is not None)
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]), dtype=np.uint32)
    special = np.zeros(len(out), dtype=bool)
    special[ends - 1] = True
    out[ends - 1] = eos
    if bos is not None:
        special[ends - lengths] = True
        out[ends - lengths] = bos
    out[~special] = flat
    return out, lengths


def _encode_chat(tok: Any, rows: list[Document], wheres: list[str], bos: int | None, eos: int,
                 tokenizer_field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row through the chat template, packed, with its assistant mask; the template's
    own bos and eos are kept, and added (unmasked) where it has none."""
    rendered = _render(tok, rows, wheres, tokenizer_field)
    tokens, masks = [], []
    for ids, marks, row, where in zip(rendered["input_ids"], rendered["assistant_masks"], rows,
                                      wheres, strict=True):
        ids = np.asarray(ids, dtype=np.uint32)
        marks = np.asarray(marks, dtype=np.uint8)
        if not marks.any() and any(m["role"] == "assistant" and m["content"] for m in row):
            raise DataError(f"data.format chat: the chat template of {tokenizer_field} marks no "
                            f"assistant tokens ({where} has an assistant message, none of whose "
                            "tokens is marked), so the loss could not tell answers from prompts; "
                            "wrap the assistant's content in {% generation %}...{% endgeneration "
                            "%} in the template")
        head = [bos] if bos is not None and (not len(ids) or ids[0] != bos) else []
        tail = [eos] if not len(ids) or ids[-1] != eos else []
        tokens += [np.array(head, dtype=np.uint32), ids, np.array(tail, dtype=np.uint32)]
        masks += [np.zeros(len(head), np.uint8), marks, np.zeros(len(tail), np.uint8)]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64).reshape(-1, 3).sum(axis=1)
    return np.concatenate(tokens), np.concatenate(masks), lengths


def _render(tok: Any, rows: list[Document], wheres: list[str], tokenizer_field: str) -> Any:
    def apply(convs: list[Document]) -> Any:
        return tok.apply_chat_template(convs, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)

    try:
        return apply(rows)
    except Exception:  # the template raised (a Jinja error, its own raise_exception)
        for row, where in zip(rows, wheres, strict=True):
            try:
                apply([row])
            except Exception as exc:
                raise DataError(f"data.format chat: the chat template of {tokenizer_field} fails "
                                f"on {where}: {exc}; fix the row (roles, their order) or the "
                                "template") from exc
        raise
