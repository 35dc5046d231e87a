"""Cluster topology: nodes, their GPUs, NVLink islands and leaf switches.

A topology comes from a cluster YAML when running locally and from Ray node
labels on a real cluster. Both become the same `NodeInfo` values. Label scheme
(each value matches Ray's label syntax):

    kc.io/node    node name, e.g. node-0
    kc.io/leaf    leaf switch, e.g. leaf-0
    kc.io/spine   spine switch (optional)
    kc.io/nvlink  NVLink islands: GPU ids joined by '.', islands by '_'
                  ('0.1.2.3_4.5.6.7'), or 'full' for an NVSwitch node
    kc.io/gpu-type          the GPUs' catalogue type (platform/cluster/hardware.py),
                            e.g. h100-80gb; one type per node
    kc.io/emulated-speed    fake clusters only: the node's ranks run at this
                            fraction of full speed (workers/parallel/emulation.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kuangchao.platform.cluster.hardware import gpu_type_from_ray, gpu_type_key
from kuangchao.platform.cluster.netplan import NetworkSpec, network_from_yaml
from kuangchao.platform.errors import TopologyError

LABEL_NODE = "kc.io/node"
LABEL_LEAF = "kc.io/leaf"
LABEL_SPINE = "kc.io/spine"
LABEL_NVLINK = "kc.io/nvlink"
LABEL_ROLE = "kc.io/role"
LABEL_GPU_TYPE = "kc.io/gpu-type"
LABEL_EMULATED_SPEED = "kc.io/emulated-speed"
# The leaf of a node without a `kc.io/leaf` label, until `kc topology probe`
# measures one for it (probe.py).
DEFAULT_LEAF = "default"
# One Ray custom resource per physical GPU (`kc_gpu_3`), so a placement group
# bundle can ask for exactly the GPU ids the plan chose; Ray's own GPU resource
# only counts GPUs and hands out whichever ids are free.
GPU_RESOURCE_PREFIX = "kc_gpu_"


def gpu_resource(gpu: int) -> str:
    return f"{GPU_RESOURCE_PREFIX}{gpu}"


@dataclass(frozen=True)
class NodeInfo:
    """One node as the placement solver sees it.

    Attributes:
        name: Stable node name (`kc.io/node`).
        gpus: Number of GPUs.
        islands: NVLink islands as tuples of GPU ids; they cover all GPUs.
        leaf: Leaf switch name.
        spine: Spine switch name, if known.
        cpus: Logical CPUs.
        node_id: Ray node id, once the node has joined.
        alive: Whether Ray reports the node alive.
        pinned_gpus: Whether the node has one `kc_gpu_N` resource per GPU.
        accelerator: The GPU model Ray detected (its `accelerator_type:X`
            resource, e.g. `H100`), or None (no GPUs, or fake ones).
        gpu_type: The GPUs' catalogue type (`h100-80gb`): an operator's override
            (overrides.py), else the node's label, else what Ray detected, mapped
            to the catalogue; None when unknown.
        emulated_speed: Fake clusters only: the fraction of full speed the node's
            ranks run at (after each forward and backward a rank sleeps
            `(1/s - 1)` times the CPU time it took). None: full speed.
        problems: What the registry left out of this entry and why (a malformed
            label, an emulated speed on real GPUs), for the node view.
        leaf_measured: Whether `leaf` was found by `kc topology probe` (the node
            has no `kc.io/leaf` label), not read from a label.
        draining: Whether Ray is draining the node (drain.py): no new placements.
        drain_deadline: When the drain's node is killed (epoch seconds); None: no deadline.
    """

    name: str
    gpus: int
    islands: tuple[tuple[int, ...], ...]
    leaf: str
    spine: str | None = None
    cpus: float = 0.0
    node_id: str = ""
    alive: bool = True
    pinned_gpus: bool = False
    accelerator: str | None = None
    gpu_type: str | None = None
    emulated_speed: float | None = None
    problems: tuple[str, ...] = ()
    leaf_measured: bool = False
    draining: bool = False
    drain_deadline: float | None = None

    def labels(self) -> dict[str, str]:
        out = {LABEL_NODE: self.name, LABEL_LEAF: self.leaf,
               LABEL_NVLINK: encode_islands(self.islands, self.gpus)}
        if self.spine:
            out[LABEL_SPINE] = self.spine
        if self.gpu_type:
            out[LABEL_GPU_TYPE] = self.gpu_type
        if self.emulated_speed is not None:
            out[LABEL_EMULATED_SPEED] = f"{self.emulated_speed:g}"
        return out

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "gpus": self.gpus,
                "nvlink": [list(i) for i in self.islands], "leaf": self.leaf,
                "leaf_measured": self.leaf_measured, "spine": self.spine, "cpus": self.cpus,
                "alive": self.alive,
                "pinned_gpus": self.pinned_gpus, "accelerator": self.accelerator,
                "gpu_type": self.gpu_type, "emulated_speed": self.emulated_speed,
                "problems": list(self.problems), "draining": self.draining,
                "drain_deadline": self.drain_deadline}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeInfo:
        """The inverse of `to_json` (the registry's node view in Redis)."""
        return cls(name=str(d["name"]), gpus=int(d.get("gpus") or 0),
                   islands=tuple(tuple(int(g) for g in i) for i in d.get("nvlink") or ()),
                   leaf=str(d.get("leaf") or DEFAULT_LEAF), spine=d.get("spine"),
                   cpus=float(d.get("cpus") or 0.0), node_id=str(d.get("node_id") or ""),
                   alive=bool(d.get("alive", True)), pinned_gpus=bool(d.get("pinned_gpus")),
                   accelerator=d.get("accelerator") or None,
                   gpu_type=d.get("gpu_type") or None,
                   emulated_speed=(float(d["emulated_speed"])
                                   if d.get("emulated_speed") is not None else None),
                   problems=tuple(str(p) for p in d.get("problems") or ()),
                   leaf_measured=bool(d.get("leaf_measured")),
                   draining=bool(d.get("draining")),
                   drain_deadline=(float(d["drain_deadline"])
                                   if d.get("drain_deadline") is not None else None))


# `node_storage` of a local cluster's YAML: "shared" (every node sees $KC_HOME, as
# one machine does) or "private" (each node gets a folder of its own, $KC_NODE_DIR,
# and may keep checkpoints only there: a job then needs an object-store
# checkpoint.path, and nothing can lean on a shared disk by accident).
NODE_STORAGE = ("shared", "private")


@dataclass(frozen=True)
class ClusterTopology:
    name: str
    nodes: tuple[NodeInfo, ...] = field(default_factory=tuple)
    node_storage: str = "shared"
    network: NetworkSpec | None = None  # `isolation: netns`: each node a network host

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)


