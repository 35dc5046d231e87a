"""Elastic jobs in the gang policy: admission in range, grow, shrink on request and for priority."""

from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.scheduling.policies import Admit, Preempt, Resize, Wait
from kuangchao.platform.spec.elastic import (
    ElasticRange,
    elastic_range,
    plan_membership,
    range_errors,
    replicas_left,
)

from .test_gang_policy import decide, nodes, running


def spec(dp=4, lo=None, hi=None, micro=2, accum=3, tp=1):
    doc = {"parallel": {"data_parallel_size": dp, "micro_batch_size": micro,
                        "gradient_accumulation_steps": accum, "tensor_parallel_size": tp}}
    if lo or hi:
        doc["elastic"] = {"min_replicas": lo, "max_replicas": hi}
    return doc


def elastic_job(jid, lo, hi, dp=4, priority=50, created=0.0, state=JobState.QUEUED, on=None,
                replicas=0, desired=None, resize=None, tp=1) -> JobRecord:
    placement = ()
    if on:
        placement = tuple(PlacedRank(rank=i, node=n, node_id="", leaf="leaf-0", gpu=g, gpus=(g,))
                          for i, (n, g) in enumerate(on))
    return JobRecord(id=jid, name=jid, spec=spec(dp, lo, hi, tp=tp), state=state,
                     priority=priority, created_at=created, gpus=len(placement) or hi * tp,
                     world_size=len(placement) or hi * tp, placement=placement,
                     started_at=created if on else None, replicas=replicas or len(placement) // tp,
                     desired_replicas=desired, resize=resize)


def on(node, ids):
    return [(node, g) for g in ids]


# -- the range ------------------------------------------------------------------

def test_the_global_batch_stays_and_accumulation_follows_the_size():
    rng = elastic_range(spec(dp=4, lo=1, hi=6, micro=2, accum=3))  # global batch 24
    assert rng.global_batch == 24
    assert rng.sizes() == [6, 4, 3, 2, 1]  # 5 replicas cannot split 12 micro-batches
    assert [rng.accumulation(n) for n in (6, 4, 3, 2, 1)] == [2, 3, 4, 6, 12]
    assert not rng.admissible(5) and not rng.admissible(7)


def test_a_job_without_elastic_has_one_size():
    rng = elastic_range(spec(dp=4))
    assert (rng.min_replicas, rng.max_replicas, rng.elastic) == (4, 4, False)


def test_range_errors_name_the_field_and_the_fix():
    errs = dict(range_errors(spec(dp=2, lo=1, hi=5, micro=2, accum=1)))
    assert "elastic.max_replicas" in errs and "does not split evenly into 5" in errs[
        "elastic.max_replicas"] and "gradient_accumulation_steps" in errs["elastic.max_replicas"]
    assert dict(range_errors(spec(lo=3, hi=2)))["elastic.min_replicas"].startswith("3 exceeds")
    assert range_errors(spec(dp=2, lo=1, hi=3, micro=1, accum=3)) == []


def test_membership_keeps_survivor_order_and_drops_whole_replicas():
    rng = ElasticRange(1, 4, micro_batch_size=1, global_batch=4, ranks_per_replica=2)
    m = plan_membership(8, rng, to_replicas=2, drop_ranks={3})  # rank 3 is in replica 1
    assert m.ranks == {0: 0, 1: 1, 4: 2, 5: 3} and m.joining == () and m.world_size == 4
    grow = plan_membership(4, rng, to_replicas=4)
    assert grow.ranks == {0: 0, 1: 1, 2: 2, 3: 3} and grow.joining == (4, 5, 6, 7)
    replace = plan_membership(8, rng, to_replicas=4, drop_ranks={2})
    assert replace.ranks == {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5} and replace.joining == (6, 7)
    assert replicas_left(8, rng, {0, 7}) == 2


# -- the policy -------------------------------------------------------------------

def test_an_elastic_job_is_admitted_at_the_most_replicas_that_fit():
    busy = [running("big", "n0", range(8)), running("mid", "n1", range(5))]
    d = decide(queued=[elastic_job("el", 1, 4)], active=busy)
    assert isinstance(d["el"][0], Admit) and d["el"][0].replicas == 3
    assert len(d["el"][0].plan.slots) == 3


def test_an_elastic_job_below_its_minimum_waits():
    busy = [running("big", "n0", range(8)), running("mid", "n1", range(7))]
    d = decide(queued=[elastic_job("el", 2, 4)], active=busy)
    assert isinstance(d["el"][0], Wait)


def test_a_running_elastic_job_grows_into_free_gpus():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", [0, 1]))
    d = decide(active=[el])
    (r,) = d["el"]
    assert isinstance(r, Resize) and (r.to, r.cause) == (4, "grow") and len(r.plan.slots) == 2


def test_no_growth_while_a_queued_job_waits_for_gpus():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", [0, 1]))
    busy = running("busy", "n1", range(8))
    d = decide(queued=[elastic_job("big", 8, 8, dp=8)], active=[el, busy])
    assert "el" not in d and isinstance(d["big"][0], Wait)


def test_asked_size_below_the_current_one_shrinks_at_once():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", [0, 1, 2, 3]), desired=2)
    assert decide(active=[el])["el"] == [Resize("el", 2, "requested",
                                                "shrinking to 2 replica(s) as asked (kc scale)")]


def test_a_job_with_a_resize_in_flight_is_left_alone():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", [0, 1]),
                     resize={"to": 4, "cause": "grow"})
    assert "el" not in decide(active=[el])


def test_priority_arrival_shrinks_an_elastic_job_instead_of_evicting_it():
    cluster = nodes(n=1, gpus=8)
    low = elastic_job("low", 2, 8, dp=8, priority=10, state=JobState.RUNNING,
                      on=on("n0", range(8)))
    d = decide(queued=[elastic_job("urgent", 4, 4, dp=4, priority=100)], active=[low],
               cluster=cluster)
    assert d["low"] == [Resize("low", 4, "preemption",
                               "shrinking to 4 replica(s) for higher-priority job urgent",
                               for_job="urgent")]
    assert isinstance(d["urgent"][0], Wait) and "shrinking low" in d["urgent"][0].reason
    assert not any(isinstance(x, Preempt) for xs in d.values() for x in xs)


def test_shrink_goes_to_the_minimum_then_eviction_is_the_last_resort():
    cluster = nodes(n=1, gpus=8)
    low = elastic_job("low", 4, 8, dp=8, priority=10, state=JobState.RUNNING,
                      on=on("n0", range(8)))
    d = decide(queued=[elastic_job("urgent", 6, 6, dp=6, priority=100)], active=[low],
               cluster=cluster)
    assert isinstance(d["low"][0], Preempt)  # at its minimum of 4 it still leaves only 4 free


def test_the_waiting_job_holds_what_the_shrink_frees():
    cluster = nodes(n=1, gpus=8)
    low = elastic_job("low", 2, 8, dp=8, priority=10, state=JobState.RUNNING,
                      on=on("n0", range(8)), resize={"to": 4, "for_job": "urgent",
                                                     "cause": "preemption"})
    d = decide(queued=[elastic_job("urgent", 4, 4, dp=4, priority=100, created=1),
                       elastic_job("small", 1, 1, dp=1, priority=50, created=2)],
               active=[low], cluster=cluster)
    assert d["urgent"] == [Wait("urgent", "waiting for job(s) low to shrink")]
    assert isinstance(d["small"][0], Wait)
