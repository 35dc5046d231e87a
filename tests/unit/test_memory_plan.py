"""The controller's peer-memory wiring (platform/execution/memory_plan.py), driven
through the controller with a fake worker group, in-memory keepers and the in-memory
store: which keepers start, what every rank's `run` carries, the gauge, the end."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from kuangchao.platform.execution.controller import JobController
from kuangchao.platform.execution.members import Outcome
from kuangchao.platform.execution.memory_plan import STATS_EVERY_S, JobKeepers, KeeperOps
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobState
from kuangchao.platform.observability import metrics
from kuangchao.platform.protocol.memory_copies import KeeperPlan, keeper_name
from tests.unit.controller_fakes import FakeCredentials, FakeGroup, Step, ask_resize, placed_job
from tests.unit.test_controller import ELASTIC, RESTORES, SETTINGS, spec_doc

IN_MEMORY = {"interval_steps": 1, "max_mb_per_rank": 64}


class FakeKeepers:
    """Keepers as Ray would hold them: by name, per job; `down` nodes never start."""

    def __init__(self, down: set[str] = frozenset(), live: dict[str, str] | None = None) -> None:
        self.down, self.live_names = set(down), dict(live or {})  # name -> job
        self.starts: list[dict[str, str]] = []
        self.waited: list[bool] = []
        self.keys: list[Any] = []
        self.killed: list[str] = []
        self.bytes: dict[str, int] = {}
        self.unreachable = False

    def ops(self) -> KeeperOps:
        return KeeperOps(self.start, self.live, self.kill, self.stats)

    def start(self, job_id: str, nodes: dict[str, str], key: Any, max_bytes: int,
              wait: bool = True) -> dict[str, str]:
        self.starts.append(dict(nodes))
        self.waited.append(wait)
        self.keys.append((key, max_bytes))
        up = {n: keeper_name(job_id, n) for n in nodes if n not in self.down}
        self.live_names.update(dict.fromkeys(up.values(), job_id))
        return up if wait else {}

    def live(self, job_id: str) -> list[str]:
        return sorted(n for n, j in self.live_names.items() if j == job_id)

    def kill(self, job_id: str) -> int:
        gone = self.live(job_id)
        for name in gone:
            del self.live_names[name]
        self.killed.append(job_id)
        return len(gone)

    def stats(self, names: dict[str, str]) -> dict[str, dict[str, Any]]:
        if self.unreachable:
            raise TimeoutError("no keeper answered")
        return {n: {"bytes": self.bytes[n]} for n in names if n in self.bytes}


@pytest.fixture
def store():
    return MemoryStore(prefix=f"kc-test-{time.monotonic_ns()}:")


def wired(store, group, keepers: FakeKeepers, job_id="j1") -> JobController:
    c = JobController(job_id, SETTINGS, store=store, poll_s=0.0, group=group,
                      watch_factory=group.watch_factory, credentials=FakeCredentials())
    c.keepers = JobKeepers(store, job_id, group, c.credentials, ops=keepers.ops())
    return c


def plans(group) -> list[tuple[tuple[int, ...], KeeperPlan | None]]:
    return [(ranks, None if p is None else KeeperPlan.from_json(p)) for ranks, p in group.plans]


def test_every_run_of_an_in_place_replacement_carries_the_plan_and_the_end_kills_them(
        store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES,
                                     checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step([Outcome(1, died="killed by SIGKILL")])])
    keepers = FakeKeepers()
    assert wired(store, group, keepers).run() == "SUCCEEDED"
    assert keepers.starts == [{"n0": "id-n0", "n1": "id-n1"}]
    assert keepers.keys == [(FakeCredentials().public_key(), 64 * 1024 * 1024)]
    expected = KeeperPlan({"n0": keeper_name("j1", "n0"), "n1": keeper_name("j1", "n1")},
                          {0: "n0", 1: "n1"})
    assert plans(group) == [((0, 1), expected), ((0, 1), expected)]  # first run, replacement
    assert keepers.killed == ["j1"] and keepers.live("j1") == []
    started = [e for e in store.events("j1") if e["type"] == "peer_memory"]
    assert len(started) == 1 and started[0]["nodes"] == ["n0", "n1"]
    assert started[0]["bound_mb"] == 2 * 64 * 2 * 2  # 2 copies x 64 MB x (1 + 1 replica) x 2 ranks


def test_without_in_memory_no_keeper_is_started_and_no_rank_gets_a_plan(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    keepers = FakeKeepers()
    assert wired(store, group, keepers).run() == "SUCCEEDED"
    assert keepers.starts == [] and keepers.killed == []
    assert plans(group) == [((0, 1), None)]


def test_a_node_whose_keeper_does_not_start_is_left_out_with_an_event(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    assert wired(store, group, FakeKeepers(down={"n1"})).run() == "SUCCEEDED"
    [(_, plan)] = plans(group)
    assert plan is not None and set(plan.keepers) == {"n0"} and plan.node_of == {0: "n0", 1: "n1"}
    missing = [e for e in store.events("j1") if e["type"] == "peer_memory_keeper_missing"]
    assert missing and missing[0]["nodes"] == ["n1"]


def test_with_no_keeper_at_all_every_rank_runs_without_a_plan(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1")
    assert wired(store, group, FakeKeepers(down={"n0", "n1"})).run() == "SUCCEEDED"
    assert plans(group) == [((0, 1), None)]
    assert any(e["type"] == "peer_memory_off" for e in store.events("j1"))


def test_joiners_of_a_live_grow_get_the_new_membership_and_keepers_on_their_nodes(store,
                                                                                  tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC,
                                     checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    grow = Step(action=lambda: ask_resize(store, "j1", 4, "grow", ["n2", "n3"]))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [grow])
    keepers = FakeKeepers()
    assert wired(store, group, keepers).run() == "SUCCEEDED"
    # The joiners' nodes: asked ahead as the group reshapes (their keepers start beside the
    # new ranks), then waited for by the generation's plan, which finds them by name.
    assert keepers.starts == [{"n0": "id-n0", "n1": "id-n1"}, {"n2": "id-n2", "n3": "id-n3"},
                              {"n2": "id-n2", "n3": "id-n3"}]
    assert keepers.waited == [True, False, True]
    (_, first), (joiners, grown) = plans(group)
    assert first is not None and first.node_of == {0: "n0", 1: "n1"}
    assert joiners == (2, 3) and grown is not None
    assert grown.node_of == {0: "n0", 1: "n1", 2: "n2", 3: "n3"}
    assert set(grown.keepers) == {"n0", "n1", "n2", "n3"}


def test_a_standby_spares_node_gets_its_keeper_ahead_once_without_waiting(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC,
                                     checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    grow = Step(action=lambda: ask_resize(store, "j1", 4, "grow", ["n2", "n3"]))
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(), Step(), grow])
    group.spares.standby = ["n2"]
    keepers = FakeKeepers()
    assert wired(store, group, keepers).run() == "SUCCEEDED"
    # At the start, waiting; then n2 ahead, asked once over every poll since, not waited on;
    # the grow asks n3 ahead as its ranks start (n2 is standing already), and its plan then
    # finds both by name (Ray's get_if_exists) and waits for their answer.
    assert keepers.starts == [{"n0": "id-n0", "n1": "id-n1"}, {"n2": "id-n2"}, {"n3": "id-n3"},
                              {"n2": "id-n2", "n3": "id-n3"}]
    assert keepers.waited == [True, False, False, True]
    (_, grown) = plans(group)[-1]
    assert grown is not None and set(grown.keepers) == {"n0", "n1", "n2", "n3"}


def test_without_in_memory_no_keeper_stands_by(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=ELASTIC), ["n0", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(), Step()])
    group.spares.standby = ["n2"]
    keepers = FakeKeepers()
    assert wired(store, group, keepers).run() == "SUCCEEDED"
    assert keepers.starts == []


def test_a_requeued_job_finds_its_earlier_keepers_and_keeps_them_while_queued(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES,
                                     checkpoint={"in_memory": IN_MEMORY}), ["n0", "n2"])
    # The earlier run's keepers: n1's node is no longer placed, its copies still wanted.
    keepers = FakeKeepers(live={keeper_name("j1", "n0"): "j1", keeper_name("j1", "n1"): "j1"})
    preempted = {"preempted": True, "steps": 3}
    group = FakeGroup(tmp_path / "ckpt" / "j1", [
        Step(action=lambda: store.request_preempt("j1", "j2")),
        Step([Outcome(0, value=preempted), Outcome(1, value=preempted)])])
    assert wired(store, group, keepers).run() == "QUEUED"
    assert keepers.starts == [{"n2": "id-n2"}]  # n0's keeper is found, not started again
    [(_, plan)] = plans(group)
    assert plan is not None and set(plan.keepers) == {"n0", "n1", "n2"}
    assert plan.node_of == {0: "n0", 1: "n2"}
    assert keepers.killed == [] and len(keepers.live("j1")) == 3  # queued: kept


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gauge(store, node: str, job_id="j1") -> float:
    field = metrics.series_field(metrics.MEMORY_CHECKPOINT_BYTES, {"job": job_id, "node": node})
    return store.metric_fields(job_id).get(field, 0.0)


def test_the_gauge_reads_the_keepers_at_most_every_ten_seconds_and_never_fails(store, tmp_path):
    placed_job(store, "j1", spec_doc(tmp_path, checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    group, keepers, clock = FakeGroup(tmp_path), FakeKeepers(), Clock()
    group.start(store.get("j1").placement, _spec(store))
    jk = JobKeepers(store, "j1", group, FakeCredentials(), ops=keepers.ops(), clock=clock)
    jk.begin(_spec(store), store.get("j1").placement)
    keepers.bytes = {"n0": 1000, "n1": 3000}
    jk.tick()
    assert (gauge(store, "n0"), gauge(store, "n1")) == (1000.0, 3000.0)
    keepers.bytes = {"n0": 500, "n1": 4000}
    clock.now += STATS_EVERY_S / 2
    jk.tick()  # too soon: not read
    assert gauge(store, "n0") == 1000.0
    clock.now += STATS_EVERY_S
    jk.tick()
    assert (gauge(store, "n0"), gauge(store, "n1")) == (500.0, 4000.0)
    keepers.bytes = {"n0": 700}  # n1's keeper does not answer: it counts 0
    clock.now += STATS_EVERY_S
    jk.tick()
    assert (gauge(store, "n0"), gauge(store, "n1")) == (700.0, 0.0)
    keepers.unreachable = True
    clock.now += STATS_EVERY_S
    jk.tick()  # logged, not raised; the gauge keeps what it had
    assert gauge(store, "n0") == 700.0
    # A later controller (a requeue) sets the same series from what the hash holds.
    keepers.unreachable, keepers.bytes = False, {"n0": 200, "n1": 100}
    again = JobKeepers(store, "j1", group, FakeCredentials(), ops=keepers.ops(), clock=Clock())
    again.begin(_spec(store), store.get("j1").placement)
    again.tick()
    assert (gauge(store, "n0"), gauge(store, "n1")) == (200.0, 100.0)
    store.update("j1", lambda j: (dataclasses.replace(j, state=JobState.CANCELLED), None))
    again.end()
    assert (gauge(store, "n0"), gauge(store, "n1")) == (0.0, 0.0) and keepers.killed == ["j1"]


def _spec(store):
    from kuangchao.platform.spec.jobspec import validate_spec

    return validate_spec(store.get("j1").spec)


def test_a_recorded_gauge_is_served_as_a_gauge(store):
    from kuangchao.api.server.cluster_metrics import recorded_families

    rec = store.recorder("j1")
    rec.set(metrics.MEMORY_CHECKPOINT_BYTES, 5.0, 0.0, job="j1", node="n0")
    rec.set(metrics.MEMORY_CHECKPOINT_BYTES, 2.0, 5.0, job="j1", node="n0")
    samples = metrics.own_job_samples(metrics.parse_hash(store.metric_fields("j1")), "j1")
    [fam] = list(recorded_families(samples))
    assert fam.type == "gauge" and fam.name == "kc_job_memory_checkpoint_bytes"
    assert [(s.labels, s.value) for s in fam.samples] == [({"job": "j1", "node": "n0"}, 2.0)]


def test_the_schedulers_sweep_kills_the_keepers_of_ended_or_vanished_jobs_only():
    from kuangchao.platform.execution.keeper import sweep_keepers

    names = [keeper_name("done", "n0"), keeper_name("done", "n1"), keeper_name("running", "n0"),
             keeper_name("gone", "n2"), "kc-job-running-abc", "kc-scheduler"]
    state = {"done": True, "running": False}  # job -> ended; "gone" is not in the store
    killed: list[str] = []
    assert sweep_keepers(lambda j: state.get(j, True), names=names, kill=killed.append) == [
        "done", "gone"]
    assert killed == ["done", "gone"]


def _moved_off_n0(store, tmp_path):
    """A job on n0 and n1 with peer memory; n0 drained, its replica moved live to n2.
    Returns the keepers, the job's JobKeepers, the group, and the two placements."""
    from types import SimpleNamespace

    from kuangchao.platform.spec.jobspec import validate_spec

    job = placed_job(store, "j1", spec_doc(tmp_path, elastic=RESTORES,
                                           checkpoint={"in_memory": IN_MEMORY}), ["n0", "n1"])
    group = SimpleNamespace(infos=[{"node_id": "id-n0"}, {"node_id": "id-n1"}], keeper_plan=None)
    keepers = FakeKeepers()
    jk = JobKeepers(store, "j1", group, FakeCredentials(), ops=keepers.ops())
    jk.begin(validate_spec(job.spec), job.placement)
    assert keepers.starts == [{"n0": "id-n0", "n1": "id-n1"}]
    assert KeeperPlan.from_json(jk.plan()).node_of == {0: "n0", 1: "n1"}
    assert len(keepers.starts) == 1  # the same raylets: nothing started again
    on_n2 = dataclasses.replace(job.placement[0], node="n2", node_id="id-n2")
    store.update("j1", lambda j: (dataclasses.replace(j, placement=(on_n2, j.placement[1])), None))
    group.infos = [{"node_id": "id-n2"}, {"node_id": "id-n1"}]
    jk.plan()
    assert keepers.starts[-1] == {"n2": "id-n2"}
    return keepers, jk, group, on_n2, job.placement[1]


