"""The first-call costs a warm spare pays while it waits, so that the rank it adopts does not.

Importing torch and the trainer is most of what a new rank costs, not all of it.
The first optimizer a process makes imports `torch._dynamo` (about 200 modules:
0.56 s on an idle 2-core node, 0.73 s beside two training ranks, measured on
2026-12-06 with torch 2.13), and the first backward pass, gradient clip and
optimizer step run code paths of their own for the first time. A spare that had
only imported paid all of that after adopting a rank, while the survivors waited
for it in their first all-reduce.

`warm` imports the trainer and runs `exercise`, one training step of a tiny CPU
model with each optimizer the trainer makes, in a thread of lower CPU priority
(`SPARE_NICENESS`), and then `settle_heap`. A spare warms up beside the ranks that
train, most of all right after a recovery used the last one; on a busy node the
lower priority leaves them the CPU. In the goodput kill series (2 ranks, 2 cores,
10 kills each way, 2026-12-06) the steps in the 15 s after each kill took 0.368 s
on average against 0.390 s at the ranks' priority, and the spare was up 8.4 s
after the kill against 9.4 s (median). It never touches CUDA: the GPUs a spare will use are known only
when it adopts a rank, and CUDA_VISIBLE_DEVICES must be set before CUDA starts.
The global random state is left as it was, though every rank seeds or receives
its own before it trains.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading

import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own convention

# Steps of niceness below the ranks' priority, capped at 19, the lowest: Ray starts its
# workers at 15, so on a Ray node the warm-up runs at 19 (CPU weight 15 against 36).
SPARE_NICENESS = 10


def warm(module: str, niceness: int = SPARE_NICENESS) -> None:
    """Import `module` and `exercise`, in a thread `niceness` steps below this one's CPU
    priority (on Linux a thread has its own), and wait for it; its errors are raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        if niceness > 0 and sys.platform == "linux":  # elsewhere PRIO_PROCESS takes a pid only
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
            except OSError:
                pass
        try:
            importlib.import_module(module)
            exercise()
        except BaseException as exc:  # noqa: BLE001 -- raised again in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="kc-spare-warm-up", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    settle_heap()


def settle_heap() -> None:
    """Collect the garbage there is, then take every object left out of the cyclic
    collector's sight (`gc.freeze`): what torch, the trainer and the user's module
    built at import lives as long as the process.

    A rank runs a full collection when its process group breaks, to free the old DDP
    wrapper (its gradient hooks belong to the group going away) before the next
    one. Over the 330,000 objects of those imports that collection took 0.16 s on an
    idle 2-core node and 0.22 s on a busy one, with the new rank waiting for the
    survivor; over what the process made since, it takes well under a millisecond.
    Objects frozen are still freed by reference counting; only a cycle among them
    would outlive its use, and imports make none that end."""
    gc.collect()
    gc.freeze()


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
