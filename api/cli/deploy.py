"""`kc control-plane start`: the control plane on a Ray cluster a deployment started."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kuangchao.api.cli.common import fail
from kuangchao.platform.errors import KuangchaoError

control_plane_app = typer.Typer(help="Run the control plane on an existing Ray cluster "
                                     "(docker-compose, Helm).", no_args_is_help=True)


@control_plane_app.command("start")
def start(address: Annotated[str | None, typer.Option(
              help="Ray head address, host:port (default: KC_RAY_ADDRESS or RAY_ADDRESS).")] = None,
          wait_nodes: Annotated[int, typer.Option(
              min=1, help="Wait for this many live Ray nodes, the head included.")] = 1,
          admin_key_file: Annotated[Path | None, typer.Option(
              help="A file with one API key to register as an admin key "
                   "(default: KC_ADMIN_KEY_FILE).")] = None,
          queues: Annotated[Path | None, typer.Option(
              help="Queues YAML to store (default: KC_QUEUES_FILE).")] = None,
          watch: Annotated[float, typer.Option(
              min=0, help="Keep it up: check every this many seconds (0: start and exit).")] = 0,
          ) -> None:
    """Start the scheduler, registry and token authority (idempotent). Run it on the
    head node: the token authority reads KC_SIGNING_KEY_FILE there."""
    from kuangchao.platform.errors import WatchEnded
    from kuangchao.platform.runtime.bootstrap import BootstrapOptions, run
    from kuangchao.platform.settings import Settings

    settings = Settings.from_env()
    if address:
        settings = dataclasses.replace(settings, ray_address=address)
    key_file = admin_key_file or os.environ.get("KC_ADMIN_KEY_FILE") or None
    queues_file = queues or os.environ.get("KC_QUEUES_FILE") or None
    opts = BootstrapOptions(wait_nodes=wait_nodes,
                            admin_key_file=str(key_file) if key_file else None,
                            queues_file=str(queues_file) if queues_file else None, watch_s=watch)
    try:
        run(opts, settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except WatchEnded as exc:
        fail(exc.message, code=1)
    except KuangchaoError as exc:
        fail(exc.message)
