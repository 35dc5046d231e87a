"""Where a job keeps its standby spares (platform/execution/standby.py)."""

from __future__ import annotations

import dataclasses

from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.execution.standby import names_of, spare_entries, standby_nodes
from kuangchao.platform.spec.jobspec import SpecError, validate_spec


def node(name: str, leaf: str = "leaf-0", gpus: int = 1, **kw) -> NodeInfo:
    return NodeInfo(name=name, gpus=gpus, islands=(tuple(range(gpus)),), leaf=leaf,
                    node_id=f"id-{name}", pinned_gpus=True, gpu_type="h100-80gb", **kw)


def test_only_eligible_nodes_the_job_does_not_use_hold_a_standby():
    nodes = [node("a"), node("b"), node("dead", alive=False), node("drain", draining=True),
             node("q"), dataclasses.replace(node("unpinned"), pinned_gpus=False),
             dataclasses.replace(node("other"), gpu_type="a100-40gb"), node("small", gpus=1),
             dataclasses.replace(node("joining"), node_id="")]
    used = {"id-a"}
    got = standby_nodes(nodes, used, set(), count=8, gpus=1, gpu_type="h100-80gb", blocked={"q"})
    assert got == {"id-b", "id-small"}
    # A rank of 2 GPUs fits on neither one-GPU node.
    assert standby_nodes(nodes, used, set(), 8, gpus=2, gpu_type="h100-80gb") == set()
    # A CPU-only job needs no pinned GPUs; any type will do when the job's is unknown.
    cpu = standby_nodes(nodes, used, set(), 8, gpus=0, gpu_type=None, blocked={"q"})
    assert cpu == {"id-b", "id-small", "id-unpinned", "id-other"}
    assert standby_nodes(nodes, used, set(), 0, 1, None) == set()


def test_the_job_s_own_leaf_first_then_by_name_and_a_held_standby_stays():
    nodes = [node("a", "leaf-1"), node("b", "leaf-0"), node("c", "leaf-1"), node("d", "leaf-1")]
    assert standby_nodes(nodes, {"id-a"}, set(), 1, 1, None) == {"id-c"}
    # d holds a standby already: choosing again keeps it (no warm process restarted).
    assert standby_nodes(nodes, {"id-a"}, {"id-d"}, 1, 1, None) == {"id-d"}
    assert standby_nodes(nodes, {"id-a"}, {"id-b"}, 2, 1, None) == {"id-b", "id-c"}
    assert names_of(nodes, {"id-d", "id-b"}) == ["b", "d"]


def test_standby_spares_need_spare_workers():
    base = {"task": {"name": "t"}, "parallel": {"data_parallel_size": 2, "micro_batch_size": 1}}
    try:
        validate_spec({**base, "fault_tolerance": {"standby_spares": 1}})
    except SpecError as exc:
        assert "fault_tolerance.standby_spares" in str(exc) and "spare_workers" in str(exc)
    else:
        raise AssertionError("standby_spares without spare_workers was accepted")
    spec = validate_spec({**base, "fault_tolerance": {"standby_spares": 1, "spare_workers": True}})
    assert spec.fault_tolerance.standby_spares == 1


def test_spare_entries_name_each_spare_and_list_the_job_s_own_first():
    entries = spare_entries({"id-b": "warm", "id-c": "warming", "0123456789abcdef": "failed"},
                            standby={"id-c"}, names={"id-b": "b", "id-c": "c"})
    assert entries == ({"node": "0123456789ab", "state": "failed", "standby": False},
                       {"node": "b", "state": "warm", "standby": False},
                       {"node": "c", "state": "warming", "standby": True})
