"""Relocation: a job whose survivors keep their work lost a replica's node; its
controller asks the scheduler for other GPUs (platform/execution/relocation.py), the
scheduler answers first in its cycle (platform/scheduling/plugins/relocation.py), and
the job re-forms at the same size there without going back to the queue."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable

import pytest

from kuangchao.platform.cluster.drain import DrainNotice, mark_draining
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.control import operations
from kuangchao.platform.execution import relocation
from kuangchao.platform.execution.members import Outcome
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank, recover
from kuangchao.platform.scheduling.plugins.fifo import FifoPolicy
from kuangchao.platform.scheduling.scheduler import Scheduler
from kuangchao.platform.spec.jobspec import validate_spec
from tests.unit.controller_fakes import FakeGroup, Step
from tests.unit.test_controller import controller, spec_doc


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh store, and KC_HOME in tmp_path (the audit file goes there)."""
    monkeypatch.setenv("KC_HOME", str(tmp_path / "home"))
    return MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")


def node(name: str, gpus: int = 1) -> NodeInfo:
    return NodeInfo(name=name, gpus=gpus, islands=(tuple(range(gpus)),), leaf="leaf-0",
                    node_id=f"id-{name}")


def running(store, name: str, nodes: list[str], doc: dict | None = None) -> str:
    """A job RUNNING with one rank (GPU 0) on each of `nodes`."""
    spec = validate_spec(doc or {"task": {"name": name},
                                 "parallel": {"data_parallel_size": len(nodes),
                                              "micro_batch_size": 1}})
    job_id = operations.submit(store, spec).id
    placement = tuple(PlacedRank(r, n, f"id-{n}", "leaf-0", gpu=0, gpus=(0,))
                      for r, n in enumerate(nodes))
    store.update(job_id, lambda j: (dataclasses.replace(
        j, state=JobState.RUNNING, placement=placement, world_size=len(nodes),
        replicas=len(nodes), gpus=len(nodes)), None))
    return job_id


def lose(store, job_id: str, replicas: list[int], avoid: list[str]) -> float:
    """What the controller writes: RECOVERING, and the request."""
    at = time.time()
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))
    store.update(job_id, lambda j: (dataclasses.replace(j, relocate={
        "replicas": replicas, "avoid": avoid, "requested_at": at}), None))
    return at


def kinds(store, job_id: str) -> list[str]:
    return [e["type"] for e in store.events(job_id)]


# -- the scheduler's answer ----------------------------------------------------------------

@pytest.mark.parametrize("policy", [None, FifoPolicy()], ids=["gang", "fifo"])
def test_a_lost_replica_is_placed_on_a_free_node_before_a_queued_job_takes_it(store, policy):
    cluster = (node("n0"), node("n1"), node("n2"))
    job_id = running(store, "a", ["n0", "n1"])
    queued = operations.submit(store, validate_spec({"task": {"name": "q"}, "parallel": {
        "data_parallel_size": 1, "micro_batch_size": 1}})).id
    at = lose(store, job_id, [1], ["n1"])
    Scheduler(store, lambda: cluster, lambda _: None, policy=policy).step()
    job = store.get(job_id)
    assert job.relocate["requested_at"] == at and [p["node"] for p in job.relocate["placed"]] == ["n2"]
    # The new slot joins the placement past the world (n1's stays until the group re-forms),
    # so that nothing else lands there; the queued job does not fit now (n1 counts as held).
    assert [(p.rank, p.node) for p in job.placement] == [(0, "n0"), (1, "n1"), (2, "n2")]
    assert store.get(queued).state is JobState.QUEUED
    assert "relocation_placed" in kinds(store, job_id)


def test_never_on_a_node_the_controller_saw_lost_nor_on_one_in_quarantine(store):
    cluster = (node("n0"), node("n1"), node("n2"), node("n3"))
    job_id = running(store, "a", ["n0", "n2"])
    store.update(job_id, lambda j: (dataclasses.replace(j, placement=(
        j.placement[0], PlacedRank(1, "n2", "id-n2", "leaf-0", gpu=0, gpus=(0,)))), None))
    store.quarantine_node("n1", {"since": time.time(), "until": time.time() + 600,
                                 "failures": 3, "reason": "flaky"})
    lose(store, job_id, [1], ["n3"])  # Ray may still list a lost node alive; it is avoided
    # n2 is the lost replica's own node and still in the placement: its GPU counts as held.
    Scheduler(store, lambda: cluster, lambda _: None).step()
    job = store.get(job_id)
    assert "refused" in job.relocate and "do not fit" in job.relocate["refused"]
    assert len(job.placement) == 2 and "relocation_refused" in kinds(store, job_id)


