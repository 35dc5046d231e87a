"""What one collective costs on the wire, as NCCL runs it (pure: stdlib only).

The cost model (`cost.py`) prices each collective the engine issues with
these; `workers/parallel/data_parallel.py` asks `allreduce_costs` whether the
two-level all-reduce hook beats NCCL's own.

A collective over `ranks` ranks, `per_node` of them on each node (the ring
visits a node's members one after another), takes

    latency + volume * nbytes / bus_bandwidth

* volume: (n-1)/n for all-gather and reduce-scatter (nbytes is the whole,
  gathered buffer), 2(n-1)/n for all-reduce, 1 for broadcast (the ring
  algorithms' bus-bandwidth factors, as nccl-tests defines them).
* bus bandwidth: NVLink inside one node. Across nodes, every GPU of a node
  communicates at once in the layouts the planner builds (one group per `tp x
  pp` position, or per shard under HSDP), so by default each rank's traffic is
  charged to its own share of the node's network, `internode_bytes_per_s` (one
  NIC on DGX A100/H100): a flat ring moves all of its bytes at that rate, which
  is what makes a hierarchical all-reduce (only 1/k of the bytes across nodes)
  or HSDP (sharding inside the node) pay off. This is what DeepSpeed's ZeRO-3
  measured on Selene (Narayanan et al. 2021, Table 2: 175B at 384-1,536 A100s,
  each GPU's gathers and reduce-scatters at about one NIC's rate). Where NCCL
  spreads a ring's channels over all of a node's NICs, a ring passes each node
  once and the node's NICs carry each byte once for all its `per_node`
  members (NCCL's tuner: bus bandwidth = channels x per-channel network
  bandwidth); published FSDP runs on other clusters show that (Zhao et al.
  2023; IBM and PyTorch 2024: 2-3x the per-GPU figure). An accelerator entry
  measured to do so sets `rings_aggregate_nics`, and a ring then gets
  `per_node` shares, at most NVLink.
* latency: NCCL's model (src/graph/tuning.cc, Ring/Simple): a base per call
  plus one hop per ring step, `hop_latency_s` inside a node and
  `net_hop_latency_s` for the (nodes - 1) steps that cross the network;
  all-gather and reduce-scatter take n - 1 steps, a ring all-reduce 2(n - 1).
  For all-reduce NCCL may take its tree instead, 2((per_node - 1) in-node hops
  + log2(nodes) network hops); the cheaper of the two is used, as NCCL's tuner
  does. Broadcast (ZeroRedundancyOptimizer's parameter sync) is a ring of n steps.
* all-to-all (expert parallelism's dispatch and combine): every rank sends
  each other rank its own 1/n of the buffer, volume (n-1)/n, as NCCL's grouped
  send/recv pairs, all issued at once: one step of latency (a network hop when
  the group spans nodes). Its bytes are distinct per destination, so no NIC
  aggregation: across nodes each rank moves them at its own share of the
  node's network, the slowest link the group crosses.
"""

from __future__ import annotations

import math

from kuangchao.platform.cluster.hardware import Accelerator