def _lost_n1_onto_new_n0(store, jk, group, on_n2, on_n1) -> KeeperPlan:
    """n1 lost; its replica placed on n0, back as a new raylet (`id-n0-new`)."""
    on_n0 = dataclasses.replace(on_n1, node="n0", node_id="id-n0-new")
    store.update("j1", lambda j: (dataclasses.replace(j, placement=(on_n2, on_n0)), None))
    group.infos = [{"node_id": "id-n2"}, {"node_id": "id-n0-new"}]
    return KeeperPlan.from_json(jk.plan())


def test_a_node_back_as_a_new_raylet_gets_a_new_keeper_for_the_ranks_placed_there(store, tmp_path):
    # Found by the full goodput run (2026-12-06): a drained node killed at its deadline
    # came back under its name, a lost replica was moved onto it, and the plan still
    # named the keeper that died with the old raylet: that rank's copies had one home.
    keepers, jk, group, on_n2, on_n1 = _moved_off_n0(store, tmp_path)
    plan = _lost_n1_onto_new_n0(store, jk, group, on_n2, on_n1)
    assert keepers.starts[-1] == {"n0": "id-n0-new"}
    assert plan.node_of == {0: "n2", 1: "n0"} and set(plan.keepers) == {"n0", "n1", "n2"}
    jk.plan()
    assert len(keepers.starts) == 3  # once per new raylet


