"""Measured topology: spines derived from bandwidth where labels are silent."""

from kuangchao.platform.cluster.probe import apply_probe, measured_spines
from kuangchao.platform.cluster.topology import NodeInfo


def pair(a, b, la, lb, gbps):
    return {"a": a, "b": b, "leaf_a": la, "leaf_b": lb, "latency_us": 10.0, "bandwidth_gbps": gbps}


PROBE = {"pairs": [
    pair("n0", "n1", "l0", "l1", 100.0),  # l0 and l1 under one spine
    pair("n0", "n2", "l0", "l2", 25.0),   # l2 and l3 under another, far away
    pair("n1", "n3", "l1", "l3", 24.0),
    pair("n2", "n3", "l2", "l3", 95.0),
    pair("n0", "n4", "l0", "l0", 400.0),  # inside a leaf: not a spine question
]}


def test_leaves_with_near_best_bandwidth_share_a_measured_spine():
    assert measured_spines(PROBE) == {"l0": "probed-0", "l1": "probed-0", "l2": "probed-1",
                                      "l3": "probed-1"}


def test_labels_win_over_measurements_and_gaps_are_filled():
    nodes = (NodeInfo(name="n0", gpus=8, islands=((0,),), leaf="l0", spine="rack-a"),
             NodeInfo(name="n2", gpus=8, islands=((0,),), leaf="l2"))
    out = apply_probe(nodes, PROBE)
    assert out[0].spine == "rack-a" and out[1].spine == "probed-1"
    assert apply_probe(nodes, None) == nodes
