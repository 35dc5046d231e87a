"""Elastic bookkeeping against a real Redis: the resize record, the sample record,
the generation handed to the ranks, and a lost raylet held back by its node id."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kuangchao.platform.cluster.quarantine import QuarantinePolicy, active, holds
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.execution.recovery import Failure, record_failure
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.scheduling.scheduler import _readmitted

pytestmark = pytest.mark.integration


def job(store, job_id="e1", **fields):
    store.create(JobRecord(id=job_id, name="e", spec={}, **fields))
    store.update(job_id, lambda j: (replace(j, state=JobState.RUNNING), None))
    return store.get(job_id)


def test_a_resize_entry_closes_once_at_its_own_size(store):
    job(store, resize_log=({"from": 3, "to": 2, "to_world_size": 2, "requested_at": 100.0},))
    assert store.close_resize("e1", 101.0, world_size=3) is None  # a step at another size
    entry = store.close_resize("e1", 101.5, world_size=2)
    assert entry["first_step_at"] == 101.5 and entry["resize_s"] == 1.5
    assert store.close_resize("e1", 105.0, world_size=2) is None  # already closed
    assert store.get("e1").resize_log[0]["resize_s"] == 1.5


def test_a_job_placed_again_at_another_size_opens_or_corrects_its_entry():
    base = JobRecord(id="e", name="e", spec={}, replicas=3, world_size=3, started_at=1.0)
    opened = _readmitted(base, 2, 2)
    assert opened[-1]["cause"] == "re-placed" and (opened[-1]["from"], opened[-1]["to"]) == (3, 2)
    pending = replace(base, resize_log=({"from": 3, "to": 1, "to_world_size": 1,
                                         "requested_at": 5.0},))
    assert _readmitted(pending, 2, 2)[-1]["to"] == 2  # the restart landed at 2, not 1
    assert _readmitted(replace(base, replicas=2), 2, 2) == ()  # same size: not a resize


def test_the_sample_record_drops_the_steps_a_restore_undid(store):
    job(store)
    store.record_samples("e1", {"0/3/0": "0:4", "1/3/0": "12:16", "2/3/0": "24:28",
                                "10/2/1": "4:8"})
    store.forget_samples_from("e1", 2)
    assert store.samples("e1") == {"0/3/0": "0:4", "1/3/0": "12:16"}


def test_a_generation_with_a_signal_asks_ranks_to_rejoin_and_one_without_clears_it(store):
    job(store)
    store.publish_generation("e1", {"gen": 4, "world_size": 2}, signal=True)
    assert store.rejoin_requested("e1") == 4 and store.generation("e1")["world_size"] == 2
    store.publish_generation("e1", {"gen": 5, "world_size": 3}, signal=False)
    assert store.rejoin_requested("e1") == 0 and store.generation("e1")["gen"] == 5


def test_a_lost_raylet_is_held_back_even_with_quarantine_off_and_only_that_raylet(store):
    job(store)
    off = QuarantinePolicy(failures=0, lost_node_s=30)
    f = Failure("node_lost", "rank 2 died; its node is gone", rank=2, node="n2",
                node_id="dead-id", failed_at=1000.0)
    record_failure(store, "e1", f, max_restarts=3, policy=off)
    entries = active(store.quarantine(), 1010.0)
    assert entries["n2"]["node_id"] == "dead-id"
    old = NodeInfo(name="n2", gpus=1, islands=((0,),), leaf="l", node_id="dead-id")
    assert holds(entries, old) and not holds(entries, replace(old, node_id="new-id"))
    died = Failure("died", "rank 1 died", rank=1, node="n1", failed_at=1000.0)
    record_failure(store, "e1", died, max_restarts=3, policy=off)
    assert "n1" not in store.quarantine()  # a plain death says nothing with quarantine off
