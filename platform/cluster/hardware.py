"""Accelerator data sheets for the auto-parallel planner (platform/planning/planner.py).

Pure: stdlib only, so the planner runs in the CLI and the control plane alike.

Conventions, the same for every entry so that the cost model can compare them:

* `peak_flops` is dense bf16 tensor-core FLOP/s (no 2:4 sparsity);
* bandwidths are per GPU, one direction, as a collective can use them: NVLink's
  data-sheet figure is bidirectional, so it is halved; InfiniBand is one NIC per
  GPU (DGX/HGX layout), Gb/s divided by 8;
* `hbm_bytes` is the memory a process can address (binary GiB for the 40/80 GB
  parts, as NVIDIA ships them; the H200's 141 GB is decimal);
* `mfu_ceiling` is the fraction of peak that large training GEMMs reach in
  practice, before pipeline bubbles and exposed communication (Megatron-LM
  reports 44-52% of peak end to end on A100, Narayanan et al. 2021, Table 1);
* `reserved_bytes` is memory no tensor can use: CUDA context, NCCL buffers,
  allocator fragmentation.

The `cpu` entry is nominal: a CPU "accelerator" differs by orders of magnitude
between machines, so callers measure (a matmul, a loopback all-reduce) and pass
the results to `calibrated()`.
"""

from __future__ import annotations

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
        internode_bytes_per_s: Inter-node (NIC) bandwidth per GPU, one direction.
        gpus_per_node: GPUs in one NVLink domain (one node).
        mfu_ceiling: Achievable fraction of `peak_flops` for large GEMMs.
        reserved_bytes: Memory lost to the runtime before any tensor is allocated.
    """

    name: str
    peak_flops: float
    hbm_bytes: int
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    gpus_per_node: int = 8
    mfu_ceiling: float = 0.5
    reserved_bytes: int = GiB

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


# A100 SXM: 312 TFLOP/s bf16; NVLink3 600 GB/s bidirectional; HDR InfiniBand
# 200 Gb/s per GPU. H100 SXM: 989 TFLOP/s; NVLink4 900 GB/s; NDR 400 Gb/s per GPU.
# H200: the H100's compute and links with 141 GB HBM3e. (NVIDIA data sheets.)
CATALOG: dict[str, Accelerator] = {
    "a100-40gb": Accelerator("a100-40gb", peak_flops=312e12, hbm_bytes=40 * GiB,
                             nvlink_bytes_per_s=300e9, internode_bytes_per_s=25e9, mfu_ceiling=0.55),
    "a100-80gb": Accelerator("a100-80gb", peak_flops=312e12, hbm_bytes=80 * GiB,
                             nvlink_bytes_per_s=300e9, internode_bytes_per_s=25e9, mfu_ceiling=0.55),
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
                       reserved_bytes=GiB // 2),
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
               efficiency: float | None = None, hbm_bytes: int | None = None) -> Accelerator:
    """A copy of `acc` with measured values in place of the data-sheet ones.

    Args:
        acc: The entry to start from.
        peak_flops: Measured FLOP/s of a large matmul.
        nvlink_bytes_per_s: Measured intra-node all-reduce bus bandwidth.
        internode_bytes_per_s: Measured inter-node all-reduce bus bandwidth.
        efficiency: Replaces `mfu_ceiling`; pass 1.0 when `peak_flops` is already
            an achieved figure rather than a data-sheet peak.
        hbm_bytes: Memory a rank may use (for `cpu`: its share of RAM).
    """
    changes: dict[str, Any] = {}
    for key, value in (("peak_flops", peak_flops), ("nvlink_bytes_per_s", nvlink_bytes_per_s),
                       ("internode_bytes_per_s", internode_bytes_per_s),
                       ("mfu_ceiling", efficiency), ("hbm_bytes", hbm_bytes)):
        if value is not None:
            changes[key] = value
    return replace(acc, **changes)
