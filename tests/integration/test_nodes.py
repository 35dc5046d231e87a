"""The registry: node view from Ray labels, nodes joining and leaving."""

from __future__ import annotations

import json

import pytest

from kuangchao.platform.runtime import procs

from .conftest import kc, wait_for

pytestmark = pytest.mark.integration


def test_nodes_show_topology_from_labels(stack):
    nodes = wait_for(lambda: len(stack.client.nodes()["nodes"]) >= 4 and stack.client.nodes(),
                     60, "the registry's node view")["nodes"]
    by_name = {n["name"]: n for n in nodes}
    assert {"node-0", "node-1", "node-2", "node-3"} <= set(by_name)
    n0 = by_name["node-0"]
    assert n0["leaf"] == "leaf-0" and n0["spine"] == "spine-0" and n0["alive"]
    assert n0["nvlink"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and n0["pinned_gpus"]
    assert by_name["node-3"]["leaf"] == "leaf-1"
    out = kc("nodes", "--json", env=stack.env)
    assert out.returncode == 0 and {n["name"] for n in json.loads(out.stdout)["nodes"]} >= set(by_name)


def test_a_node_that_joins_and_leaves_is_discovered_both_times(stack):
    out = kc("node", "join", "--address", stack.state["ray_address"], "--name", "joiner",
             "--leaf", "leaf-9", "--gpus", "2", "--nvlink", "full", "--cpus", "1", "--json",
             env=stack.env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["nvlink"] == [[0, 1]]

    def joiner(alive: bool):
        nodes = {n["name"]: n for n in stack.client.nodes()["nodes"]}
        return "joiner" in nodes and nodes["joiner"]["alive"] is alive and nodes["joiner"]
    seen = wait_for(lambda: joiner(True), 60, "the joined node in /v1/nodes")
    assert seen["leaf"] == "leaf-9" and seen["gpus"] == 2 and seen["pinned_gpus"]

    raylet = procs.matching(['"kc.io/node": "joiner"'])
    assert raylet, "no raylet carries the joiner's labels"
    procs.stop(raylet)
    wait_for(lambda: joiner(False), 120, "the registry to see the node leave")


def test_topology_probe_measures_every_pair_of_live_nodes(stack):
    out = kc("topology", "probe", "--size-mb", "4", "--rounds", "2", "--json", env=stack.env,
             timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    live = [n for n in stack.client.nodes()["nodes"] if n["alive"]]
    assert len(result["pairs"]) == len(live) * (len(live) - 1) // 2
    assert all(p["latency_us"] > 0 and p["bandwidth_gbps"] > 0 for p in result["pairs"])


def test_a_probe_actor_whose_worker_dies_before_it_runs_is_started_again(stack, ray_driver):
    """`kc topology probe` once failed with a traceback: a node's probe actor died before
    it ran. Now it is started again, and a node whose actor never comes up is named."""
    import os

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kuangchao.platform.cluster.probe import PEER_STARTS, _Peer, start_peers
    from kuangchao.platform.cluster.registry import nodes_from_ray
    from kuangchao.platform.errors import ClusterError

    class Dies:  # local, so that Ray ships it by value
        def __init__(self) -> None:
            os._exit(1)

        def ping(self) -> int:
            return 0

    live = [n for n in nodes_from_ray(ray_driver.nodes()) if n.alive][:2]
    assert len(live) == 2
    starts: list[str] = []

    def start(n, cls=None):
        starts.append(n.name)
        cls = cls or (Dies if n.name == live[0].name and starts.count(n.name) == 1 else _Peer)
        on = NodeAffinitySchedulingStrategy(n.node_id, soft=False)
        return ray_driver.remote(cls).options(num_cpus=0, scheduling_strategy=on).remote(
            *(() if cls is Dies else (1024,)))

    peers = start_peers(live, start)
    try:
        assert sorted(peers) == sorted(n.name for n in live)
        assert starts.count(live[0].name) == 2 and starts.count(live[1].name) == 1
        assert ray_driver.get([p.ping.remote() for p in peers.values()], timeout=60) == [0, 0]
    finally:
        for p in peers.values():
            ray_driver.kill(p)
    starts.clear()
    with pytest.raises(ClusterError) as exc:
        start_peers(live[:1], lambda n: start(n, Dies))
    assert live[0].name in exc.value.message and f"after {PEER_STARTS} tries" in exc.value.message
    assert starts == [live[0].name] * PEER_STARTS
