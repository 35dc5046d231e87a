"""Drain notices: Ray's table read, the node view marked, the scheduler placing nothing on
a draining node, the drain policy's decision, and the controller moving a job off with
no step lost and no failure counted. In-memory fakes only: no Ray, no Redis."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from kuangchao.platform.cluster.drain import DrainNotice, mark_draining, notices_from
from kuangchao.platform.cluster.registry import draining_nodes
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.control import operations
from kuangchao.platform.execution.drain import DRAIN_TAG, DrainResponder
from kuangchao.platform.execution.drain_policy import DrainAction, DrainView, decide
from kuangchao.platform.execution.members import Outcome
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobState, PlacedRank, start
from kuangchao.platform.scheduling.scheduler import Scheduler
from kuangchao.platform.spec.elastic import ElasticRange
from kuangchao.platform.spec.jobspec import validate_spec
from tests.unit.controller_fakes import FakeGroup, Step, placed_job
from tests.unit.test_controller import ELASTIC, RESTORES, controller, spec_doc

ID0, ID1 = "0a" * 28, "1b" * 28  # Ray node ids: 28 bytes in hex


@pytest.fixture(autouse=True)
def _kc_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_HOME", str(tmp_path / "home"))  # the audit file goes there


@pytest.fixture
def store():
    return MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")


def node(name: str, node_id: str, gpus: int = 4) -> NodeInfo:
    return NodeInfo(name=name, gpus=gpus, islands=(tuple(range(gpus)),), leaf="leaf-0",
                    node_id=node_id)


def slots(*nodes: str) -> tuple[PlacedRank, ...]:
    return tuple(PlacedRank(r, n, f"id-{n}", "leaf0") for r, n in enumerate(nodes))


def audit(store) -> list[dict]:
    return [json.loads(line) for line in store.audit_lines()]


def kinds(store, job_id: str = "j1") -> list[str]:
    return [e["type"] for e in store.events(job_id)]


# -- Ray's table ---------------------------------------------------------------------------

def test_notices_from_reads_deadlines_in_seconds_and_none_for_zero():
    got = notices_from({ID0: 1_700_000_020_500, ID1.upper(): 0})
    assert got == {ID0: DrainNotice(ID0, 1_700_000_020.5), ID1: DrainNotice(ID1, None)}


@pytest.mark.parametrize("raw", [None, [], "x", 3, {1: 5}, {"not-hex!": 5}, {"": 5}])
def test_notices_from_skips_what_is_not_a_node_id_and_a_deadline_without_raising(raw):
    assert notices_from(raw) == {}


@pytest.mark.parametrize("deadline", [-5, math.inf, math.nan, True, "soon", None, [1]])
def test_notices_from_reads_an_odd_deadline_as_none(deadline):
    assert notices_from({ID0: deadline}) == {ID0: DrainNotice(ID0, None)}


def test_a_notice_says_how_long_is_left_or_how_long_ago_it_passed():
    assert DrainNotice(ID0, 120.0).describe(100.0) == "deadline in 20 s"
    assert DrainNotice(ID0, 97.0).describe(100.0) == "deadline passed 3 s ago"
    assert DrainNotice(ID0, 97.0).remaining_s(100.0) == 0.0
    assert DrainNotice(ID0).describe(100.0) == "no deadline"
    assert DrainNotice(ID0).remaining_s(100.0) is None


def test_a_process_not_connected_to_ray_knows_no_drain():
    assert draining_nodes() == {}


def test_the_node_view_marks_draining_nodes_and_ignores_unknown_ids():
    view = mark_draining((node("a", ID0), node("b", ID1)),
                         notices_from({ID0: 5_000, "ff" * 28: 9_000}))
    a, b = view
    assert a.draining and a.drain_deadline == 5.0 and not b.draining
    assert a.to_json()["draining"] is True and a.to_json()["drain_deadline"] == 5.0
    assert NodeInfo.from_json(a.to_json()) == a and NodeInfo.from_json(b.to_json()) == b


def test_kc_nodes_shows_a_draining_node_and_its_deadline(capsys):
    from kuangchao.api.cli.render import print_nodes

    view = mark_draining((node("a", ID0), node("b", ID1)), notices_from({ID0: 0}))
    print_nodes({"nodes": [{**n.to_json(), "free_gpus": 4, "jobs": []} for n in view]})
    out = capsys.readouterr().out
    assert [line.split()[3] for line in out.splitlines()[1:3]] == ["draining", "ready"]
    assert "a is draining (no deadline): nothing new is placed there" in out


# -- the scheduler -------------------------------------------------------------------------

def submit(store, name: str, gpus: int) -> str:
    doc = {"task": {"name": name}, "parallel": {"data_parallel_size": gpus, "micro_batch_size": 1}}
    return operations.submit(store, validate_spec(doc)).id


def test_the_scheduler_places_nothing_on_a_draining_node_and_again_once_undrained():
    store = MemoryStore()
    cluster = [mark_draining((node("a", ID0), node("b", ID1)), notices_from({ID0: 0}))]
    scheduler = Scheduler(store, lambda: cluster[0], lambda _: None)
    first, second = submit(store, "first", 4), submit(store, "second", 4)
    scheduler.step()
    assert {p.node for p in store.get(first).placement} == {"b"}
    assert store.get(second).state is JobState.QUEUED  # a would fit it, but a is draining
    cluster[0] = (node("a", ID0), node("b", ID1))  # the drain ended
    scheduler.step()
    assert {p.node for p in store.get(second).placement} == {"a"}


# -- the policy ----------------------------------------------------------------------------

RANGE = ElasticRange(min_replicas=1, max_replicas=4, micro_batch_size=2, global_batch=8)
NOTICE = {"id-n1": DrainNotice("id-n1", 150.0)}


def test_policy_leaves_a_job_alone_when_no_rank_runs_on_a_draining_node():
    d = decide(DrainView(slots("n0", "n2"), NOTICE))
    assert d.action is DrainAction.NONE


def test_policy_requeues_a_fixed_size_job_with_a_rank_on_a_draining_node():
    d = decide(DrainView(slots("n0", "n1"), {**NOTICE, "id-n0": DrainNotice("id-n0", 140.0)}))
    assert d.action is DrainAction.REQUEUE and d.nodes == ("n0", "n1")
    assert d.ranks == {0, 1} and d.deadline == 140.0 and d.membership is None


def test_policy_shrinks_a_live_elastic_job_without_the_replicas_there():
    d = decide(DrainView(slots("n0", "n1", "n2", "n1"), NOTICE, live=True, elastic=RANGE))
    assert d.action is DrainAction.SHRINK and d.ranks == {1, 3}
    assert d.membership.ranks == {0: 0, 2: 1} and d.membership.world_size == 2
    assert not d.membership.joining


def test_policy_requeues_an_elastic_job_that_would_fall_below_its_minimum():
    rng = dataclasses.replace(RANGE, min_replicas=2)
    d = decide(DrainView(slots("n0", "n1"), NOTICE, live=True, elastic=rng))
    assert d.action is DrainAction.REQUEUE and "elastic.min_replicas" in d.reason


def test_policy_requeues_an_elastic_job_that_cannot_resize_in_place():
    d = decide(DrainView(slots("n0", "n1"), NOTICE, live=False, elastic=RANGE))
    assert d.action is DrainAction.REQUEUE


FIXED = ElasticRange(min_replicas=4, max_replicas=4, micro_batch_size=2, global_batch=8)


def test_policy_moves_the_replicas_of_a_job_whose_survivors_keep_their_work():
    d = decide(DrainView(slots("n0", "n1", "n2", "n1"), NOTICE, elastic=FIXED, keeps=True))
    assert d.action is DrainAction.MOVE and d.ranks == {1, 3} and d.replicas == (1, 3)
    # The same size: the others keep their order, two new ranks join.
    assert d.membership.ranks == {0: 0, 2: 1} and d.membership.joining == (2, 3)
    assert d.membership.world_size == 4 and d.deadline == 150.0


def test_policy_requeues_a_job_every_replica_of_which_runs_on_the_draining_node():
    d = decide(DrainView(slots("n1", "n1"), NOTICE, elastic=FIXED, keeps=True))
    assert d.action is DrainAction.REQUEUE and "every replica" in d.reason


# -- the controller ------------------------------------------------------------------------

def draining(ctl, *names: str, deadline: float | None = None) -> None:
    """Ray drains these nodes from now on (the fake group's node ids are `id-<name>`)."""
    ctl.drain.source = lambda: {f"id-{n}": DrainNotice(f"id-{n}", deadline) for n in names}
    ctl.drain.poll_s = 0.0


def test_a_drained_fixed_size_job_checkpoints_at_the_next_step_and_queues_again(store, tmp_path):
    # A train function that resizes by restarting: its replicas cannot move live.
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES), ["n0", "n1"])
    store.set_progress("j1", {"step": 40})
    ckpt = {"path": str(tmp_path / "ckpt" / "j1" / "step_00000041"), "step": 41}
    yielded = {"preempted": True, "steps": 41, "checkpoint": ckpt}
    group = FakeGroup(tmp_path / "ckpt" / "j1", [
        Step(), Step(action=lambda: asked.append(store.preempt_reason("j1"))),
        Step([Outcome(0, value=yielded), Outcome(1, value=yielded)])])
    asked: list = []
    ctl = controller(store, group)
    draining(ctl, "n1", deadline=time.time() + 20)
    assert ctl.run() == "QUEUED"
    job = store.get("j1")
    assert asked == [DRAIN_TAG + "n1"] and not store.preempt_requested("j1")
    assert job.restarts == 0 and job.preemptions == 1 and not store.quarantine()
    assert "drained off n1 at step 41" in job.message
    assert kinds(store)[-4:] == ["node_draining", "drain_checkpoint", "drained_off", "state"]
    noticed, saved, off = (next(e for e in store.events("j1") if e["type"] == t)
                           for t in ("node_draining", "drain_checkpoint", "drained_off"))
    assert noticed["step"] == 40 and saved["step"] == 41 >= noticed["step"]
    assert noticed["ranks"] == [1] and noticed["action"] == "requeue" and noticed["nodes"] == ["n1"]
    assert "deadline in" in noticed["message"] and saved["path"] == ckpt["path"]
    assert off["how"] == "requeue"
    (rec,) = audit(store)
    assert rec["action"] == "job.drain_requeue" and rec["resource"] == "node/n1"
    assert rec["principal"] == "ray-gcs" and rec["job"] == "j1" and rec["decision"] == "allow"


