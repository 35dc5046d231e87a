"""Activation memory of one transformer layer on one rank, with and without sequence
parallelism: the planner's terms (pure arithmetic, no torch).

From Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), section 4: the bytes one layer stores for
backward, with 16-bit activations and 1-byte dropout masks, for sequence length s,
micro-batch b, hidden size h, a attention heads and tensor-parallel size t:

    no parallelism                  s*b*h*(34 + 5*a*s/h)
    tensor parallelism              s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallelism   s*b*h*(34/t + 5*a*s/(h*t))

Of the 34 bytes per token and channel, tensor parallelism splits 24 (the
attention's q, k, v and output-projection input, the MLP's hidden activations)
and leaves 10 whole on every rank: the two norms' inputs (4), the inputs of the
q/k/v and first MLP projections (4) and the two dropout masks (2). Sequence
parallelism splits those 10 along the sequence too (keeping the projections'
inputs as shards, all-gathered again in backward). The 5*a*s/h term is the
attention's s x s matrices (scores, softmax, its dropout mask); a flash-style
kernel, or selective recomputation, keeps none of them: `scores=False`. Without
it, the ratio of the last line to the second is 0.77 at t = 2 and 0.53 at t = 4.
"""

from __future__ import annotations

REPLICATED_UNDER_TP = 10  # bytes per token and channel that plain tensor parallelism keeps whole
SPLIT_UNDER_TP = 24        # ... and those it splits over the t ranks
SCORE_BYTES = 5            # per token, head and key position: the attention's s x s matrices


def activation_terms(seq_len: int, d_model: int, n_heads: int,
                     scores: bool = True) -> tuple[float, float]:
    """Bytes one layer stores per token of a micro-batch, as (replicated, split): the
    part plain tensor parallelism keeps whole on every rank, and the part it splits."""
    _check(seq_len=seq_len, d_model=d_model, n_heads=n_heads)
    split = float(SPLIT_UNDER_TP * d_model)
    if scores:
        split += SCORE_BYTES * n_heads * seq_len
    return float(REPLICATED_UNDER_TP * d_model), split


def layer_activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                           tp: int = 1, sequence_parallel: bool = False,
                           scores: bool = True) -> float:
    """Bytes of activations one layer stores on one rank for backward (the table above).

    With `sequence_parallel` (which needs tp > 1 to mean anything) the replicated part
    is split over the tp ranks as well."""
    _check(micro_batch=micro_batch, tp=tp)
    replicated, split = activation_terms(seq_len, d_model, n_heads, scores)
    shards = tp if sequence_parallel else 1
    return seq_len * micro_batch * (replicated / shards + split / tp)


def sp_memory_ratio(seq_len: int, d_model: int, n_heads: int, tp: int,
                    scores: bool = False) -> float:
    """A layer's activation bytes per rank with sequence parallelism over those without
    (same tp): 0.77 at tp 2 and 0.53 at tp 4 without the attention's s x s matrices."""
    def layer(sp: bool) -> float:
        return layer_activation_bytes(seq_len, 1, d_model, n_heads, tp, sp, scores)
    return layer(True) / layer(False)


def _check(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
