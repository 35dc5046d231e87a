"""What GPUs this machine really has, from nvidia-smi: the product and memory
of each, and the catalogue type they make.

`kc node join` labels the node with the type it finds, and both it and `kc up`
refuse an emulated speed where real GPUs are present: emulation slows a fake
cluster's CPU ranks, and on real GPUs it would only waste them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

from kuangchao.platform.cluster.hardware import gpu_type_from_product
from kuangchao.platform.cluster.topology import NodeInfo
from kuangchao.platform.errors import ClusterError

QUERY = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]

Gpu = tuple[str, int]  # (product name, total memory in MiB)


def parse_gpu_query(text: str) -> list[Gpu]:
    """The GPUs in the output of `nvidia-smi --query-gpu=name,memory.total
    --format=csv,noheader,nounits`: one `NAME, MIB` line each. Lines that are not
    such a pair (a driver warning) are skipped."""
    out = []
    for line in text.splitlines():
        name, _, memory = line.rpartition(",")
        try:
            mib = int(float(memory.strip()))
        except ValueError:
            continue
        if name.strip():
            out.append((name.strip(), mib))
    return out


def query_gpus() -> list[Gpu] | None:
    """This machine's GPUs as nvidia-smi lists them; None without nvidia-smi, or
    when it fails (no driver loaded: no GPU a process could use)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return parse_gpu_query(out)


def gpu_type_of(gpus: Sequence[Gpu]) -> str | None:
    """The catalogue type of a node's GPUs: None when there are none, when the
    catalogue does not describe them, or when they are not all one type."""
    types = {gpu_type_from_product(name, mib) for name, mib in gpus}
    return types.pop() if len(types) == 1 else None


def describe(gpus: Sequence[Gpu]) -> str:
    names = sorted({name for name, _ in gpus})
    return f"{len(gpus)} x {', '.join(names)}"


def refuse_emulation(nodes: Sequence[NodeInfo], gpus: Sequence[Gpu] | None) -> None:
    """`kc up`'s check: a cluster YAML that emulates slow nodes runs only on a
    machine without real GPUs.

    Raises:
        ClusterError: Naming the nodes to change.
    """
    emulated = [f"nodes[{i}].emulated_speed ({n.name})" for i, n in enumerate(nodes)
                if n.emulated_speed is not None]
    if gpus and emulated:
        raise ClusterError(
            f"{', '.join(emulated)}: this machine has real GPUs (nvidia-smi lists "
            f"{describe(gpus)}); emulation is for fake clusters only. Remove emulated_speed "
            "from the cluster YAML, or run it on a machine without GPUs")
