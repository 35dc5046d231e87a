"""`kc node join`: start a raylet that joins a cluster with kuangchao's labels.

Topology comes from the GPUs themselves when `nvidia-smi` is present (NVLink
islands are the connected groups of `nvidia-smi topo -m`'s NV# links; the GPU
type from the product name and memory, platform/cluster/detect.py), and from
flags otherwise. The raylet gets the `kc.io/*` labels and one `kc_gpu_N`
resource per GPU, so the placement solver can pin ranks to exact GPU ids.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kuangchao.platform.cluster.detect import describe, gpu_type_of, query_gpus
from kuangchao.platform.cluster.hardware import gpu_type_key
from kuangchao.platform.cluster.topology import (
    NodeInfo,
    decode_islands,
    emulated_speed_value,
    gpu_resource,
)
from kuangchao.platform.errors import TopologyError

_GPU_ROW = re.compile(r"^GPU(\d+)\s+(.*)$")


def islands_from_topo_matrix(text: str) -> tuple[tuple[int, ...], ...]:
    """NVLink islands from `nvidia-smi topo -m` output: GPUs joined by NV# links."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _GPU_ROW.match(line.strip())
        if m:
            rows[int(m.group(1))] = m.group(2).split()
    n = len(rows)
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, cells in rows.items():
        for j, cell in enumerate(cells[:n]):
            if cell.startswith("NV") and j != i:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for g in range(n):
        groups.setdefault(find(g), []).append(g)
    return tuple(tuple(v) for v in sorted(groups.values()))


def detect_gpus() -> tuple[int, tuple[tuple[int, ...], ...]] | None:
    """(GPU count, islands) from nvidia-smi, or None when there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    islands = islands_from_topo_matrix(out)
    return sum(len(i) for i in islands), islands


@dataclass(frozen=True)
class JoinOptions:
    address: str
    name: str
    leaf: str
    spine: str | None = None
    gpus: int | None = None
    nvlink: str | None = None
    cpus: int | None = None
    extra: tuple[str, ...] = ()  # more `ray start` flags, as given
    gpu_type: str | None = None
    emulated_speed: float | None = None


def node_for(opts: JoinOptions) -> NodeInfo:
    """The node to announce: detected GPUs win over flags; flags fill the gaps.

    Raises:
        TopologyError: When the flags contradict each other or the hardware.
    """
    detected = detect_gpus()
    if detected is not None:
        gpus, islands = detected
        if opts.gpus is not None and opts.gpus != gpus:
            raise TopologyError(f"--gpus {opts.gpus} but nvidia-smi shows {gpus} GPUs; drop --gpus")
    else:
        gpus = opts.gpus or 0
        islands = decode_islands(opts.nvlink or ("full" if gpus else None), gpus)
    gpu_type, speed = _gpu_type_and_speed(opts, gpus, query_gpus())
    return NodeInfo(name=opts.name, gpus=gpus, islands=islands, leaf=opts.leaf, spine=opts.spine,
                    cpus=float(opts.cpus or 0), gpu_type=gpu_type, emulated_speed=speed)


def _gpu_type_and_speed(opts: JoinOptions, gpus: int,
                        real: list[tuple[str, int]] | None) -> tuple[str | None, float | None]:
    """The type nvidia-smi's GPUs make, else `--gpu-type`; `--emulated-speed` only
    where nvidia-smi lists no GPU."""
    gpu_type = None
    if opts.gpu_type is not None:
        try:
            gpu_type = gpu_type_key(opts.gpu_type)
        except ValueError as exc:
            raise TopologyError(f"--gpu-type: {exc}") from None
        if not gpus:
            raise TopologyError("--gpu-type: this node offers no GPUs; drop --gpu-type or pass --gpus")
    if real:
        found = gpu_type_of(real)
        if found and gpu_type and found != gpu_type:
            raise TopologyError(f"--gpu-type {gpu_type} but nvidia-smi shows {describe(real)} "
                                f"({found}); drop --gpu-type")
        gpu_type = found or gpu_type
    if opts.emulated_speed is None:
        return gpu_type, None
    if real:
        raise TopologyError(f"--emulated-speed: nvidia-smi shows real GPUs ({describe(real)}); "
                            "emulation is for fake clusters only, drop --emulated-speed")
    if not gpus:
        raise TopologyError("--emulated-speed: this node offers no GPUs whose ranks could be "
                            "slowed; drop --emulated-speed or pass --gpus")
    try:
        return gpu_type, emulated_speed_value(opts.emulated_speed)
    except ValueError as exc:
        raise TopologyError(f"--emulated-speed: {exc}") from None


def ray_start_args(opts: JoinOptions, node: NodeInfo) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in node.labels().items())
    args = [f"--address={opts.address}", f"--num-gpus={node.gpus}", f"--labels={labels}"]
    if node.gpus:
        args.append(f"--resources={json.dumps({gpu_resource(g): 1 for g in range(node.gpus)})}")
    if opts.cpus is not None:
        args.append(f"--num-cpus={opts.cpus}")
    return [*args, *opts.extra]


def join(opts: JoinOptions, block: bool = False) -> NodeInfo:
    """Run `ray start` for this node. Raises `TopologyError` if Ray refuses.

    With `block`, this process becomes the raylet's `ray start --block`: a
    container's stop signal then reaches Ray, and the container ends with it.
    """
    node = node_for(opts)
    ray = Path(sys.executable).parent / "ray"
    args = [str(ray), "start", *ray_start_args(opts, node), "--disable-usage-stats"]
    if block:
        print(f"{node.name}: {node.gpus} GPU(s) of type {node.gpu_type or 'unknown'}, islands "
              f"{[list(i) for i in node.islands]}, leaf {node.leaf}; joining {opts.address}",
              file=sys.stderr, flush=True)
        os.execv(str(ray), [*args, "--block"])
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise TopologyError(f"`ray start` failed to join {opts.address}:\n{out.stderr[-2000:]}")
    return node
