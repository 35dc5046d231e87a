"""Guarded collectives: the seed's SDK shape over `torch.distributed`, default deny.

    group = CommGroup(ranks=[0, 1, 2, 3], backend="gloo", timeout_ms=30000, name="dp")
    all_reduce(tensor, group=group, op="sum")

Every call first asks the rank's capability token (`set_token`) whether the
interface is whitelisted and the group is in scope; only then does it call
`torch.distributed`. Without a token, nothing is allowed. The check is a set
lookup and a clock read, so it costs nothing next to the collective itself
(`bench/tokens.py`). A refusal raises `PermissionError` and is reported to
the deny hook: the rank writes it to the job's events and the token
authority audits it (`workers/runtime/credentials.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kuangchao.platform.errors import TokenError
from kuangchao.platform.security.tokens import Claims, check

WORLD = "world"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


class _Guard:
    def __init__(self) -> None:
        self.claims: Claims | None = None
        self.withdrawn: TokenError | None = None
        self.on_deny: Callable[[str, str, str], None] = lambda interface, group, why: None

    def valid(self) -> Claims:
        claims = self.claims
        if claims is None:
            raise TokenError("missing", "this process holds no capability token")
        if self.withdrawn is not None:
            raise self.withdrawn
        if time.time() >= claims.expires_at:
            raise TokenError("expired", f"token {claims.token_id} expired; it was not renewed")
        return claims

    def allow(self, interface: str, group: str) -> None:
        try:
            check(self.valid(), interface, group=group)
        except TokenError as exc:
            self.on_deny(interface, group, str(exc))
            raise


_guard = _Guard()


def set_token(claims: Claims | None,
              on_deny: Callable[[str, str, str], None] | None = None) -> None:
    """Install this process's verified token (None takes every right away).

    `on_deny(interface, group, reason)` hears of every refusal.
    """
    _guard.claims, _guard.withdrawn = claims, None
    if on_deny is not None:
        _guard.on_deny = on_deny


def withdraw(reason: TokenError) -> None:
    """Refuse everything from now on, saying why (a revoked or unrenewable token)."""
    _guard.withdrawn = reason


def valid_claims() -> Claims:
    """The installed token's claims, or `TokenError` if there is none or it is no longer good."""
    return _guard.valid()


def permit(interface: str, group: str = WORLD) -> None:
    """Ask the token before a collective this module does not wrap (object
    collectives, DDP's own set-up); raises `PermissionError` when refused."""
    _guard.allow(interface, group)


class CommGroup:
    """A communication group by name; its ranks must be in the caller's token scope.

    Args:
        ranks: Global ranks in the group; None or every rank means the world.
        backend: "gloo" or "nccl" (None: the default group's).
        timeout_ms: How long a collective may wait.
        name: The name the token's scope lists; defaults to "world" for the
            whole group, else "ranks:0,1,...".
    """

    def __init__(self, ranks: list[int] | None = None, backend: str | None = None,
                 timeout_ms: int = 30_000, name: str | None = None) -> None:
        world = dist.get_world_size()
        whole = ranks is None or sorted(ranks) == list(range(world))
        self.ranks = list(range(world)) if ranks is None else sorted(ranks)
        self.name = name or (WORLD if whole else "ranks:" + ",".join(map(str, self.ranks)))
        # Creating a group is itself collective, so it is allowed only in scope.
        _guard.allow("barrier", self.name)
        self.pg: Any = None if whole and backend is None else dist.new_group(
            self.ranks, timeout=timedelta(milliseconds=timeout_ms), backend=backend)


def _group(group: CommGroup | None) -> tuple[str, Any]:
    return (WORLD, None) if group is None else (group.name, group.pg)


def all_reduce(tensor: torch.Tensor, group: CommGroup | None = None, op: str = "sum") -> None:
    name, pg = _group(group)
    _guard.allow("all_reduce", name)
    dist.all_reduce(tensor, op=_OPS[op], group=pg)


def broadcast(tensor: torch.Tensor, src: int, group: CommGroup | None = None) -> None:
    name, pg = _group(group)
    _guard.allow("broadcast", name)
    dist.broadcast(tensor, src=src, group=pg)


def all_gather(out: list[torch.Tensor], tensor: torch.Tensor,
               group: CommGroup | None = None) -> None:
    name, pg = _group(group)
    _guard.allow("all_gather", name)
    dist.all_gather(out, tensor, group=pg)


def reduce_scatter(out: torch.Tensor, inputs: list[torch.Tensor], group: CommGroup | None = None,
                   op: str = "sum") -> None:
    name, pg = _group(group)
    _guard.allow("reduce_scatter", name)
    dist.reduce_scatter(out, inputs, op=_OPS[op], group=pg)


def send(tensor: torch.Tensor, dst: int, group: CommGroup | None = None) -> None:
    name, pg = _group(group)
    _guard.allow("send", name)
    dist.send(tensor, dst=dst, group=pg)


def recv(tensor: torch.Tensor, src: int, group: CommGroup | None = None) -> None:
    name, pg = _group(group)
    _guard.allow("recv", name)
    dist.recv(tensor, src=src, group=pg)


def barrier(group: CommGroup | None = None) -> None:
    name, pg = _group(group)
    _guard.allow("barrier", name)
    dist.barrier(group=pg)
