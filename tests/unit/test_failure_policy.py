"""The failure policy: one pure decision per failed rank."""

from kuangchao.platform.execution.failure_policy import Action, FailureView, decide
from kuangchao.platform.jobs.state import PlacedRank
from kuangchao.platform.spec.elastic import ElasticRange


def slot(rank: int, node: str, node_id: str) -> PlacedRank:
    return PlacedRank(rank, node, node_id, leaf="leaf0")


SLOTS = tuple(slot(r, f"n{r}", f"id{r}") for r in range(4))


def view(**kw) -> FailureView:
    base = dict(kind="died", rank=1, restarts=0, max_restarts=3, live=False, has_group=True,
                slots=SLOTS)
    return FailureView(**{**base, **kw})


def elastic(min_replicas=1, max_replicas=4, rpr=1) -> ElasticRange:
    return ElasticRange(min_replicas=min_replicas, max_replicas=max_replicas, micro_batch_size=1,
                        global_batch=4 * rpr, ranks_per_replica=rpr)


def test_a_dead_rank_on_a_healthy_node_is_replaced_in_place():
    d = decide(view())
    assert d.action is Action.REPLACE and d.dead == {1}


def test_expired_and_hung_ranks_are_replaced_in_place_too():
    assert decide(view(kind="expired")).action is Action.REPLACE
    assert decide(view(kind="hung")).action is Action.REPLACE


def test_a_lost_node_or_a_numeric_fault_needs_a_new_placement_for_a_fixed_size_job():
    assert decide(view(kind="node_lost")).action is Action.REQUEUE
    assert decide(view(kind="placement", rank=None)).action is Action.REQUEUE


def test_a_rank_on_a_quarantined_node_is_placed_elsewhere():
    d = decide(view(blocked=frozenset({"n1"})))
    assert d.action is Action.REQUEUE and "quarantined" in d.reason


def test_a_torn_down_group_can_only_be_placed_again():
    assert decide(view(has_group=False)).action is Action.REQUEUE


def test_the_restart_budget_comes_first_whatever_the_failure():
    d = decide(view(restarts=3, max_restarts=3, live=True, elastic=elastic()))
    assert d.action is Action.FAIL and "fault_tolerance.max_restarts" in d.reason
    assert decide(view(restarts=2, max_restarts=3)).action is Action.REPLACE
    assert decide(view(restarts=0, max_restarts=0)).action is Action.FAIL


def test_a_live_job_that_lost_a_node_shrinks_without_refilling_it():
    d = decide(view(kind="node_lost", live=True, lost_nodes=frozenset({"id1"}), elastic=elastic()))
    assert d.action is Action.RESHAPE and d.dead == {1} and d.refill == ()
    # Three survivors, but 3 replicas do not divide the global batch of 4: the job runs at 2.
    assert d.membership.world_size == 2 and d.membership.ranks == {0: 0, 2: 1}


def test_a_live_job_refills_a_replica_whose_node_is_still_there():
    d = decide(view(live=True, elastic=elastic()))
    assert d.action is Action.RESHAPE and d.refill == (1,)
    assert d.membership.world_size == 4 and d.membership.joining == (3,)


def test_every_rank_on_a_lost_node_is_counted_dead_with_its_replica_peers():
    slots = (slot(0, "a", "ida"), slot(1, "a", "ida"), slot(2, "b", "idb"), slot(3, "b", "idb"))
    d = decide(view(rank=0, kind="node_lost", live=True, slots=slots,
                    lost_nodes=frozenset({"ida"}), elastic=elastic(max_replicas=2, rpr=2)))
    assert d.action is Action.RESHAPE and d.dead == {0, 1}
    assert d.membership.world_size == 2 and d.membership.ranks == {2: 0, 3: 1}


def test_a_live_job_below_min_replicas_goes_back_to_the_queue():
    d = decide(view(kind="node_lost", live=True, lost_nodes=frozenset({"id1", "id2", "id3"}),
                    elastic=elastic(min_replicas=2)))
    assert d.action is Action.REQUEUE and "elastic.min_replicas" in d.reason


def test_a_failure_during_a_live_resize_is_placed_again():
    assert decide(view(kind="resize", live=True, elastic=elastic())).action is Action.REQUEUE


# Survivors keep their work (`keeps`): a job of one size (min == max replicas).
def fixed(replicas=4, rpr=1) -> ElasticRange:
    return elastic(min_replicas=replicas, max_replicas=replicas, rpr=rpr)


def test_a_fixed_size_job_whose_survivors_keep_their_work_refills_the_rank_live():
    for kind in ("died", "expired", "hung"):
        d = decide(view(kind=kind, keeps=True, elastic=fixed()))
        assert d.action is Action.RESHAPE and d.dead == {1} and d.refill == (1,), kind
        # Same size: the three survivors keep their order, the refill joins as rank 3.
        assert d.membership.world_size == 4 and d.membership.joining == (3,)
        assert d.membership.ranks == {0: 0, 2: 1, 3: 2}
        assert "survivors keep their work" in d.reason