# torch DDP's default `bucket_cap_mb` (25 MiB): gradients travel in buckets of this
# size, each its own all-reduce (torch/nn/parallel/distributed.py).
DDP_BUCKET_BYTES = 25 * 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def nodes_of(ranks: int, per_node: int) -> int:
    return max(1, -(-ranks // max(1, per_node)))


def bus_bandwidth(ranks: int, per_node: int, acc: Accelerator) -> float:
    """Bytes/s a ring moves per rank: NVLink in one node; across nodes one share of the
    node's network, or `per_node` shares where rings aggregate the NICs."""
    if nodes_of(ranks, per_node) <= 1:
        return acc.nvlink_bytes_per_s
    shares = max(1, per_node) if acc.rings_aggregate_nics else 1
    return min(acc.nvlink_bytes_per_s, shares * acc.internode_bytes_per_s)


def latency(kind: str, ranks: int, per_node: int, acc: Accelerator) -> float:
    """Seconds one collective of `kind` spends on NCCL's per-call and per-step latency."""
    if ranks <= 1:
        return 0.0
    nodes = nodes_of(ranks, per_node)
    if kind == "all_to_all":
        return acc.base_latency_s + (acc.net_hop_latency_s if nodes > 1 else acc.hop_latency_s)
    steps = {"all_gather": ranks - 1, "reduce_scatter": ranks - 1, "all_reduce": 2 * (ranks - 1),
             "broadcast": ranks}[kind]
    cross = (nodes - 1) * (2 if kind == "all_reduce" else 1)
    ring = acc.base_latency_s + (steps - cross) * acc.hop_latency_s + cross * acc.net_hop_latency_s
    if kind != "all_reduce" or nodes <= 1:
        return ring
    local = min(per_node, ranks)
    tree = acc.base_latency_s + 2 * ((local - 1) * acc.hop_latency_s
                                     + math.ceil(math.log2(nodes)) * acc.net_hop_latency_s)
    return min(ring, tree)


def collective(kind: str, nbytes: float, ranks: int, per_node: int, acc: Accelerator) -> float:
    """Seconds for one collective of `kind` over `nbytes` (see the module docstring)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    volume = {"all_gather": (ranks - 1) / ranks, "reduce_scatter": (ranks - 1) / ranks,
              "all_reduce": 2 * (ranks - 1) / ranks, "broadcast": 1.0,
              "all_to_all": (ranks - 1) / ranks}[kind]
    if kind == "all_to_all":  # per destination: no ring to share a node's NICs
        bw = acc.nvlink_bytes_per_s if nodes_of(ranks, per_node) <= 1 else \
            min(acc.nvlink_bytes_per_s, acc.internode_bytes_per_s)
    else:
        bw = bus_bandwidth(ranks, per_node, acc)
    return latency(kind, ranks, per_node, acc) + volume * nbytes / bw


def p2p(nbytes: float, crosses: bool, senders_per_node: int, acc: Accelerator,
        node_size: int) -> float:
    """Seconds for one send between pipeline stages: NVLink, or a NIC shared by the
    `senders_per_node` GPUs of a node that send across at the same time."""
    if not crosses:
        return acc.base_latency_s + acc.hop_latency_s + nbytes / acc.nvlink_bytes_per_s
    share = acc.internode_bytes_per_s * node_size / max(1, senders_per_node)
    bw = min(acc.nic_alone_bytes_per_s, share)
    return acc.base_latency_s + acc.net_hop_latency_s + nbytes / bw


def allreduce_costs(nbytes: float, ranks: int, ranks_per_node: int, acc: Accelerator) -> tuple[float, float]:
    """Seconds to all-reduce `nbytes` of gradients per rank in DDP's buckets: (NCCL's own
    all-reduce over the whole group, the engine's two-level hook).

    The hook (workers/parallel/comm_hooks.py `Hierarchy`) reduce-scatters each bucket
    over NVLink, all-reduces its 1/k across nodes (k rings at once, one member per
    node each: one share of the NICs apiece), and all-gathers over NVLink. Each
    rank sends 1/k of the flat ring's bytes across nodes, so it wins wherever a
    flat ring's traffic is charged per GPU; where rings aggregate the node's NICs
    (`rings_aggregate_nics`) the cross-node bytes per node are the same and it can
    only win on latency. Within one node both are the same NVLink all-reduce.
    """
    if ranks <= 1:
        return 0.0, 0.0
    buckets = max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))
    k = max(1, min(ranks_per_node, ranks))
    flat = (buckets * latency("all_reduce", ranks, k, acc)
            + 2 * (ranks - 1) / ranks * nbytes / bus_bandwidth(ranks, k, acc))
    n = ranks // k
    if n <= 1:
        return flat, flat
    per_bucket = (latency("reduce_scatter", k, k, acc) + latency("all_reduce", n, 1, acc)
                  + latency("all_gather", k, k, acc))
    hier = (buckets * per_bucket + 2 * (k - 1) / k * nbytes / acc.nvlink_bytes_per_s
            + 2 * (n - 1) / n * (nbytes / k) / bus_bandwidth(n, 1, acc))
    return flat, hier
