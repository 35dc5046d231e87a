"""Control flags between the API, the scheduler, the controller and the ranks:
cancel, preempt, resize and rejoin requests, process-group generations, stack
requests, and the scheduler's wake-up list."""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.encoding import STACK_TTL_S


def carried_flags(p: str, job_id: str) -> dict[str, str]:
    """The flags a rank's heartbeat reads with each beat: name -> key."""
    return {"preempt": keys.preempt(p, job_id), "cancel": keys.cancel(p, job_id),
            "debug": keys.debug_request(p, job_id)}


def queue_stack_answer(pipe: Any, p: str, job_id: str, rank: int, text: str) -> None:
    """A rank's answer to a stack request, which it also takes away; the rank's
    heartbeat thread sends it on its own pipeline (workers/runtime/heartbeat.py)."""
    pipe.set(keys.stacks(p, job_id, rank), text, ex=STACK_TTL_S)
    pipe.delete(keys.stack_request(p, job_id, rank))


class ControlFlags:
    """The control-flags part of `JobStore`."""

    r: redis.Redis
    p: str

    def request_stacks(self, job_id: str, ranks: list[int], ttl_s: float = 60.0) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for rank in ranks:
                pipe.delete(keys.stacks(self.p, job_id, rank))
                pipe.set(keys.stack_request(self.p, job_id, rank), "1", ex=int(ttl_s))
            pipe.execute()

    def stack_requested(self, job_id: str, rank: int) -> bool:
        return bool(self.r.exists(keys.stack_request(self.p, job_id, rank)))

    def answer_stacks(self, job_id: str, rank: int, text: str) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            queue_stack_answer(pipe, self.p, job_id, rank, text)
            pipe.execute()

    def stacks(self, job_id: str, ranks: list[int]) -> dict[int, str]:
        values = self.r.mget([keys.stacks(self.p, job_id, r) for r in ranks])
        return {r: v for r, v in zip(ranks, values, strict=True) if v}

    def request_cancel(self, job_id: str) -> None:
        self.r.set(keys.cancel(self.p, job_id), "1")
        self.wake_scheduler(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.cancel(self.p, job_id)))

    def request_preempt(self, job_id: str, for_job: str) -> None:
        self.r.set(keys.preempt(self.p, job_id), for_job)

    def preempt_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.preempt(self.p, job_id)))

    def preempt_reason(self, job_id: str) -> str | None:
        """What asked for the preemption (a job's id, a resize, a drain); None: none asked."""
        return self.r.get(keys.preempt(self.p, job_id))

    def clear_preempt(self, job_id: str) -> None:
        self.r.delete(keys.preempt(self.p, job_id))

    # The scheduler raises `resize` for the job's controller (the request itself is
    # on the record); the controller publishes each new process-group generation
    # and raises `rejoin` with its number for the ranks, which read it every step.
    def request_resize(self, job_id: str) -> None:
        self.r.set(keys.resize(self.p, job_id), "1")

    def resize_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(keys.resize(self.p, job_id)))

    def clear_resize(self, job_id: str) -> None:
        self.r.delete(keys.resize(self.p, job_id))

    def publish_generation(self, job_id: str, generation: dict[str, Any], signal: bool) -> None:
        """Store the next generation; with `signal`, ask running ranks to rejoin at their next step."""
        with self.r.pipeline() as pipe:
            pipe.set(keys.generation(self.p, job_id), json.dumps(generation))
            if signal:
                pipe.set(keys.rejoin(self.p, job_id), str(generation["gen"]))
            else:  # a group formed from scratch: no earlier request may reach its ranks
                pipe.delete(keys.rejoin(self.p, job_id))
            pipe.execute()

    def generation(self, job_id: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.generation(self.p, job_id))
        return json.loads(raw) if raw else None

    def rejoin_requested(self, job_id: str) -> int:
        """The generation ranks are asked to rejoin, 0 when none."""
        raw = self.r.get(keys.rejoin(self.p, job_id))
        return int(raw) if raw else 0

    def clear_rejoin(self, job_id: str) -> None:
        self.r.delete(keys.rejoin(self.p, job_id))

    def wake_scheduler(self, reason: str = "") -> None:
        self.r.rpush(keys.sched_wake(self.p), reason or "tick")

    def wait_for_wake(self, timeout_s: float) -> None:
        """Block until someone wakes the scheduler or `timeout_s` passes."""
        got = self.r.blpop([keys.sched_wake(self.p)], timeout=timeout_s)
        if got:  # drain the backlog: one cycle serves all pending wake-ups
            self.r.delete(keys.sched_wake(self.p))
