"""Measured leaves: nodes without a `kc.io/leaf` label grouped by measured bandwidth
(platform/cluster/leaves.py), applied by the registry, shown by `kc topology probe`
and `kc nodes`, and used by the placement solver."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from kuangchao.api.cli.render import print_nodes, print_probe
from kuangchao.platform.cluster.leaves import measured_leaves, pair_medians
from kuangchao.platform.cluster.probe import apply_probe, found_leaves
from kuangchao.platform.cluster.registry import current_nodes
from kuangchao.platform.cluster.topology import DEFAULT_LEAF, LABEL_LEAF, NodeInfo
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.placement.score import score
from kuangchao.platform.placement.solver import JobShape, PlacementPlan, place


def probe_of(leaves: list[list[str]], intra: float = 2.0, inter: float = 0.5, noise: float = 0.15,
             seed: int = 0, fast: tuple[tuple[str, str], ...] = (),
             missing: tuple[tuple[str, str], ...] = ()) -> dict:
    """A probe of unlabelled nodes whose true leaves are `leaves`: `intra` Gbit/s
    inside a leaf, `inter` across, each times a factor in [1 - noise, 1 + noise];
    `fast` pairs measured at the intra rate although across leaves (noise)."""
    rnd = random.Random(seed)
    true = {n: i for i, g in enumerate(leaves) for n in g}
    pairs = []
    for a, b in itertools.combinations(sorted(true), 2):
        if (a, b) in missing:
            continue
        base = intra if true[a] == true[b] or (a, b) in fast else inter
        pairs.append({"a": a, "b": b, "leaf_a": DEFAULT_LEAF, "leaf_b": DEFAULT_LEAF,
                      "latency_us": 50.0, "bandwidth_gbps": base * rnd.uniform(1 - noise, 1 + noise)})
    return {"pairs": pairs, "node_leaves": dict.fromkeys(true, DEFAULT_LEAF)}


def groups(found: dict[str, str]) -> list[list[str]]:
    by_leaf: dict[str, list[str]] = {}
    for node, leaf in sorted(found.items()):
        by_leaf.setdefault(leaf, []).append(node)
    return [by_leaf[lf] for lf in sorted(by_leaf)]


@pytest.mark.parametrize("seed", range(25))
def test_two_leaves_of_two_nodes_are_found_through_15_percent_noise(seed):
    found = measured_leaves(probe_of([["n0", "n2"], ["n1", "n3"]], seed=seed))
    # Named by their smallest node: the leaf of n0 comes first.
    assert found == {"n0": "probed-leaf-0", "n2": "probed-leaf-0",
                     "n1": "probed-leaf-1", "n3": "probed-leaf-1"}


@pytest.mark.parametrize("seed", range(10))
def test_three_leaves_are_found(seed):
    true = [["a0", "a1", "a2"], ["b0", "b1"], ["c0", "c1", "c2", "c3"]]
    assert groups(measured_leaves(probe_of(true, seed=seed))) == true


def test_equal_bandwidth_everywhere_is_one_leaf():
    found = measured_leaves(probe_of([["n0", "n1", "n2", "n3"]], noise=0.0))
    assert set(found.values()) == {"probed-leaf-0"} and len(found) == 4


def test_a_single_node_is_a_leaf_of_its_own():
    probe = {"pairs": [], "node_leaves": {"solo": DEFAULT_LEAF}}
    assert measured_leaves(probe) == {"solo": "probed-leaf-0"}
    assert measured_leaves({"pairs": []}) == {}


def test_a_missing_pair_is_unknown_and_never_merges_on_its_own():
    # Two nodes whose one pair went unmeasured: nothing says they share a leaf.
    probe = probe_of([["n0", "n1"]], missing=(("n0", "n1"),))
    assert groups(measured_leaves(probe)) == [["n0"], ["n1"]]
    # Three of one leaf with one pair missing: the measured pairs still join them.
    probe = probe_of([["n0", "n1", "n2"], ["n3", "n4"]], missing=(("n0", "n2"),))
    assert groups(measured_leaves(probe)) == [["n0", "n1", "n2"], ["n3", "n4"]]


def test_each_pair_counts_at_its_median():
    probe = {"pairs": [{"a": "n0", "b": "n1", "leaf_a": DEFAULT_LEAF, "leaf_b": DEFAULT_LEAF,
                        "bandwidth_gbps": v} for v in (2.0, 0.1, 2.1)]}
    assert pair_medians(probe) == {("n0", "n1"): 2.0}


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("true,fast", [
    ([["a", "b", "c"], ["d", "e", "f"]], (("a", "d"),)),
    ([["a", "b"], ["c", "d"]], (("a", "c"),)),
])
def test_one_noisy_fast_pair_across_leaves_does_not_merge_them(seed, true, fast):
    assert groups(measured_leaves(probe_of(true, seed=seed, fast=fast))) == true


def test_a_leaf_of_slower_links_is_still_a_leaf():
    # Leaf b's NICs are slower than leaf a's; each node is judged by its own best link.
    probe = probe_of([["a0", "a1"], ["b0", "b1"]], noise=0.0)
    for p in probe["pairs"]:
        if p["a"].startswith("b") and p["b"].startswith("b"):
            p["bandwidth_gbps"] = 0.8
    assert groups(measured_leaves(probe)) == [["a0", "a1"], ["b0", "b1"]]


def nodes4(leaf: str = DEFAULT_LEAF, **labels: str) -> tuple[NodeInfo, ...]:
    return tuple(NodeInfo(name=f"n{i}", gpus=2, islands=((0, 1),), node_id=f"id{i}",
                          leaf=labels.get(f"n{i}", leaf)) for i in range(4))


def test_labels_win_and_the_node_view_says_which_leaves_were_measured():
    probe = probe_of([["n0", "n2"], ["n1", "n3"]])
    probe["pairs"] = [{**p, "leaf_a": "rack-7" if p["a"] == "n3" else p["leaf_a"]} for p in probe["pairs"]]
    nodes = nodes4(n3="rack-7") + (NodeInfo(name="late", gpus=2, islands=((0, 1),), leaf=DEFAULT_LEAF),)
    out = {n.name: n for n in apply_probe(nodes, probe)}
    assert out["n3"].leaf == "rack-7" and not out["n3"].leaf_measured
    assert out["n0"].leaf == out["n2"].leaf == "probed-leaf-0" and out["n1"].leaf == "probed-leaf-1"
    assert all(out[n].leaf_measured for n in ("n0", "n1", "n2"))
    # Joined after the probe: nothing measured, so no leaf is made up for it.
    assert out["late"].leaf == DEFAULT_LEAF and not out["late"].leaf_measured
    # Spines over the measured leaves (and the labelled one) as before.
    assert out["n0"].spine and out["n1"].spine
    for n in out.values():
        assert NodeInfo.from_json(n.to_json()) == n


def test_the_registry_measures_the_leaves_of_unlabelled_raylets():
    store = MemoryStore()
    raw = [{"NodeID": n.node_id, "Alive": True, "Resources": {"CPU": 2, "GPU": 2},
            "Labels": {k: v for k, v in n.labels().items() if k != LABEL_LEAF}} for n in nodes4()]
    assert {n.leaf for n in current_nodes(store, raw)} == {DEFAULT_LEAF}
    store.set_info("probe", probe_of([["n0", "n2"], ["n1", "n3"]]))
    seen = {n.name: (n.leaf, n.leaf_measured) for n in current_nodes(store, raw)}
    assert seen == {"n0": ("probed-leaf-0", True), "n2": ("probed-leaf-0", True),
                    "n1": ("probed-leaf-1", True), "n3": ("probed-leaf-1", True)}


def test_placement_keeps_the_ring_inside_a_measured_leaf():
    # 4 nodes x 2 GPUs; truly n0+n2 and n1+n3 share leaves. Two replicas of a TP=2 group.
    shape = JobShape(dp=2, tp=2)
    measured = apply_probe(nodes4(), probe_of([["n0", "n2"], ["n1", "n3"]], noise=0.0))
    blind = place(nodes4(), {}, shape)
    seen = place(measured, {}, shape)
    assert isinstance(blind, PlacementPlan) and isinstance(seen, PlacementPlan)
    for plan in (blind, seen):  # each TP group inside one node
        assert plan.slots[0].node == plan.slots[1].node and plan.slots[2].node == plan.slots[3].node
    # On all-"default" leaves the solver takes n0 and n1, a ring across the real leaves;
    # with the measured leaves it keeps the ring inside one.
    assert [s.node for s in blind.slots] == ["n0", "n0", "n1", "n1"]
    leaf_of = {n.name: n.leaf for n in measured}
    truly = PlacementPlan(slots=tuple(replace(s, leaf=leaf_of[s.node]) for s in blind.slots))
    assert score(truly, measured, shape).cross_leaf_ring_edges == 4
    assert {s.node for s in seen.slots} == {"n0", "n2"}
    assert score(seen, measured, shape).cross_leaf_ring_edges == 0


def test_probe_output_shows_each_found_leaf_with_bandwidth_inside_and_across(capsys):
    probe = probe_of([["n0", "n2"], ["n1", "n3"]], noise=0.0)
    leaves = found_leaves(probe)
    assert [(lf["leaf"], lf["nodes"], lf["intra_gbps"], lf["inter_gbps"]) for lf in leaves] == [
        ("probed-leaf-0", ["n0", "n2"], 2.0, 0.5), ("probed-leaf-1", ["n1", "n3"], 2.0, 0.5)]
    assert leaves[0]["spine"] == leaves[1]["spine"] == "probed-0"
    print_probe({**probe, "leaves": leaves})
    out = capsys.readouterr().out
    assert "probed-leaf-1" in out and "n1, n3" in out and "inside     2.00" in out
    print_probe({"pairs": [], "leaves": []})
    assert "every node measured carries a kc.io/leaf label" in capsys.readouterr().out


def test_kc_nodes_marks_a_measured_leaf(capsys):
    view = [{**n.to_json(), "free_gpus": 2, "jobs": []}
            for n in apply_probe(nodes4(n3="rack-7"), probe_of([["n0", "n2"], ["n1"], ["n3"]]))]
    print_nodes({"nodes": view})
    out = capsys.readouterr().out
    assert "probed-leaf-0~" in out and "rack-7~" not in out and "~ measured by" in out
