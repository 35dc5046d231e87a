"""The keeper of a job's peer-memory checkpoints on one node: a thin Ray actor around
`CopyStore` (platform/protocol/memory_copies.py, where the rules and their reasons are).

One keeper per job per node, named `keeper_name(job_id, node)` in kuangchao's Ray
namespace, pinned to its node (NodeAffinity, not soft), holding no CPU, and
detached: it outlives a requeue or an in-place recovery of the job's worker group,
which is when its copies are wanted. It dies with its node (its copies with it,
which is why each rank's copy also goes to `replicas` keepers elsewhere), and
`kill_keepers` ends all of a job's when the job ends.

Every call but `stats` presents a capability token. The keeper holds the token
authority's public key only, and admits a trainer token of its own job that is
signed, unexpired and grants checkpoint_write (put, drop) or checkpoint_read
(listing, get); anything else is a `TokenError` saying why. It checks the job, not
the rank: ranks renumber in a live resize and keep their tokens, and the ranks of
one job already share their state through the job's collectives. The keeper reads
no Redis, so a token revoked before it expires still works here until it expires;
the job's keepers are killed when its tokens are revoked at its end.

The bytes of a copy travel as a Ray argument (the rank `ray.put`s them once for all
its keepers); put and drop answer small dicts, get the copy and its description.
This module imports only Ray and pure modules: a rank that finds a keeper by name
loads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray

from kuangchao.platform.errors import TokenError
from kuangchao.platform.protocol.memory_copies import (
    KEEPER_PREFIX,
    CopyMeta,
    CopyStore,
    keeper_name,
    keeper_prefix,
)
from kuangchao.platform.security.tokens import Claims, Verifier, check_role, load_public
from kuangchao.platform.settings import RAY_NAMESPACE

log = logging.getLogger(__name__)

# How long starting a node's keeper may take before the job goes on without it.
START_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 5.0


class Keeper:
    """What one node keeps of one job's ranks' states (the actor's class; also usable
    in-process, as the unit tests do).

    Args:
        job_id: The job whose copies this keeper holds; tokens of other jobs are refused.
        node: The node it runs on (kc.io/node name), for its answers and logs.
        public_key: The token authority's public key, PEM.
        max_bytes: The bound on one copy (`checkpoint.in_memory.max_mb_per_rank`).
    """

    def __init__(self, job_id: str, node: str, public_key: str | bytes, max_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        pem = public_key.encode() if isinstance(public_key, str) else public_key
        self.job_id, self.node = job_id, node
        self._verifier = Verifier(load_public(pem), clock=clock)
        self.store = CopyStore(max_bytes, clock=clock)
        self.refused = 0

    def _admit(self, token: str | None, interface: str) -> Claims:
        """The claims of a valid trainer token of this job that grants `interface`.

        Raises:
            TokenError: missing, malformed, tampered, expired, or denied (another job,
                another role, the interface not granted).
        """
        try:
            claims = self._verifier.verify(token)
            if claims.job != self.job_id:
                raise TokenError("denied", f"{claims.module} holds a token of job {claims.job}; "
                                           f"this keeper holds job {self.job_id}'s copies only")
            check_role(claims, "trainer", interface)
            return claims
        except TokenError as exc:
            self.refused += 1
            log.warning("keeper %s of job %s refused %s: %s", self.node, self.job_id, interface, exc)
            raise

    def put(self, token: str | None, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        """Keep one copy; answers what was kept and dropped.

        Raises:
            TokenError: The token does not admit checkpoint_write on this job.
            CopyRefused: Over the bound, or the bytes do not match the description.
        """
        self._admit(token, "checkpoint_write")
        copy = CopyMeta.from_json(meta)
        dropped = self.store.put(copy, data)
        return {"node": self.node, "rank": copy.rank, "step": copy.step, "size": copy.size,
                "dropped": dropped, "bytes_held": self.store.bytes_held()}

    def listing(self, token: str | None, rank: int) -> list[dict[str, Any]]:
        """The descriptions of the copies held for `rank`, oldest first."""
        self._admit(token, "checkpoint_read")
        return [m.to_json() for m in self.store.list(rank)]

    def get(self, token: str | None, rank: int, step: int) -> dict[str, Any] | None:
        """One copy: {"meta": its description, "data": its bytes}, or None."""
        self._admit(token, "checkpoint_read")
        found = self.store.get(rank, step)
        if found is None:
            return None
        meta, data = found
        return {"node": self.node, "meta": meta.to_json(), "data": data}

    def drop(self, token: str | None, rank: int | None = None, step: int | None = None) -> int:
        """Forget copies (of one rank, one step, or all of them); returns the bytes freed."""
        self._admit(token, "checkpoint_write")
        return self.store.drop(rank, step)

    def stats(self) -> dict[str, Any]:
        """Sizes only, no contents (no token): what the controller reads for its metrics."""
        return {"job": self.job_id, "node": self.node, "refused": self.refused,
                **self.store.stats()}


# -- the controller's side -------------------------------------------------------------


def start_keepers(job_id: str, nodes: Mapping[str, str], public_key: str | bytes, max_bytes: int,
                  namespace: str = RAY_NAMESPACE,
                  timeout_s: float = START_TIMEOUT_S, wait: bool = True) -> dict[str, str]:
    """Start (or find) the job's keeper on each node; returns node -> actor name, the
    map a rank's `KeeperPlan` carries (with `wait` False: {}, once each is asked to
    start; its start goes on in Ray, and a later call finds it by name).

    Args:
        nodes: kc.io/node name -> Ray node id of each node the job's ranks run on.
        public_key: The token authority's public key (a rank's grant carries it).
        max_bytes: `checkpoint.in_memory.max_mb_per_rank` in bytes.

    A node whose keeper does not answer within `timeout_s` is left out (logged): its
    ranks' copies then live on their peers only, and the job runs on.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pem = public_key.decode() if isinstance(public_key, bytes) else public_key
    actor_class = ray.remote(Keeper)
    started: dict[str, Any] = {}
    for node, node_id in sorted(nodes.items()):
        name = keeper_name(job_id, node)
        try:
            started[node] = actor_class.options(  # type: ignore[attr-defined]
                name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(job_id, node, pem, max_bytes)
        except Exception as exc:  # noqa: BLE001 -- the job runs on without this node's keeper
            log.warning("job %s: no peer-memory keeper on %s: %s", job_id, node, exc)
    names: dict[str, str] = {}
    if not wait:
        return names
    refs = {actor.stats.remote(): node for node, actor in started.items()}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        node = refs[ref]
        try:
            ray.get(ref)
            names[node] = keeper_name(job_id, node)
        except Exception as exc:  # noqa: BLE001
            log.warning("job %s: the peer-memory keeper on %s did not start: %s", job_id, node, exc)
    for node in set(started) - set(names):
        log.warning("job %s: the peer-memory keeper on %s did not answer within %.0fs",
                    job_id, node, timeout_s)
    return names


def job_keepers(job_id: str, namespace: str = RAY_NAMESPACE) -> list[str]:
    """The names of the job's keepers Ray knows (live ones; a dead keeper's name is freed)."""
    from ray.util import list_named_actors

    prefix = keeper_prefix(job_id)
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith(prefix))


