"""Accelerator data sheets for the auto-parallel planner (platform/planning/planner.py).

Pure: stdlib only, so the planner runs in the CLI and the control plane alike.

Conventions, the same for every entry so that the cost model can compare them:

* `peak_flops` is dense bf16 tensor-core FLOP/s (no 2:4 sparsity);
* bandwidths are per GPU, one direction, as a collective can use them: NVLink's
  data-sheet figure is bidirectional, so it is halved. `internode_bytes_per_s` is
  the share of the node's network each GPU gets when the whole node sends at
  once: the node's NICs (Gb/s / 8, one direction) over its GPUs. On the DGX/HGX
  layouts below each GPU has its own NIC (a "rail"), so the share is one NIC;
  `nic_bytes_per_s` is what one GPU gets when it sends alone (one NIC, where a
  node has fewer NICs than GPUs it is above the share). How the planner uses
  them (a ring whose k members share a node gets k shares) is in
  platform/planning/comm.py;
* latencies are NCCL's own model of a ring step with its Simple protocol
  (`ncclTunerConstantsDefaults` in NCCL's src/graph/tuning.cc: base 8.4 us per
  collective, 3.4 us a step over NVLink, 14 us a step that crosses the network),
  which NCCL uses to choose its algorithm;
* `hbm_bytes` is the memory a process can address (binary GiB for the 40/80 GB
  parts, as NVIDIA ships them; the H200's 141 GB is decimal);
* `mfu_ceiling` is the fraction of peak that large training GEMMs reach in
  practice, before pipeline bubbles and exposed communication. On A100, 0.6:
  end to end, with their communication included, Megatron-LM reaches 44-52%
  (Narayanan et al. 2021, Table 1), PyTorch FSDP 55-60% on GPT-175B (Zhao et
  al. 2023, Sec. 5.4), FSDP on Llama-2 57-67% of peak in hardware FLOPs (IBM
  and PyTorch, "Maximizing training throughput using PyTorch FSDP", 2024);
  tests/unit/test_planner_calibration.py holds the planner to those runs;
* `reserved_bytes` is memory no tensor can use: CUDA context, NCCL buffers,
  allocator fragmentation.

The `cpu` entry is nominal: a CPU "accelerator" differs by orders of magnitude
between machines, so callers measure (a matmul, a loopback all-reduce) and pass
the results to `calibrated()`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One accelerator type as the cost model sees it.

    Attributes:
        name: Catalog key, e.g. ``h100-80gb``.
        peak_flops: Dense bf16 FLOP/s.
        hbm_bytes: Device memory in bytes.
        nvlink_bytes_per_s: Intra-node bandwidth per GPU, one direction.
        internode_bytes_per_s: Inter-node bandwidth per GPU, one direction, when every GPU
            of the node sends at once (the node's NICs over its GPUs).
        gpus_per_node: GPUs in one NVLink domain (one node).
        mfu_ceiling: Achievable fraction of `peak_flops` for large GEMMs.
        reserved_bytes: Memory lost to the runtime before any tensor is allocated.
        nic_bytes_per_s: One GPU's inter-node bandwidth when it sends alone (one NIC);
            None: the same as `internode_bytes_per_s` (a NIC per GPU).
        base_latency_s: Fixed cost of one collective call.
        hop_latency_s: One ring step inside a node.
        net_hop_latency_s: One ring step that crosses to another node.
        rings_aggregate_nics: Whether a ring that spans nodes moves each byte through
            the node's network once for all of its members on the node (NCCL's channels
            spread over every NIC), so that a ring with k members a node gets k shares;
            False: every member's traffic is charged to its own share. Measurable: the
            bus bandwidth nccl-tests' all_gather_perf reports across nodes, about
            `gpus_per_node x internode_bytes_per_s` when it holds. False by default,
            the conservative figure (see platform/planning/comm.py).
    """

    name: str
    peak_flops: float
    hbm_bytes: int
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    gpus_per_node: int = 8
    mfu_ceiling: float = 0.5
    reserved_bytes: int = GiB
    nic_bytes_per_s: float | None = None
    base_latency_s: float = 8.4e-6
    hop_latency_s: float = 3.4e-6
    net_hop_latency_s: float = 14e-6
    rings_aggregate_nics: bool = False

    def __post_init__(self) -> None:
        for attr in ("peak_flops", "hbm_bytes", "nvlink_bytes_per_s", "internode_bytes_per_s",
                     "gpus_per_node"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"accelerator {self.name!r}: {attr} must be positive, "
                                 f"got {getattr(self, attr)!r}")
        if not 0 < self.mfu_ceiling <= 1:
            raise ValueError(f"accelerator {self.name!r}: mfu_ceiling must be in (0, 1], "
                             f"got {self.mfu_ceiling!r}")
        if self.reserved_bytes < 0 or self.reserved_bytes >= self.hbm_bytes:
            raise ValueError(f"accelerator {self.name!r}: reserved_bytes must be in [0, hbm_bytes)")
        if self.nic_bytes_per_s is not None and not self.nic_bytes_per_s >= self.internode_bytes_per_s:
            raise ValueError(f"accelerator {self.name!r}: nic_bytes_per_s (one GPU sending alone) "
                             "must be at least internode_bytes_per_s (its share of the node's NICs)")
        for attr in ("base_latency_s", "hop_latency_s", "net_hop_latency_s"):
            if not getattr(self, attr) >= 0:
                raise ValueError(f"accelerator {self.name!r}: {attr} must be >= 0")

    @property
    def nic_alone_bytes_per_s(self) -> float:
        """Inter-node bandwidth of one GPU sending while the rest of its node is quiet."""
        return self.nic_bytes_per_s if self.nic_bytes_per_s is not None else self.internode_bytes_per_s