def test_a_request_is_answered_once_and_a_withdrawn_one_not_at_all(store):
    cluster = (node("n0"), node("n1"), node("n2"), node("n3"))
    scheduler = Scheduler(store, lambda: cluster, lambda _: None)
    job_id = running(store, "a", ["n0", "n1"])
    lose(store, job_id, [1], ["n1"])
    scheduler.step()
    scheduler.step()
    job = store.get(job_id)
    assert len(job.relocate["placed"]) == 1 and len(job.placement) == 3
    relocation.withdraw(store, job_id)  # the controller gave up: the late slot goes too
    job = store.get(job_id)
    assert job.relocate is None and [p.node for p in job.placement] == ["n0", "n1"]
    scheduler.step()
    assert store.get(job_id).relocate is None and len(store.get(job_id).placement) == 2


def test_a_job_resizing_or_placing_gets_no_answer_but_a_running_one_moving_off_a_drain_does(
        store):
    cluster = (node("n0"), node("n1"), node("n2"))
    scheduler = Scheduler(store, lambda: cluster, lambda _: None)
    job_id = running(store, "a", ["n0", "n1"])
    request = {"replicas": [1], "avoid": ["n1"], "requested_at": 1.0}
    for state in (JobState.RESIZING, JobState.PLACING):
        store.update(job_id, lambda j, s=state: (dataclasses.replace(j, state=s, relocate=request),
                                                 None))
        scheduler.step()
        job = store.get(job_id)
        assert "placed" not in job.relocate and len(job.placement) == 2, state
    store.update(job_id, lambda j: (dataclasses.replace(j, state=JobState.RUNNING), None))
    scheduler.step()
    assert [p["node"] for p in store.get(job_id).relocate["placed"]] == ["n2"]


# -- the controller's side ------------------------------------------------------------------

def test_ask_waits_for_the_answer_and_withdraws_when_none_comes(store):
    job_id = running(store, "a", ["n0", "n1"])
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))
    ticks = iter(range(100))
    answer = relocation.ask(store, job_id, [1], ["n1"], wait_s=3, clock=lambda: next(ticks),
                            sleep=lambda _: None)
    assert answer.slots == () and "did not answer within 3s" in answer.why_not
    assert store.get(job_id).relocate is None
    # Not RECOVERING (the job ended meanwhile): nothing is asked.
    store.update(job_id, lambda j: (dataclasses.replace(j, state=JobState.SUCCEEDED), None))
    assert "no longer RECOVERING" in relocation.ask(store, job_id, [1], ["n1"], wait_s=3).why_not


def test_a_refused_lost_replica_is_asked_again_and_placed_on_a_node_that_joins(store, monkeypatch):
    """A node coming back joins a moment after the loss: the job waits for it with its
    survivors' work instead of going back to the queue. Only the first refusal is an event."""
    monkeypatch.setattr(relocation, "ASK_AGAIN_S", 0.05)
    job_id = running(store, "a", ["n0", "n1"])
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))
    nodes = [node("n0"), node("n1")]  # n1 lost, still listed: no room anywhere yet
    seen_refusal = threading.Event()

    def note_refusal() -> None:
        if (store.get(job_id).relocate or {}).get("refused"):
            seen_refusal.set()

    def cluster() -> tuple[NodeInfo, ...]:
        if seen_refusal.is_set() and len(nodes) == 2:
            nodes.append(node("n2"))  # the node back, registered after the first refusal
        return tuple(nodes)

    with scheduling(store, cluster, after=note_refusal):
        answer = relocation.ask(store, job_id, [1], ["n1"], wait_s=30)
    assert [p.node for p in answer.slots] == ["n2"] and not answer.why_not
    assert seen_refusal.is_set()
    req = store.get(job_id).relocate
    assert req["asked_again"] >= 1 and "refused" not in req
    assert kinds(store, job_id).count("relocation_refused") == 1
    assert "relocation_placed" in kinds(store, job_id)