def test_a_drained_live_elastic_job_shrinks_off_the_node_without_a_restart(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step()])
    ctl = controller(store, group)
    draining(ctl, "n1")
    assert ctl.run() == "SUCCEEDED"
    job = store.get("j1")
    assert job.world_size == 1 and [p.node for p in job.placement] == ["n0"]
    assert job.restarts == 0 and job.preemptions == 0 and not store.preempt_requested("j1")
    assert job.resize_log[-1]["cause"] == "drain" and job.resize_log[-1]["path"] == "live"
    assert ("release", (1,)) in group.calls and not store.quarantine()
    assert [e["how"] for e in store.events("j1") if e["type"] == "drained_off"] == ["shrink"]
    assert "no deadline" in next(e for e in store.events("j1")
                                 if e["type"] == "node_draining")["message"]


def test_a_drain_elsewhere_or_a_deadline_in_the_past_never_fails_the_job(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(), Step()])
    ctl = controller(store, group)
    draining(ctl, "n7")
    assert ctl.run() == "SUCCEEDED" and kinds(store).count("node_draining") == 0

    placed_job(store, "j2", spec_doc(tmp_path), ["n0", "n1"])
    yielded = {"preempted": True, "steps": 5}
    group = FakeGroup(tmp_path / "ckpt" / "j2", [
        Step(), Step([Outcome(0, value=yielded), Outcome(1, value=yielded)])])
    ctl = controller(store, group, job_id="j2")
    draining(ctl, "n0", deadline=time.time() - 3)
    assert ctl.run() == "QUEUED"
    assert "deadline passed" in store.events("j2")[-4]["message"]


