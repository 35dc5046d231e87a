"""The job spec's `data` section: the built-in corpus, a token or text file, or the
user's own documents (text, jsonl, parquet, chat) tokenized with the model's tokenizer.

Reading and tokenizing is the worker's (workers/data/); here is only what a spec
may say, and what it may not say given its model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DATA_FORMATS = ("text", "jsonl", "parquet", "chat")


class DataSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: Literal["stdlib"] = "stdlib"
    # A file, a folder or a glob (`/data/docs/*.jsonl`).
    path: str | None = None
    # How `path` is read: None keeps the byte/token reader of the built-in models (a
    # uint16 `.bin`, or text read as bytes); text, jsonl, parquet and chat are tokenized
    # with the model's tokenizer (a Hugging Face model's, or `data.tokenizer`).
    format: Literal["text", "jsonl", "parquet", "chat"] | None = None
    # The text column of jsonl and parquet rows (chat rows carry `messages`).
    field: str = Field("text", min_length=1, max_length=200)
    # A tokenizer folder (tokenizer.json); default: the Hugging Face model's folder.
    tokenizer: str | None = Field(None, min_length=1, max_length=4096)
    # The share of documents held out for the eval loss (`training.eval_interval`).
    eval_fraction: float = Field(0.0, ge=0.0, le=0.5)
    max_bytes: int = Field(4_000_000, ge=1024)
    prefetch: int = Field(2, ge=1, le=64)
    # Record every step's global sample indices in Redis (`kc samples`), to audit the sequence.
    record_samples: bool = False

    @property
    def tokenized(self) -> bool:
        """Whether the data goes through a tokenizer (and the tokenized cache)."""
        return self.format is not None


def data_errors(spec: Any) -> list[tuple[str, str]]:
    """The data section against the model: tokenized formats need a tokenizer and a path.

    `spec` is a JobSpec (typed loosely: jobspec.py imports this module)."""
    d, m = spec.data, spec.model
    errs: list[tuple[str, str]] = []
    if d.format is not None and d.path is None:
        errs.append(("data.path", f"data.format {d.format} reads files; name a file, a folder or "
                                  "a glob, or remove data.format to train on the built-in corpus"))
    if d.tokenizer is not None and not m.is_hf and d.format is None:
        errs.append(("data.tokenizer", "tokenizes data.format text, jsonl, parquet or chat; set "
                                       "data.format, or remove data.tokenizer"))
    if d.format is not None and not m.is_hf and d.tokenizer is None:
        errs.append(("data.tokenizer", f"data.format {d.format} is tokenized with a tokenizer; a "
                                       "built-in model has none of its own, so name a tokenizer "
                                       "folder (tokenizer.json)"))
    if spec.training.eval_interval is not None and d.eval_fraction == 0:
        errs.append(("training.eval_interval", "evaluates on the held-out split; set "
                                               "data.eval_fraction (e.g. 0.05), or remove it"))
    if d.eval_fraction > 0 and not (d.tokenized or m.is_hf):
        errs.append(("data.eval_fraction", "holds out documents of a tokenized dataset; set "
                                           "data.format (and data.tokenizer for a built-in model)"))
    return errs
