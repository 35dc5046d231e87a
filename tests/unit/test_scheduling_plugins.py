"""Each scheduling plugin on its own, over a hand-built snapshot and cycle ledger."""

import dataclasses

import pytest

from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.placement.solver import Infeasible, JobShape
from kuangchao.platform.scheduling.plugins.admission import GangAdmission
from kuangchao.platform.scheduling.plugins.backfill import HeadReservation
from kuangchao.platform.scheduling.plugins.cycle import Cycle
from kuangchao.platform.scheduling.plugins.decisions import Admit, Hold, Preempt, Resize, Wait
from kuangchao.platform.scheduling.plugins.elastic import ElasticGrow, ElasticShrink
from kuangchao.platform.scheduling.plugins.gang import GangPolicy
from kuangchao.platform.scheduling.plugins.preemption import CheckpointPreemption, may_yield
from kuangchao.platform.scheduling.plugins.quota import QueueQuota, Sizes
from kuangchao.platform.scheduling.plugins.registry import POLICIES, make_policy
from kuangchao.platform.scheduling.plugins.snapshot import Snapshot
from kuangchao.platform.spec.queues import Queue, QueueTable

from .test_elastic_policy import elastic_job, on
from .test_gang_policy import job, nodes, running

TEAMS = QueueTable(queues=(Queue("team-a", 8, 0), Queue("team-b", 4, 8), Queue("default")))


def cycle(queued=(), active=(), queues=QueueTable(), cluster=None) -> Cycle:
    return Cycle(Snapshot(nodes=cluster or nodes(), queued=tuple(queued), active=tuple(active),
                          queues=queues))


# -- the snapshot ---------------------------------------------------------------------

def test_snapshot_resolves_each_jobs_spec_once_with_its_defaults():
    snap = Snapshot(nodes=nodes(), queued=(job("q", gpus=4, tp=2),), active=())
    view = snap.views["q"]
    assert view is snap.view(snap.queued[0])  # cached for the cycle
    assert view.shape == JobShape(dp=2, tp=2)
    assert view.spec.parallel.micro_batch_size == 8  # the JobSpec default, not restated here
    assert view.rng.gpus_per_replica == 2


def test_snapshot_free_gpus_leave_out_used_gpus_and_dead_nodes():
    cluster = (nodes()[0], dataclasses.replace(nodes()[1], alive=False))
    snap = Snapshot(nodes=cluster, queued=(), active=(running("r", "n0", [0, 1, 2]),))
    assert snap.free_gpus == {"n0": frozenset(range(3, 8))}
    assert snap.total_gpus == 8


def test_snapshot_and_decisions_are_frozen():
    snap = Snapshot(nodes=nodes(), queued=(), active=())
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.nodes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Wait("a", "b").reason = "c"  # type: ignore[misc]


# -- quota --------------------------------------------------------------------------

@pytest.mark.parametrize("queued, active, expected", [
    (job("x", queue="nope"), [], "queue 'nope' does not exist; known queues: team-a, team-b, default"),
    (job("a2", gpus=4, queue="team-a"), [running("a1", "n0", range(8), queue="team-a")],
     "quota team-a: 8/8 GPUs in use"),
    (job("huge", gpus=24), [], "needs 24 GPUs, the cluster has 16"),
])
def test_quota_makes_a_job_wait_when_its_queue_or_the_cluster_has_no_room(queued, active, expected):
    c = cycle(queued=[queued], active=active, queues=TEAMS)
    assert QueueQuota().admissible(c.job(queued.id), c) == Wait(queued.id, expected)


def test_quota_offers_an_elastic_job_only_the_sizes_within_its_queues_limit():
    queues = QueueTable(queues=(Queue("default", 3, 0),))
    c = cycle(queued=[elastic_job("el", 1, 4)], queues=queues)
    assert QueueQuota().admissible(c.job("el"), c) == Sizes((3, 2, 1))


def test_quota_room_counts_what_the_queue_already_holds():
    c = cycle(active=[running("b1", "n0", range(10 - 2), queue="team-b")], queues=TEAMS)
    assert QueueQuota().room("team-b", 4, c) and not QueueQuota().room("team-b", 5, c)
    assert QueueQuota().room("no-such-queue", 1000, c)


