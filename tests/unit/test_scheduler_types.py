"""GPU types in the gang policy (issue 25): a typed job stays on its type through
admission, grow, backfill and preemption; a one-type job picks its pool as the
issue says; a mixed job's TP groups are each of one type; per-type quotas."""

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.errors import SpecError
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.scheduling.policies import Admit, GangPolicy, Preempt, Resize, Snapshot, Wait
from kuangchao.platform.spec.queues import Queue, QueueTable, parse_queues

H100, A100 = "h100-80gb", "a100-80gb"


def cluster(per_type=2, gpus=8, island=4) -> tuple[NodeInfo, ...]:
    """`per_type` H100 nodes (h0, h1, ...) and as many A100 nodes (a0, a1, ...)."""
    isl = tuple(tuple(range(i, i + island)) for i in range(0, gpus, island))
    return tuple(NodeInfo(name=f"{t[0]}{i}", gpus=gpus, islands=isl, leaf="leaf-0",
                          node_id=f"id-{t[0]}{i}", gpu_type=t)
                 for t in (H100, A100) for i in range(per_type))


def typed(jid, gpus=1, tp=1, types=(), hetero=False, queue="default", priority=50, created=0.0,
          on=(), elastic=None) -> JobRecord:
    """A job; `on` lists `(node, gpu)` it runs on (then it is RUNNING)."""
    spec = {"parallel": {"data_parallel_size": gpus // tp, "tensor_parallel_size": tp},
            "resources": {"gpu_types": list(types), "heterogeneous": hetero}}
    if elastic:  # a global batch of 48 micro-batches: 12 and 16 replicas split it evenly
        spec["elastic"] = {"min_replicas": elastic[0], "max_replicas": elastic[1]}
        spec["parallel"] |= {"micro_batch_size": 1, "gradient_accumulation_steps": 48 * tp // gpus}
    placement = tuple(PlacedRank(rank=i, node=n, node_id="", leaf="leaf-0", gpu=g, gpus=(g,))
                      for i, (n, g) in enumerate(on))
    return JobRecord(id=jid, name=jid, spec=spec, queue=queue, priority=priority,
                     state=JobState.RUNNING if on else JobState.QUEUED, created_at=created,
                     gpus=len(on) or gpus, world_size=len(on) or gpus, placement=placement,
                     started_at=created if on else None, replicas=len(on) // tp)


def holding(jid, spots, **kw) -> JobRecord:
    """A running job on `spots`: {node: number of GPUs, from GPU 0}."""
    on = [(n, g) for n, k in spots.items() for g in range(k)]
    return typed(jid, gpus=len(on), on=on, **kw)


def decide(queued=(), active=(), queues=QueueTable(), nodes=None) -> dict[str, list]:
    snap = Snapshot(nodes=nodes or cluster(), queued=tuple(queued), active=tuple(active),
                    queues=queues)
    out: dict[str, list] = {}
    for d in GangPolicy().decide(snap):
        out.setdefault(d.job_id, []).append(d)
    return out


def types_of(decision, nodes=None) -> set:
    kinds = {n.name: n.gpu_type for n in nodes or cluster()}
    slots = decision.plan.slots
    return {kinds[s.node] for s in slots}


# -- a job that asks for one type never lands on another -------------------------------

def test_admission_places_a_typed_job_on_its_type_only():
    active = [holding("busy", {"a0": 8})]
    d = decide(queued=[typed("a", gpus=8, types=[A100], created=0),
                       typed("a-more", gpus=8, types=[A100], created=1)], active=active)
    assert isinstance(d["a"][0], Admit) and types_of(d["a"][0]) == {A100}
    # The A100s are now full; 16 H100 GPUs are free, and still it waits.
    assert d["a-more"] == [Wait("a-more", "waiting for pool a100-80gb: needs 8 GPUs, 0 of 16 are "
                                          "free", pool=A100)]


def test_a_typed_job_whose_type_is_gone_waits_and_holds_nothing():
    gone = tuple(n if n.gpu_type == H100 else NodeInfo(**{**n.__dict__, "alive": False})
                 for n in cluster())
    d = decide(queued=[typed("a", gpus=2, types=[A100]), typed("h", gpus=16, types=[H100])],
               nodes=gone)
    assert d["a"] == [Wait("a", "no live node has GPU type a100-80gb (the live nodes have "
                                "h100-80gb); list one of those in resources.gpu_types")]
    assert isinstance(d["h"][0], Admit)  # nothing was held back for the job that cannot run


@pytest.mark.parametrize("types", [[A100], []])
def test_grow_keeps_an_elastic_job_on_its_own_type(types):
    # On a100 a0; the other A100 node is full, both H100 nodes are free.
    el = typed("el", gpus=8, types=types, elastic=(1, 16), on=[("a0", g) for g in range(8)])
    d = decide(active=[el, holding("other", {"a1": 8})])
    assert "el" not in d  # no grow onto the H100s
    d = decide(active=[el, holding("other", {"a1": 4})])
    (grow,) = d["el"]
    assert isinstance(grow, Resize) and grow.to == 12 and types_of(grow) == {A100}


def test_a_mixed_elastic_job_may_grow_onto_another_type():
    el = typed("el", gpus=8, hetero=True, elastic=(1, 16), on=[("a0", g) for g in range(8)])
    (grow,) = decide(active=[el, holding("other", {"a1": 8})])["el"]
    assert isinstance(grow, Resize) and grow.to == 16 and types_of(grow) == {H100}


def test_preemption_evicts_only_on_the_type_the_job_can_use():
    # The newest low-priority job (first in line to go) runs on the H100s; evicting
    # it would not help a job that takes A100s only.
    active = [holding("low-a", {"a0": 8, "a1": 8}, priority=10, created=0),
              holding("low-h", {"h0": 8, "h1": 8}, priority=10, created=5)]
    d = decide(queued=[typed("hi", gpus=8, types=[A100], priority=100, created=9)],
               active=active)
    assert [type(x) for x in d["hi"]] == [Wait]
    assert d["low-a"] == [Preempt("low-a", "hi", "preempted for higher-priority job hi")]
    assert "low-h" not in d


# -- a mixed job's TP groups are each of one type ---------------------------------------

def test_a_mixed_jobs_tp_groups_are_each_one_type_when_admitted():
    # One free 4-GPU island on h0 and one on a0: the job needs both types.
    active = [holding("r", {"h0": 4, "h1": 8, "a0": 4, "a1": 8})]
    (admit,) = decide(queued=[typed("mix", gpus=8, tp=4, hetero=True)], active=active)["mix"]
    assert isinstance(admit, Admit) and types_of(admit) == {H100, A100}
    kinds = {n.name: n.gpu_type for n in cluster()}
    groups = [admit.plan.slots[i:i + 4] for i in range(0, 8, 4)]
    assert [len({kinds[s.node] for s in g}) for g in groups] == [1, 1]


# -- the pool a one-type job goes to ---------------------------------------------------

@pytest.mark.parametrize("types, active, expect", [
    ([A100, H100], [], A100),                              # fits in both: the listed order
    ([], [], H100),                                        # none listed: the fastest
    ([A100, H100], [holding("r", {"a0": 8, "a1": 4})], H100),  # only the H100s fit now
])
def test_a_job_that_fits_now_goes_to_its_preferred_pool_that_fits(types, active, expect):
    (admit,) = decide(queued=[typed("j", gpus=8, types=types)], active=active)["j"]
    assert isinstance(admit, Admit) and types_of(admit) == {expect}


def test_a_job_that_fits_nowhere_waits_for_the_pool_with_the_shortest_queue_ahead():
    # 4 GPUs free in each pool. "first" waits for the H100s, so the H100 queue ahead
    # of "mine" is 8 GPUs long and the A100 queue empty: "mine" waits for the A100s,
    # although it lists H100 first.
    active = [holding("rh", {"h0": 8, "h1": 4}), holding("ra", {"a0": 8, "a1": 4})]
    d = decide(queued=[typed("first", gpus=8, types=[H100], created=0),
                       typed("mine", gpus=8, types=[H100, A100], created=1)], active=active)
    assert d["first"] == [Wait("first", "waiting for pool h100-80gb: needs 8 GPUs, 4 of 16 are "
                                        "free", pool=H100)]
    assert d["mine"] == [Wait("mine", "waiting for pool a100-80gb: needs 8 GPUs, 4 of 16 are "
                                      "free", pool=A100)]


@pytest.mark.parametrize("h_used, expect", [(13, A100), (12, H100), (11, H100)])
def test_an_equal_queue_ahead_is_broken_by_the_gpus_in_use(h_used, expect):
    active = [holding("rh", {"h0": 8, "h1": h_used - 8}), holding("ra", {"a0": 8, "a1": 4})]
    (wait,) = decide(queued=[typed("j", gpus=8, types=[H100, A100])], active=active)["j"]
    assert isinstance(wait, Wait) and wait.pool == expect


def test_the_head_holds_gpus_in_its_pool_only_so_the_other_pool_backfills():
    active = [holding("rh", {"h0": 8, "h1": 4}), holding("ra", {"a0": 8, "a1": 4})]
    d = decide(queued=[typed("head", gpus=8, types=[A100], created=0),
                       typed("small-a", gpus=2, types=[A100], created=1),
                       typed("small-h", gpus=2, types=[H100], created=2)], active=active)
    assert d["head"][0].pool == A100
    assert d["small-a"] == [Wait("small-a", "waiting for pool a100-80gb: GPUs are held for job "
                                            "head, ahead in the queue", pool=A100)]
    assert isinstance(d["small-h"][0], Admit) and types_of(d["small-h"][0]) == {H100}


def test_a_job_behind_the_head_in_another_pool_says_why_it_waits_itself():
    # H100s: 4 GPUs free, 2 in each island of h0, nothing held there. A 4-GPU TP
    # group does not fit them: not because of the head, which holds A100s only.
    frag = typed("frag", gpus=12, on=[("h0", g) for g in (0, 1, 4, 5)] + [("h1", g) for g in range(8)])
    d = decide(queued=[typed("head", gpus=8, types=[A100], created=0),
                       typed("tp4", gpus=4, tp=4, types=[H100], created=1)],
               active=[frag, holding("ra", {"a0": 8, "a1": 4})])
    assert d["head"][0].pool == A100
    assert d["tp4"] == [Wait("tp4", "waiting for pool h100-80gb: needs 1 groups of 4 GPUs inside "
                                    "one NVLink island; only 0 are free (4 GPUs free but "
                                    "fragmented)", pool=H100)]


def test_a_job_too_big_for_any_one_pool_is_told_to_mix_types():
    (wait,) = decide(queued=[typed("big", gpus=24)])["big"]
    assert wait == Wait("big", "needs 24 GPUs of one type; the largest pool (h100-80gb) has 16 "
                               "(set resources.heterogeneous: true to mix types)")
    assert isinstance(decide(queued=[typed("big", gpus=24, hetero=True)])["big"][0], Admit)


# -- per-type quotas -------------------------------------------------------------------

TEAM = QueueTable(queues=(Queue("team", gpu_types={H100: 8}), Queue("default")))


def test_a_per_type_quota_makes_a_job_wait_or_take_another_type():
    active = [holding("mine", {"h0": 8}, queue="team")]
    d = decide(queued=[typed("h-only", gpus=4, types=[H100], queue="team", created=0),
                       typed("either", gpus=4, types=[H100, A100], queue="team", created=1),
                       typed("other-team", gpus=4, types=[H100], created=2)],
               active=active, queues=TEAM)
    assert d["h-only"] == [Wait("h-only", "quota team: h100-80gb 8/8 GPUs in use")]
    assert isinstance(d["either"][0], Admit) and types_of(d["either"][0]) == {A100}
    assert isinstance(d["other-team"][0], Admit)  # the limit is the team's, not the cluster's


def test_a_mixed_job_takes_no_more_of_a_limited_type_than_the_room_left():
    active = [holding("mine", {"h0": 4}, queue="team")]
    (admit,) = decide(queued=[typed("mix", gpus=16, hetero=True, queue="team")], active=active,
                      queues=TEAM)["mix"]
    kinds = {n.name: n.gpu_type for n in cluster()}
    assert isinstance(admit, Admit)
    assert sum(kinds[s.node] == H100 for s in admit.plan.slots) == 4  # 8 - 4 held already


def test_per_type_limits_in_the_queue_file_are_validated_and_round_trip():
    table = parse_queues({"queues": [{"name": "team", "gpu_types": {"H100-80GB": 8}}]})
    assert table.queues[0].gpu_types == {H100: 8}
    assert QueueTable.from_json(table.to_json()) == table
    assert "gpu_types" not in QueueTable().to_json()["queues"][0]  # unset: stored as before
    with pytest.raises(SpecError) as exc:
        parse_queues({"queues": [{"name": "team", "gpu_types": {"v100": 8}}]})
    assert exc.value.errors == [("queues: queues.0.gpu_types", "'v100' is not a GPU type in the catalogue; "
                                 "per-type limits take one of a100-40gb, a100-80gb, h100-80gb, "
                                 "h200-141gb, e.g. {h100-80gb: 8}")]
