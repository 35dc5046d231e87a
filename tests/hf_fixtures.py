"""The tiny Hugging Face models and datasets the tests build (kuangchao.workers.models.tiny_hf)."""

from kuangchao.workers.models.tiny_hf import (  # noqa: F401
    CHAT_TEMPLATE,
    VOCAB,
    chat_rows,
    stdlib_texts,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
    write_datasets,
)
