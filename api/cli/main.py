"""`kc`: the command line. Every command that prints data takes `--json`.

Exit codes: 0 success; 1 the job or operation failed; 2 bad input (spec, flag,
unknown job, unreachable service), with a message saying what to change.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kuangchao.api.cli.admin import admin_app, audit, doctor, whoami
from kuangchao.api.cli.checkpoint import checkpoint_app
from kuangchao.api.cli.common import Json, call, client, fail
from kuangchao.api.cli.debug import debug_app, profile
from kuangchao.api.cli.deploy import control_plane_app
from kuangchao.api.cli.drill import drill_app
from kuangchao.api.cli.following import TrainProgress, follow
from kuangchao.api.cli.nodes import node_app, nodes
from kuangchao.api.cli.plan import plan_command
from kuangchao.api.cli.render import (
    print_events,
    print_job,
    print_jobs,
    print_log_lines,
    print_plan,
    print_probe,
    print_queues,
    terminal_safe,
)
from kuangchao.api.sdk.client import load_file
from kuangchao.platform.errors import KuangchaoError, SpecError
from kuangchao.platform.settings import DEFAULT_API_PORT, DEFAULT_DASHBOARD_PORT, Settings
from kuangchao.platform.spec.jobspec import validate_spec
from kuangchao.platform.version import __version__

app = typer.Typer(help="kuangchao: elastic, topology-aware training on Ray.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

Sets = Annotated[list[str] | None, typer.Option("--set", help="Override a field: a.b=value.")]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print kc's version and exit.")] = False) -> None:
    """kuangchao: elastic, topology-aware training on Ray."""


def load_job_doc(path: Path, sets: list[str] | None) -> dict[str, Any]:
    """Read a spec file as the SDK does (`extends:`, sets, a relative `data.path` made
    absolute) and validate it here, so a bad file exits 2 before any request."""
    try:
        return validate_spec(load_file(path, sets or [])).model_dump(mode="json")
    except SpecError as exc:
        fail(f"{path}:\n" + "\n".join(f"  {p or '.'}: {m}" for p, m in exc.errors))


@app.command()
def submit(spec: Annotated[Path, typer.Argument(help="Job YAML.")], set_: Sets = None,
           wait: Annotated[bool, typer.Option("--wait", help="Follow the job to its end.")] = False,
           as_json: Json = False) -> None:
    """Submit a job to the control plane."""
    doc = load_job_doc(spec, set_)
    c = client()
    job = call(c.submit, doc)
    if wait:
        job = follow(c, job["id"], as_json)
    if as_json:
        typer.echo(json.dumps(job))
    elif wait:
        print_job(job)
    else:
        typer.echo(job["id"])
    if wait and job["state"] != "SUCCEEDED":
        raise typer.Exit(1)


@app.command()
def status(job_id: str, as_json: Json = False) -> None:
    """Show one job."""
    job = call(client().get, job_id)
    typer.echo(json.dumps(job)) if as_json else print_job(job)


@app.command("list")
def list_(as_json: Json = False) -> None:
    """List jobs."""
    jobs = call(client().list)
    typer.echo(json.dumps(jobs)) if as_json else print_jobs(jobs)


@app.command()
def cancel(job_id: str, as_json: Json = False) -> None:
    """Cancel a job."""
    job = call(client().cancel, job_id)
    typer.echo(json.dumps(job)) if as_json else typer.echo(f"{job_id}: cancel requested "
                                                           f"(state {job['state']})")


@app.command()
def scale(job_id: str,
          replicas: int = typer.Option(..., "--replicas", min=1,
                                       help="data-parallel replicas to run at"),
          as_json: Json = False) -> None:
    """Resize an elastic job (within its elastic.min_replicas..max_replicas)."""
    job = call(client().scale, job_id, replicas)
    if as_json:
        typer.echo(json.dumps(job))
        return
    typer.echo(f"{job_id}: asked for {replicas} replica(s); now {job.get('replicas')} "
               f"(state {job['state']}); the scheduler resizes it as capacity allows")


@app.command()
def events(job_id: str, as_json: Json = False) -> None:
    """Show a job's events."""
    evs = call(client().events, job_id)["events"]
    typer.echo(json.dumps(evs)) if as_json else print_events(evs)


@app.command()
def logs(job_id: str,
         follow_: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing.")] = False,
         rank: Annotated[int | None, typer.Option("--rank", min=0,
                                                  help="Only this rank's lines.")] = None,
         module: Annotated[str | None, typer.Option(
             "--module", help="Only this module's lines (train, worker, stdout, stderr, "
                              "heartbeat, permission, telemetry).")] = None,
         as_json: Json = False) -> None:
    """Print a job's logs from every rank (JSON lines with --json)."""
    c, start = client(), 0
    while True:
        page = call(c.logs, job_id, start, rank, module)
        print_log_lines(page["logs"], as_json)
        start = page["next"]
        if not follow_:
            return
        if not page["logs"] and call(c.get, job_id)["state"] in TERMINAL:
            if not call(c.logs, job_id, start, rank, module)["logs"]:
                return
        time.sleep(1.0)


topology_app = typer.Typer(help="Measure the cluster's network.", no_args_is_help=True)
app.add_typer(topology_app, name="topology")
app.add_typer(node_app, name="node")
app.command()(nodes)
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(admin_app, name="admin")
app.command()(audit)
app.command()(whoami)
app.command()(doctor)
app.add_typer(debug_app, name="debug")
app.add_typer(control_plane_app, name="control-plane")
app.add_typer(drill_app, name="drill")
app.command()(profile)
app.command("plan")(plan_command)


