"""The first-call costs a warm spare pays while it waits, so that the rank it adopts does not.

Importing torch and the trainer is most of what a new rank costs, not all of it.
The first optimizer a process makes imports `torch._dynamo` (about 200 modules:
0.56 s on an idle 2-core node, 0.73 s beside two training ranks, measured on
2026-12-06 with torch 2.13), and the first backward pass, gradient clip and
optimizer step run code paths of their own for the first time. A spare that had
only imported paid all of that after adopting a rank, while the survivors waited
for it in their first all-reduce.

`exercise` runs one training step of a tiny CPU model with each optimizer the
trainer makes. It never touches CUDA: the GPUs a spare will use are known only
when it adopts a rank, and CUDA_VISIBLE_DEVICES must be set before CUDA starts.
The global random state is left as it was, though every rank seeds or receives
its own before it trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own convention


def exercise() -> None:
    """One tiny training step on CPU with AdamW and with SGD (the trainer's optimizers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vocab, width = 16, 8
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.LayerNorm(width),
                                    torch.nn.Linear(width, vocab))
        tokens = torch.randint(0, vocab, (2, 4))
        for optimizer in (torch.optim.AdamW(model.parameters(), lr=1e-3),
                          torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)):
            loss = F.cross_entropy(model(tokens).reshape(-1, vocab), tokens.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
