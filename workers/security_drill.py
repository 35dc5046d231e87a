"""A security drill: a job whose ranks try, from the inside, what a job's code
must never manage, and report each attempt.

    entrypoint: kuangchao.workers.security_drill:train
    args: {victim: <another job's id>}

Each attempt is one log line (`module: train`, `attack`, `refused`, `detail`);
the job succeeds when every attempt was refused and fails naming those that
were not. Operators run it to check a deployment (docs/security.md); the
security tests run it against a live stack (tests/security/).

What it tries, as the rank's own process and with what the rank was handed:
- the token authority, which Ray lets any code in the cluster call: mint
  tokens for the victim, for its controller, revoke the victim's tokens, with
  no credential and with a made-up one, and renew a token it does not hold;
- Redis, as the job's own ACL user: the control plane's credential, the API
  key records, the victim's record and its cancel flag;
- the head node, which Ray lets any code pin a task to: read the control
  plane's secrets from the environment a task there inherits, and run work
  that asks for a CPU there;
- the victim's checkpoints, through a symlink planted in its own folder;
- the scheduler and the victim's controller, named actors any code may call:
  stop the scheduling loop, run the victim's controller a second time.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import ray
import torch

from kuangchao.platform.security.authority import AUTHORITY_NAME
from kuangchao.platform.settings import RAY_NAMESPACE
from kuangchao.workers.runtime.context import TrainContext

SCHEDULER = "kc-scheduler"  # platform/runtime/actors.py, not imported: a rank need not load it


def _attempt(name: str, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one attack; refused means it raised (what it raised is the detail)."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 -- every refusal counts, whatever its type
        cause = getattr(exc, "cause", None) or exc  # a remote call's error, unwrapped from Ray's
        return {"attack": name, "refused": True, "detail": f"{type(cause).__name__}: {cause}"[:300]}
    return {"attack": name, "refused": False, "detail": repr(out)[:300]}


# What the head's environment must not hand a task pinned there.
SECRET_ENV = ("KC_REDIS_URL", "KC_SIGNING_KEY_FILE", "KC_ADMIN_KEY_FILE", "KC_API_KEY",
              "KC_REDIS_PASSWORD_FILE")


def _environ_names() -> list[str]:
    import os

    return sorted(os.environ)


def _on_head(**options: Any) -> Any:
    """`_environ_names` as a task pinned to the head, hard, with `options`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kuangchao.platform.cluster.registry import head_node_id

    head = head_node_id(ray.nodes())
    if head is None:
        raise LookupError("no node is labelled the head")
    return ray.remote(_environ_names).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False), **options).remote()


def _head_secrets() -> list[str]:
    found = [n for n in ray.get(_on_head(num_cpus=0), timeout=120) if n in SECRET_ENV]
    if not found:
        raise LookupError("the head's environment holds none of " + ", ".join(SECRET_ENV))
    return found


def _cpu_on_head() -> Any:
    ref = _on_head(num_cpus=1)
    try:
        return ray.get(ref, timeout=10)  # only a head with CPUs for user work answers
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError("no CPU on the head for user work: the task was never scheduled") \
            from None
    finally:
        ray.cancel(ref, force=True)


def _through_symlink(ctx: TrainContext, victim: str) -> Any:
    from kuangchao.platform.protocol import checkpoint as protocol

    link = ctx.checkpoint.dir / "step-00000001-drill"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(protocol.job_dir(ctx.checkpoint.root, victim), target_is_directory=True)
    model = torch.nn.Linear(1, 1)
    try:
        return ctx.checkpoint.load(link, model, torch.optim.SGD(model.parameters(), lr=0.0))
    finally:
        link.unlink(missing_ok=True)


def _victims_controller(victim: str) -> Any:
    """Run the victim's controller loop a second time (Ray lists named actors to anyone)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"kc-job-{victim}-")]
    if not names:
        raise LookupError(f"no controller of {victim} is listed")
    controller = ray.get_actor(names[0], namespace=RAY_NAMESPACE)
    return ray.get(controller.run.remote(), timeout=60)


def attacks(ctx: TrainContext, victim: str) -> list[tuple[str, Callable[[], Any]]]:
    authority = ray.get_actor(AUTHORITY_NAME, namespace=RAY_NAMESPACE)
    guess = secrets.token_urlsafe(32)
    store = ctx.store
    if store is None:
        raise ValueError("the drill runs in a job's ranks, which have the job's store")

    def call(method: str, *args: Any) -> Any:
        return ray.get(getattr(authority, method).remote(*args), timeout=60)

    return [
        ("authority.grant_workers without a credential", lambda: call("grant_workers", None, victim,
                                                                      {0: ()})),
        ("authority.grant_workers with a guessed credential",
         lambda: call("grant_workers", guess, victim, {0: ()})),
        ("authority.grant_module as the victim's controller",
         lambda: call("grant_module", guess, victim, "controller", "controller")),
        ("authority.revoke_job of the victim", lambda: call("revoke_job", guess, victim, "drill")),
        ("authority.renew of a token it does not hold", lambda: call("renew", "kc1.forged.token")),
        ("redis: read the control plane's credential", lambda: store.control_secret()),
        ("redis: read the API key records", lambda: store.api_key_records()),
        ("redis: read the victim's record", lambda: store.get(victim)),
        ("redis: cancel the victim", lambda: store.request_cancel(victim)),
        ("head: read the control plane's secrets from a task pinned there", _head_secrets),
        ("head: run a task that asks for a CPU there", _cpu_on_head),
        ("checkpoint: load the victim's folder through a symlink in its own",
         lambda: _through_symlink(ctx, victim)),
        ("scheduler: stop the scheduling loop",
         lambda: ray.get(ray.get_actor(SCHEDULER, namespace=RAY_NAMESPACE).stop.remote(),
                         timeout=60)),
        ("controller: run the victim's controller a second time",
         lambda: _victims_controller(victim)),
    ]


def train(ctx: TrainContext) -> dict[str, Any]:
    victim = str(ctx.spec.args.get("victim") or "")
    if not victim:
        raise ValueError("args.victim: name the job the drill attacks")
    results = [_attempt(name, fn) for name, fn in attacks(ctx, victim)]
    for r in results:
        ctx.log(f"{'refused' if r['refused'] else 'NOT REFUSED'}: {r['attack']} ({r['detail']})",
                attack=r["attack"], refused=r["refused"], detail=r["detail"])
    ctx.report(1, loss=0.0)
    # A job succeeds with its final checkpoint on disk; the drill's state is its results.
    model = torch.nn.Linear(1, 1)
    ctx.checkpoint.save(1, model, torch.optim.SGD(model.parameters(), lr=0.0),
                        rank_state={"results": results})
    allowed = [r["attack"] for r in results if not r["refused"]]
    if allowed:
        raise PermissionError(f"the drill was not refused: {'; '.join(allowed)}")
    return {"attacks": len(results)}