@topology_app.command("probe")
def topology_probe(size_mb: Annotated[float, typer.Option(help="Payload per transfer, MiB.")] = 16.0,
                   rounds: Annotated[int, typer.Option(help="Transfers per pair.")] = 5,
                   as_json: Json = False) -> None:
    """Measure latency and bandwidth between every pair of nodes; store them in Redis."""
    import ray

    from kuangchao.platform.cluster.probe import found_leaves, measure
    from kuangchao.platform.cluster.registry import nodes_from_ray
    from kuangchao.platform.jobs.store import JobStore
    from kuangchao.platform.runtime.ray_connect import connect

    settings = Settings.from_env()
    try:
        store = JobStore.from_url(settings.redis_url, settings.redis_prefix)
        connect(settings.ray_address)
    except KuangchaoError as exc:
        fail(exc.message)
    except ConnectionError as exc:
        fail(f"cannot connect to Ray ({exc}); run `kc up`, or set RAY_ADDRESS")
    try:
        result = measure(nodes_from_ray(ray.nodes()), size_mb, rounds)
    except KuangchaoError as exc:  # a node's probe actor died or never answered
        fail(exc.message, 1)
    store.set_info("probe", result)  # the measurements only: the registry finds leaves anew
    shown = {**result, "leaves": found_leaves(result)}
    typer.echo(json.dumps(shown)) if as_json else print_probe(shown)


@app.command()
def queues(as_json: Json = False) -> None:
    """Show the queues, their quotas, and the GPUs each holds and waits for."""
    data = call(client().queues)
    typer.echo(json.dumps(data)) if as_json else print_queues(data)


@app.command()
def place(spec: Annotated[Path, typer.Argument(help="Job YAML.")],
          cluster: Annotated[Path, typer.Option(help="Cluster topology YAML.")],
          set_: Sets = None, as_json: Json = False) -> None:
    """Show where a job's ranks would go on an empty cluster, and the plan's score."""
    from kuangchao.platform.cluster.topology import load_topology
    from kuangchao.platform.placement.score import score
    from kuangchao.platform.placement.solver import Infeasible, traffic_from_spec
    from kuangchao.platform.placement.solver import place as solve
    from kuangchao.platform.scheduling.policies import shape_of

    doc = load_job_doc(spec, set_)
    try:
        topo = load_topology(cluster)
    except KuangchaoError as exc:
        fail(exc.message)
    shape = shape_of(doc)
    plan = solve(topo.nodes, {}, shape, traffic_from_spec(doc))
    if isinstance(plan, Infeasible):
        typer.echo(json.dumps({"feasible": False, "reason": plan.reason}) if as_json
                   else f"infeasible: {plan.reason}")
        raise typer.Exit(1)
    sc = score(plan, topo.nodes, shape, traffic_from_spec(doc))
    if as_json:
        typer.echo(json.dumps({"feasible": True, "score": sc.to_json(), "plan": [
            {"rank": s.rank, "node": s.node, "leaf": s.leaf, "gpus": list(s.gpus)}
            for s in plan.slots]}))
        return
    print_plan(plan, sc, shape)


@app.command()
def up(cluster: Annotated[Path, typer.Option(help="Cluster topology YAML.")] = Path(
           "examples/cluster-2x4.yaml"),
       api_port: Annotated[int, typer.Option(
           help="Port for the REST API (0: any free port).")] = DEFAULT_API_PORT,
       dashboard_port: Annotated[int, typer.Option(
           help="Port for Ray's dashboard (0: any free port).")] = DEFAULT_DASHBOARD_PORT,
       queues: Annotated[Path | None, typer.Option(help="Queues and quotas YAML.")] = None,
       as_json: Json = False) -> None:
    """Start Redis, a local Ray cluster, the control plane and the API."""
    from kuangchao.platform.runtime import localcluster
    try:
        state = localcluster.up(localcluster.UpOptions(cluster=cluster, api_port=api_port,
                                                       dashboard_port=dashboard_port, queues=queues))
    except SpecError as exc:
        fail("\n".join(f"{p}: {m}" if p else m for p, m in exc.errors))
    except KuangchaoError as exc:
        fail(exc.message)
    public = {k: v for k, v in state.items() if k != "redis_url"}
    typer.echo(json.dumps(public) if as_json else f"kuangchao is up: API {state['api_url']}")


@app.command()
def down() -> None:
    """Stop everything `kc up` started."""
    from kuangchao.platform.runtime import localcluster
    typer.echo("kuangchao stopped" if localcluster.down() else "nothing to stop")


@app.command()
def train(config: Annotated[Path, typer.Option("--config", help="Job YAML.")], set_: Sets = None,
          as_json: Json = False) -> None:
    """Run a job with this process as the driver (what `ray job submit` runs), showing its progress."""
    from kuangchao.platform.errors import DriverStopped
    from kuangchao.platform.runtime.driver import run_as_driver

    doc = load_job_doc(config, set_)
    progress = TrainProgress(sys.stderr if as_json else sys.stdout)
    job = None
    try:
        try:
            job = run_as_driver(doc, on_submitted=progress.start)
        finally:
            progress.stop(job)
    except KuangchaoError as exc:
        fail(exc.message)
    except DriverStopped:
        raise typer.Exit(143) from None  # 128 + SIGTERM, as if the signal had ended it
    typer.echo(json.dumps(job)) if as_json else print_job(job)
    if job["state"] != "SUCCEEDED":
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KuangchaoError as exc:  # a bad setting, read before a command's own handling
        typer.echo(f"error: {terminal_safe(exc.message)}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