def encode_islands(islands: tuple[tuple[int, ...], ...], gpus: int) -> str:
    if len(islands) == 1 and sorted(islands[0]) == list(range(gpus)):
        return "full"
    return "_".join(".".join(str(g) for g in isl) for isl in islands)


def decode_islands(value: str | None, gpus: int) -> tuple[tuple[int, ...], ...]:
    """Parse a `kc.io/nvlink` label; a missing label means one island per GPU."""
    if gpus == 0:
        return ()
    if not value:
        return tuple((g,) for g in range(gpus))
    if value == "full":
        return (tuple(range(gpus)),)
    try:
        islands = tuple(tuple(int(g) for g in part.split(".")) for part in value.split("_"))
    except ValueError:
        raise TopologyError(
            f"label {LABEL_NVLINK}={value!r} is malformed; use GPU ids joined by '.' "
            "and islands by '_', e.g. 0.1.2.3_4.5.6.7, or 'full'"
        ) from None
    _check_islands(islands, gpus, f"label {LABEL_NVLINK}")
    return islands


def _check_islands(islands: tuple[tuple[int, ...], ...], gpus: int, where: str) -> None:
    flat = sorted(g for isl in islands for g in isl)
    if flat != list(range(gpus)):
        raise TopologyError(
            f"{where}: NVLink islands {[list(i) for i in islands]} must cover GPU ids "
            f"0..{gpus - 1} exactly once each"
        )


def emulated_speed_value(value: Any) -> float:
    """`value` as an emulated speed: a number in (0, 1], the fraction of full speed.

    Raises:
        ValueError: Saying what is allowed.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"must be a number in (0, 1], the fraction of full speed the node's "
                         f"ranks run at (0.5: half speed), got {value!r}")
    return float(value)


def _gpu_fields(where: str, raw: dict[str, Any], gpus: int) -> tuple[str | None, float | None]:
    """A YAML node's `gpu_type` and `emulated_speed`, checked."""
    gpu_type, speed = raw.get("gpu_type"), raw.get("emulated_speed")
    if gpu_type is not None:
        if not gpus:
            raise TopologyError(f"{where}.gpu_type: the node has no GPUs; drop gpu_type or set gpus")
        try:
            gpu_type = gpu_type_key(gpu_type)
        except ValueError as exc:
            raise TopologyError(f"{where}.gpu_type: {exc}") from None
    if speed is not None:
        if not gpus:
            raise TopologyError(f"{where}.emulated_speed: the node has no GPUs whose ranks "
                                "could be slowed; drop emulated_speed or set gpus")
        try:
            speed = emulated_speed_value(speed)
        except ValueError as exc:
            raise TopologyError(f"{where}.emulated_speed: {exc}") from None
    return gpu_type, speed


