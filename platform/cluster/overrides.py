"""An operator's word on a node's GPU type and emulated speed.

`kc node set NAME --gpu-type T --emulated-speed S` (`PATCH /v1/nodes/{name}`)
stores an override per node in Redis (`info:node_overrides`); the registry
applies it over what the labels and Ray's detection said (registry.current_nodes),
so it survives a raylet restart and needs no relabelling. A null value clears
that field's override: the node goes back to its label or detected type.

Precedence of a node's GPU type: override, else the `kc.io/gpu-type` label,
else Ray's detected accelerator mapped to the catalogue. An emulated speed is
never applied to a node where Ray detected real GPUs: the API refuses to store
one, and one stored before the node got its GPUs is ignored and named in the
node's `problems`.

Pure: the store is passed in.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from kuangchao.platform.cluster.hardware import gpu_type_key
from kuangchao.platform.cluster.topology import NodeInfo, emulated_speed_value, emulation_refused
from kuangchao.platform.errors import SpecError

OVERRIDES_INFO = "node_overrides"
FIELDS = ("gpu_type", "emulated_speed")


def checked(node: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` (a subset of FIELDS; None clears) for the registry's entry `node`,
    with the GPU type as its catalogue key.

    Raises:
        SpecError: One `(field, message)` per bad value, saying what to change.
    """
    problems: list[tuple[str, str]] = []
    out: dict[str, Any] = {}
    name, gpus = node["name"], int(node.get("gpus") or 0)
    if not changes:
        problems.append(("", f"send gpu_type, emulated_speed or both (null clears the "
                             f"override) for node {name}"))
    for field in set(changes) - set(FIELDS):
        problems.append((field, f"unknown field; a node override sets {' and '.join(FIELDS)}"))
    if changes.get("gpu_type") is not None:
        try:
            out["gpu_type"] = gpu_type_key(changes["gpu_type"])
        except ValueError as exc:
            problems.append(("gpu_type", str(exc)))
        if not gpus:
            problems.append(("gpu_type", f"node {name} has no GPUs"))
    elif "gpu_type" in changes:
        out["gpu_type"] = None
    if changes.get("emulated_speed") is not None:
        try:
            out["emulated_speed"] = emulated_speed_value(changes["emulated_speed"])
        except ValueError as exc:
            problems.append(("emulated_speed", str(exc)))
        if node.get("accelerator") or not gpus:
            problems.append(("emulated_speed", emulation_refused(name, node.get("accelerator"))))
    elif "emulated_speed" in changes:
        out["emulated_speed"] = None
    if problems:
        raise SpecError(problems)
    return out


def stored(doc: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Node name -> its override, from the stored document."""
    nodes = (doc or {}).get("nodes")
    return nodes if isinstance(nodes, dict) else {}


def store_override(store: Any, name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """Merge checked `changes` into node `name`'s stored override; returns it.

    A read-modify-write of one document: two operators changing overrides in
    the same instant may lose one change (`kc nodes` shows what stuck).
    """
    nodes = stored(store.info(OVERRIDES_INFO))
    mine = {k: v for k, v in {**nodes.get(name, {}), **changes}.items() if v is not None}
    if mine:
        nodes[name] = mine
    else:
        nodes.pop(name, None)
    store.set_info(OVERRIDES_INFO, {"nodes": nodes, "updated_at": time.time()})
    return mine


def apply_overrides(nodes: tuple[NodeInfo, ...], doc: dict[str, Any] | None) -> tuple[NodeInfo, ...]:
    """The nodes with their stored overrides applied (see the module's docstring)."""
    table = stored(doc)
    return tuple(_apply(n, table[n.name]) if table.get(n.name) else n for n in nodes)


def _apply(node: NodeInfo, override: dict[str, Any]) -> NodeInfo:
    changes: dict[str, Any] = {}
    problems = list(node.problems)
    if override.get("gpu_type") is not None:
        try:
            changes["gpu_type"] = gpu_type_key(override["gpu_type"])
        except ValueError as exc:  # a type the catalogue has since dropped
            problems.append(f"override gpu_type ignored: {exc}")
    if override.get("emulated_speed") is not None:
        if node.accelerator or not node.gpus:
            problems.append(emulation_refused(node.name, node.accelerator)
                            + "; its override is ignored")
        else:
            try:
                changes["emulated_speed"] = emulated_speed_value(override["emulated_speed"])
            except ValueError as exc:
                problems.append(f"override emulated_speed ignored: {exc}")
    return replace(node, **changes, problems=tuple(problems))
