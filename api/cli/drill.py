"""`kc drill`: network faults on a local netns cluster (`isolation: netns`).

Each drill changes one node's link as a broken network would, and `heal`
undoes them all. They need the root that `kc up` of such a cluster needed,
and act only on the links that `kc up` made.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kuangchao.api.cli.common import Json, fail

drill_app = typer.Typer(help="Cut, slow and heal the links of a netns cluster (`isolation: netns`).",
                        no_args_is_help=True)
Node = Annotated[str, typer.Argument(help="Node name, as in the cluster YAML.")]


def _run(what: str, node: str, gbps: float | None = None, as_json: bool = False) -> None:
    from kuangchao.platform.errors import KuangchaoError
    from kuangchao.platform.runtime import netns
    from kuangchao.platform.runtime.ray_nodes import net_plan
    from kuangchao.platform.settings import read_cluster_state

    state = read_cluster_state()
    plan = net_plan(state) if state else None
    if plan is None:
        fail("no netns cluster is up here: drills need `kc up` with a cluster YAML that says "
             "`isolation: netns`")
    try:
        cmds = netns.drill(plan, what, node, gbps)
    except KuangchaoError as exc:
        fail(exc.message)
    n = plan.node(node)
    out = {"drill": what, "node": node, "netns": n.netns, "addr": n.addr, "gbps": gbps,
           "commands": [" ".join(c) for c in cmds]}
    if as_json:
        typer.echo(json.dumps(out))
        return
    said = {"cut": "cut off from every other host", "cut-redis": f"cut from Redis ({plan.redis_addr})",
            "slow": f"slowed to {gbps:g} Gbit/s" if gbps else "", "heal": "healed"}[what]
    typer.echo(f"{node} ({n.addr}) {said}")


@drill_app.command("cut")
def cut(node: Node, as_json: Json = False) -> None:
    """Take the node's link down: it reaches nothing, and nothing reaches it."""
    _run("cut", node, as_json=as_json)


@drill_app.command("cut-redis")
def cut_redis(node: Node, as_json: Json = False) -> None:
    """Drop what the node sends to Redis; its other traffic still flows."""
    _run("cut-redis", node, as_json=as_json)


@drill_app.command("slow")
def slow(node: Node, gbps: Annotated[float, typer.Option(help="The link's new rate, Gbit/s.")],
         as_json: Json = False) -> None:
    """Shape the node's link, both ways, to --gbps (a straggler)."""
    if not 0.001 <= gbps <= 400:
        fail(f"--gbps must be between 0.001 and 400 Gbit/s, got {gbps:g}")
    _run("slow", node, gbps, as_json)


@drill_app.command("heal")
def heal(node: Node, as_json: Json = False) -> None:
    """Undo every drill on the node: link up, Redis reachable, leaf rate back."""
    _run("heal", node, as_json=as_json)


@drill_app.command("show")
def show(as_json: Json = False) -> None:
    """The netns cluster's hosts, addresses and link rates."""
    from kuangchao.platform.runtime.ray_nodes import net_plan
    from kuangchao.platform.settings import read_cluster_state

    state = read_cluster_state()
    plan = net_plan(state) if state else None
    if plan is None:
        fail("no netns cluster is up here (`kc up` with `isolation: netns`)")
    doc = plan.to_json() | {"host_addr": plan.host_addr, "redis_addr": plan.redis_addr}
    if as_json:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"host side {plan.host_addr} (head, API), Redis {plan.redis_addr}; leaves "
               f"{plan.spec.leaf_gbps:g} Gbit/s, spine {plan.spec.spine_gbps:g} Gbit/s")
    for n in plan.nodes:
        typer.echo(f"  {n.name:<12} {n.addr:<15} leaf {n.leaf:<10} netns {n.netns}")