# A100 SXM: 312 TFLOP/s bf16; NVLink3 600 GB/s bidirectional; DGX A100: eight HDR
# InfiniBand 200 Gb/s NICs, one per GPU (as on Selene, Narayanan et al. 2021, Sec. 5).
# H100 SXM: 989 TFLOP/s; NVLink4 900 GB/s; DGX H100: eight ConnectX-7 NDR 400 Gb/s,
# one per GPU. H200: the H100's compute and links with 141 GB HBM3e. (NVIDIA data
# sheets.) Clusters with fewer NICs than GPUs (e.g. 400 Gb/s for a whole 8-GPU
# node) are a `calibrated()` copy with a smaller internode_bytes_per_s and
# nic_bytes_per_s set to one NIC.
CATALOG: dict[str, Accelerator] = {
    "a100-40gb": Accelerator("a100-40gb", peak_flops=312e12, hbm_bytes=40 * GiB,
                             nvlink_bytes_per_s=300e9, internode_bytes_per_s=25e9, mfu_ceiling=0.6),
    "a100-80gb": Accelerator("a100-80gb", peak_flops=312e12, hbm_bytes=80 * GiB,
                             nvlink_bytes_per_s=300e9, internode_bytes_per_s=25e9, mfu_ceiling=0.6),
    # Hopper reaches a smaller fraction of its (much higher) peak: the same
    # kernels become more memory- and launch-bound.
    "h100-80gb": Accelerator("h100-80gb", peak_flops=989e12, hbm_bytes=80 * GiB,
                             nvlink_bytes_per_s=450e9, internode_bytes_per_s=50e9, mfu_ceiling=0.5),
    "h200-141gb": Accelerator("h200-141gb", peak_flops=989e12, hbm_bytes=141 * 10**9,
                              nvlink_bytes_per_s=450e9, internode_bytes_per_s=50e9, mfu_ceiling=0.5),
    # Nominal: ranks are processes, "NVLink" is shared memory, the network is
    # ordinary Ethernet. Replace with measured numbers via `calibrated()`.
    "cpu": Accelerator("cpu", peak_flops=50e9, hbm_bytes=16 * GiB, nvlink_bytes_per_s=5e9,
                       internode_bytes_per_s=1e9, gpus_per_node=2, mfu_ceiling=0.5,
                       reserved_bytes=GiB // 2, base_latency_s=50e-6, hop_latency_s=20e-6,
                       net_hop_latency_s=50e-6),
}


def get_accelerator(name: str) -> Accelerator:
    """Look up a catalog entry by name (case-insensitive).

    Raises:
        ValueError: For an unknown name; the message lists the known ones.
    """
    try:
        return CATALOG[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(sorted(CATALOG))}") from None


