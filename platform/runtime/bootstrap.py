"""`kc control-plane start`: the control plane on a Ray cluster someone else started.

`kc up` starts Ray, Redis and the control plane together. A deployment
(docker-compose, the Helm chart) starts Ray and Redis itself and runs this on
the head node, where the signing key is mounted:

1. check the configuration, naming the setting to fix (a missing Redis URL or
   signing key is an operator's mistake, reported before anything starts);
2. register the deployment's admin key from `KC_ADMIN_KEY_FILE` (a generated
   Secret), revoking the key it replaces;
3. store the queue table from `KC_QUEUES_FILE`, when given;
4. create the registry, token authority and scheduler actors (idempotent);
5. with `watch_s`, check them every `watch_s` seconds and create them again
   when they are gone (the head restarted under Ray's GCS fault tolerance, or
   someone killed one). When Ray itself goes away the loop ends with an error,
   and the container's restart policy starts it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kuangchao.platform.errors import ClusterError, WatchEnded
from kuangchao.platform.jobs.redis_client import redact
from kuangchao.platform.jobs.store import JobStore
from kuangchao.platform.settings import RAY_NAMESPACE, Settings


@dataclass(frozen=True)
class BootstrapOptions:
    """Args:
        wait_nodes: Wait until this many Ray nodes are alive (the head counts).
        admin_key_file: A file holding one API key to register as an admin key.
        queues_file: A queues YAML to store (`kc up --queues` takes the same).
        watch_s: Keep the control plane up, checking at this period; 0 = once.
    """

    wait_nodes: int = 1
    admin_key_file: str | None = None
    queues_file: str | None = None
    watch_s: float = 0.0


def check(settings: Settings) -> None:
    """Refuse a configuration the control plane cannot run on safely.

    Raises:
        ClusterError: Naming the environment variable to set.
    """
    from kuangchao.platform.security.authority import load_signing_key

    if not settings.redis_url:
        raise ClusterError("no Redis: set KC_REDIS_URL to the admin URL, "
                           "redis://USER:PASSWORD@HOST:6379/0")
    if not settings.ray_address:
        raise ClusterError("no Ray address: pass --address HOST:6379 or set KC_RAY_ADDRESS")
    load_signing_key(settings.signing_key_file, settings.dev)


def read_admin_key(path: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ClusterError(f"cannot read the admin key file {path} ({exc.strerror}); fix "
                           "KC_ADMIN_KEY_FILE") from None
    if not text or len(text.split()) != 1:
        raise ClusterError(f"the admin key file {path} must hold exactly one key, "
                           "kc_<16 hex>_<43 characters>")
    return text


def prepare(store: JobStore, opts: BootstrapOptions, log: Callable[[str], None]) -> None:
    """Steps 2 and 3: the admin key and the queue table."""
    from kuangchao.platform.security.keystore import KeyStore
    from kuangchao.platform.spec.queues import load_queues

    if opts.admin_key_file:
        key = read_admin_key(opts.admin_key_file)
        try:
            who = KeyStore(store).register(key)
        except ValueError as exc:
            raise ClusterError(f"cannot register the admin key in {opts.admin_key_file}: "
                               f"{exc}") from None
        log(f"admin key  {who.key_id} ({who.name}, tenant {who.tenant}) registered")
    if opts.queues_file:
        table = load_queues(opts.queues_file)
        store.set_info("queues", table.to_json())
        log(f"queues     {', '.join(q.name for q in table.queues)} from {opts.queues_file}")


def control_plane_missing() -> list[str]:
    """Names of the control-plane actors that are not alive."""
    import ray

    from kuangchao.platform.runtime.actors import REGISTRY_NAME, SCHEDULER_NAME
    from kuangchao.platform.security.authority import AUTHORITY_NAME

    gone = []
    for name in (REGISTRY_NAME, AUTHORITY_NAME, SCHEDULER_NAME):
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError:
            gone.append(name)
    return gone


def run(opts: BootstrapOptions, settings: Settings, log: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep) -> None:
    """Bring the control plane up, and with `opts.watch_s` keep it up.

    Raises:
        ClusterError: Bad configuration, or Ray unreachable.
    """

    from kuangchao.platform.runtime.actors import start_control_plane, wait_for_nodes
    from kuangchao.platform.runtime.ray_connect import connect

    check(settings)
    store = JobStore.from_url(settings.redis_url, settings.redis_prefix)  # fails fast, clearly
    log(f"redis      {redact(settings.redis_url)} (prefix {settings.redis_prefix})")
    prepare(store, opts, log)
    try:
        connect(settings.ray_address)
    except ConnectionError as exc:
        raise ClusterError(f"cannot connect to Ray at {settings.ray_address} ({exc}); check "
                           "--address and that the head is up") from None
    try:
        wait_for_nodes(opts.wait_nodes, timeout_s=600)
    except TimeoutError as exc:
        raise ClusterError(str(exc)) from None
    start_control_plane(settings)
    log("control    kc-scheduler, kc-registry, kc-token-authority are up")
    while opts.watch_s > 0:
        sleep(opts.watch_s)
        try:
            gone = control_plane_missing()
            if gone:
                log(f"control    {', '.join(gone)} gone; starting again")
                start_control_plane(settings)
                log("control    up again")
        except Exception as exc:  # Ray went away under us: end, and be restarted
            raise WatchEnded(f"lost the Ray cluster at {settings.ray_address} ({exc}); exiting "
                             "so that the container is restarted") from None
