"""What a running job does about a node that Ray is draining: the decision, made purely.

The controller gathers the facts (where the current group's ranks run, the drain notices,
how the job may resize) into a `DrainView`; `decide` turns them into a frozen
`DrainDecision`, and platform/execution/drain.py applies it:

- SHRINK: an elastic job that resizes in place (`live_resize`) lets the replicas on the
  draining nodes leave at their next step, and the others go on at a smaller admissible
  size without a restart. They hold every step in memory, so nothing is redone; the
  scheduler grows the job back onto other nodes when it can.
- MOVE: a job of one size whose survivors keep their work (`survivors_keep_work`) asks
  the scheduler to place the replicas on the draining nodes elsewhere, starts them there
  while every rank trains on, and switches generations: the ranks there leave at their
  next step, the new ones take the others' state. Nothing is redone, nothing restored;
  when the scheduler has no room, or the move is called off, the job requeues instead.
- REQUEUE: any other job checkpoints at its next step boundary and yields its GPUs (the
  preemption path); the scheduler places it again off the draining nodes and it resumes
  from that checkpoint, at the step it stopped.

A drain is planned, not a failure: neither action counts against
`fault_tolerance.max_restarts`, and no node is reported for quarantine.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from kuangchao.platform.cluster.drain import DrainNotice
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.elastic import ElasticRange, Membership, plan_membership, replicas_left


class DrainAction(enum.StrEnum):
    NONE = "none"  # no rank of the job runs on a draining node
    SHRINK = "shrink"  # live: the replicas there leave, the others go on
    MOVE = "move"  # same size: the replicas there move live to other nodes
    REQUEUE = "requeue"  # checkpoint at the next step, then be placed again elsewhere


@dataclass(frozen=True)
class DrainView:
    """What the controller knows when it reads the drain table.

    slots: Where the current group's ranks run (reserved slots of a pending grow excluded).
    notices: The drain notices, by Ray node id.
    live: The job resizes in place (elastic, `live_resize`).
    elastic: The job's replica range.
    keeps: Survivors keep their work (`survivors_keep_work`): replicas can move live.
    """

    slots: tuple[PlacedRank, ...]
    notices: Mapping[str, DrainNotice]
    live: bool = False
    elastic: ElasticRange | None = None
    keeps: bool = False


@dataclass(frozen=True)
class DrainDecision:
    """The action, and what it is about.

    nodes: Names of the draining nodes the job uses.
    ranks: The ranks running there.
    deadline: The earliest deadline among those nodes (epoch seconds); None: no deadline.
    membership: For SHRINK and MOVE, the next generation (the ranks there leave).
    replicas: For MOVE, the replicas (by index) to place elsewhere.
    """

    action: DrainAction
    reason: str
    nodes: tuple[str, ...] = ()
    ranks: frozenset[int] = frozenset()
    deadline: float | None = None
    membership: Membership | None = None
    replicas: tuple[int, ...] = ()


def decide(view: DrainView) -> DrainDecision:
    """The action for the drain notices that concern this job (see `DrainAction`)."""
    hit = [s for s in view.slots if s.node_id in view.notices]
    if not hit:
        return DrainDecision(DrainAction.NONE, "no rank runs on a draining node")
    nodes = tuple(sorted({s.node for s in hit}))
    ranks = frozenset(s.rank for s in hit)
    deadlines = [d for s in hit if (d := view.notices[s.node_id].deadline) is not None]
    deadline = min(deadlines) if deadlines else None
    rng = view.elastic
    if view.live and rng is not None and rng.elastic:
        world = len(view.slots)
        sizes = rng.sizes(upto=replicas_left(world, rng, set(ranks)))
        if sizes:
            m = plan_membership(world, rng, sizes[0], drop_ranks=ranks)
            return DrainDecision(DrainAction.SHRINK, f"shrink live to {sizes[0]} replica(s) "
                                 "without them", nodes, ranks, deadline, m)
        why = (f"fewer than {rng.min_replicas} replica(s) would be left without them "
               "(elastic.min_replicas): checkpoint at the next step, be placed again elsewhere")
    elif view.keeps and rng is not None:
        world = len(view.slots)
        moved = tuple(sorted({r // rng.ranks_per_replica for r in ranks}))
        if replicas_left(world, rng, set(ranks)):  # a survivor holds the state to hand over
            m = plan_membership(world, rng, world // rng.ranks_per_replica, drop_ranks=ranks)
            return DrainDecision(DrainAction.MOVE, f"move {len(moved)} replica(s) live to "
                                 "other nodes; every rank trains on meanwhile", nodes, ranks,
                                 deadline, m, moved)
        why = "every replica runs there: checkpoint at the next step, be placed again elsewhere"
    else:
        why = "checkpoint at the next step, be placed again elsewhere"
    return DrainDecision(DrainAction.REQUEUE, why, nodes, ranks, deadline)
