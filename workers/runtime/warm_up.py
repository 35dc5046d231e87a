"""The start-up a warm spare pays while it waits, so that the rank it adopts does not,
and at a priority that leaves the node's CPUs to the ranks that train.

Importing torch, the worker and the trainer is most of what a new rank costs, not all
of it. The first optimizer a process makes imports `torch._dynamo` (about 200 modules:
0.56 s on an idle 2-core node, 0.73 s beside two training ranks, measured on
2026-12-06 with torch 2.13), and the first backward pass, gradient clip and
optimizer step run code paths of their own for the first time. A spare that had
only imported paid all of that after adopting a rank, while the survivors waited
for it in their first all-reduce.

`warm` imports `SPARE_MODULES` and runs `exercise`, one training step of a tiny CPU
model with each optimizer the trainer makes, in a thread of background priority, and
then `settle_heap`. The spare's actor (rank_actor.py) names no torch at import, so
the imports too run in that thread, not at the ranks' priority in the thread Ray
built the actor in. A spare warms up beside the ranks that train, most of all right
after a recovery used the last one, and on a node whose CPUs they keep busy (data
loading, a host-side optimizer, or two ranks on two cores here) every CPU second it
takes is theirs. On Linux the thread runs as `SCHED_IDLE`: it gets the CPU time no
one else wants, for `IDLE_FOR_S` at most (a node with no idle CPU would never warm
it); then, and elsewhere or where that is refused, its niceness drops by
`SPARE_NICENESS` (capped at 19; Ray starts its workers at 15). A spare still warming
when a rank fails gets the CPU its stalled peers leave, and the controller waits for
it (spares.py). On Linux a thread has its own policy and priority, so the rank the
spare becomes keeps Ray's. In the goodput chaos run (2 ranks on 2 cores, 7 rank kills
30 s apart, 2026-12-06) the steps in the 10 s after each kill ran 0.99 s over their
median in all, against 2.6 s with the imports at the ranks' priority and the
exercise at niceness 19, and the 30 s before the first kill (three spares warming)
9.3 s over against 3.8 s; the run's ETTR went from 0.894 to 0.928.

It never touches CUDA: the GPUs a spare will use are known only when it adopts a
rank, and CUDA_VISIBLE_DEVICES must be set before CUDA starts. The global random
state is left as it was, though every rank seeds or receives its own before it trains.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
from collections.abc import Sequence

# What a spare imports before it waits: torch comes with the worker. The trainer is
# the built-in one (worker.py's BUILTIN_TRAINER; a test keeps the two the same).
SPARE_MODULES = ("kuangchao.workers.runtime.worker", "kuangchao.workers.trainer.loop")
# Where SCHED_IDLE is not to be had: steps of niceness below the ranks' priority, capped
# at 19, the lowest (on a Ray node, 19: CPU weight 15 against the ranks' 36).
SPARE_NICENESS = 10
# How long a warm-up runs at SCHED_IDLE before it goes on at the niceness above instead:
# on a node with no idle CPU at all (data loaders busy on every core) an idle thread
# gets almost none, and the spare would never be warm. Warming took 8-12 s here beside
# two training ranks on two cores.
IDLE_FOR_S = 30.0


def background_priority(niceness: int = SPARE_NICENESS) -> str:
    """Put the calling thread at background priority: `idle` (Linux's SCHED_IDLE), else
    `niceness` steps lower (`nice+N`), else `unchanged`. Says which it got."""
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS takes a pid only, and names the process
        return "unchanged"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        return "idle"
    except (AttributeError, OSError):
        pass
    if niceness <= 0:
        return "unchanged"
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        return f"nice+{niceness}"
    except OSError:
        return "unchanged"


def out_of_idle(tid: int, niceness: int) -> str:
    """Move thread `tid` from SCHED_IDLE to the normal policy, `niceness` steps below the
    calling thread; says what it got."""
    try:
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # not allowed here (RLIMIT_NICE): it stays idle
        return "idle"
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + niceness))
    except OSError:
        return "idle, then unchanged"
    return f"idle, then nice+{niceness}"


def warm(modules: Sequence[str] = SPARE_MODULES, niceness: int = SPARE_NICENESS,
         idle_for_s: float = IDLE_FOR_S) -> str:
    """Import `modules` and `exercise`, in a thread at background priority, and wait
    for it; its errors are raised here. A warm-up still running at SCHED_IDLE after
    `idle_for_s` goes on `niceness` steps below this thread. Returns the priority it
    ran at."""
    errors: list[BaseException] = []
    got: list[str] = []
    tids: list[int] = []

    def run() -> None:
        tids.append(threading.get_native_id())
        got.append(background_priority(niceness))
        try:
            for module in modules:
                importlib.import_module(module)
            exercise()
        except BaseException as exc:  # noqa: BLE001 -- raised again in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="kc-spare-warm-up", daemon=True)
    thread.start()
    thread.join(idle_for_s)
    if thread.is_alive() and got == ["idle"]:
        got[0] = out_of_idle(tids[0], niceness)
    thread.join()
    if errors:
        raise errors[0]
    settle_heap()
    return got[0]


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
    import torch  # here, not at the top: the spare's actor imports this module before torch
    import torch.nn.functional as F  # noqa: N812 -- torch's own convention

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
