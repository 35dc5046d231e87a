"""A rank's metrics registration is the job's own code talking: the file_sd groups
publish only an address on the node the placement puts that rank on, with a
non-privileged port, and label it from the placement (issue 22, gap 13)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kuangchao.platform.cluster.registry import node_ips as ray_node_ips
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.platform.observability import scrape_targets as st
from kuangchao.workers.runtime.telemetry import WorkerTelemetry

IPS = {"id-a": "10.0.0.1", "id-b": "10.0.0.2", "id-6": "fd00::6"}


def _job(job_id: str = "j1", world: int = 2, state: JobState = JobState.RUNNING) -> JobRecord:
    # rank 0 on node-a, rank 1 on node-b, rank 2 placed but beyond the world size.
    placement = (PlacedRank(rank=0, node="node-a", node_id="id-a", leaf="l0"),
                 PlacedRank(rank=1, node="node-b", node_id="id-b", leaf="l0"),
                 PlacedRank(rank=2, node="node-b", node_id="id-b", leaf="l0"))
    return JobRecord(id=job_id, name=job_id, spec={}, state=state, world_size=world,
                     placement=placement)


def _entry(addr, node: str = "node-a") -> str:
    return json.dumps({"addr": addr, "node": node, "pid": 7, "ts": 1.0})


def _groups(registered: dict[str, str], job: JobRecord | None = None) -> list[dict]:
    job = job or _job()
    return st.groups([job], {job.id: registered}, IPS)


def test_a_good_registration_passes_with_the_placements_labels():
    out = _groups({"0": _entry("10.0.0.1:41234"), "1": _entry("10.0.0.2:41235", "node-b")})
    assert out == [
        {"targets": ["10.0.0.1:41234"], "labels": {"job": "j1", "rank": "0", "node": "node-a"}},
        {"targets": ["10.0.0.2:41235"], "labels": {"job": "j1", "rank": "1", "node": "node-b"}}]


@pytest.mark.parametrize("addr", [
    "10.0.0.2:41234",          # another node of the cluster (rank 1's)
    "10.0.0.9:41234",          # a host that is no node at all
    "127.0.0.1:8000",          # Prometheus' own host (the API, say)
    "169.254.169.254:8080",    # a cloud metadata service
    "kc-api:8000",             # a name: Prometheus would resolve it
    "localhost:41234",
    "10.0.0.1:0", "10.0.0.1:22", "10.0.0.1:1023", "10.0.0.1:65536", "10.0.0.1:99999",
    "10.0.0.1:-1", "10.0.0.1:+41234", "10.0.0.1: 41234", "10.0.0.1:4123a", "10.0.0.1:",
    "10.0.0.1", ":41234", "", "10.0.0.1:41234/metrics", "http://10.0.0.1:41234",
    "10.0.0.1:41234\n", "10.0.0.1:41234,10.0.0.9:80", "[10.0.0.1]:41234x",
    None, 41234, ["10.0.0.1:41234"], {"host": "10.0.0.1"},
])
def test_a_forged_or_garbage_addr_is_dropped(addr):
    assert _groups({"0": _entry(addr)}) == []


@pytest.mark.parametrize("raw", ["not json", json.dumps(["10.0.0.1:41234"]), json.dumps(None),
                                 json.dumps({"node": "node-a"}), json.dumps("10.0.0.1:41234")])
def test_an_entry_that_is_no_registration_is_dropped(raw):
    assert _groups({"0": raw}) == []


def test_the_node_label_is_the_placements_not_the_entrys():
    forged = json.dumps({"addr": "10.0.0.1:41234", "node": "node-b", "job": "other",
                         "rank": "5", "labels": {"job": "other"}})
    assert _groups({"0": forged}) == [
        {"targets": ["10.0.0.1:41234"], "labels": {"job": "j1", "rank": "0", "node": "node-a"}}]


def test_an_entry_naming_another_ranks_node_is_checked_against_its_own_rank():
    # Rank 0 is on node-a; an entry claiming node-b with node-b's IP is still rank 0's.
    assert _groups({"0": _entry("10.0.0.2:41234", node="node-b")}) == []


@pytest.mark.parametrize("rank", ["2", "3", "99", "-1", "01", " 1", "1 ", "+1", "1.0", "x",
                                  "\u0661", "1e0", "999999999999"])
def test_an_out_of_range_or_odd_rank_is_dropped(rank):
    # Every rank on node-a, so only the rank itself decides. "2" is placed but beyond
    # the world size (after a shrink); "\u0661" is an Arabic 1, which int() reads.
    job = dataclasses.replace(_job(), placement=tuple(
        dataclasses.replace(p, node="node-a", node_id="id-a") for p in _job().placement))
    assert len(_groups({"1": _entry("10.0.0.1:41234")}, job)) == 1
    assert _groups({rank: _entry("10.0.0.1:41234")}, job) == []


def test_a_rank_the_placement_does_not_hold_is_dropped():
    job = _job(world=2)
    job = dataclasses.replace(job, placement=job.placement[:1])
    assert _groups({"0": _entry("10.0.0.1:41234"), "1": _entry("10.0.0.2:41235")}, job) == [
        {"targets": ["10.0.0.1:41234"], "labels": {"job": "j1", "rank": "0", "node": "node-a"}}]


def test_a_node_with_no_known_ip_publishes_nothing():
    job = _job()
    assert st.groups([job], {"j1": {"0": _entry("10.0.0.1:41234")}}, {}) == []
    assert st.groups([job], {"j1": {"0": _entry("10.0.0.1:41234")}}, {"id-a": "node-a"}) == []


def test_an_address_two_ranks_claim_is_listed_for_neither():
    placement = tuple(PlacedRank(rank=r, node="node-a", node_id="id-a", leaf="l0") for r in (0, 1))
    job = JobRecord(id="j1", name="j1", spec={}, state=JobState.RUNNING, world_size=2,
                    placement=placement)
    same = _entry("10.0.0.1:41234")
    assert _groups({"0": same, "1": same}, job) == []
    assert len(_groups({"0": same, "1": _entry("10.0.0.1:41235")}, job)) == 2


def test_jobs_that_hold_no_resources_publish_nothing():
    for state in (JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        assert _groups({"0": _entry("10.0.0.1:41234")}, _job(state=state)) == []


def test_an_entry_under_another_jobs_id_labels_nothing_of_it():
    # The store hands each job its own hash; one job's registrations never label another.
    out = st.groups([_job("j1")], {"j2": {"0": _entry("10.0.0.1:41234")}}, IPS)
    assert out == []


def test_the_target_is_rebuilt_from_the_nodes_ip():
    assert st.target("10.0.0.1:41234", "10.0.0.1") == "10.0.0.1:41234"
    assert st.target("[fd00::6]:41234", "fd00::6") == "[fd00::6]:41234"
    assert st.target("[fd00:0:0::6]:41234", "fd00::6") == "[fd00::6]:41234"
    assert st.target("[fd00::7]:41234", "fd00::6") is None
    assert st.target("10.0.0.1:1024", "10.0.0.1") == "10.0.0.1:1024"
    assert st.target("10.0.0.1:65535", "10.0.0.1") == "10.0.0.1:65535"
    assert st.target("010.0.0.1:41234", "10.0.0.1") is None
    assert st.target("10.0.0.1:41234", None) is None


def test_node_ips_read_the_registry_view_and_ignore_junk():
    assert st.node_ips(None) == {} and st.node_ips({"nodes": []}) == {}
    assert st.node_ips({"ips": ["10.0.0.1"]}) == {}
    assert st.node_ips({"ips": {"id-a": "10.0.0.1", "id-b": None, "id-c": 5, "id-d": ""}}) == {
        "id-a": "10.0.0.1"}


def test_the_registry_publishes_ips_of_live_ray_nodes_only():
    nodes = [{"NodeID": "id-a", "NodeManagerAddress": "10.0.0.1", "Alive": True},
             {"NodeID": "id-b", "NodeManagerAddress": "10.0.0.2", "Alive": False},
             {"NodeID": "id-c", "Alive": True}]
    assert ray_node_ips(nodes) == {"id-a": "10.0.0.1"}


def test_read_groups_checks_against_the_stored_node_view():
    store = MemoryStore()
    job = store.create(_job())
    store.set_info("nodes", {"nodes": [], "ips": {"id-a": "10.0.0.1", "id-b": "10.0.0.2"}})
    store.register_target(job.id, 0, {"addr": "10.0.0.1:41234", "node": "node-a", "pid": 1})
    store.register_target(job.id, 1, {"addr": "10.0.0.9:41235", "node": "node-b", "pid": 2})
    assert st.read_groups(store) == [
        {"targets": ["10.0.0.1:41234"], "labels": {"job": job.id, "rank": "0", "node": "node-a"}}]


def test_the_rank_serves_no_job_rank_or_node_label():
    tel = WorkerTelemetry("j1", 0, "node-a")
    tel.end_step(3, samples=1, tokens=8)
    for fam in tel.collect():
        for sample in fam.samples:
            assert not {"job", "rank", "node"} & set(sample.labels), (fam.name, sample.labels)
