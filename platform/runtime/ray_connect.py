"""Connecting to a kuangchao Ray cluster, whose GCS and job API take a token.

Every stack kuangchao starts turns on Ray's token authentication
(`RAY_AUTH_MODE=token`): `kc up` writes the token to `$KC_HOME/ray-token`,
compose and the chart hand it to every Ray container. A process that connects
presents it from `RAY_AUTH_TOKEN_PATH` (or `RAY_AUTH_TOKEN`); `ray job submit`
reads the same variables. Processes that `kc up` starts get them in their
environment; a `kc` command or a test run later finds the local stack's token
through `$KC_HOME/cluster.json` (`use_cluster_token`).

No Ray import at module level: `kc up` reads the constants without loading Ray.
"""

from __future__ import annotations

import os
from typing import Any

from kuangchao.platform.settings import RAY_NAMESPACE, read_cluster_state

RAY_TOKEN_NAME = "ray-token"
# The head node's custom resource, which only control-plane actors ask for.
# Stacks started by kuangchao give the head no CPUs or GPUs, so no rank, task
# or driver that asks for either lands there; the control plane runs on this
# instead, and the head holds enough of it for a controller per job.
CONTROL_RESOURCE = "kc_control_plane"
CONTROL_CAPACITY = 10_000


def ray_token_env(state: dict[str, Any]) -> dict[str, str]:
    """The variables that make Ray present the stack's token ({} without one)."""
    path = state.get("ray_token_file")
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": path} if path else {}


def use_cluster_token(address: str | None = None) -> bool:
    """Present the local stack's token when this process connects to the stack
    `$KC_HOME/cluster.json` records (no address, `auto`, or its own). The
    record wins over token variables inherited from elsewhere: they may name
    another stack's token. Returns whether the recorded token is now in use."""
    state = read_cluster_state() or {}
    env = ray_token_env(state)
    if not env or address not in (None, "", "auto", state.get("ray_address")):
        return False
    os.environ.update(env)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the path
    return True


def _refresh_ray_config() -> None:
    """Ray caches its configuration, the auth mode in it, once loaded: a token
    variable set after that counts only once it is read again (Ray's `ray start`
    does the same after turning token mode on). It also caches the token it read:
    after `ray.shutdown()` a process joining another cluster (a benchmark's next
    stack) would present the previous one, so that cache is dropped too."""
    from ray import _raylet

    _raylet.Config.initialize("")
    loader = getattr(_raylet, "AuthenticationTokenLoader", None)
    if loader is not None:
        loader.instance().reset_cache()


def connect(address: str | None, namespace: str = RAY_NAMESPACE, **kwargs: Any) -> None:
    """`ray.init` to a kuangchao cluster, quietly, with its token.

    Raises:
        ConnectionError: Ray is unreachable, or refused the token.
    """
    import ray
    from ray.exceptions import AuthenticationError

    use_cluster_token(address)
    if not ray.is_initialized():
        _refresh_ray_config()
    try:
        ray.init(address=address or "auto", namespace=namespace,
                 **{"log_to_driver": False, "logging_level": "ERROR", **kwargs})
    except AuthenticationError as exc:
        raise ConnectionError(f"Ray refused this process ({exc}); set RAY_AUTH_MODE=token and "
                              "RAY_AUTH_TOKEN_PATH to the cluster's token file") from None