def test_a_lost_replica_refused_until_the_wait_ends_is_withdrawn_with_why(store, monkeypatch):
    monkeypatch.setattr(relocation, "ASK_AGAIN_S", 0.05)
    job_id = running(store, "a", ["n0", "n1"])
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))
    with scheduling(store, (node("n0"), node("n1"))):
        answer = relocation.ask(store, job_id, [1], ["n1"], wait_s=0.6)
    assert answer.slots == () and "do not fit" in answer.why_not and "asked" in answer.why_not
    assert store.get(job_id).relocate is None  # withdrawn: the job goes back to the queue
    assert kinds(store, job_id).count("relocation_refused") == 1


def test_a_job_cancelled_while_it_waits_for_room_stops_asking(store, monkeypatch):
    monkeypatch.setattr(relocation, "ASK_AGAIN_S", 0.05)
    job_id = running(store, "a", ["n0", "n1"])
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))

    def cancel_after_refusal() -> None:
        if (store.get(job_id).relocate or {}).get("refused"):
            store.update(job_id, lambda j: (dataclasses.replace(j, state=JobState.CANCELLED), None))

    with scheduling(store, (node("n0"), node("n1")), after=cancel_after_refusal):
        t0 = time.monotonic()
        answer = relocation.ask(store, job_id, [1], ["n1"], wait_s=30)
    assert answer.slots == () and "no longer RECOVERING" in answer.why_not
    assert time.monotonic() - t0 < 10 and store.get(job_id).relocate is None


def test_a_drains_refused_move_is_not_asked_again(store, monkeypatch):
    monkeypatch.setattr(relocation, "ASK_AGAIN_S", 0.05)
    job_id = running(store, "a", ["n0", "n1"])
    with scheduling(store, (node("n0"), node("n1"))):
        t0 = time.monotonic()
        answer = relocation.ask(store, job_id, [1], ["n1"], wait_s=30, planned=True)
    assert answer.slots == () and "do not fit" in answer.why_not and "asked" not in answer.why_not
    assert time.monotonic() - t0 < 10  # the first refusal ends it, not the 30 s wait
    assert store.get(job_id).relocate is None


def placed(store, tmp_path, nodes: list[str], job_id: str = "j1") -> None:
    """A job PLACING with one rank on each of `nodes`, on GPU 0 (as the scheduler admits)."""
    placement = tuple(PlacedRank(r, n, f"id-{n}", "leaf-0", gpu=0, gpus=(0,))
                      for r, n in enumerate(nodes))
    store.create(JobRecord(id=job_id, name=job_id, spec=spec_doc(tmp_path), state=JobState.PLACING,
                           world_size=len(nodes), gpus=len(nodes), replicas=len(nodes),
                           placement=placement))