def test_a_gcs_that_cannot_answer_costs_nothing(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step()])
    ctl = controller(store, group)

    def broken():
        raise RuntimeError("GCS unavailable")
    ctl.drain.source, ctl.drain.poll_s = broken, 0.0
    assert ctl.run() == "SUCCEEDED"


def responder(store, group, notices=None) -> DrainResponder:
    return DrainResponder(store, "j1", group, resizer=type("R", (), {"live": False})(),
                          source=lambda: notices or {}, poll_s=0.0)


def test_a_new_run_withdraws_a_drain_request_an_earlier_run_left_not_a_schedulers(store,
                                                                                 tmp_path):
    job = placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    group.start(job.placement, validate_spec(job.spec))
    store.request_preempt("j1", DRAIN_TAG + "n1")
    responder(store, group).check(validate_spec(job.spec))
    assert not store.preempt_requested("j1")
    (off,) = [e for e in store.events("j1") if e["type"] == "drained_off"]
    assert off["how"] == "failure" and off["nodes"] == ["n1"]
    store.request_preempt("j1", "j9")  # the scheduler's preemption for job j9 stays
    responder(store, group).check(validate_spec(job.spec))
    assert store.preempt_reason("j1") == "j9" and kinds(store).count("drained_off") == 1


def test_a_node_gone_before_the_job_yielded_is_the_failure_paths_alone(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(), Step([Outcome(1, died="raylet gone")])],
                      lost_nodes={"id-n1"})
    ctl = controller(store, group)
    draining(ctl, "n1", deadline=time.time() + 1)
    assert ctl.run() == "QUEUED"
    job = store.get("j1")
    assert job.restarts == 1 and job.restart_log[0]["kind"] == "node_lost"
    assert job.preemptions == 0 and "drain_checkpoint" not in kinds(store)
    assert store.preempt_reason("j1") == DRAIN_TAG + "n1"  # left by the run that asked
    # Placed again on n0 and n2, the next run takes the drain's request back before
    # its ranks can yield to it, and trains to the end.
    moved = tuple(PlacedRank(r, n, f"id-{n}", "leaf0") for r, n in enumerate(["n0", "n2"]))
    store.update("j1", lambda j: (dataclasses.replace(j, state=JobState.PLACING,
                                                      placement=moved), None))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step()])
    ctl = controller(store, group)
    draining(ctl, "n1")
    assert ctl.run() == "SUCCEEDED"
    assert not store.preempt_requested("j1") and store.get("j1").preemptions == 0
    assert kinds(store).count("node_draining") == 1
    assert [e["how"] for e in store.events("j1") if e["type"] == "drained_off"] == ["failure"]


def test_the_failure_path_moving_the_job_first_stands_the_drain_down(store, tmp_path):
    job = placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES), ["n0", "n1"])
    spec = validate_spec(job.spec)
    store.update("j1", lambda j: start(j, "running"))
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    group.start(job.placement, spec)
    r = responder(store, group, {"id-n1": DrainNotice("id-n1", time.time() + 20)})
    r.check(spec)
    assert store.preempt_reason("j1") == DRAIN_TAG + "n1" and r.pending is not None
    # n1 went before the ranks yielded: recovery re-formed the job on n0 and n2.
    moved = tuple(dataclasses.replace(p, node=n, node_id=f"id-{n}")
                  for p, n in zip(job.placement, ["n0", "n2"], strict=True))
    store.update("j1", lambda j: (dataclasses.replace(j, placement=moved), None))
    r.check(spec)
    assert not store.preempt_requested("j1") and r.pending is None
    assert store.events("j1")[-1]["type"] == "drained_off"
    assert store.events("j1")[-1]["how"] == "failure"
    assert r.yielded({"preempted": True, "steps": 9}) is None  # not the drain's any more