def test_the_nodes_new_ranks_start_on_get_their_keepers_ahead_of_the_generation(store,
                                                                                 tmp_path):
    # Found by the goodput run of 2026-12-06 23:54: a lost replica moved to a node back
    # from a drain, with no standby there, and its keeper started only in the generation's
    # plan, once the new rank had imported everything: a second more for the survivors.
    keepers, jk, group, on_n2, on_n1 = _moved_off_n0(store, tmp_path)
    group.keepers_ahead({"n2": "id-n2", "n0": "id-n0-new"})  # as the group reshapes
    # n2 has its keeper; n0, back as a new raylet, gets one asked for, not waited on,
    # and the job's events say so (the integration tests read it there).
    assert keepers.starts[-1] == {"n0": "id-n0-new"} and keepers.waited[-1] is False
    ahead = [e for e in store.events("j1") if e["type"] == "peer_memory_ahead"]
    assert [e["nodes"] for e in ahead] == [["n0"]] and "n0" in ahead[0]["message"]
    plan = _lost_n1_onto_new_n0(store, jk, group, on_n2, on_n1)
    assert keepers.starts[-1] == {"n0": "id-n0-new"} and keepers.waited[-1] is True
    assert "n0" in plan.keepers
    group.keepers_ahead({"n0": "id-n0-new"})
    assert len(keepers.starts) == 4  # up since: not asked again
    assert len([e for e in store.events("j1") if e["type"] == "peer_memory_ahead"]) == 1