@contextlib.contextmanager
def scheduling(store, cluster: tuple[NodeInfo, ...] | Callable[[], tuple[NodeInfo, ...]],
               after: Callable[[], None] = lambda: None):
    """A scheduler beside the controller, on the same store, cycling on every wake-up
    (`cluster`: the nodes, or what returns them at each cycle; `after`: run after each)."""
    scheduler = Scheduler(store, cluster if callable(cluster) else lambda: cluster, lambda _: None)
    stop = threading.Event()

    def schedule() -> None:
        while not stop.is_set():
            store.wait_for_wake(0.05)
            scheduler.step()
            after()

    thread = threading.Thread(target=schedule, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def test_a_fixed_size_job_that_loses_a_node_refills_it_live_where_the_scheduler_placed_it(
        store, tmp_path):
    """The controller and a scheduler on one store: the lost rank's replica is placed on
    the free node, and the job trains on at its size without going back to the queue."""
    job_id = "j1"
    placed(store, tmp_path, ["n0", "n1"])
    with scheduling(store, (node("n0"), node("n1"), node("n2"))):
        group = FakeGroup(tmp_path / "ckpt" / job_id, [Step([Outcome(1, died="raylet gone")])],
                          lost_nodes={"id-n1"})
        assert controller(store, group, relocate_wait_s=30).run() == "SUCCEEDED"
    job = store.get(job_id)
    assert [p.node for p in job.placement] == ["n0", "n2"] and job.world_size == 2
    assert job.restarts == 1 and job.restart_log[0]["kind"] == "node_lost"
    assert job.restart_log[0]["path"] == "live" and job.restart_log[0]["relocated"] == 1
    assert job.relocate is None
    assert "QUEUED" not in [e.get("to") for e in store.events(job_id)]
    assert ("reshape", (0,), 1) in group.calls
    assert [c for c in group.calls if c[0] == "teardown"] == [("teardown",)]  # at the end only
    assert group.pg_history[-1] == ["pg-r0", "pg-new0"]  # a new placement group on n2
    assert {"relocation_requested", "relocation_placed"} <= set(kinds(store, job_id))


# -- a drain's planned move ------------------------------------------------------------------

def drained(ctl, name: str) -> None:
    ctl.drain.source = lambda: {f"id-{name}": DrainNotice(f"id-{name}", time.time() + 20)}
    ctl.drain.poll_s = 0.0


def test_a_drained_fixed_size_job_moves_the_replica_there_live_and_redoes_nothing(store, tmp_path):
    placed(store, tmp_path, ["n0", "n1"])
    with scheduling(store, (node("n0"), mark_draining((node("n1"),), {"id-n1": DrainNotice(
            "id-n1", None)})[0], node("n2"))):
        group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(), Step()])
        ctl = controller(store, group, relocate_wait_s=30)
        drained(ctl, "n1")
        assert ctl.run() == "SUCCEEDED"
    job = store.get("j1")
    assert [p.node for p in job.placement] == ["n0", "n2"] and job.world_size == 2
    # Planned: no restart, no checkpoint, no preemption; one generation change.
    assert job.restarts == 0 and job.preemptions == 0 and not store.preempt_requested("j1")
    entry = job.resize_log[-1]
    assert (entry["from"], entry["to"], entry["cause"], entry["moved"]) == (2, 2, "drain", 1)
    assert ("reshape", (0,), 1) in group.calls and ("release", (1,)) in group.calls
    (noticed,) = [e for e in store.events("j1") if e["type"] == "node_draining"]
    assert noticed["action"] == "move"
    (off,) = [e for e in store.events("j1") if e["type"] == "drained_off"]
    assert off["how"] == "move" and "train on n2" in off["message"]
    assert "drain_checkpoint" not in kinds(store, "j1") and job.relocate is None
    assert audit_actions(store) == ["job.drain_move"]


def test_a_drained_job_with_no_room_elsewhere_checkpoints_and_queues_again(store, tmp_path):
    placed(store, tmp_path, ["n0", "n1"])
    yielded = {"preempted": True, "steps": 41}
    with scheduling(store, (node("n0"), node("n1"))):  # no free node
        group = FakeGroup(tmp_path / "ckpt" / "j1", [
            Step(), Step(), Step([Outcome(0, value=yielded), Outcome(1, value=yielded)])])
        ctl = controller(store, group, relocate_wait_s=30)
        drained(ctl, "n1")
        assert ctl.run() == "QUEUED"
    job = store.get("j1")
    assert job.preemptions == 1 and job.restarts == 0 and job.relocate is None
    (failed,) = [e for e in store.events("j1") if e["type"] == "relocation_failed"]
    assert "could not move live" in failed["message"] and "do not fit" in failed["message"]
    assert [e["how"] for e in store.events("j1") if e["type"] == "drained_off"] == ["requeue"]
    assert not [c for c in group.calls if c[0] == "reshape"]


def audit_actions(store) -> list[str]:
    return [json.loads(line)["action"] for line in store.audit_lines()]


