"""A cluster of network hosts on one machine: the plan of namespaces, links and rates.

With `isolation: netns` in a cluster YAML, every fake node gets a Linux network
namespace of its own, so its raylet and every rank it starts have their own
address and reach the others only over links that can be cut or slowed:

    host side (head, API: .1; Redis: .2)
        |
    spine bridge ──uplink (spine_gbps)── leaf bridge ──link (leaf_gbps)── node netns (.10+)
                 ──uplink (spine_gbps)── leaf bridge ──link (leaf_gbps)── node netns
                                                     ──link (leaf_gbps)── node netns

All of it is one layer-2 segment, a /24 of 198.18.0.0/15: the range RFC 2544
sets aside for benchmarking network devices, which no real network routes.
Nodes get no default route, so traffic stays on the links the run made. Each
link is shaped in both directions with a token bucket (`tbf`) at its rate: two
nodes under one leaf meet at `leaf_gbps`, nodes under different leaves share
their leaves' uplinks at `spine_gbps` (an oversubscribed spine when it is the
lower).

This module is pure: it names things and writes the `ip`/`tc` commands;
platform/runtime/netns.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuangchao.platform.errors import TopologyError

ISOLATION = ("none", "netns")
TEST_RANGE = "198.18.0.0/15"  # RFC 2544: benchmarking only; never routed
SUBNETS = 256  # 198.18.0.0/24 ... 198.18.255.0/24, one per cluster on the machine
HOST_OCTET, REDIS_OCTET, FIRST_NODE_OCTET = 1, 2, 10
MAX_NODES = 254 - FIRST_NODE_OCTET
NODE_IF = "eth0"  # the interface's name inside every node's namespace
MTU = 9000  # as data-centre fabrics run; fewer packets for the token buckets to count
TBF_LATENCY_MS = 20  # the most a packet waits in a shaped link's queue before it drops


@dataclass(frozen=True)
class NetworkSpec:
    """The `isolation` part of a cluster YAML.

    Attributes:
        leaf_gbps: A node's link to its leaf switch, each way.
        spine_gbps: A leaf's uplink to the spine, each way.
        leaf_labels: Whether raylets carry their `kc.io/leaf` label. False
            leaves the structure for `kc topology probe` to find by measuring.
    """

    leaf_gbps: float = 10.0
    spine_gbps: float = 10.0
    leaf_labels: bool = True


def network_from_yaml(doc: dict[str, Any], where: str) -> NetworkSpec | None:
    """The YAML's `isolation`, `leaf_gbps`, `spine_gbps` and `leaf_labels`, checked.

    Returns None for `isolation: none` (the default: every node on loopback)."""
    isolation = doc.get("isolation", "none")
    if isolation not in ISOLATION:
        raise TopologyError(f"{where}: isolation must be one of {list(ISOLATION)}, "
                            f"got {isolation!r}")
    fields = {k: doc[k] for k in ("leaf_gbps", "spine_gbps", "leaf_labels") if k in doc}
    if isolation == "none":
        if fields:
            raise TopologyError(f"{where}: {sorted(fields)} shape the links of a netns "
                                "cluster; add `isolation: netns` or drop them")
        return None
    for key in ("leaf_gbps", "spine_gbps"):
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0.001 <= value <= 400):
            raise TopologyError(f"{where}: {key} must be a rate in Gbit/s between 0.001 "
                                f"and 400, got {value!r}")
    if not isinstance(fields.get("leaf_labels", True), bool):
        raise TopologyError(f"{where}: leaf_labels must be true or false")
    return NetworkSpec(**{k: (float(v) if k.endswith("gbps") else v) for k, v in fields.items()})


@dataclass(frozen=True)
class NetNode:
    name: str  # the cluster YAML's node name
    netns: str
    host_if: str  # its link's end on the leaf bridge
    addr: str
    leaf: str


@dataclass(frozen=True)
class NetPlan:
    """Names, addresses and rates of one netns cluster. `tag` (4 hex digits) marks
    every interface it makes (`kc<tag>...`) and every namespace (`kc-<tag>-<node>`),
    so that what one run made can always be found and removed."""

    tag: str
    subnet: int  # the third octet: 198.18.<subnet>.0/24
    spec: NetworkSpec
    nodes: tuple[NetNode, ...]
    leaves: tuple[str, ...]

    @property
    def prefix(self) -> str:
        return f"kc{self.tag}"

    def addr(self, octet: int) -> str:
        return f"198.18.{self.subnet}.{octet}"

    @property
    def host_addr(self) -> str:
        """The head's and the API's address: the host side of the spine."""
        return self.addr(HOST_OCTET)

    @property
    def redis_addr(self) -> str:
        """Redis's own address on the host side, so a node can be cut from Redis alone."""
        return self.addr(REDIS_OCTET)

    @property
    def spine_bridge(self) -> str:
        return f"{self.prefix}s"

    def leaf_bridge(self, i: int) -> str:
        return f"{self.prefix}l{i}"

    def uplink(self, i: int) -> tuple[str, str]:
        """The two ends of leaf `i`'s uplink: on the leaf bridge, on the spine bridge."""
        return f"{self.prefix}u{i}", f"{self.prefix}v{i}"

    def node(self, name: str) -> NetNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise TopologyError(f"no node {name!r} in this cluster; its nodes are "
                            f"{[n.name for n in self.nodes]}")

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "subnet": self.subnet, "leaf_gbps": self.spec.leaf_gbps,
                "spine_gbps": self.spec.spine_gbps, "leaf_labels": self.spec.leaf_labels,
                "leaves": list(self.leaves),
                "nodes": [{"name": n.name, "netns": n.netns, "host_if": n.host_if,
                           "addr": n.addr, "leaf": n.leaf} for n in self.nodes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NetPlan:
        spec = NetworkSpec(float(d["leaf_gbps"]), float(d["spine_gbps"]),
                           bool(d.get("leaf_labels", True)))
        return cls(tag=d["tag"], subnet=int(d["subnet"]), spec=spec,
                   nodes=tuple(NetNode(**n) for n in d["nodes"]), leaves=tuple(d["leaves"]))

    # -- commands --------------------------------------------------------------
    def build(self) -> list[list[str]]:
        """Every command that makes the network, in order."""
        spine = self.spine_bridge
        cmds = [["ip", "link", "add", spine, "mtu", str(MTU), "type", "bridge"],
                ["ip", "addr", "add", f"{self.host_addr}/24", "dev", spine],
                ["ip", "addr", "add", f"{self.redis_addr}/24", "dev", spine],
                ["ip", "link", "set", spine, "up"]]
        for i, _ in enumerate(self.leaves):
            bridge, (down, up) = self.leaf_bridge(i), self.uplink(i)
            cmds += [["ip", "link", "add", bridge, "mtu", str(MTU), "type", "bridge"],
                     ["ip", "link", "set", bridge, "up"],
                     ["ip", "link", "add", down, "mtu", str(MTU), "type", "veth",
                      "peer", "name", up, "mtu", str(MTU)],
                     ["ip", "link", "set", down, "master", bridge, "up"],
                     ["ip", "link", "set", up, "master", spine, "up"],
                     shape(down, self.spec.spine_gbps), shape(up, self.spec.spine_gbps)]
        for j, n in enumerate(self.nodes):
            inner = f"{self.prefix}m{j}"
            ns = ["ip", "-n", n.netns]
            cmds += [["ip", "netns", "add", n.netns],
                     ["ip", "link", "add", n.host_if, "mtu", str(MTU), "type", "veth",
                      "peer", "name", inner, "mtu", str(MTU), "netns", n.netns],
                     ["ip", "link", "set", n.host_if, "master",
                      self.leaf_bridge(self.leaves.index(n.leaf)), "up"],
                     [*ns, "link", "set", inner, "name", NODE_IF],
                     [*ns, "addr", "add", f"{n.addr}/24", "dev", NODE_IF],
                     [*ns, "link", "set", NODE_IF, "up"],
                     [*ns, "link", "set", "lo", "up"],
                     shape(n.host_if, self.spec.leaf_gbps),
                     shape(NODE_IF, self.spec.leaf_gbps, n.netns)]
        return cmds

    def teardown(self) -> list[list[str]]:
        """Every command that removes what `build` made (each may find it gone already).
        Deleting a namespace deletes the link end inside it, and with it its peer."""
        cmds = [["ip", "netns", "del", n.netns] for n in self.nodes]
        cmds += [["ip", "link", "del", n.host_if] for n in self.nodes]
        cmds += [["ip", "link", "del", self.uplink(i)[0]] for i, _ in enumerate(self.leaves)]
        cmds += [["ip", "link", "del", self.leaf_bridge(i)] for i, _ in enumerate(self.leaves)]
        cmds.append(["ip", "link", "del", self.spine_bridge])
        return cmds

    # -- drills ----------------------------------------------------------------
    def cut(self, name: str) -> list[list[str]]:
        """Take the node's only link down: it reaches nothing, and nothing reaches it."""
        return [["ip", "link", "set", self.node(name).host_if, "down"]]

    def cut_redis(self, name: str) -> list[list[str]]:
        """Drop whatever the node sends to Redis's address; everything else still flows.
        A blackhole route drops silently, as a broken path does, rather than answering
        with an error no real partition gives."""
        return [["ip", "-n", self.node(name).netns, "route", "replace", "blackhole",
                 f"{self.redis_addr}/32"]]

    def slow(self, name: str, gbps: float) -> list[list[str]]:
        """Shape the node's link, both ways, to `gbps`."""
        n = self.node(name)
        return [shape(n.host_if, gbps, change=True), shape(NODE_IF, gbps, n.netns, change=True)]

    def heal(self, name: str) -> list[list[str]]:
        """Undo every drill on the node (each command may find nothing to undo)."""
        n = self.node(name)
        return [["ip", "link", "set", n.host_if, "up"],
                ["ip", "-n", n.netns, "route", "del", "blackhole", f"{self.redis_addr}/32"],
                *self.slow(name, self.spec.leaf_gbps)]


def shape(dev: str, gbps: float, netns: str | None = None, change: bool = False) -> list[str]:
    """A token-bucket qdisc holding `dev`'s sending rate to `gbps`.

    The bucket holds 4 ms at the rate (at least 64 KiB): enough for the kernel's
    timer granularity and for offloaded 64 KiB segments, small enough that the
    rate holds over any transfer of interest."""
    rate_bytes = gbps * 1e9 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.004))
    where = ["-n", netns] if netns else []
    return ["tc", *where, "qdisc", "replace" if change else "add", "dev", dev, "root", "tbf",
            "rate", f"{max(1, round(gbps * 1000))}mbit", "burst", str(burst),
            "latency", f"{TBF_LATENCY_MS}ms"]


def plan_network(tag: str, subnet: int, spec: NetworkSpec,
                 nodes: list[tuple[str, str]]) -> NetPlan:
    """The plan for `nodes` ((name, leaf) pairs, in the YAML's order) on 198.18.<subnet>.0/24."""
    if not 0 <= subnet < SUBNETS:
        raise TopologyError(f"subnet {subnet} is outside {TEST_RANGE}")
    if len(nodes) > MAX_NODES:
        raise TopologyError(f"a netns cluster holds at most {MAX_NODES} nodes, got {len(nodes)}")
    leaves = tuple(dict.fromkeys(leaf for _, leaf in nodes))
    prefix = f"kc{tag}"
    out = tuple(NetNode(name=name, netns=f"kc-{tag}-{name}", host_if=f"{prefix}n{j}",
                        addr=f"198.18.{subnet}.{FIRST_NODE_OCTET + j}", leaf=leaf)
                for j, (name, leaf) in enumerate(nodes))
    return NetPlan(tag=tag, subnet=subnet, spec=spec, nodes=out, leaves=leaves)
