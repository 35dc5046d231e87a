"""Training data: corpora, sample order and batching, background prefetch."""