def test_a_placement_group_ray_refuses_is_a_rank_failure_and_the_ones_made_are_removed(monkeypatch, tmp_path):
    # Found by the full goodput run (2026-12-06): a relocation after a
    # drain's move asked for a group named as one still alive, and Ray's error failed
    # the job. Names are now unique; any refusal is a RankFailed (the loss requeues).
    from kuangchao.platform.errors import RankFailed
    from kuangchao.platform.execution import bundles

    made, removed = [], []

    def fake_pg(job_id, slots, resources):
        if slots[0].rank == 3:
            # Ray's own error kind (no cluster: this module may not import ray itself)
            raise bundles.ray.exceptions.RaySystemError("Failed to create placement group: name exists")
        made.append(slots[0].rank)
        return f"pg-{slots[0].rank}"

    monkeypatch.setattr(bundles, "replica_pg", fake_pg)
    monkeypatch.setattr(bundles, "remove_placement_group", removed.append)
    spec = validate_spec(spec_doc(tmp_path))
    slot = [PlacedRank(2, "n2", "id-n2", "leaf-0", gpu=0, gpus=(0,))]
    keep = ([PlacedRank(5, "n1", "id-n1", "leaf-0", gpu=0, gpus=(0,))], "pg-kept")
    bad = [PlacedRank(3, "n3", "id-n3", "leaf-0", gpu=0, gpus=(0,))]
    joiners = [(slot, None), keep, (bad, None)]
    with pytest.raises(RankFailed, match="placement group could not be made: .*Failed to create"):
        bundles.joiner_pgs("j1", spec, joiners, pinned=set())
    assert made == [2] and removed == ["pg-2"]  # the kept group is not the new ones'
    joiners = [(slot, None), keep]
    assert bundles.joiner_pgs("j1", spec, joiners, pinned=set()) == ["pg-2"]
    assert joiners[0] == (slot, "pg-2") and joiners[1] == keep


def test_placement_group_names_stay_unique_for_the_same_first_rank(monkeypatch):
    from kuangchao.platform.execution import bundles

    names = []
    monkeypatch.setattr(bundles, "placement_group",
                        lambda b, strategy, name, bundle_label_selector: names.append(name))
    slots = [PlacedRank(2, "n2", "id-n2", "leaf-0", gpu=0, gpus=(0,))]
    bundles.replica_pg("j1", slots, [{"CPU": 1}])
    bundles.replica_pg("j1", slots, [{"CPU": 1}])
    assert names[0].startswith("kc-j1-r2-") and names[1].startswith("kc-j1-r2-") and names[0] != names[1]


# -- standby spares --------------------------------------------------------------------------

def test_the_scheduler_places_a_relocated_replica_on_a_preferred_node_where_it_fits(store):
    cluster = (node("n0"), node("n1"), node("n2"), node("n3"), node("n4"))
    scheduler = Scheduler(store, lambda: cluster, lambda _: None)

    def lose_preferring(job_id: str, replica: int, avoid: str, prefer: list[str]) -> None:
        lose(store, job_id, [replica], [avoid])
        store.update(job_id, lambda j: (dataclasses.replace(
            j, relocate={**j.relocate, "prefer": prefer}), None))

    job_id = running(store, "a", ["n0", "n1"])
    # n3 holds the job's standby spare: placed there, not on n2 (the solver's first).
    lose_preferring(job_id, 1, "n1", ["n3"])
    scheduler.step()
    assert [p["node"] for p in store.get(job_id).relocate["placed"]] == ["n3"]
    # A preferred node with no room (the first job's slot holds its GPU now) leaves the
    # choice to the solver, which finds the free node.
    other = running(store, "b", ["n2"])
    lose_preferring(other, 0, "n2", ["n3"])
    scheduler.step()
    assert [p["node"] for p in store.get(other).relocate["placed"]] == ["n4"]


def test_ask_names_the_preferred_nodes_but_never_an_avoided_one(store):
    job_id = running(store, "a", ["n0", "n1"])
    store.update(job_id, lambda j: recover(j, "node lost", {"kind": "node_lost"}))
    seen: list[dict] = []

    def peek(_s: float) -> None:
        seen.append(dict(store.get(job_id).relocate or {}))

    ticks = iter(range(100))
    relocation.ask(store, job_id, [1], ["n1"], wait_s=2, clock=lambda: next(ticks), sleep=peek,
                   prefer=["n1", "n3"])
    assert seen and seen[0]["prefer"] == ["n3"]


def test_a_lost_node_relocation_prefers_the_standby_spares_node(store, tmp_path):
    """The controller's request carries the group's standby nodes; the scheduler places there."""
    placed(store, tmp_path, ["n0", "n1"])
    with scheduling(store, (node("n0"), node("n1"), node("n2"), node("n3"))):
        group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="raylet gone")])],
                          lost_nodes={"id-n1"})
        group.spares.standby = ["n3"]
        assert controller(store, group, relocate_wait_s=30).run() == "SUCCEEDED"
    assert [p.node for p in store.get("j1").placement] == ["n0", "n3"]