# -- gang admission -----------------------------------------------------------------

def test_admission_takes_the_largest_size_that_places():
    c = cycle(queued=[elastic_job("el", 1, 4)], active=[running("big", "n0", range(8)),
                                                         running("mid", "n1", range(6))])
    admit = GangAdmission().place(c.job("el"), Sizes((4, 2, 1)), c)
    assert isinstance(admit, Admit) and admit.replicas == 2 and len(admit.plan.slots) == 2


def test_admission_is_all_or_nothing():
    c = cycle(queued=[job("q", gpus=4)], active=[running("big", "n0", range(8)),
                                                  running("mid", "n1", range(5))])
    out = GangAdmission().place(c.job("q"), Sizes((4,)), c)
    assert out == Infeasible("needs 4 GPUs, 3 of 16 are free")


# -- backfill -----------------------------------------------------------------------

def test_the_first_blocked_job_becomes_the_head_and_holds_its_partial_fit():
    c = cycle(queued=[job("head", gpus=12)], active=[running("r", "n0", range(8))])
    steps = HeadReservation().wait(c.job("head"), JobShape(dp=12), 12, "no room", c)
    assert steps == (Hold({"n1": set(range(8))}, head="head"), Wait("head", "no room"))


@pytest.mark.parametrize("need, reason", [
    (2, "GPUs are held for job head, ahead in the queue"),  # it would fit but for the head
    (9, "no room"),  # it would not fit anyway: its own reason stands
])
def test_a_job_behind_the_head_says_why_it_waits(need, reason):
    c = cycle(queued=[job("head", gpus=12), job("small", gpus=need)],
              active=[running("r", "n0", range(8))])
    c.apply(Hold({"n1": set(range(8))}, head="head"))
    assert HeadReservation().wait(c.job("small"), JobShape(dp=need), need, "no room",
                                  c) == (Wait("small", reason),)


# -- preemption ---------------------------------------------------------------------

@pytest.mark.parametrize("victim, eligible", [
    (running("low", "n0", range(8), priority=10), True),
    (running("same", "n0", range(8), priority=50, queue="team-a"), False),
    (running("going", "n0", range(8), priority=10, preempting_for="x"), False),
    (running("borrower", "n0", range(8), priority=50, queue="team-b"), True),
])
def test_who_may_yield_gpus_to_a_queued_job(victim, eligible):
    queued = job("a1", gpus=8, queue="team-a")
    queues = QueueTable(queues=(Queue("team-a", 8, 0), Queue("team-b", 4, None), Queue("default")))
    c = cycle(queued=[queued], active=[victim], queues=queues)
    assert may_yield(c.job("a1"), 8, victim, c) is eligible


def test_preemption_evicts_only_the_victims_needed():
    active = [running("old-low", "n0", range(8), priority=10, created=1),
              running("new-low", "n1", range(8), priority=10, created=2)]
    c = cycle(queued=[job("urgent", gpus=8, priority=100, created=3)], active=active)
    steps = CheckpointPreemption().evict(c.job("urgent"), JobShape(dp=8), 8, c)
    assert steps == (Preempt("new-low", "urgent", "preempted for higher-priority job urgent"),
                     Wait("urgent", "preempting new-low"))


@pytest.mark.parametrize("queues, already", [(QueueTable(preemption=False), False),
                                             (QueueTable(), True)])
def test_preemption_starts_nothing_when_off_or_when_one_started_this_cycle(queues, already):
    c = cycle(queued=[job("urgent", gpus=8, priority=100)],
              active=[running("low", "n0", range(8), priority=10),
                      running("low2", "n1", range(8), priority=10)], queues=queues)
    c.preempting = already
    assert CheckpointPreemption().evict(c.job("urgent"), JobShape(dp=8), 8, c) == ()


def test_a_job_whose_victims_are_checkpointing_waits_and_holds_their_gpus():
    c = cycle(queued=[job("urgent", gpus=8, priority=100)],
              active=[running("victim", "n0", range(8), priority=10, preempting_for="urgent")])
    steps = CheckpointPreemption().pending(c.job("urgent"), c)
    assert steps == (Hold({"n0": set(range(8))}),
                     Wait("urgent", "waiting for preempted job(s) victim to checkpoint"))
    assert CheckpointPreemption().pending(c.job("victim"), c) == ()


