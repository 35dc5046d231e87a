"""What to do about a failed rank: the controller's one decision, made purely.

The controller gathers the facts (the failure, the job's restarts and
placement, which nodes are gone or quarantined, how the job may resize) into
a `FailureView`; `decide` turns them into a frozen `FailureDecision`. The
controller then applies it: replace the rank in place, shrink (or re-form)
the group around the survivors, send the job back to the queue, or fail it.
Nothing here touches Ray or Redis, so every branch is unit-tested directly.

Two notions stay apart: `live` (an elastic job that resizes in place: a failure
may shrink it) and `keeps` (the survivors keep their work: a failed replica
whose node remains is refilled live at the same size, elastic or not). A job
that keeps its work and lost a replica's node (or has it quarantined) asks the
scheduler to place that replica elsewhere (`relocate`), and refills it live
there; only when the scheduler finds no room does it go back to the queue. One
that does not keep its work is replaced in place from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.elastic import ElasticRange, Membership, plan_membership, replicas_left

# Failures the in-place path can handle: the rank's node is still there.
IN_PLACE_KINDS = frozenset({"died", "expired", "hung"})
# Failures a job whose survivors keep their work refills live: in place, or on other
# nodes when the replica's node is lost (the node agent's or raylet's loss).
RELOCATABLE_KINDS = IN_PLACE_KINDS | {"node_lost"}


class Action(enum.StrEnum):
    REPLACE = "replace"  # a fresh (or spare) process for the failed rank; survivors stay
    RESHAPE = "reshape"  # live: re-form the group without the lost ranks, refilled where possible
    REQUEUE = "requeue"  # tear down; the scheduler places the job again
    FAIL = "fail"  # past fault_tolerance.max_restarts


@dataclass(frozen=True)
class FailureView:
    """What the controller knows when a rank fails.

    kind, rank: The failure's kind and the rank it names (None: the whole job).
    restarts, max_restarts: From the job record and its spec.
    live: The job resizes in place (elastic, `live_resize`).
    has_group: A placement group still holds the ranks (False once torn down).
    slots: Where the current group's ranks run.
    lost_nodes: Node ids that are gone; blocked: node names in quarantine.
    elastic: The job's replica range.
    keeps: Survivors keep their processes and state while a lost replica is
        refilled live (`JobSpec.survivors_keep_work`), elastic or not.
    unreachable: The failed rank's node was judged lost because it cannot be
        reached (`network`, `redis`, `agent`), not because its raylet is gone.
    """

    kind: str
    rank: int | None
    restarts: int
    max_restarts: int
    live: bool
    has_group: bool
    slots: tuple[PlacedRank, ...]
    lost_nodes: frozenset[str] = frozenset()
    blocked: frozenset[str] = frozenset()
    elastic: ElasticRange | None = None
    keeps: bool = False
    unreachable: str | None = None


@dataclass(frozen=True)
class FailureDecision:
    """The action, and for a reshape the new membership and what refills it.

    dead: The ranks lost (the failed one and every rank on a lost node).
    refill: Replicas (by index) hit by the failure whose nodes are all still
        usable: their placement groups get fresh ranks.
    relocate: Replicas hit whose node is lost or quarantined, in a job whose
        survivors keep their work: placed elsewhere by the scheduler, then refilled
        (the controller requeues the job when it finds no room).
    """

    action: Action
    reason: str
    dead: frozenset[int] = frozenset()
    membership: Membership | None = None
    refill: tuple[int, ...] = field(default_factory=tuple)
    relocate: tuple[int, ...] = field(default_factory=tuple)


def restarts_exhausted(restarts: int, max_restarts: int) -> bool:
    """Whether a job that has restarted `restarts` times may not restart again."""
    return restarts >= max_restarts


def decide(view: FailureView) -> FailureDecision:
    """The action for one failure (see `Action`)."""
    if restarts_exhausted(view.restarts, view.max_restarts):
        return FailureDecision(Action.FAIL, f"gave up after {view.restarts} restart(s) "
                                            "(fault_tolerance.max_restarts)")
    if view.rank is None or not view.has_group:
        return FailureDecision(Action.REQUEUE, "the whole job is affected: place it again")
    if view.live:  # an elastic job shrinks around its survivors; the scheduler regrows it
        return _reshape(view)
    if view.keeps and view.elastic is not None and view.kind in RELOCATABLE_KINDS:
        return _refill(view)
    if view.kind not in IN_PLACE_KINDS:
        return FailureDecision(Action.REQUEUE, f"a {view.kind} failure needs a new placement")
    slot = _slot(view, view.rank)
    if slot is not None and slot.node in view.blocked:
        return FailureDecision(Action.REQUEUE, f"node {slot.node} is quarantined: place the job "
                                               "elsewhere")
    return FailureDecision(Action.REPLACE, f"replace rank {view.rank} in place",
                           dead=frozenset({view.rank}))


def _refill(view: FailureView) -> FailureDecision:
    """Survivors keep their work: the failed replica is refilled live at the same size, in
    its own placement group where every node it holds is still there and not quarantined,
    else on nodes the scheduler finds for it (`relocate`)."""
    rng = view.elastic
    assert rng is not None and view.rank is not None
    slot = _slot(view, view.rank)
    if view.kind == "node_lost" and view.unreachable:
        # Its ranks may live on behind the cut, in the survivors' collectives: nothing
        # breaks those but the survivors' own teardown.
        return FailureDecision(Action.REQUEUE, f"a node cut off ({view.unreachable}) may still "
                                               "hold the survivors' collectives: place the job "
                                               "again", dead=frozenset({view.rank}))
    if view.kind == "node_lost" and slot is not None:  # lost to the controller, if not yet to Ray
        view = dataclasses.replace(view, lost_nodes=view.lost_nodes | {slot.node_id})
    d = _reshape(view, relocate=True)
    if d.action is not Action.RESHAPE or d.membership is None or (
            d.membership.world_size != len(view.slots)):
        return FailureDecision(Action.REQUEUE, "a failed replica cannot be refilled at the job's "
                                               "size: place the job again", dead=d.dead)
    if not d.membership.ranks:  # one replica: nobody holds the state to hand over
        if d.relocate or view.kind not in IN_PLACE_KINDS:
            return FailureDecision(Action.REQUEUE, "the job's only replica lost its node: place "
                                                   "the job again", dead=d.dead)
        return FailureDecision(Action.REPLACE, f"replace rank {view.rank} in place (no survivor "
                                               "holds the state)", dead=frozenset({view.rank}))
    where = " on other nodes" if d.relocate else ""
    return dataclasses.replace(d, reason=f"refill rank(s) {sorted(d.dead)} live{where} at "
                                         f"{d.membership.world_size // rng.ranks_per_replica} "
                                         "replica(s); the survivors keep their work")


def _reshape(view: FailureView, relocate: bool = False) -> FailureDecision:
    """An elastic job re-forms around its survivors, refilling replicas whose nodes remain
    (with `relocate`, also those whose nodes do not, on nodes the scheduler finds)."""
    rng = view.elastic
    if rng is None or view.kind == "resize":
        return FailureDecision(Action.REQUEUE, "a failure during a resize: place the job again")
    world = len(view.slots)
    dead = {view.rank} | {s.rank for s in view.slots if s.node_id in view.lost_nodes}
    hit = sorted({r // rng.ranks_per_replica for r in dead})
    refill = tuple(i for i in hit if all(
        (s := _slot(view, r)) is not None and s.node_id not in view.lost_nodes
        and s.node not in view.blocked for r in rng.replica_ranks(i)))
    moved = tuple(i for i in hit if i not in refill) if relocate else ()
    sizes = rng.sizes(upto=replicas_left(world, rng, dead) + len(refill) + len(moved))
    if not sizes:
        return FailureDecision(Action.REQUEUE, f"fewer than {rng.min_replicas} replica(s) left "
                                               "(elastic.min_replicas): place the job again",
                               dead=frozenset(dead))
    m = plan_membership(world, rng, sizes[0], drop_ranks=dead)
    usable = len(m.joining) // rng.ranks_per_replica
    chosen = (refill + moved)[:usable]
    return FailureDecision(Action.RESHAPE, f"re-form at {sizes[0]} replica(s)", dead=frozenset(dead),
                           membership=m, refill=tuple(i for i in chosen if i in refill),
                           relocate=tuple(i for i in chosen if i in moved))


def _slot(view: FailureView, rank: int) -> PlacedRank | None:
    return next((s for s in view.slots if s.rank == rank), None)
