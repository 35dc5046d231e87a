"""`kc nodes` and `kc node join|release|set`: the cluster's nodes and an
operator's say over them."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from kuangchao.api.cli.common import Json, call, client, fail
from kuangchao.api.cli.render import print_nodes
from kuangchao.platform.errors import KuangchaoError

node_app = typer.Typer(help="Manage this machine as a node of a cluster.", no_args_is_help=True)


def nodes(as_json: Json = False) -> None:
    """Show the nodes: topology, GPU type, liveness, and the GPUs jobs hold on each."""
    data = call(client().nodes)
    typer.echo(json.dumps(data)) if as_json else print_nodes(data)


@node_app.command("join")
def node_join(address: Annotated[str, typer.Option(help="Ray head address, host:port.")],
              leaf: Annotated[str, typer.Option(help="Leaf switch this node hangs off.")],
              name: Annotated[str | None, typer.Option(help="Node name (default: hostname).")] = None,
              spine: Annotated[str | None, typer.Option(help="Spine switch.")] = None,
              gpus: Annotated[int | None, typer.Option(help="GPUs, when nvidia-smi is absent.")] = None,
              nvlink: Annotated[str | None, typer.Option(
                  help="NVLink islands when nvidia-smi is absent: '0.1.2.3_4.5.6.7' or 'full'.")] = None,
              cpus: Annotated[int | None, typer.Option(help="CPUs to offer.")] = None,
              gpu_type: Annotated[str | None, typer.Option(
                  help="The GPUs' catalogue type (h100-80gb, a100-80gb, ...), where nvidia-smi "
                       "does not tell it.")] = None,
              emulated_speed: Annotated[float | None, typer.Option(
                  help="Fake GPUs only: run this node's ranks at this fraction of full speed, "
                       "in (0, 1].")] = None,
              ray_arg: Annotated[list[str] | None, typer.Option(
                  "--ray-arg", help="Passed to `ray start` as it is, e.g. "
                                    "--ray-arg=--dashboard-agent-listen-port=52366.")] = None,
              block: Annotated[bool, typer.Option(
                  "--block", help="Run the raylet in the foreground, as this process (a "
                                  "container's main process).")] = False,
              as_json: Json = False) -> None:
    """Join this machine to a cluster as a raylet with kuangchao's topology labels."""
    import socket

    from kuangchao.platform.cluster.nodejoin import JoinOptions, join
    from kuangchao.platform.runtime.ray_connect import use_cluster_token

    use_cluster_token(address)  # joining the local stack: its Ray token (a deployment sets its own)

    try:
        node = join(JoinOptions(address=address, name=name or socket.gethostname(), leaf=leaf,
                                spine=spine, gpus=gpus, nvlink=nvlink, cpus=cpus,
                                extra=tuple(ray_arg or ()), gpu_type=gpu_type,
                                emulated_speed=emulated_speed), block=block)
    except KuangchaoError as exc:
        fail(exc.message)
    speed = f", emulated at {node.emulated_speed:g}x" if node.emulated_speed is not None else ""
    typer.echo(json.dumps(node.to_json()) if as_json else
               f"{node.name} joined {address}: {node.gpus} GPU(s) of type "
               f"{node.gpu_type or 'unknown'}{speed}, islands "
               f"{[list(i) for i in node.islands]}, leaf {node.leaf}")


@node_app.command("release")
def node_release(name: Annotated[str, typer.Argument(help="The quarantined node.")],
                 as_json: Json = False) -> None:
    """End a node's quarantine early, once it has been repaired."""
    out = call(client().release_node, name)
    typer.echo(json.dumps(out) if as_json else f"{name} released from quarantine")


@node_app.command("set")
def node_set(name: Annotated[str, typer.Argument(help="The node, as `kc nodes` names it.")],
             gpu_type: Annotated[str | None, typer.Option(
                 help="Its GPUs' catalogue type (h100-80gb, a100-80gb, ...).")] = None,
             emulated_speed: Annotated[float | None, typer.Option(
                 help="Fake GPUs only: the fraction of full speed its ranks run at, in (0, 1].")] = None,
             clear_gpu_type: Annotated[bool, typer.Option(
                 "--clear-gpu-type", help="Drop the override: back to the label or detected type.")] = False,
             clear_emulated_speed: Annotated[bool, typer.Option(
                 "--clear-emulated-speed", help="Drop the override: back to the label.")] = False,
             as_json: Json = False) -> None:
    """Override a node's GPU type or emulated speed (stored in the control plane; the
    scheduler uses it from its next cycle)."""
    body: dict[str, Any] = {}
    for field, value, clear in (("gpu_type", gpu_type, clear_gpu_type),
                                ("emulated_speed", emulated_speed, clear_emulated_speed)):
        if value is not None and clear:
            fail(f"--{field.replace('_', '-')} and --clear-{field.replace('_', '-')} contradict "
                 "each other; pass one")
        if value is not None or clear:
            body[field] = value
    if not body:
        fail("nothing to set: pass --gpu-type, --emulated-speed, or a --clear-... flag")
    c = client()
    out = call(c.set_node, name, **body)
    if as_json:
        typer.echo(json.dumps(out))
        return
    o = out["overrides"]
    parts = [f"gpu_type {o['gpu_type']}" if "gpu_type" in o else "gpu_type not overridden",
             f"emulated_speed {o['emulated_speed']:g}" if "emulated_speed" in o
             else "emulated_speed not overridden"]
    typer.echo(f"{name}: {', '.join(parts)}; `kc nodes` shows the node as the scheduler sees it")
