"""The job controller's decisions, driven through a fake worker group and the in-memory store.

No Ray, no Redis: each test scripts what the ranks do (a death, a verdict, a
request on the store) and checks what the controller did about it, both on
the job record and on the worker group.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from kuangchao.platform.cluster.quarantine import QuarantinePolicy
from kuangchao.platform.execution.controller import JobController
from kuangchao.platform.execution.heartbeat import Verdict
from kuangchao.platform.execution.members import Outcome
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.settings import Settings
from tests.unit.controller_fakes import FakeCredentials, FakeGroup, Step, ask_resize, placed_job


def spec_doc(tmp_path, world=2, **sections) -> dict:
    doc = {"task": {"name": "t"}, "parallel": {"data_parallel_size": world, "micro_batch_size": 8,
                                                "gradient_accumulation_steps": 2},
           "checkpoint": {"path": str(tmp_path / "ckpt")},
           "fault_tolerance": {"max_restarts": 3, "stop_grace_s": 1.0}}
    for name, fields in sections.items():
        doc[name] = {**doc.get(name, {}), **fields}
    return doc


# No service is reached: the store and the worker group are given to the controller.
SETTINGS = Settings(redis_url=None, redis_prefix="kc-test:", ray_address=None,
                    api_url="http://127.0.0.1:1", quarantine=QuarantinePolicy())
ELASTIC = {"min_replicas": 1, "max_replicas": 4, "resize": "live"}
# A train function that does not resize live: a failed rank is replaced in place from the
# newest checkpoint (with it, the built-in trainer's survivors keep their work instead).
RESTORES = {"resize": "restart"}


@pytest.fixture
def store():
    return MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")


def controller(store, group, settings=SETTINGS, job_id="j1",
               relocate_wait_s: float = 0.5) -> JobController:
    ctl = JobController(job_id, settings, store=store, poll_s=0.0, group=group,
                        watch_factory=group.watch_factory, credentials=FakeCredentials())
    # No scheduler runs beside most of these tests: a relocation goes unanswered, soon.
    ctl.resizer.relocate_wait_s = relocate_wait_s
    return ctl


def events(store, job_id="j1") -> list[dict]:
    return store.events(job_id)


def test_a_job_whose_ranks_all_return_finishes_at_its_final_checkpoint(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", final_step=12)
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert "finished at step 12" in job.message and "final loss 1.5000" in job.message
    assert [c for c in group.calls if c[0] in ("start", "join", "run")] == [
        ("start", 2), ("join", 1, 2), ("run", (0, 1))]
    assert group.calls[-1] == ("teardown",)


def test_a_rank_that_dies_is_replaced_in_place_and_the_survivor_keeps_its_process(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="killed by SIGKILL")])])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.restarts == 1 and job.restart_log[0]["path"] == "in_place"
    assert job.restart_log[0]["cause"].startswith("rank 1 on n1") and "SIGKILL" in \
        job.restart_log[0]["cause"]
    assert ("stop", 1, False) in group.calls and ("replace", 1) in group.calls
    assert ("reset", (0,)) in group.calls and ("start", 2) in group.calls
    assert group.calls.count(("start", 2)) == 1  # the group was never started over
    assert [c for c in group.calls if c[0] == "join"] == [("join", 1, 2), ("join", 2, 2)]
    assert any(e["type"] == "failure" for e in events(store))


def test_a_rank_the_heartbeats_judge_failed_is_killed_hard_with_its_stacks_recorded(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1",
                      [Step(verdicts=[Verdict(1, "expired", 10.5, None)])])
    assert controller(store, group).run() == "SUCCEEDED"
    assert ("stop", 1, True) in group.calls  # SIGKILL first: a wedged process ignores Ray
    stacks = [e for e in events(store) if e["type"] == "stacks"]
    assert [e["rank"] for e in stacks] == [1]
    assert store.get("j1").restart_log[0]["kind"] == "expired"


@pytest.mark.parametrize("cut, said", [("network", "cut off from the network"),
                                        ("redis", "cannot reach Redis at 10.0.0.2:6380")])
def test_expired_heartbeats_on_a_node_cut_off_are_a_lost_node_held_back(store, tmp_path, cut,
                                                                       said):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(verdicts=[Verdict(1, "expired", 10.5, None)])])
    group.unreachable = {"id-n1": cut}
    settings = dataclasses.replace(SETTINGS, redis_url="redis://:pw@10.0.0.2:6380/0")
    assert controller(store, group, settings).run() == "QUEUED"
    job = store.get("j1")
    entry = job.restart_log[0]
    assert entry["kind"] == "node_lost" and entry["unreachable"] == cut and said in entry["cause"]
    assert entry["path"] == "requeue" and ("reach", "id-n1") in group.calls
    assert store.quarantine()["n1"]["reason"].startswith("unreachable: ")
    failure = next(e for e in events(store) if e["type"] == "failure")
    assert failure["unreachable"] == cut and said in failure["message"]


def test_expired_heartbeats_on_a_node_that_reaches_redis_are_the_ranks_own_fault(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(verdicts=[Verdict(1, "expired", 10.5, None)])])
    settings = dataclasses.replace(SETTINGS, redis_url="redis://:pw@10.0.0.2:6380/0")
    assert controller(store, group, settings).run() == "SUCCEEDED"
    assert store.get("j1").restart_log[0]["kind"] == "expired" and not store.quarantine()


def test_survivors_that_do_not_stop_send_the_job_back_to_the_queue(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(0, died="gone")])])
    group.survivors_stop = False
    assert controller(store, group).run() == "QUEUED"
    job = store.get("j1")
    assert job.restarts == 1 and job.restart_log[0]["path"] == "requeue"
    assert ("teardown",) in group.calls


def test_a_job_past_max_restarts_fails_and_says_which_setting_to_change(store, tmp_path):
    doc = spec_doc(tmp_path, fault_tolerance={"max_restarts": 1}, elastic=RESTORES)
    placed_job(store, "j1", doc, ["n0", "n1"])
    script = [Step([Outcome(1, died="first")]), Step([Outcome(1, died="second")])]
    group = FakeGroup(tmp_path / "ckpt" / "j1", script)
    assert controller(store, group).run() == "FAILED"
    job = store.get("j1")
    assert job.restarts == 1
    assert "second" in job.message and "gave up after 1 restart(s)" in job.message
    assert "fault_tolerance.max_restarts" in job.message
    assert group.calls.count(("replace", 1)) == 1


def test_survivors_of_a_fixed_size_job_keep_their_work_and_a_spare_refills_the_rank(store,
                                                                                  tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, fault_tolerance={"spare_workers": True}),
               ["n0", "n1"])

    def first_step(generation: int, step: int):  # what rank 0 reports (TrainContext.report)
        return Step(action=lambda: store.post_report("j1", {
            "kind": "first_step", "at": time.time(), "world_size": 2, "step": step,
            "generation": generation, "after": "resize", "first_step_s": 0.25}))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="killed by SIGKILL")]),
                                                 first_step(1, 9), first_step(2, 14),
                                                 first_step(2, 15)])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 2 and job.replicas == 2 and job.restarts == 1
    entry = job.restart_log[0]
    assert entry["path"] == "live" and entry["spare"] is True and entry["refilled"] == 1
    assert entry["generation"] == 2 and entry["placement_s"] >= 0
    # The survivors' first step in generation 2 (not another generation's) closes it.
    assert entry["resumed_step"] == 13 and entry["first_step_s"] == 0.25
    assert 0 <= entry["survivor_stall_s"] == pytest.approx(entry["first_step_at"]
                                                           - entry["failed_at"], abs=1e-3)
    kept = [e for e in events(store) if e["type"] == "survivors_kept"]
    assert len(kept) == 1 and kept[0]["step"] == 13
    assert "kept their work at step 13" in kept[0]["message"]
    # Nobody was stopped but the dead rank, nobody restored: the survivor kept its process.
    assert ("stop", 1, False) in group.calls and ("replace", 1) not in group.calls
    assert not [c for c in group.calls if c[0] == "reset"]
    assert ("reshape", (0,), 1) in group.calls and ("spares_taken", 1) in group.calls
    assert group.pg_history == [["pg-r0", "pg-r1"]]  # the dead replica's group, reused
    assert [p.node for p in job.placement] == ["n0", "n1"] and job.resize_log == ()
    # Same size: RECOVERING straight back to RUNNING, no RESIZING; the spare is replaced.
    states = [e["to"] for e in events(store) if e["type"] == "state"]
    assert "RESIZING" not in states and states[-3:] == ["RECOVERING", "RUNNING", "SUCCEEDED"]
    assert "survivor(s) kept their work" in next(
        e["message"] for e in events(store) if e["type"] == "state" and e["from"] == "RECOVERING")
    assert group.calls.count(("spares", ("id-n0", "id-n1"))) == 2


def test_a_fixed_size_job_refills_with_a_fresh_rank_without_spares(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(0, died="oom")])])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.restart_log[0]["path"] == "live" and "spare" not in job.restart_log[0]
    # Rank 1 survived and is rank 0 now; the new rank 1 runs in rank 0's old group.
    assert ("reshape", (1,), 1) in group.calls and group.pg_history == [["pg-r1", "pg-r0"]]
    assert [p.node for p in job.placement] == ["n1", "n0"]
    assert not [c for c in group.calls if c[0] in ("spares", "spares_taken")]


def test_a_fixed_size_job_whose_node_is_lost_or_quarantined_is_placed_again(store, tmp_path):
    # No scheduler answers the relocation (none runs here): the job goes back to the queue.
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="raylet gone")])],
                      lost_nodes={"id-n1"})
    assert controller(store, group).run() == "QUEUED"
    assert store.get("j1").restart_log[0]["path"] == "requeue"
    assert not [c for c in group.calls if c[0] == "reshape"]
    (failed,) = [e for e in events(store) if e["type"] == "relocation_failed"]
    assert failed["nodes"] == ["n1"] and "did not answer" in failed["message"]
    assert store.get("j1").relocate is None

    store.quarantine_node("n1", {"since": time.time(), "until": time.time() + 600,
                                 "failures": 2, "reason": "flaky"})
    placed_job(store, "j2", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j2", [Step([Outcome(1, died="again")])])
    assert controller(store, group, job_id="j2").run() == "QUEUED"
    assert store.get("j2").restart_log[0]["path"] == "requeue"
    assert not [c for c in group.calls if c[0] == "reshape"]


def test_a_train_function_error_with_every_rank_alive_fails_the_job_without_a_restart(store,
                                                                                    tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(0, error="ValueError: bad batch")])])
    assert controller(store, group).run() == "FAILED"
    job = store.get("j1")
    assert job.message == "ValueError: bad batch" and job.restarts == 0


def test_a_lost_node_shrinks_a_live_elastic_job_around_its_survivors(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="raylet gone")])],
                      lost_nodes={"id-n1"})
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 1 and job.replicas == 1 and [p.node for p in job.placement] == ["n0"]
    assert job.restarts == 1 and job.restart_log[0]["kind"] == "node_lost"
    assert job.restart_log[0]["path"] == "live"
    # one question about all the job's nodes, not a GCS read and a connect per node
    assert [c for c in group.calls if c[0] == "lost_among"] == [("lost_among", ("id-n0", "id-n1"))]
    assert job.resize_log[-1]["from"] == 2 and job.resize_log[-1]["to"] == 1
    assert job.resize_log[-1]["cause"] == "node_lost"
    assert ("reshape", (0,), 0) in group.calls and ("replace", 1) not in group.calls
    assert "n1" in store.quarantine()  # a lost node is held back


def test_a_dead_rank_on_a_live_node_is_refilled_in_its_own_placement_group(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="oom")])])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 2 and job.restarts == 1
    assert ("reshape", (0,), 1) in group.calls
    assert group.pg_history == [["pg-r0", "pg-r1"]]  # the dead replica's group, reused


def test_the_scheduler_grows_a_running_job_into_the_slots_it_reserved(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    grow = Step(action=lambda: ask_resize(store, "j1", 4, "grow", ["n2", "n3"]))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [grow])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 4 and job.replicas == 4 and job.resize is None
    assert [p.rank for p in job.placement] == [0, 1, 2, 3]
    assert [p.node for p in job.placement] == ["n0", "n1", "n2", "n3"]
    assert ("reshape", (0, 1), 2) in group.calls and ("run", (2, 3)) in group.calls
    assert job.resize_log[-1]["to"] == 4 and job.resize_log[-1]["cause"] == "grow"


def test_the_scheduler_shrinks_a_running_job_and_the_leaving_rank_is_released(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    shrink = Step(action=lambda: ask_resize(store, "j1", 1, "preempt", for_job="j2"))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [shrink])
    assert controller(store, group).run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 1 and [p.node for p in job.placement] == ["n0"]
    assert ("release", (1,)) in group.calls
    assert job.resize_log[-1]["for_job"] == "j2"


def test_a_job_that_cannot_resize_live_checkpoints_and_is_placed_again(store, tmp_path):
    doc = spec_doc(tmp_path, elastic={**ELASTIC, "resize": "restart"})
    placed_job(store, "j1", doc, ["n0", "n1"])
    preempted = {"preempted": True, "steps": 7}
    group = FakeGroup(tmp_path / "ckpt" / "j1", [
        Step(action=lambda: ask_resize(store, "j1", 4, "grow", ["n2", "n3"])),
        Step([Outcome(0, value=preempted), Outcome(1, value=preempted)])])
    assert controller(store, group).run() == "QUEUED"
    job = store.get("j1")
    assert "resizing to 4 replica(s) by a restart (grow)" in job.message
    assert job.resize_log[-1]["path"] == "restart" and job.preemptions == 1
    assert not store.preempt_requested("j1")


def test_a_preempted_job_checkpoints_gives_its_gpus_back_and_queues_again(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    preempted = {"preempted": True, "steps": 3}
    group = FakeGroup(tmp_path / "ckpt" / "j1", [
        Step(action=lambda: store.request_preempt("j1", "j2")),
        Step([Outcome(0, value=preempted), Outcome(1, value=preempted)])])
    assert controller(store, group).run() == "QUEUED"
    job = store.get("j1")
    assert job.preemptions == 1 and "preempted at step 3" in job.message
    assert ("teardown",) in group.calls and not store.preempt_requested("j1")


def test_a_cancel_request_stops_the_ranks_and_ends_the_job(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(action=lambda: store.request_cancel("j1"))])
    creds = FakeCredentials()
    ctl = JobController("j1", SETTINGS, store=store, poll_s=0.0, group=group,
                        watch_factory=group.watch_factory, credentials=creds)
    assert ctl.run() == "CANCELLED"
    assert ("teardown",) in group.calls and creds.retired == 1


def test_a_restarted_controller_recovers_its_job_through_the_queue(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    store.update("j1", lambda j: (dataclasses.replace(j, state=JobState.RUNNING), None))
    store.claim_controller("j1", "driver/1")  # the earlier run of this controller, now dead
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    assert controller(store, group).run() == "QUEUED"
    job = store.get("j1")
    assert job.restarts == 1 and job.restart_log[0]["kind"] == "controller"
    assert ("start", 2) not in group.calls


def test_a_train_function_that_saves_nothing_fails_with_what_to_call(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    group.results = lambda rank: {"steps": 5}
    ctl = JobController("j1", SETTINGS, store=store, poll_s=0.0, group=group,
                        watch_factory=group.watch_factory, credentials=FakeCredentials(),
                        latest_checkpoint=lambda spec, job_id: None)
    assert ctl.run() == "FAILED"
    assert "ctx.checkpoint.save" in store.get("j1").message
