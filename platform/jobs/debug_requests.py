"""`kc debug` and `kc profile` requests in the job's key space, and the ranks'
answers (platform/jobs/debugreq.py has the request and reads the answers)."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.debugreq import ANSWER_TTL_S, DebugRequest, new_request, parse_answers


# What a rank's heartbeat thread does on its own client (workers/runtime/debug.py):
# the same reads and writes as the store's.
def read_request(client: Any, p: str, job_id: str) -> DebugRequest | None:
    return DebugRequest.from_json(client.get(keys.debug_request(p, job_id)))


def queue_answer(pipe: Any, p: str, job_id: str, request_id: str, rank: int,
                 body: dict[str, Any]) -> None:
    key = keys.debug_answers(p, job_id, request_id)
    pipe.hset(key, str(rank), json.dumps(body, default=str))
    pipe.expire(key, ANSWER_TTL_S)


class DebugRequests:
    """The debug-requests part of `JobStore`."""

    r: redis.Redis
    p: str

    def post_debug(self, job_id: str, kind: str, step: int | None = None,
                   steps: int = 1) -> DebugRequest:
        """Ask the job's ranks; the request replaces any earlier one.

        Raises:
            ValueError: For an unknown kind.
        """
        req = new_request(kind, step, steps)
        self.r.set(keys.debug_request(self.p, job_id), req.to_json(), ex=ANSWER_TTL_S)
        return req

    def debug_request(self, job_id: str) -> DebugRequest | None:
        """The open request, or None."""
        return read_request(self.r, self.p, job_id)

    def retire_debug(self, job_id: str, request_id: str) -> None:
        """Take the request away, unless a newer one replaced it (the answers stay)."""
        current = self.debug_request(job_id)
        if current is not None and current.id == request_id:
            self.r.delete(keys.debug_request(self.p, job_id))

    def answer_debug(self, job_id: str, request_id: str, rank: int, body: dict[str, Any]) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            queue_answer(pipe, self.p, job_id, request_id, rank, body)
            pipe.execute()

    def debug_answers(self, job_id: str, request_id: str) -> dict[int, dict]:
        """rank -> answer of request `request_id`."""
        return parse_answers(self.r.hgetall(keys.debug_answers(self.p, job_id, request_id)))
