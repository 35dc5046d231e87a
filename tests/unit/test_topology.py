"""Cluster YAML, node labels and the registry's view of Ray's node table."""

from pathlib import Path

import pytest

from kuangchao.platform.cluster.registry import head_node_id, nodes_from_ray
from kuangchao.platform.cluster.topology import decode_islands, encode_islands, load_topology
from kuangchao.platform.errors import TopologyError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_example_cluster_loads_with_islands_and_leaves():
    topo = load_topology(EXAMPLES / "cluster-4x8.yaml")
    assert topo.total_gpus == 32
    assert {n.leaf for n in topo.nodes} == {"leaf-0", "leaf-1"}
    assert topo.nodes[0].islands == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("islands,gpus,label", [
    (((0, 1), (2, 3)), 4, "0.1_2.3"),
    (((0, 1, 2, 3),), 4, "full"),
])
def test_islands_round_trip_through_node_labels(islands, gpus, label):
    assert encode_islands(islands, gpus) == label
    assert decode_islands(label, gpus) == islands


def test_missing_nvlink_label_means_one_island_per_gpu():
    assert decode_islands(None, 3) == ((0,), (1,), (2,))


@pytest.mark.parametrize("text,match", [
    ("nodes: []", "non-empty 'nodes'"),
    ("nodes: [{name: a, gpus: 2, nvlink: [[0]], leaf: l}]", "cover GPU ids"),
    ("nodes: [{name: a, gpus: 2}]", "leaf"),
    ("nodes: [{name: a, gpus: 2, leaf: l, color: red}]", "unknown field"),
    ("nodes: [{name: a, gpus: 1, leaf: l}, {name: a, gpus: 1, leaf: l}]", "unique"),
])
def test_bad_cluster_yaml_names_the_problem(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=match):
        load_topology(path)


def test_malformed_nvlink_label_is_reported():
    with pytest.raises(TopologyError, match="malformed"):
        decode_islands("0-1", 2)


def test_registry_reads_labels_and_leaves_out_the_head():
    ray_nodes = [
        {"NodeID": "h" * 56, "Alive": True, "Resources": {"CPU": 2}, "Labels": {"kc.io/role": "head"}},
        {"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 4, "GPU": 4},
         "Labels": {"kc.io/node": "node-0", "kc.io/leaf": "leaf-0", "kc.io/nvlink": "0.1_2.3"}},
        {"NodeID": "b" * 56, "Alive": False, "Resources": {"GPU": 4},
         "Labels": {"kc.io/node": "node-1", "kc.io/leaf": "leaf-1"}},
    ]
    nodes = nodes_from_ray(ray_nodes)
    assert [(n.name, n.leaf, n.alive) for n in nodes] == [("node-0", "leaf-0", True),
                                                          ("node-1", "leaf-1", False)]
    assert nodes[0].islands == ((0, 1), (2, 3)) and nodes[1].islands == ((0,), (1,), (2,), (3,))
    assert head_node_id(ray_nodes) == "h" * 56


def test_granted_gpu_ids_reads_plain_and_placement_group_resource_names():
    from kuangchao.workers.runtime.worker import granted_gpu_ids

    assigned = {"CPU": 1.0, "GPU": 2.0, "kc_gpu_3": 1.0, "kc_gpu_2_group_0_abcdef": 1.0,
                "kc_gpu_2_group_abcdef": 1.0, "other_7": 1.0}
    assert granted_gpu_ids(assigned) == [2, 3]


def test_registry_marks_nodes_with_per_gpu_resources_as_pinned():
    base = {"NodeID": "a" * 56, "Alive": True, "Labels": {"kc.io/node": "n"}}
    pinned = nodes_from_ray([{**base, "Resources": {"GPU": 2, "kc_gpu_0": 1, "kc_gpu_1": 1}}])
    plain = nodes_from_ray([{**base, "Resources": {"GPU": 2}}])
    assert pinned[0].pinned_gpus and not plain[0].pinned_gpus