def calibrated(acc: Accelerator, peak_flops: float | None = None,
               nvlink_bytes_per_s: float | None = None, internode_bytes_per_s: float | None = None,
               efficiency: float | None = None, hbm_bytes: int | None = None, *,
               nic_bytes_per_s: float | None = None, base_latency_s: float | None = None,
               hop_latency_s: float | None = None,
               net_hop_latency_s: float | None = None,
               rings_aggregate_nics: bool | None = None) -> Accelerator:
    """A copy of `acc` with measured values in place of the data-sheet ones.

    Args:
        acc: The entry to start from.
        peak_flops: Measured FLOP/s of a large matmul.
        nvlink_bytes_per_s: Measured intra-node all-reduce bus bandwidth.
        internode_bytes_per_s: Measured inter-node all-reduce bus bandwidth.
        efficiency: Replaces `mfu_ceiling`; pass 1.0 when `peak_flops` is already
            an achieved figure rather than a data-sheet peak.
        hbm_bytes: Memory a rank may use (for `cpu`: its share of RAM).
        nic_bytes_per_s: One GPU's inter-node bandwidth when it sends alone.
        base_latency_s, hop_latency_s, net_hop_latency_s: Measured collective latencies
            (fixed per call, per ring step in a node, per step across nodes).
        rings_aggregate_nics: Measured: a whole-node ring's bus bandwidth across nodes is
            about the node's NICs together, not one GPU's share.
    """
    changes: dict[str, Any] = {}
    for key, value in (("peak_flops", peak_flops), ("nvlink_bytes_per_s", nvlink_bytes_per_s),
                       ("internode_bytes_per_s", internode_bytes_per_s),
                       ("mfu_ceiling", efficiency), ("hbm_bytes", hbm_bytes),
                       ("nic_bytes_per_s", nic_bytes_per_s), ("base_latency_s", base_latency_s),
                       ("hop_latency_s", hop_latency_s), ("net_hop_latency_s", net_hop_latency_s),
                       ("rings_aggregate_nics", rings_aggregate_nics)):
        if value is not None:
            changes[key] = value
    return replace(acc, **changes)


# --- GPU types: the catalogue's keys as a node's `gpu_type` -----------------------

def gpu_types() -> list[str]:
    """The catalogue's GPU types, sorted: every key but `cpu`, which is no GPU."""
    return sorted(k for k in CATALOG if k != "cpu")


def gpu_type_key(name: str) -> str:
    """`name` as a catalogue GPU type (case-insensitive, surrounding blanks ignored).

    Raises:
        ValueError: For a name that is no GPU type; the message lists the known ones.
    """
    key = str(name).strip().lower()
    if key not in CATALOG or key == "cpu":
        raise ValueError(f"{name!r} is not a GPU type in the catalogue; known types: "
                         f"{', '.join(gpu_types())}")
    return key


def speed_of(gpu_type: str) -> float:
    """The FLOP/s a GPU of this type achieves on training GEMMs, `peak_flops x
    mfu_ceiling`: what work is balanced by. A data-sheet peak alone would
    overrate Hopper against Ampere (it reaches a smaller fraction of its peak).

    Raises:
        ValueError: For a type the catalogue does not have.
    """
    acc = get_accelerator(gpu_type)
    return acc.peak_flops * acc.mfu_ceiling


# Ray's accelerator names (its `accelerator_type:X` resource). Ray derives them
# from the product name and drops the memory, so a plain "A100" may be either
# size and maps to nothing; "A100-40G"/"A100-80G" are the names an operator adds
# by hand. Ray names the H100's SXM, PCIe and NVL parts alike; the catalogue's
# entry is the SXM part, the common one in training clusters. A node whose GPUs
# are another part says so with its `kc.io/gpu-type` label (`kc node join`
# reads the exact product from nvidia-smi), which wins over Ray's name.
_RAY_NAMES = {"A100-40G": "a100-40gb", "A100-80G": "a100-80gb", "H100": "h100-80gb",
              "H200": "h200-141gb"}


def gpu_type_from_ray(accelerator_type: str | None) -> str | None:
    """The catalogue type for Ray's detected accelerator name; None when the name is
    unknown or does not tell the type (e.g. "A100": 40 or 80 GB)."""
    if not accelerator_type:
        return None
    return _RAY_NAMES.get(accelerator_type.strip().upper())


# Product family -> (type, the memory nvidia-smi reports for it, GiB, low..high).
# The memory check keeps a part the catalogue does not describe (the H100 NVL's
# 94 GB, a GH200) from passing as its namesake.
_PRODUCTS = {"A100": (("a100-40gb", 36, 44), ("a100-80gb", 72, 88)),
             "H100": (("h100-80gb", 72, 88),),
             "H200": (("h200-141gb", 128, 144),)}
# The PCIe and NVL parts of Hopper run at lower clocks and power than the SXM
# parts the catalogue's figures are for; the A100's PCIe part has the SXM's peak.
_SLOWER_PARTS = {"H100": {"PCIE", "NVL"}, "H200": {"NVL"}}


def gpu_type_from_product(name: str, memory_mib: int | float) -> str | None:
    """The catalogue type for nvidia-smi's product name and total memory (MiB),
    e.g. ("NVIDIA H100 80GB HBM3", 81559) -> "h100-80gb"; None for a product the
    catalogue does not describe."""
    words = set(re.split(r"[\s_-]+", str(name).upper()))
    gib = float(memory_mib) / 1024
    for family, sizes in _PRODUCTS.items():
        if family not in words:
            continue
        if words & _SLOWER_PARTS.get(family, set()):
            return None
        return next((key for key, low, high in sizes if low <= gib <= high), None)
    return None