def test_a_fixed_size_job_refills_a_whole_replica_of_several_ranks():
    slots = (slot(0, "a", "ida"), slot(1, "a", "ida"), slot(2, "b", "idb"), slot(3, "b", "idb"))
    d = decide(view(rank=3, slots=slots, keeps=True, elastic=fixed(replicas=2, rpr=2)))
    assert d.action is Action.RESHAPE and d.refill == (1,) and d.membership.joining == (2, 3)


def test_a_single_replica_job_has_no_survivor_to_keep_work_and_is_replaced_in_place():
    d = decide(view(rank=0, slots=SLOTS[:1], keeps=True, elastic=fixed(replicas=1)))
    assert d.action is Action.REPLACE and d.dead == {0} and "no survivor" in d.reason


def test_a_fixed_size_job_whose_node_is_lost_is_refilled_on_nodes_the_scheduler_finds():
    d = decide(view(keeps=True, lost_nodes=frozenset({"id1"}), elastic=fixed()))
    assert d.action is Action.RESHAPE and d.dead == {1}
    assert d.relocate == (1,) and d.refill == ()
    assert d.membership.world_size == 4 and d.membership.joining == (3,)
    assert "on other nodes" in d.reason and "survivors keep their work" in d.reason
    # Another rank's node lost with it: both replicas are placed elsewhere.
    d = decide(view(keeps=True, lost_nodes=frozenset({"id2"}), elastic=fixed()))
    assert d.action is Action.RESHAPE and d.dead == {1, 2}
    assert d.refill == (1,) and d.relocate == (2,) and d.membership.joining == (2, 3)
    # The controller saw the node lost before Ray did: it is lost all the same.
    d = decide(view(kind="node_lost", keeps=True, elastic=fixed()))
    assert d.action is Action.RESHAPE and d.relocate == (1,) and d.refill == ()


def test_a_node_cut_off_rather_than_gone_sends_the_job_back_to_the_queue():
    """A cut node's ranks may live on, blocking the survivors in a collective that only
    their teardown ends: no relocation for a node lost to the network, Redis or its agent."""
    for why in ("network", "redis", "agent"):
        d = decide(view(kind="node_lost", keeps=True, elastic=fixed(), unreachable=why))
        assert d.action is Action.REQUEUE and why in d.reason and d.relocate == ()


def test_a_replica_of_several_ranks_moves_whole_off_a_lost_node():
    slots = (slot(0, "a", "ida"), slot(1, "a", "ida"), slot(2, "b", "idb"), slot(3, "b", "idb"))
    d = decide(view(kind="node_lost", rank=0, slots=slots, keeps=True, lost_nodes=frozenset({"ida"}),
                    elastic=fixed(replicas=2, rpr=2)))
    assert d.action is Action.RESHAPE and d.dead == {0, 1} and d.relocate == (0,)
    assert d.membership.ranks == {2: 0, 3: 1} and d.membership.joining == (2, 3)


def test_a_single_replica_job_whose_node_is_lost_goes_back_to_the_queue():
    d = decide(view(kind="node_lost", rank=0, slots=SLOTS[:1], keeps=True,
                    lost_nodes=frozenset({"id0"}), elastic=fixed(replicas=1)))
    assert d.action is Action.REQUEUE and "only replica" in d.reason


def test_a_fixed_size_job_on_a_quarantined_node_moves_that_replica_elsewhere():
    d = decide(view(keeps=True, blocked=frozenset({"n1"}), elastic=fixed()))
    assert d.action is Action.RESHAPE and d.relocate == (1,) and d.refill == ()


def test_a_lost_node_still_needs_a_new_placement_when_survivors_do_not_keep_their_work():
    d = decide(view(kind="node_lost", lost_nodes=frozenset({"id1"}), elastic=fixed()))
    assert d.action is Action.REQUEUE and d.relocate == ()
    d = decide(view(blocked=frozenset({"n1"}), elastic=fixed()))
    assert d.action is Action.REQUEUE and "quarantined" in d.reason


def test_a_job_whose_survivors_do_not_keep_their_work_is_replaced_in_place_as_before():
    d = decide(view(keeps=False, elastic=fixed()))
    assert d.action is Action.REPLACE and d.dead == {1} and d.membership is None
    assert decide(view(keeps=True, restarts=3, max_restarts=3, elastic=fixed())).action \
        is Action.FAIL


def test_keeping_work_does_not_change_an_elastic_jobs_decisions():
    for kw in ({}, {"kind": "node_lost", "lost_nodes": frozenset({"id1"})}):
        assert decide(view(live=True, keeps=True, elastic=elastic(), **kw)) == \
            decide(view(live=True, elastic=elastic(), **kw))
