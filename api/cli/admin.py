"""`kc admin key ...`, `kc audit`, `kc whoami` and `kc doctor`: keys, the audit trail,
the caller, and a health check of the environment."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from typing import Annotated

import typer

from kuangchao.api.cli.common import Json, call, client, fail
from kuangchao.api.cli.render import print_audit
from kuangchao.platform.security.apikeys import ROLES

admin_app = typer.Typer(help="Administer the platform (admin keys only).", no_args_is_help=True)
key_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
admin_app.add_typer(key_app, name="key")


@key_app.command("create")
def key_create(tenant: Annotated[str, typer.Option(help="The tenant whose jobs the key reaches.")],
               role: Annotated[str, typer.Option(help=f"One of: {', '.join(ROLES)}.")],
               name: Annotated[str | None, typer.Option(
                   help="Who the key is for (default: ROLE-TENANT).")] = None,
               ttl: Annotated[str | None, typer.Option(
                   help="Lifetime, e.g. 90d or 12h (default: until revoked).")] = None,
               as_json: Json = False) -> None:
    """Create an API key. It is printed once and cannot be shown again."""
    if role not in ROLES:
        fail(f"--role {role!r} is unknown; use one of {', '.join(ROLES)}")
    ttl_s = parse_age(ttl, "--ttl") if ttl else None
    out = call(client().create_key, name or f"{role}-{tenant}", tenant, role, ttl_s)
    if as_json:
        typer.echo(json.dumps(out))
        return
    typer.echo(out["key"])
    typer.echo(f"key {out['key_id']}: {out['name']}, tenant {out['tenant']}, role {out['role']} "
               "(shown once; store it now)", err=True)


@key_app.command("list")
def key_list(all_: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
             as_json: Json = False) -> None:
    """List API keys (their ids and principals, never the keys)."""
    keys = call(client().keys, all_)
    if as_json:
        typer.echo(json.dumps(keys))
        return
    typer.echo(f"{'KEY ID':<17} {'NAME':<24} {'TENANT':<14} {'ROLE':<10} {'CREATED':<20} REVOKED")
    for k in keys:
        typer.echo(f"{k['key_id']:<17} {k['name']:<24} {k['tenant']:<14} {k['role']:<10} "
                   f"{_when(k['created_at']):<20} {_when(k['revoked_at']) if k['revoked_at'] else '-'}")


@key_app.command("revoke")
def key_revoke(key_id: Annotated[str, typer.Argument(help="The key id (`kc admin key list`).")],
               as_json: Json = False) -> None:
    """Revoke an API key: requests with it are refused from now on."""
    out = call(client().revoke_key, key_id)
    typer.echo(json.dumps(out) if as_json else f"key {key_id} ({out['name']}) revoked")


def audit(job: Annotated[str | None, typer.Option(help="Only records about this job.")] = None,
          task: Annotated[str | None, typer.Option(
              help="Only records about the jobs of this task name (task.name) that you "
                   "may see.")] = None,
          since: Annotated[str | None, typer.Option(
              help="Only records from this time on: an ISO date or time in UTC "
                   "(2024-01-01, 2024-01-15T10:23:45), unix seconds, or an age such as "
                   "30s, 15m, 2h, 1d.")] = None,
          action: Annotated[str | None, typer.Option(
              help="allow or deny; or an action such as job.cancel, or its family (job).")] = None,
          limit: Annotated[int, typer.Option(min=1, help="At most this many (the newest).")] = 1000,
          as_json: Json = False) -> None:
    """Show the audit trail (operator and admin keys).

    One line per record: UTC time | subject | action | ALLOWED or DENIED | reason.
    """
    if task is not None and not task.strip():
        fail("--task is empty; give a job's task name (`kc list` shows them)")
    start = parse_since(since) if since is not None else None
    records = call(client().audit, job, start, action, limit, task)
    if as_json:
        typer.echo(json.dumps(records))
        return
    print_audit(records)


def whoami(as_json: Json = False) -> None:
    """Show whom the API key in use speaks for."""
    me = call(client().whoami)
    typer.echo(json.dumps(me) if as_json else
               f"{me['name']} (key {me['key_id']}): tenant {me['tenant']}, role {me['role']}")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(text: str) -> float | None:
    t = text.strip()
    if t and t[-1] in _UNITS and t[:-1].replace(".", "", 1).isdigit():
        return float(t[:-1]) * _UNITS[t[-1]]
    return None


def parse_age(text: str, flag: str) -> float:
    """Seconds from an age such as 30s, 15m, 2h, 90d."""
    age = _age(text)
    if not age:
        fail(f"{flag} {text!r} is not a duration; give one such as 30s, 15m, 12h or 90d")
    return age


def doctor(checkpoint_path: Annotated[str | None, typer.Option(
               help="Where checkpoints will go: a folder (default $KC_HOME/checkpoints), or an "
                    "object-store URL (s3://bucket/prefix), checked from here and from every "
                    "Ray node.")] = None,
           as_json: Json = False) -> None:
    """Check this environment before training: versions on every node, Redis, Ray,
    clocks, checkpoint storage, ports. Exit 0 only when all is healthy."""
    from kuangchao.platform.runtime.doctor import healthy
    from kuangchao.platform.runtime.doctor_probe import examine
    from kuangchao.platform.runtime.doctor_store import checkpoint_target
    from kuangchao.platform.settings import Settings

    target = None
    if checkpoint_path is not None:
        try:
            target = checkpoint_target(checkpoint_path)
        except ValueError as exc:
            fail(f"--checkpoint-path: {exc}")
    findings = examine(Settings.from_env(), target)
    if as_json:
        typer.echo(json.dumps({"healthy": healthy(findings),
                               "findings": [f.to_json() for f in findings]}))
    else:
        marks = {"ok": "ok  ", "info": "--  ", "warn": "WARN", "fail": "FAIL"}
        for f in findings:
            typer.echo(f"{marks[f.status]} {f.check:<20} {f.message}")
            if f.fix:
                typer.echo(f"     {'':<20} fix: {f.fix}")
    if not healthy(findings):
        raise typer.Exit(1)


def parse_since(text: str, now: float | None = None) -> float:
    """Unix seconds from `--since`: an ISO date or time (UTC unless it names a
    zone), unix seconds, or an age like 15m."""
    now = time.time() if now is None else now
    t = text.strip()
    age = _age(t)
    if age is not None:
        ts = now - age
    else:
        try:
            ts = float(t)
        except ValueError:
            try:
                when = datetime.fromisoformat(t)
            except ValueError:
                fail(f"--since {text!r} is not a time; give an ISO date or time in UTC "
                     "(2024-01-01, 2024-01-15T10:23:45), unix seconds, or an age (30s, 15m, "
                     "2h, 1d)")
            # A time without a zone is UTC, as `kc audit` prints them.
            ts = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    if not math.isfinite(ts) or ts < 0:
        fail(f"--since {text!r} is before 1970 or not a number; give a later time")
    return ts


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"
