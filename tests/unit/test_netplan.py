"""The plan of a netns cluster: names, addresses, rates and the drills' commands."""

from __future__ import annotations

import pytest

from kuangchao.platform.cluster.netplan import (
    NetPlan,
    NetworkSpec,
    network_from_yaml,
    plan_network,
    shape,
)
from kuangchao.platform.cluster.topology import load_topology
from kuangchao.platform.errors import TopologyError
from kuangchao.platform.execution.reachability import NodeReach, redis_address

NODES = [("node-0", "leaf-0"), ("node-1", "leaf-0"), ("node-2", "leaf-1"), ("node-3", "leaf-1")]


def plan() -> NetPlan:
    return plan_network("ab12", 7, NetworkSpec(2.0, 0.5, leaf_labels=False), NODES)


def test_every_name_fits_linux_and_carries_the_runs_tag():
    p = plan()
    links = [p.spine_bridge, *(p.leaf_bridge(i) for i in range(2)),
             *(end for i in range(2) for end in p.uplink(i)), *(n.host_if for n in p.nodes)]
    assert len(set(links)) == len(links)
    assert all(len(name) <= 15 and name.startswith("kcab12") for name in links)
    assert [n.netns for n in p.nodes] == [f"kc-ab12-node-{i}" for i in range(4)]


def test_addresses_come_from_the_benchmarking_range_one_per_host():
    p = plan()
    assert p.host_addr == "198.18.7.1" and p.redis_addr == "198.18.7.2"
    assert [n.addr for n in p.nodes] == [f"198.18.7.{10 + i}" for i in range(4)]
    assert p.leaves == ("leaf-0", "leaf-1")


def test_build_shapes_node_links_at_the_leaf_rate_and_uplinks_at_the_spine_rate():
    cmds = [" ".join(c) for c in plan().build()]
    shaped = {c.split(" dev ")[1].split()[0] + (" in-ns" if " -n " in c else ""):
              c.split(" rate ")[1].split()[0] for c in cmds if " tbf " in c}
    assert shaped["kcab12u0"] == shaped["kcab12v1"] == "500mbit"
    assert shaped["kcab12n2"] == shaped["eth0 in-ns"] == "2000mbit"
    # node-2 hangs on leaf-1's bridge, and nothing gets a default route
    assert "ip link set kcab12n2 master kcab12l1 up" in cmds
    assert not any("default" in c for c in cmds)


def test_teardown_removes_every_namespace_link_and_bridge_build_made():
    p = plan()
    made = {c[3] for c in p.build() if c[:3] == ["ip", "link", "add"]}
    made |= {c[3] for c in p.build() if c[:3] == ["ip", "netns", "add"]}
    removed = {c[3] for c in p.teardown()}
    # veth pairs go with one end; namespaces take their inner end with them
    assert made - removed == set()


def test_drills_touch_only_the_named_node():
    p = plan()
    assert p.cut("node-1") == [["ip", "link", "set", "kcab12n1", "down"]]
    assert p.cut_redis("node-1") == [["ip", "-n", "kc-ab12-node-1", "route", "replace",
                                      "blackhole", "198.18.7.2/32"]]
    slow = [" ".join(c) for c in p.slow("node-3", 0.1)]
    assert all("100mbit" in c and "replace" in c for c in slow)
    healed = [" ".join(c) for c in p.heal("node-3")]
    assert "ip link set kcab12n3 up" in healed and any("2000mbit" in c for c in healed)
    with pytest.raises(TopologyError, match="no node 'node-9'.*node-0"):
        p.cut("node-9")


def test_plan_round_trips_through_the_cluster_state():
    p = plan()
    assert NetPlan.from_json(p.to_json()) == p


def test_token_bucket_holds_a_few_ms_at_its_rate():
    cmd = shape("x", 2.0)
    assert int(cmd[cmd.index("burst") + 1]) == 1_000_000
    assert int(shape("x", 0.01)[shape("x", 0.01).index("burst") + 1]) == 64 * 1024


@pytest.mark.parametrize("doc, match", [
    ({"isolation": "vm"}, "isolation must be one of"),
    ({"leaf_gbps": 2}, "add `isolation: netns`"),
    ({"isolation": "netns", "spine_gbps": 0}, "spine_gbps must be a rate"),
    ({"isolation": "netns", "leaf_gbps": "fast"}, "leaf_gbps must be a rate"),
    ({"isolation": "netns", "leaf_labels": "no"}, "leaf_labels must be true or false"),
])
def test_bad_network_fields_name_the_field(doc, match):
    with pytest.raises(TopologyError, match=match):
        network_from_yaml(doc, "c.yaml")


def test_the_example_cluster_is_a_netns_cluster_with_an_oversubscribed_spine():
    topo = load_topology("examples/cluster-netns.yaml")
    assert topo.network == NetworkSpec(2.0, 0.5, True)
    assert load_topology("examples/cluster-2x4.yaml").network is None


def test_too_many_nodes_or_a_subnet_outside_the_range_is_refused():
    with pytest.raises(TopologyError, match="at most"):
        plan_network("ab12", 1, NetworkSpec(), [(f"n{i}", "l") for i in range(300)])
    with pytest.raises(TopologyError, match="outside"):
        plan_network("ab12", 256, NetworkSpec(), NODES)


def test_a_node_probe_says_which_part_of_the_network_is_gone():
    redis = redis_address("redis://:pw@198.18.7.2:6400/0")
    assert redis == ("198.18.7.2", 6400)
    assert "cut off from the network" in NodeReach(False).describe("node-1", redis)
    said = NodeReach(True, "timed out").describe("node-1", redis)
    assert "cannot reach Redis at 198.18.7.2:6400" in said
    assert NodeReach(False).network_fault and NodeReach(True, "x").network_fault
    assert not NodeReach(True).network_fault
