"""Tiny Hugging Face models, tokenizers and datasets, built on this machine (no hub):
what the tests, the benchmarks and examples/finetune-llama.yaml train on.

    python -m kuangchao.workers.models.tiny_hf ~/.kuangchao/data

writes `tiny-llama/` and `chat.jsonl` (and the other formats) there.

- `tiny_tokenizer(folder)`: a byte-level BPE trained with `tokenizers` on Python's
  standard-library sources, with <s>, </s> and <pad>, and a chat template that
  marks the assistant's turns with `{% generation %}` (so transformers can tell
  the prompt from the answer);
- `tiny_llama(folder)`: a 2-layer Llama config with seeded random weights,
  `save_pretrained` next to that tokenizer;
- `write_datasets(folder)`: the same documents as text, jsonl, parquet, and chat.

Each builder is deterministic for its arguments, so two calls give the same files.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ m['content'] }}</s>{% endgeneration %}\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_texts(n: int = 40, max_chars: int = 4000) -> list[str]:
    """`n` documents: the beginnings of standard-library modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:n]
    return [p.read_text(errors="replace")[:max_chars] for p in files]


def tiny_tokenizer(folder: str | Path, vocab: int = VOCAB) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(stdlib_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def tiny_llama(folder: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, seed: int = 0, tie: bool = False, vocab: int = VOCAB,
               max_positions: int = 256) -> Path:
    """A Llama folder (config.json, model.safetensors, tokenizer) with seeded weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tiny_tokenizer(folder, vocab)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return folder


def chat_rows(texts: list[str]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Explain this code:\n{t[:300]}"},
                          {"role": "assistant", "content": t[300:900]}]} for t in texts]


def write_datasets(folder: str | Path, n: int = 40) -> dict[str, Path]:
    """text (one file per document), jsonl, parquet and chat files of the same documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    texts = stdlib_texts(n)
    (folder / "text").mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / "text" / f"doc_{i:03d}.txt").write_text(t)
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    parquet = folder / "docs.parquet"
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), parquet)
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(texts)))
    return {"text": folder / "text", "jsonl": jsonl, "parquet": parquet, "chat": chat}


def tiny_gpt2(folder: str | Path, *, seed: int = 0, vocab: int = VOCAB) -> Path:
    """A GPT-2 folder: a family the built-in trainer runs whole (no layer cut)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    tiny_tokenizer(folder, vocab)
    cfg = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kuangchao.workers.models.tiny_hf DIR", file=sys.stderr)
        return 2
    root = Path(args[0]).expanduser()
    model = tiny_llama(root / "tiny-llama", layers=4, hidden=128, heads=4, kv_heads=2)
    files = write_datasets(root / "tiny-data")
    (root / "chat.jsonl").write_bytes(files["chat"].read_bytes())
    print(f"model: {model}\nchat data: {root / 'chat.jsonl'}\nother formats: {root / 'tiny-data'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