def kill_keepers(job_id: str, namespace: str = RAY_NAMESPACE,
                 names: Iterable[str] | None = None) -> int:
    """End the job's keepers (all that Ray lists, or `names`); returns how many were killed.
    Their copies go with them: call it once the job has ended."""
    killed = 0
    for name in job_keepers(job_id, namespace) if names is None else names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed += 1
        except ValueError:  # gone already
            continue
    return killed


def sweep_keepers(ended: Callable[[str], bool], namespace: str = RAY_NAMESPACE,
                  names: Iterable[str] | None = None,
                  kill: Callable[[str], Any] | None = None) -> list[str]:
    """Kill the keepers of every job that has ended (`ended(job_id)`: terminal, or gone
    from the store); returns those jobs. The scheduler's backstop for keepers no
    controller killed: a job cancelled while queued after a run, a controller that died
    as its job ended. `names` (default: Ray's named actors) and `kill` are for tests."""
    if names is None:
        from ray.util import list_named_actors

        names = [a["name"] for a in list_named_actors(all_namespaces=True)
                 if a.get("namespace") == namespace]
    prefix = KEEPER_PREFIX + ":"
    jobs = {n[len(prefix):].split(":", 1)[0] for n in names if n.startswith(prefix)}
    done = [job for job in sorted(jobs) if job and ended(job)]
    for job in done:
        (kill or (lambda j: kill_keepers(j, namespace)))(job)
    return done


def keeper_stats(names: Mapping[str, str], namespace: str = RAY_NAMESPACE,
                 timeout_s: float = STATS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """node -> what its keeper holds (`Keeper.stats`), for the keepers that answer."""
    refs: dict[Any, str] = {}
    for node, name in names.items():
        try:
            refs[ray.get_actor(name, namespace=namespace).stats.remote()] = node
        except ValueError:
            continue
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    out = {}
    for ref in ready:
        try:
            out[refs[ref]] = ray.get(ref)
        except Exception:  # noqa: BLE001 -- a keeper that died meanwhile holds nothing
            continue
    return out
