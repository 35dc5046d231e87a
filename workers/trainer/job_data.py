"""The batches a job trains and evaluates on.

Two kinds of data feed the same index-based sampler (workers/data/sampling.py):

- bytes or uint16 tokens (`data.format` unset, a built-in model): the built-in
  corpus, a `.bin` token file or text read as bytes (workers/data/corpus.py);
- tokenized documents (`data.format` text, jsonl, parquet or chat, and every
  Hugging Face model): tokenized once with the model's tokenizer, packed with
  document boundaries, cached next to the data and memory-mapped
  (workers/data/tokenized.py). A chat dataset's prompt tokens carry no loss.

A Hugging Face model given no `data.path` trains on the built-in corpus
through its own tokenizer: the standard library's sources, one document per
module, written once as a text folder under the user's cache.

A `data.path` in an object store (`s3://...`) is copied to this node's cache
first (workers/data/remote.py) and read from there: the readers, and the
tokenized cache, see only local files.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from kuangchao.platform.settings import data_roots
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.platform.storage.urls import is_url
from kuangchao.workers.data.sampling import BatchSource, load_corpus
from kuangchao.workers.data.shares import Shares
from kuangchao.workers.parallel.engine import Engine
from kuangchao.workers.runtime.context import TrainContext
from kuangchao.workers.trainer.job_model import dims, tokenizer_folder


def job_sources(spec: JobSpec, model: nn.Module) -> tuple[BatchSource, BatchSource | None]:
    """(training batches, eval batches or None) for the job.

    Raises:
        DataError: The data cannot be read or tokenized; the message names the setting.
    """
    d, m = spec.data, spec.model
    _, _, vocab = dims(spec, model)
    path, roots = data_location(d.path)
    if not (d.tokenized or m.is_hf):
        corpus = load_corpus(path, d.max_bytes, vocab, roots=roots)
        return BatchSource(corpus, m.seq_len, spec.training.seed), None
    from kuangchao.workers.data.tokenized import MaskedBatchSource, load_tokenized

    data = d if path == d.path else d.model_copy(update={"path": path})
    if d.path is None:  # the built-in corpus, through the model's tokenizer
        data = d.model_copy(update={"path": str(stdlib_documents(d.max_bytes)), "format": "text"})
        roots = None  # the platform's own files, not the user's
    tokenizer = tokenizer_folder(spec)
    assert tokenizer is not None  # validation: a tokenized format names one
    field = "data.tokenizer" if d.tokenizer else ("model.checkpoint" if m.type == "llama"
                                                  else "model.path")
    td = load_tokenized(data, tokenizer, m.seq_len, vocab_limit=vocab, roots=roots,
                        seed=spec.training.seed, tokenizer_field=field)
    train = MaskedBatchSource(td.tokens, td.mask, m.seq_len, spec.training.seed)
    held = (MaskedBatchSource(td.eval_tokens, td.eval_mask, m.seq_len, spec.training.seed)
            if td.eval_tokens is not None else None)
    return train, held


def data_location(path: str | None) -> tuple[str | None, tuple[str, ...] | None]:
    """(`data.path` as this rank reads it, the roots it is held to there).

    A local path is read as written, held to `KC_DATA_ROOTS` with symlinks resolved.
    An object-store URL, checked against `KC_DATA_URLS` at submission, becomes its
    local copy in the node's cache, a folder of the platform's own: no roots."""
    if path is not None and is_url(path):
        from kuangchao.workers.data.remote import local_copy

        return str(local_copy(path)), None
    return path, data_roots()


def stdlib_documents(max_bytes: int) -> Path:
    """The built-in corpus as a folder of text documents (one per stdlib module), made once."""
    from kuangchao.workers.data.corpus import _cache_dir, stdlib_corpus

    folder = _cache_dir() / f"stdlib-docs-{max_bytes}"
    if (folder / ".complete").exists():
        return folder
    raw = bytes(stdlib_corpus(max_bytes).astype("uint8"))
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # The cached corpus is the modules' sources end to end; cut it into ~16 KB
    # documents at line ends, so that packing puts a boundary between them.
    text = raw.decode("utf-8", errors="replace")
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + 16384)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    for i, doc in enumerate(docs):
        (tmp / f"doc_{i:05d}.txt").write_text(doc)
    (tmp / ".complete").write_text("")
    try:
        os.replace(tmp, folder)
    except OSError:  # another rank made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def eval_loss(engine: Engine, ctx: TrainContext) -> float:
    """This rank's mean loss over `training.eval_batches` rounds of the held-out split.

    The same samples at every evaluation, so the curve compares like with like."""
    spec, source = ctx.spec, ctx.eval_source
    if source is None:
        return float("nan")
    # The training split's shares: a pipeline replica's schedule takes its own number of
    # micro-batches, and the caller weights this rank's mean by its share.
    shares = ctx.shares or Shares.even(ctx.dp_size, spec.parallel.micro_batch_size, ctx.accum_steps)
    total = 0.0
    rounds = spec.training.eval_batches
    for r in range(rounds):
        batches = [tuple(b.to(ctx.device) for b in source.get(idx))
                   for idx in shares.spans(r, ctx.dp_rank)]
        total += engine.evaluate(batches)
    return total / rounds