def test_a_keeper_that_cannot_be_asked_ahead_is_left_to_the_plan_without_an_event(store,
                                                                                  tmp_path):
    keepers, jk, group, on_n2, on_n1 = _moved_off_n0(store, tmp_path)

    def refused(*args, **kwargs):
        raise RuntimeError("Ray is away")

    jk.ops.start = refused
    group.keepers_ahead({"n0": "id-n0-new"})  # logged, never raised into the reshape
    assert not [e for e in store.events("j1") if e["type"] == "peer_memory_ahead"]
    jk.ops.start = keepers.start
    plan = _lost_n1_onto_new_n0(store, jk, group, on_n2, on_n1)
    assert keepers.starts[-1] == {"n0": "id-n0-new"} and keepers.waited[-1] is True
    assert "n0" in plan.keepers


def test_a_standby_node_back_as_a_new_raylet_gets_its_keeper_ahead_again(store, tmp_path):
    # Found by the chaos run of 2026-12-06 17:22: a drained node came back under its name
    # and held the standby spare, but the keeper that died with its old raylet still stood
    # in the plan, so none was started ahead; the lost replica placed there 10 s later
    # then waited for a keeper to start inside its generation.
    keepers, jk, group, on_n2, on_n1 = _moved_off_n0(store, tmp_path)
    jk.stand_by({"n0": "id-n0"})  # the old raylet, still standing: it has its keeper
    assert len(keepers.starts) == 2
    jk.stand_by({"n0": "id-n0-new"})  # back as a new raylet, chosen for the standby spare
    assert keepers.starts[-1] == {"n0": "id-n0-new"} and keepers.waited[-1] is False
    jk.stand_by({"n0": "id-n0-new"})
    assert len(keepers.starts) == 3  # asked once for the new raylet
    # The generation placing n1's replica there finds that keeper by name, waiting.
    plan = _lost_n1_onto_new_n0(store, jk, group, on_n2, on_n1)
    assert keepers.starts[-1] == {"n0": "id-n0-new"} and keepers.waited[-1] is True
    assert plan.node_of == {0: "n2", 1: "n0"} and "n0" in plan.keepers
