"""GPU types as topology: the catalogue's speeds and names, a node's type and
emulated speed from the cluster YAML, labels, Ray's detection and nvidia-smi,
and an operator's overrides as the registry applies them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuangchao.platform.cluster import detect, nodejoin
from kuangchao.platform.cluster.detect import gpu_type_of, parse_gpu_query, refuse_emulation
from kuangchao.platform.cluster.hardware import (
    CATALOG,
    gpu_type_from_product,
    gpu_type_from_ray,
    gpu_type_key,
    gpu_types,
    speed_of,
)
from kuangchao.platform.cluster.nodejoin import JoinOptions, node_for, ray_start_args
from kuangchao.platform.cluster.overrides import (
    OVERRIDES_INFO,
    apply_overrides,
    checked,
    store_override,
)
from kuangchao.platform.cluster.registry import current_nodes, nodes_from_ray
from kuangchao.platform.cluster.topology import NodeInfo, load_topology, node_from_labels
from kuangchao.platform.errors import ClusterError, SpecError, TopologyError
from kuangchao.platform.jobs.memory import MemoryStore


def test_speed_is_achieved_flops_and_an_h100_outruns_an_a100():
    for name, acc in CATALOG.items():
        assert speed_of(name) == acc.peak_flops * acc.mfu_ceiling
    # 989 x 0.5 against 312 x 0.6 TFLOP/s
    assert speed_of("H100-80GB") / speed_of("a100-80gb") == pytest.approx(494.5 / 187.2)
    with pytest.raises(ValueError, match="h100-80gb"):
        speed_of("b200")


def test_gpu_type_names_are_catalogue_keys_without_cpu():
    assert gpu_types() == ["a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"]
    assert gpu_type_key(" H100-80GB ") == "h100-80gb"
    for bad in ("cpu", "h100", "b200"):
        with pytest.raises(ValueError, match="known types: a100-40gb, a100-80gb, h100-80gb"):
            gpu_type_key(bad)


@pytest.mark.parametrize("ray_name, expected", [
    ("H100", "h100-80gb"), ("H200", "h200-141gb"), ("A100-80G", "a100-80gb"),
    ("A100-40G", "a100-40gb"),
    ("A100", None),  # 40 or 80 GB: Ray's detected name drops the memory
    ("GH200", None), ("B200", None), ("L40S", None), ("", None), (None, None),
])
def test_ray_accelerator_names_map_to_the_catalogue_only_when_unambiguous(ray_name, expected):
    assert gpu_type_from_ray(ray_name) == expected


# nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits, as
# machines of each kind print it.
SMI = {
    "h100-sxm": "NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559\n",
    "a100-40": "NVIDIA A100-SXM4-40GB, 40960\n",
    "a100-80-pcie": "NVIDIA A100 80GB PCIe, 81920\n",
    "h200": "NVIDIA H200, 143771\n",
    "h100-nvl": "NVIDIA H100 NVL, 95830\n",
    "h100-pcie": "NVIDIA H100 PCIe, 81559\n",
    "gh200": "NVIDIA GH200 480GB, 97871\n",
    "mixed": "NVIDIA A100-SXM4-80GB, 81920\nNVIDIA H100 80GB HBM3, 81559\n",
    "warning": "WARNING: infoROM is corrupted at gpu 0000:00:04.0\nNVIDIA A100-SXM4-80GB, 81920\n",
}


@pytest.mark.parametrize("machine, expected", [
    ("h100-sxm", "h100-80gb"), ("a100-40", "a100-40gb"), ("a100-80-pcie", "a100-80gb"),
    ("h200", "h200-141gb"), ("warning", "a100-80gb"),
    # Parts the catalogue does not describe: slower clocks, other memory.
    ("h100-nvl", None), ("h100-pcie", None), ("gh200", None),
    ("mixed", None),  # one type per node
])
def test_nvidia_smi_products_map_to_catalogue_types(machine, expected):
    assert gpu_type_of(parse_gpu_query(SMI[machine])) == expected


def test_nvidia_smi_query_parses_name_and_memory_and_skips_other_lines():
    assert parse_gpu_query(SMI["warning"]) == [("NVIDIA A100-SXM4-80GB", 81920)]
    assert parse_gpu_query("") == []
    assert gpu_type_from_product("Tesla V100-SXM2-16GB", 16160) is None


def yaml_topology(tmp_path, node: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"nodes: [{node}]")
    return load_topology(path)


def test_cluster_yaml_carries_gpu_type_and_emulated_speed(tmp_path):
    (node,) = yaml_topology(tmp_path, "{name: a, gpus: 2, leaf: l, gpu_type: A100-80GB, "
                                      "emulated_speed: 0.5}").nodes
    assert (node.gpu_type, node.emulated_speed) == ("a100-80gb", 0.5)
    assert node.labels()["kc.io/gpu-type"] == "a100-80gb"
    assert node.labels()["kc.io/emulated-speed"] == "0.5"


@pytest.mark.parametrize("fields, match", [
    ("gpu_type: b200", r"nodes\[0\]\.gpu_type: 'b200' is not a GPU type .*known types: a100-40gb"),
    ("gpu_type: cpu", r"nodes\[0\]\.gpu_type: .*known types"),
    ("emulated_speed: 1.5", r"nodes\[0\]\.emulated_speed: must be a number in \(0, 1\]"),
    ("emulated_speed: 0", r"nodes\[0\]\.emulated_speed: must be a number in \(0, 1\]"),
    ("emulated_speed: true", r"nodes\[0\]\.emulated_speed"),
    ("emulated_speed: fast", r"nodes\[0\]\.emulated_speed"),
])
def test_bad_gpu_fields_in_the_cluster_yaml_name_the_field(tmp_path, fields, match):
    with pytest.raises(TopologyError, match=match):
        yaml_topology(tmp_path, f"{{name: a, gpus: 1, leaf: l, {fields}}}")


@pytest.mark.parametrize("field", ["emulated_speed: 0.5", "gpu_type: h100-80gb"])
def test_a_node_without_gpus_takes_no_gpu_fields(tmp_path, field):
    name = field.split(":")[0]
    with pytest.raises(TopologyError, match=rf"nodes\[0\]\.{name}: .*no GPUs"):
        yaml_topology(tmp_path, f"{{name: a, gpus: 0, leaf: l, {field}}}")


def ray_node(labels: dict, resources: dict, node_id: str = "a" * 56) -> dict:
    return {"NodeID": node_id, "Alive": True, "Labels": labels,
            "Resources": {"CPU": 4, **resources}}


def test_labels_round_trip_through_the_registry():
    sent = NodeInfo(name="n", gpus=2, islands=((0, 1),), leaf="l", gpu_type="a100-80gb",
                    emulated_speed=0.25)
    (seen,) = nodes_from_ray([ray_node(sent.labels(), {"GPU": 2})])
    assert (seen.gpu_type, seen.emulated_speed, seen.problems) == ("a100-80gb", 0.25, ())
    assert NodeInfo.from_json(seen.to_json()) == seen


def test_without_a_label_the_type_is_what_ray_detected():
    (h100,) = nodes_from_ray([ray_node({"kc.io/node": "h"}, {"GPU": 8, "accelerator_type:H100": 1})])
    assert (h100.accelerator, h100.gpu_type) == ("H100", "h100-80gb")
    # An operator's exact name beside Ray's own plain one is the one that tells the size.
    (a100,) = nodes_from_ray([ray_node({"kc.io/node": "a"}, {
        "GPU": 8, "accelerator_type:A100": 1, "accelerator_type:A100-80G": 1})])
    assert (a100.accelerator, a100.gpu_type) == ("A100-80G", "a100-80gb")
    (plain,) = nodes_from_ray([ray_node({"kc.io/node": "p"}, {"GPU": 8, "accelerator_type:A100": 1})])
    assert plain.gpu_type is None and plain.problems == ()


def test_a_label_wins_over_detection_and_a_bad_label_is_reported_not_fatal():
    (labelled,) = nodes_from_ray([ray_node({"kc.io/node": "n", "kc.io/gpu-type": "a100-80gb"},
                                           {"GPU": 1, "accelerator_type:H100": 1})])
    assert labelled.gpu_type == "a100-80gb"
    assert any("although Ray detected H100" in p for p in labelled.problems)
    bad, good = nodes_from_ray([
        ray_node({"kc.io/node": "bad", "kc.io/gpu-type": "b200", "kc.io/emulated-speed": "2"},
                 {"GPU": 1}),
        ray_node({"kc.io/node": "good", "kc.io/gpu-type": "h100-80gb"}, {"GPU": 1}, "b" * 56)])
    assert (bad.gpu_type, bad.emulated_speed) == (None, None)
    assert [p.split(":")[0] for p in bad.problems] == ["label kc.io/gpu-type ignored",
                                                       "label kc.io/emulated-speed ignored"]
    assert good.gpu_type == "h100-80gb" and not good.problems


def test_an_emulated_speed_never_reaches_a_node_with_real_gpus():
    (node,) = nodes_from_ray([ray_node({"kc.io/node": "n", "kc.io/emulated-speed": "0.5"},
                                       {"GPU": 8, "accelerator_type:H100": 1})])
    assert node.emulated_speed is None
    assert node.problems == ("emulated_speed: node n has real GPUs (H100 detected); emulation is "
                             "for fake clusters only; its label is ignored",)
    assert node_from_labels("x" * 56, {"kc.io/emulated-speed": "0.5"}, gpus=0, cpus=1,
                            alive=True).emulated_speed is None


FAKE = {"name": "n0", "gpus": 2, "accelerator": None}
REAL = {"name": "n1", "gpus": 8, "accelerator": "H100"}


def test_overrides_are_checked_and_name_the_field():
    assert checked(FAKE, {"gpu_type": "H100-80GB", "emulated_speed": 0.5}) == {
        "gpu_type": "h100-80gb", "emulated_speed": 0.5}
    assert checked(REAL, {"gpu_type": None, "emulated_speed": None}) == {
        "gpu_type": None, "emulated_speed": None}
    with pytest.raises(SpecError) as bad:
        checked(REAL, {"gpu_type": "b200", "emulated_speed": 0.5})
    assert [f for f, _ in bad.value.errors] == ["gpu_type", "emulated_speed"]
    assert "known types: a100-40gb" in bad.value.errors[0][1]
    assert bad.value.errors[1][1] == ("emulated_speed: node n1 has real GPUs (H100 detected); "
                                      "emulation is for fake clusters only")
    for speed in (0, 1.01, -1):
        with pytest.raises(SpecError, match=r"emulated_speed: must be a number in \(0, 1\]"):
            checked(FAKE, {"emulated_speed": speed})
    with pytest.raises(SpecError, match="send gpu_type, emulated_speed or both"):
        checked(FAKE, {})


def test_overrides_are_stored_merged_cleared_and_applied_by_the_registry():
    store = MemoryStore()
    assert store_override(store, "n0", {"gpu_type": "a100-40gb"}) == {"gpu_type": "a100-40gb"}
    assert store_override(store, "n0", {"emulated_speed": 0.5}) == {
        "gpu_type": "a100-40gb", "emulated_speed": 0.5}
    raw = [ray_node({"kc.io/node": "n0", "kc.io/gpu-type": "h100-80gb"}, {"GPU": 2}),
           ray_node({"kc.io/node": "n1"}, {"GPU": 8, "accelerator_type:H100": 1}, "b" * 56)]
    n0, n1 = current_nodes(store, raw)
    assert (n0.gpu_type, n0.emulated_speed) == ("a100-40gb", 0.5)
    assert (n1.gpu_type, n1.emulated_speed) == ("h100-80gb", None)
    assert store_override(store, "n0", {"gpu_type": None}) == {"emulated_speed": 0.5}
    assert current_nodes(store, raw)[0].gpu_type == "h100-80gb"  # back to its label
    assert store_override(store, "n0", {"emulated_speed": None}) == {}
    assert store.info(OVERRIDES_INFO)["nodes"] == {}


def test_a_stored_emulated_speed_is_ignored_once_the_node_has_real_gpus():
    real = NodeInfo(name="n1", gpus=8, islands=(tuple(range(8)),), leaf="l", accelerator="H100",
                    gpu_type="h100-80gb")
    (node,) = apply_overrides((real,), {"nodes": {"n1": {"emulated_speed": 0.5}}})
    assert node.emulated_speed is None and "its override is ignored" in node.problems[0]


def test_node_join_types_the_node_from_nvidia_smi_or_the_flag(monkeypatch):
    monkeypatch.setattr(nodejoin, "detect_gpus", lambda: None)
    monkeypatch.setattr(nodejoin, "query_gpus", lambda: None)
    opts = JoinOptions(address="h:1", name="n", leaf="l", gpus=2, gpu_type="A100-80GB",
                       emulated_speed=0.5)
    node = node_for(opts)
    assert (node.gpu_type, node.emulated_speed) == ("a100-80gb", 0.5)
    assert "kc.io/gpu-type=a100-80gb" in next(a for a in ray_start_args(opts, node)
                                              if a.startswith("--labels="))
    with pytest.raises(TopologyError, match="--gpu-type: 'b200' is not a GPU type"):
        node_for(JoinOptions(address="h:1", name="n", leaf="l", gpus=2, gpu_type="b200"))
    with pytest.raises(TopologyError, match=r"--emulated-speed: must be a number in \(0, 1\]"):
        node_for(JoinOptions(address="h:1", name="n", leaf="l", gpus=2, emulated_speed=2.0))

    monkeypatch.setattr(nodejoin, "detect_gpus", lambda: (2, ((0, 1),)))
    monkeypatch.setattr(nodejoin, "query_gpus", lambda: parse_gpu_query(SMI["h100-sxm"]))
    assert node_for(JoinOptions(address="h:1", name="n", leaf="l")).gpu_type == "h100-80gb"
    with pytest.raises(TopologyError, match="nvidia-smi shows 2 x NVIDIA H100 80GB HBM3 "
                                            r"\(h100-80gb\); drop --gpu-type"):
        node_for(JoinOptions(address="h:1", name="n", leaf="l", gpu_type="a100-80gb"))
    with pytest.raises(TopologyError, match="--emulated-speed: nvidia-smi shows real GPUs"):
        node_for(JoinOptions(address="h:1", name="n", leaf="l", emulated_speed=0.5))
    # A product the catalogue lacks: the flag names the type.
    monkeypatch.setattr(nodejoin, "query_gpus", lambda: parse_gpu_query(SMI["h100-pcie"] * 2))
    assert node_for(JoinOptions(address="h:1", name="n", leaf="l",
                                gpu_type="h100-80gb")).gpu_type == "h100-80gb"


def test_kc_up_refuses_emulation_on_a_machine_with_real_gpus(tmp_path):
    topo = yaml_topology(tmp_path, "{name: a, gpus: 1, leaf: l}, "
                                   "{name: b, gpus: 1, leaf: l, emulated_speed: 0.5}")
    refuse_emulation(topo.nodes, None)  # no nvidia-smi
    refuse_emulation(topo.nodes, [])    # nvidia-smi, no GPU
    with pytest.raises(ClusterError, match=r"nodes\[1\]\.emulated_speed \(b\): this machine has "
                                           r"real GPUs \(nvidia-smi lists 2 x NVIDIA H100 80GB "
                                           r"HBM3\); .*Remove emulated_speed"):
        refuse_emulation(topo.nodes, parse_gpu_query(SMI["h100-sxm"]))
    plain = yaml_topology(tmp_path, "{name: a, gpus: 1, leaf: l, gpu_type: h100-80gb}")
    refuse_emulation(plain.nodes, parse_gpu_query(SMI["h100-sxm"]))


def test_no_nvidia_smi_means_no_gpus_found(monkeypatch):
    monkeypatch.setattr(detect.shutil, "which", lambda _: None)
    assert detect.query_gpus() is None


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("cluster-*.yaml")), ids=lambda p: p.name)
def test_example_clusters_load(path):
    assert load_topology(path).total_gpus > 0


def test_the_emulated_example_runs_its_a100_at_the_catalogues_speed_ratio():
    fast, slow = load_topology(EXAMPLES / "cluster-emulated.yaml").nodes
    assert (fast.gpu_type, fast.emulated_speed, slow.gpu_type) == ("h100-80gb", None, "a100-80gb")
    assert slow.emulated_speed == pytest.approx(speed_of("a100-80gb") / speed_of("h100-80gb"),
                                                abs=0.005)
    mixed = load_topology(EXAMPLES / "cluster-mixed.yaml").nodes
    assert [n.gpu_type for n in mixed] == ["h100-80gb"] * 2 + ["a100-80gb"] * 2
    assert all(n.emulated_speed is None for n in mixed)