def _node_from_yaml(i: int, raw: Any) -> NodeInfo:
    where = f"nodes[{i}]"
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: must be a mapping with name, gpus, nvlink, leaf")
    unknown = set(raw) - {"name", "gpus", "nvlink", "leaf", "spine", "cpus", "gpu_type",
                          "emulated_speed"}
    if unknown:
        raise TopologyError(f"{where}: unknown field(s) {sorted(unknown)}")
    gpus = raw.get("gpus", 0)
    if not isinstance(gpus, int) or gpus < 0:
        raise TopologyError(f"{where}.gpus: must be a non-negative integer, got {gpus!r}")
    nvlink = raw.get("nvlink", "full" if gpus else None)
    if nvlink == "full" or nvlink is None:
        islands = decode_islands(nvlink, gpus) if gpus else ()
    elif isinstance(nvlink, list) and all(isinstance(isl, list) for isl in nvlink):
        islands = tuple(tuple(int(g) for g in isl) for isl in nvlink)
        _check_islands(islands, gpus, f"{where}.nvlink")
    else:
        raise TopologyError(f"{where}.nvlink: use a list of GPU-id lists, or 'full'")
    name = str(raw.get("name") or f"node-{i}")
    leaf = raw.get("leaf")
    if not leaf:
        raise TopologyError(f"{where}.leaf: every node needs a leaf switch name")
    cpus = raw.get("cpus", max(gpus, 1))
    gpu_type, speed = _gpu_fields(where, raw, gpus)
    return NodeInfo(name=name, gpus=gpus, islands=islands, leaf=str(leaf),
                    spine=raw.get("spine"), cpus=float(cpus), gpu_type=gpu_type,
                    emulated_speed=speed)


def load_topology(path: str | Path) -> ClusterTopology:
    """Read a cluster YAML (see examples/cluster-2x4.yaml).

    Raises:
        TopologyError: Naming the node and field that is wrong.
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"cluster file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise TopologyError(f"{path}: expected a mapping with a non-empty 'nodes' list")
    nodes = tuple(_node_from_yaml(i, raw) for i, raw in enumerate(doc["nodes"]))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise TopologyError(f"{path}: node names must be unique, got {names}")
    storage = doc.get("node_storage", "shared")
    if storage not in NODE_STORAGE:
        raise TopologyError(f"{path}: node_storage must be one of {list(NODE_STORAGE)}, "
                            f"got {storage!r}")
    return ClusterTopology(name=str(doc.get("name", path.stem)), nodes=nodes, node_storage=storage,
                           network=network_from_yaml(doc, str(path)))


def node_from_labels(node_id: str, labels: dict[str, str], gpus: int, cpus: float,
                     alive: bool, pinned_gpus: bool = False,
                     accelerator: str | None = None) -> NodeInfo:
    """Build a `NodeInfo` from a Ray node's labels and resources.

    The GPU type is the `kc.io/gpu-type` label, else Ray's detected accelerator
    mapped to the catalogue. A label the registry cannot use is left out and
    named in `problems`, never fatal: one bad node must not hide the others.
    """
    name = labels.get(LABEL_NODE) or node_id[:12]
    gpu_type, speed, problems = _typed(name, labels, gpus, accelerator)
    return NodeInfo(
        name=name,
        gpus=gpus,
        islands=decode_islands(labels.get(LABEL_NVLINK), gpus),
        leaf=labels.get(LABEL_LEAF, DEFAULT_LEAF),
        spine=labels.get(LABEL_SPINE),
        cpus=cpus,
        node_id=node_id,
        alive=alive,
        pinned_gpus=pinned_gpus,
        accelerator=accelerator,
        gpu_type=gpu_type,
        emulated_speed=speed,
        problems=tuple(problems),
    )


def _typed(name: str, labels: dict[str, str], gpus: int,
           accelerator: str | None) -> tuple[str | None, float | None, list[str]]:
    problems: list[str] = []
    detected = gpu_type_from_ray(accelerator)
    gpu_type = detected
    if labels.get(LABEL_GPU_TYPE):
        try:
            gpu_type = gpu_type_key(labels[LABEL_GPU_TYPE])
        except ValueError as exc:
            problems.append(f"label {LABEL_GPU_TYPE} ignored: {exc}")
    if detected and gpu_type != detected:
        problems.append(f"label {LABEL_GPU_TYPE}={gpu_type} although Ray detected {accelerator}; "
                        "the label is used")
    speed = None
    raw = labels.get(LABEL_EMULATED_SPEED)
    if raw:
        try:
            speed = emulated_speed_value(float(raw))
        except ValueError as exc:
            problems.append(f"label {LABEL_EMULATED_SPEED} ignored: {exc}")
        if speed is not None and (accelerator or not gpus):
            problems.append(emulation_refused(name, accelerator) + "; its label is ignored")
            speed = None
    return gpu_type, speed, problems


def emulation_refused(name: str, accelerator: str | None) -> str:
    """Why node `name` runs at full speed whatever its emulated speed says."""
    if accelerator:
        return (f"emulated_speed: node {name} has real GPUs ({accelerator} detected); "
                "emulation is for fake clusters only")
    return f"emulated_speed: node {name} has no GPUs whose ranks could be slowed"