# -- elastic shrink and grow --------------------------------------------------------

def test_shrink_for_priority_takes_only_the_replicas_needed():
    low = elastic_job("low", 2, 8, dp=8, priority=10, state=JobState.RUNNING, on=on("n0", range(8)))
    c = cycle(queued=[elastic_job("urgent", 2, 2, dp=2, priority=100)], active=[low],
              cluster=nodes(n=1))
    steps = ElasticShrink().make_room(c.job("urgent"), JobShape(dp=2), 2, c)
    assert steps[0] == Resize("low", 6, "preemption",
                              "shrinking to 6 replica(s) for higher-priority job urgent",
                              for_job="urgent")
    assert steps[1:] == (Wait("urgent", "shrinking low to make room"),)


def test_shrink_on_request_only_below_the_current_size():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", range(4)), desired=2)
    c = cycle(active=[el])
    assert ElasticShrink().requested(c.job("el")).to == 2
    grown = elastic_job("g", 1, 4, state=JobState.RUNNING, on=on("n0", range(2)), desired=4)
    assert ElasticShrink().requested(cycle(active=[grown]).job("g")) is None


def test_grow_stops_at_the_queues_limit():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", [0]))
    c = cycle(active=[el], queues=QueueTable(queues=(Queue("default", 2, 0),)))
    grow = ElasticGrow(QueueQuota()).grow(c.job("el"), c)
    assert isinstance(grow, Resize) and (grow.to, grow.cause, len(grow.plan.slots)) == (2, "grow", 1)


def test_a_job_at_its_target_does_not_grow():
    el = elastic_job("el", 1, 4, state=JobState.RUNNING, on=on("n0", range(4)))
    c = cycle(active=[el])
    assert ElasticGrow(QueueQuota()).grow(c.job("el"), c) is None


# -- the ledger and the composition -------------------------------------------------

def test_applying_an_admit_takes_its_gpus_and_its_queues_quota():
    c = cycle(queued=[job("q", gpus=4, queue="team-b")], queues=TEAMS)
    admit = GangAdmission().place(c.job("q"), Sizes((4,)), c)
    c.apply(admit)
    assert (c.free, c.usage["team-b"]) == (12, 4)
    assert sum(len(ids) for ids in c.used.values()) == 4


def test_applying_a_preempt_holds_the_victims_gpus_and_closes_preemption():
    c = cycle(queued=[job("urgent", gpus=8, priority=100)],
              active=[running("low", "n0", range(8), priority=10)])
    c.apply(Preempt("low", "urgent", "why"))
    assert c.preempting and c.preempted == {"low"} and c.reserved == {"n0": set(range(8))}


class WaitingQuota(QueueQuota):
    """A quota that refuses everyone: nothing after it may run."""

    def admissible(self, job, cycle):
        return Wait(job.id, "closed")


class ExplodingAdmission:
    def place(self, job, sized, cycle):
        raise AssertionError("admission ran after the quota said wait")


def test_the_composition_stops_at_the_first_plugin_that_answers():
    snap = Snapshot(nodes=nodes(), queued=(job("q"),), active=())
    policy = GangPolicy(quota=WaitingQuota(), admission=ExplodingAdmission())
    assert policy.decide(snap) == [Wait("q", "closed")]


def test_the_composition_keeps_holds_to_itself():
    snap = Snapshot(nodes=nodes(), queued=(job("head", gpus=12), job("small", gpus=1, created=1)),
                    active=(running("r", "n0", range(8), priority=100),))
    out = GangPolicy().decide(snap)
    assert not any(isinstance(d, Hold) for d in out)
    assert [type(d) for d in out] == [Wait, Wait]


def test_policies_are_picked_by_the_names_users_configure():
    assert sorted(POLICIES) == ["fifo", "gang"]
    assert make_policy("gang").name == "gang" and make_policy("fifo").name == "fifo"
    with pytest.raises(ValueError, match=r"'bin-pack' is unknown; choose one of \['fifo', 'gang'\]"):
        make_policy("bin-pack")
