"""The job's keepers (platform/execution/keeper.py), called through Ray by a rank's
peer-memory copies (peer_memory.py): found by name, every call bounded in time, and
a keeper that fails or does not answer reported as an exception in its node's place.

A copy goes to several keepers at once: the rank's own node's and its peers'. One
keeper that stops answering (its node's raylet was just killed: the RPC fails only
after seconds) must not hold up the others: a push counts as done once a keeper
took the copy and the rest had `STRAGGLER_S` more, and until then every rank skips
its next copies (peer_memory.py), while training goes on. Measured in a chaos run
(bench/goodput.py's raylet kills), a push waiting on the dead node's keeper cost 15
steps of copies, which the restore then redid. The put left behind still runs:
Ray runs one caller's calls to one actor in order, so it lands before any later
copy to that keeper, and no second copy is sent to a keeper still taking one (the
memory it holds stays bounded), until it answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kuangchao.platform.errors import CopyRefused, TokenError
from kuangchao.platform.protocol.memory_copies import KeeperPlan

PUT_TIMEOUT_S = 120.0
LIST_TIMEOUT_S = 10.0
GET_TIMEOUT_S = 120.0
# Once one keeper took a copy, how long the others get before the push is done without them.
STRAGGLER_S = 0.5


def _cause(exc: BaseException) -> BaseException:
    """The keeper's own exception (TokenError, CopyRefused) out of Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RayKeepers:
    """Calls the job's keepers, found by name (`plan.keepers`)."""

    def __init__(self, plan: KeeperPlan) -> None:
        self.plan = plan
        self._handles: dict[str, Any] = {}
        self._taking: dict[str, Any] = {}  # node -> a put left behind, still running

    def replan(self, plan: KeeperPlan) -> None:
        """The keepers of a new generation; handles to keepers no longer in it go."""
        self.plan = plan
        for node in [n for n in self._handles if plan.keepers.get(n) is None]:
            self._handles.pop(node, None)

    def _handle(self, node: str) -> Any:
        import ray

        if node not in self._handles:
            name = self.plan.keepers.get(node)
            if name is None:
                raise LookupError(f"the job has no keeper on {node}")
            self._handles[node] = ray.get_actor(name, namespace=self.plan.namespace)
        return self._handles[node]

    def _answer(self, node: str, ref: Any) -> Any:
        """A finished call's answer, or its exception (a dead keeper's handle is dropped,
        so that the next call looks the keeper up again)."""
        import ray

        try:
            return ray.get(ref)
        except Exception as exc:  # noqa: BLE001 -- refused, or the keeper died
            cause = _cause(exc)
            if not isinstance(cause, TokenError | CopyRefused):
                self._handles.pop(node, None)
            return cause

    def _gather(self, calls: dict[str, Callable[[Any], Any]], timeout_s: float,
                straggler_s: float | None = None) -> dict[str, Any]:
        """Each node's answer. With `straggler_s`, once one answer is in (not an
        exception), the others get that long more; those still running then are
        answered with a TimeoutError and kept in `_taking`."""
        import ray

        out: dict[str, Any] = {}
        refs: dict[Any, str] = {}
        for node, call in calls.items():
            try:
                refs[call(self._handle(node))] = node
            except Exception as exc:  # noqa: BLE001 -- no such keeper (any more)
                self._handles.pop(node, None)
                out[node] = exc
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                out[refs[ref]] = self._answer(refs[ref], ref)
            took = any(not isinstance(out.get(n), BaseException) for n in refs.values()
                       if n in out)
            if straggler_s is not None and took and pending:
                ready, pending = ray.wait(pending, num_returns=len(pending),
                                          timeout=min(straggler_s, max(0.0, left)))
                for ref in ready:
                    out[refs[ref]] = self._answer(refs[ref], ref)
                for ref in pending:
                    self._taking[refs[ref]] = ref
                    out[refs[ref]] = TimeoutError(
                        f"still taking the copy {straggler_s:.1f}s after another keeper took "
                        "it; the next copies go to the others until it answers")
                return out
        for ref in pending:
            out[refs[ref]] = TimeoutError(f"no answer within {timeout_s:.0f}s")
            if straggler_s is not None:  # a put: none more to this keeper until it answers
                self._taking[refs[ref]] = ref
        return out

    def _still_taking(self, node: str) -> bool:
        """Whether a put left behind on `node` still runs (one that ended is answered)."""
        import ray

        ref = self._taking.get(node)
        if ref is None:
            return False
        done, _ = ray.wait([ref], timeout=0)
        if not done:
            return True
        del self._taking[node]
        self._answer(node, ref)  # a dead keeper's handle goes
        return False

    def put(self, nodes: list[str], token: str | None, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        import ray

        out: dict[str, Any] = {n: TimeoutError("still taking an earlier copy")
                               for n in nodes if self._still_taking(n)}
        ready = [n for n in nodes if n not in out]
        if not ready:
            return out
        ref = ray.put(data)  # once, for every keeper
        out.update(self._gather({n: lambda h: h.put.remote(token, meta, ref) for n in ready},
                                PUT_TIMEOUT_S, straggler_s=STRAGGLER_S))
        return out

    def listing(self, nodes: list[str], token: str | None, rank: int) -> dict[str, Any]:
        return self._gather({n: lambda h: h.listing.remote(token, rank) for n in nodes}, LIST_TIMEOUT_S)

    def get(self, node: str, token: str | None, rank: int, step: int) -> Any:
        answer = self._gather({node: lambda h: h.get.remote(token, rank, step)}, GET_TIMEOUT_S)[node]
        if isinstance(answer, BaseException):
            raise answer
        return answer
