"""The dataset-preparation half of bench/hf.py: `load_tokenized` against plain `tokenizers`.

No Ray, no Redis, no stack: one process. The texts are the standard library's
modules in full (`tests/hf_fixtures.stdlib_texts` with no length cut), repeated
until they hold `target_mb` MB, one jsonl row `{"text": ...}` each (with
`whole=False`, the quick mode's, only the first modules that reach `target_mb`: a
smaller target than the 4.7 MB of one copy is not rounded up to it); the tokenizer
is `tests/hf_fixtures.tiny_tokenizer` (byte-level BPE, 512 tokens, <s> and </s>).

* ours: `load_tokenized(DataSection(path=docs.jsonl, format="jsonl", max_bytes=...),
  tokenizer folder, seq_len)` on a fresh cache: the jsonl read, every document
  tokenized as `[bos] + ids + [eos]`, packed, written as uint32 and fsynced, the
  meta written last and the cache renamed into place. A fresh copy of the jsonl
  (new mtime, new folder) per repeat, so the cache key is new each time, and the
  process's tokenizer cache (`encode._loaded`) is cleared first, so the tokenizer
  load is timed on both sides. `data.max_bytes` is raised to twice the file's size
  (the default 4 MB would stop reading before the end); nothing else is set.
* baseline: what a plain script does with the same file: read the jsonl rows,
  `Tokenizer.from_file(tokenizer.json)`, `encode_batch_fast(texts, add_special_tokens=False)`
  (tokenizers' documented faster `encode_batch`: it skips the character offsets, which
  packing does not need) in batches of 1,000 documents (kuangchao's batch size), `<s>` and `</s>` around each
  document and everything packed into one uint32 array in memory (no file written).
* cache hit: a second `load_tokenized` of the same data right after ours (the key
  is hashed, the meta read, the arrays memory-mapped).

Both sides must produce the same number of tokens; the run stops otherwise. The line
also gives each side's CPU seconds (`time.process_time()`, every thread of the
process): on a shared machine the wall times move with the load, the work does not.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import log, median, wait_for_quiet

BATCH = 1000  # documents per encode_batch call (kuangchao's encode.BATCH_DOCS)


def make_texts(target_mb: float, whole: bool = True) -> list[str]:
    """Whole copies of the stdlib's modules until `target_mb` MB; with `whole=False`,
    the first modules that reach it (never fewer than one)."""
    from kuangchao.workers.models.tiny_hf import stdlib_texts

    base = stdlib_texts(n=100_000, max_chars=10**9)
    texts: list[str] = []
    while sum(map(len, texts)) < target_mb * 1e6:
        texts.extend(base)
    if not whole:
        size = 0
        for i, t in enumerate(texts):
            size += len(t)
            if size >= target_mb * 1e6:
                return texts[:i + 1]
    return texts


def write_jsonl(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def plain_tokenizers(jsonl: Path, tokenizer_dir: Path) -> tuple[int, float, float]:
    """(tokens, seconds, CPU seconds of the process, all threads) of the baseline."""
    from tokenizers import Tokenizer

    c0, t0 = time.process_time(), time.perf_counter()
    with open(jsonl) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    head, tail = np.array([bos], dtype=np.uint32), np.array([eos], dtype=np.uint32)
    # encode_batch_fast: encode_batch without the character offsets (documented as the
    # faster call), which packing does not need.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts: list[np.ndarray] = []
    for i in range(0, len(texts), BATCH):
        for enc in encode(texts[i:i + BATCH], add_special_tokens=False):
            parts += (head, np.asarray(enc.ids, dtype=np.uint32), tail)
    packed = np.concatenate(parts)
    return len(packed), time.perf_counter() - t0, time.process_time() - c0


def kc_load(jsonl: Path, tokenizer_dir: Path, seq_len: int,
            fresh: bool) -> tuple[int, float, float, Any]:
    """(tokens, seconds, CPU seconds, TokenizedData) of one `load_tokenized`."""
    from kuangchao.platform.spec.data import DataSection
    from kuangchao.workers.data import encode
    from kuangchao.workers.data.tokenized import load_tokenized

    data = DataSection(path=str(jsonl), format="jsonl",
                       max_bytes=max(1024, 2 * jsonl.stat().st_size))
    if fresh:
        encode._loaded.clear()  # a job's process loads its tokenizer once: time that load too
    c0, t0 = time.process_time(), time.perf_counter()
    td = load_tokenized(data, str(tokenizer_dir), seq_len, vocab_limit=None, roots=None, seed=0)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if td.meta.get("max_bytes_reached"):
        raise RuntimeError("data.max_bytes was reached: ours did not tokenize every document")
    return int(td.meta["tokens"] + td.meta["eval_tokens"]), dt, cpu, td


def measure(work: Path, target_mb: float, repeats: int, seq_len: int = 64,
            whole: bool = True) -> dict[str, Any]:
    """Alternating fresh-cache runs of both; medians. Uses `work` as scratch (removed after).
    `whole`: see `make_texts`."""
    from kuangchao.workers.models.tiny_hf import tiny_tokenizer

    old_xdg = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg")  # kuangchao's fallback cache: ours alone
    try:
        tok_dir = tiny_tokenizer(work / "tokenizer")
        texts = make_texts(target_mb, whole)
        # Warm-up, untimed: imports (transformers, tokenizers) and the page cache.
        small = write_jsonl(work / "warm", texts[:20])
        kc_load(small, tok_dir, seq_len, fresh=True)
        plain_tokenizers(small, tok_dir)
        ours, base, hits, ours_cpu, base_cpu = [], [], [], [], []
        n_tokens = None
        size = 0
        for i in range(repeats):
            jsonl = write_jsonl(work / f"data-{i}", texts)
            size = jsonl.stat().st_size
            order = ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")
            for who in order:
                wait_for_quiet()
                if who == "ours":
                    n, dt, cpu, td = kc_load(jsonl, tok_dir, seq_len, fresh=True)
                    if not str(td.cache_dir).startswith(str(jsonl.parent)):
                        log(f"cache built in {td.cache_dir}, not beside the data")
                    _, hit, _, _ = kc_load(jsonl, tok_dir, seq_len, fresh=False)
                    ours.append(dt)
                    ours_cpu.append(cpu)
                    hits.append(hit)
                else:
                    n, dt, cpu = plain_tokenizers(jsonl, tok_dir)
                    base.append(dt)
                    base_cpu.append(cpu)
                if n_tokens is None:
                    n_tokens = n
                elif n != n_tokens:
                    raise RuntimeError(f"token counts differ: {n} against {n_tokens}")
            log(f"tokenize #{i}: ours {ours[-1]:.3f}s ({ours_cpu[-1]:.2f} CPU s, hit "
                f"{hits[-1] * 1000:.1f}ms), tokenizers {base[-1]:.3f}s ({base_cpu[-1]:.2f} CPU s), "
                f"{n_tokens:,} tokens")
            shutil.rmtree(work / f"data-{i}", ignore_errors=True)
        assert n_tokens is not None
        return {"tokens": n_tokens, "bytes": size, "documents": len(texts), "ours_s": ours,
                "baseline_s": base, "hit_s": hits,
                "ours_cpu_s": ours_cpu, "baseline_cpu_s": base_cpu}
    finally:
        if old_xdg is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old_xdg


def results(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The two result lines (fields for `bench.hf.emit_line`)."""
    ours_rate = m["tokens"] / median(m["ours_s"])
    base_rate = m["tokens"] / median(m["baseline_s"])
    common = {"tokens": m["tokens"], "jsonl_bytes": m["bytes"], "documents": m["documents"],
              "repeats": len(m["ours_s"])}
    return [
        {"metric": "tokenize_throughput", "unit": "tokens/s", "ours": ours_rate,
         "baseline": base_rate, "target": 0.8, "better": "higher", "target_on": "ratio",
         **common,
         "ours_runs_s": m["ours_s"], "baseline_runs_s": m["baseline_s"],
         # CPU seconds of the process (all threads): the work, whatever else loads the machine.
         "ours_cpu_s": median(m["ours_cpu_s"]), "baseline_cpu_s": median(m["baseline_cpu_s"]),
         "notes": "ours: load_tokenized on a fresh cache (format jsonl; data.max_bytes raised to "
                  "2x the file so every document is read); baseline: read the jsonl, "
                  "tokenizers Tokenizer.from_file + encode_batch_fast (1,000 docs "
                  "a batch, add_special_tokens=False), <s>/</s> per document, packed to uint32 in memory. "
                  "Target is a floor: met when ratio >= 0.8"},
        {"metric": "tokenize_cache_hit_s", "unit": "s", "ours": median(m["hit_s"]),
         "baseline": median(m["baseline_s"]), "target": None, "better": "lower",
         "target_on": "ratio", **common,
         "notes": "ours: a second load_tokenized of the same data (cache hit); baseline: "
                  "tokenizing it again with plain tokenizers. Informative, no target"},
    ]
