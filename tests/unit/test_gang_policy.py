"""The gang policy: queues, quotas, priorities, backfill and preemption."""

import pytest

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.errors import SpecError
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.scheduling.policies import Admit, GangPolicy, Preempt, Snapshot, Wait
from kuangchao.platform.spec.queues import Queue, QueueTable, parse_queues


def nodes(n=2, gpus=8, island=4) -> tuple[NodeInfo, ...]:
    isl = tuple(tuple(range(i, i + island)) for i in range(0, gpus, island))
    return tuple(NodeInfo(name=f"n{i}", gpus=gpus, islands=isl, leaf="leaf-0", node_id=f"id{i}")
                 for i in range(n))


def job(jid, gpus=1, tp=1, queue="default", priority=50, created=0.0, state=JobState.QUEUED,
        on=None, preempting_for=None) -> JobRecord:
    placement = ()
    if on:
        node, ids = on
        placement = tuple(PlacedRank(rank=i, node=node, node_id="", leaf="leaf-0", gpu=g, gpus=(g,))
                          for i, g in enumerate(ids))
    dp = gpus // tp
    return JobRecord(id=jid, name=jid, spec={"parallel": {"data_parallel_size": dp,
                                                          "tensor_parallel_size": tp}},
                     state=state, queue=queue, priority=priority, created_at=created, gpus=gpus,
                     world_size=gpus, placement=placement, started_at=created if on else None,
                     preempting_for=preempting_for)


def running(jid, node, ids, **kw) -> JobRecord:
    return job(jid, gpus=len(ids), state=JobState.RUNNING, on=(node, ids), **kw)


TEAMS = QueueTable(queues=(Queue("team-a", 8, 0), Queue("team-b", 4, 8), Queue("default")))


def decide(queued=(), active=(), queues=QueueTable(), cluster=None) -> dict[str, list]:
    snap = Snapshot(nodes=cluster or nodes(), queued=tuple(queued), active=tuple(active),
                    queues=queues)
    out: dict[str, list] = {}
    for d in GangPolicy().decide(snap):
        out.setdefault(d.job_id, []).append(d)
    return out


def test_higher_priority_goes_first_even_when_it_arrived_later():
    d = decide(queued=[job("low", gpus=12, created=0), job("high", gpus=8, priority=100, created=5)])
    assert isinstance(d["high"][0], Admit)
    assert isinstance(d["low"][0], Wait)


def test_quota_blocks_a_queue_at_its_limit_while_another_queue_runs():
    active = [running("a1", "n0", range(8), queue="team-a")]
    d = decide(queued=[job("a2", gpus=4, queue="team-a", created=1),
                       job("b1", gpus=4, queue="team-b", created=2)], active=active, queues=TEAMS)
    assert d["a2"] == [Wait("a2", "quota team-a: 8/8 GPUs in use")]
    assert isinstance(d["b1"][0], Admit)


def test_unknown_queue_waits_with_the_known_names():
    d = decide(queued=[job("x", queue="nope")], queues=TEAMS)
    assert "does not exist; known queues: team-a, team-b, default" in d["x"][0].reason


def test_backfill_never_takes_gpus_the_blocked_head_would_use():
    active = [running("r", "n0", range(8), priority=100)]
    d = decide(queued=[job("head", gpus=12, created=0), job("small", gpus=2, created=1)],
               active=active)
    assert isinstance(d["head"][0], Wait)
    assert d["small"] == [Wait("small", "GPUs are held for job head, ahead in the queue")]


def test_backfill_uses_gpus_the_blocked_head_cannot_use():
    # Free: one GPU in each of four islands. The head needs a 2-GPU island; 1-GPU jobs fit.
    active = [running("r0", "n0", [0, 1, 2, 4, 5, 6], priority=100),
              running("r1", "n1", [0, 1, 2, 4, 5, 6], priority=100)]
    d = decide(queued=[job("head", gpus=2, tp=2, created=0), job("small", gpus=1, created=1)],
               active=active)
    assert isinstance(d["head"][0], Wait) and "fragmented" in d["head"][0].reason
    assert isinstance(d["small"][0], Admit)


def test_high_priority_job_preempts_the_lowest_priority_youngest_job():
    active = [running("old-low", "n0", range(8), priority=10, created=1),
              running("new-low", "n1", range(8), priority=10, created=2)]
    d = decide(queued=[job("urgent", gpus=8, priority=100, created=3)], active=active)
    assert d["new-low"] == [Preempt("new-low", "urgent", "preempted for higher-priority job urgent")]
    assert "old-low" not in d
    assert d["urgent"] == [Wait("urgent", "preempting new-low")]


def test_equal_priority_in_the_same_queue_is_never_preempted():
    active = [running("r", "n0", range(8)), running("s", "n1", range(8))]
    d = decide(queued=[job("q", gpus=8, created=3)], active=active)
    assert set(d) == {"q"} and isinstance(d["q"][0], Wait)


def test_queue_under_its_guarantee_reclaims_gpus_a_borrowing_queue_holds():
    # team-b (guarantee 4) borrows all 16 GPUs; team-a (guarantee 8) wants its share back.
    active = [running("b1", "n0", range(8), queue="team-b", created=1),
              running("b2", "n1", range(8), queue="team-b", created=2)]
    queues = QueueTable(queues=(Queue("team-a", 8, 0), Queue("team-b", 4, None)))
    d = decide(queued=[job("a1", gpus=8, queue="team-a", created=3)], active=active, queues=queues)
    assert [type(x) for x in d["b2"]] == [Preempt] and "b1" not in d


def test_job_waits_for_its_victims_and_nobody_takes_their_gpus():
    active = [running("victim", "n0", range(8), priority=10, preempting_for="urgent"),
              running("other", "n1", range(4), priority=100)]
    d = decide(queued=[job("urgent", gpus=8, priority=100, created=1),
                       job("small", gpus=4, priority=50, created=2)], active=active)
    assert "waiting for preempted job(s) victim" in d["urgent"][0].reason
    admitted = d["small"][0]
    assert isinstance(admitted, Admit) and {s.node for s in admitted.plan.slots} == {"n1"}


def test_preemption_can_be_switched_off():
    active = [running("low", "n0", range(8), priority=10), running("low2", "n1", range(8), priority=10)]
    d = decide(queued=[job("urgent", gpus=8, priority=100)], active=active,
               queues=QueueTable(preemption=False))
    assert set(d) == {"urgent"} and isinstance(d["urgent"][0], Wait)


def test_queue_file_errors_name_the_field():
    with pytest.raises(SpecError) as info:
        parse_queues({"queues": [{"name": "a", "guaranteed_gpus": -1}, {"name": "a"}]})
    assert any("guaranteed_gpus" in p for p, _ in info.value.errors)
    table = parse_queues({"queues": [{"name": "a", "guaranteed_gpus": 8, "borrow_limit_gpus": 4}]})
    assert table.get("a").limit == 12 and table.policy == "gang"
