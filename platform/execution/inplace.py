"""The in-place recovery path of the job controller, and its warm spares.

A mixin of `JobController`, kept apart because it is one decision with its
own rules: when a rank fails on a node that is still there, keep the
survivors' processes and replace only that rank (with a warm spare when the
job keeps them), instead of tearing the whole job down and queueing it again.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuangchao.platform.cluster import quarantine
from kuangchao.platform.errors import Cancelled, GaveUp, KuangchaoError
from kuangchao.platform.execution.grants import worker_settings
from kuangchao.platform.execution.recovery import Failure, record_failure
from kuangchao.platform.execution.watch import kill_process
from kuangchao.platform.jobs.state import PlacedRank, start
from kuangchao.platform.spec.jobspec import JobSpec
from kuangchao.workers.runtime.worker import SpareWorker

# Failures the in-place path can handle: the rank's node is still there.
IN_PLACE_KINDS = frozenset({"died", "expired", "hung"})
SPARE_WAIT_S = 60.0


class InPlaceRecovery:
    """Methods `JobController` runs to replace a failed rank in place."""

    def _replace_in_place(self, failure: Failure, spec: JobSpec) -> bool:
        """The fast path: keep the survivors' processes, replace only the dead rank.

        The failed rank is killed (a hung or stopped one too), so survivors
        waiting on it in a collective fail out of it within moments; they
        leave the process group and, with a warm spare or a fresh actor in the
        failed rank's bundle, meet at a new rendezvous and resume from the
        newest checkpoint without re-importing anything. Returns False (failure recorded, job
        RECOVERING) when the path does not apply: a lost node, survivors that
        do not stop within `stop_grace_s`, another death.
        """
        rank = failure.rank
        if failure.kind not in IN_PLACE_KINDS or rank is None or not self.pgs:
            return False
        if not record_failure(self.store, self.job_id, failure,
                              spec.fault_tolerance.max_restarts, self.settings.quarantine):
            raise GaveUp(failure.message)  # the job already ended (FAILED, or cancelled)
        t0 = time.monotonic()
        slot = self._slot(rank)
        if slot and slot.node in quarantine.active(self.store.quarantine(), time.time()):
            return False  # the failure put its node in quarantine: place the job elsewhere
        if failure.kind != "died":
            kill_process(self.watch.hosts.get(rank) if self.watch else None,
                         slot.node_id if slot else None)
        try:
            ray.kill(self.workers[rank], no_restart=True)
        except Exception:
            pass
        node = slot.node if slot else ""
        # A warm spare takes over at once; else a new actor starts now, and its
        # start-up overlaps the survivors' stop.
        spare = self._take_spare(rank, slot, spec)
        self.workers[rank] = spare or self._spawn(rank, node, spec)
        survivors = [r for r in range(len(self.workers)) if r != rank]
        ready, not_ready = ray.wait([self.refs[r] for r in survivors], num_returns=len(survivors),
                                    timeout=spec.fault_tolerance.stop_grace_s)
        if not_ready or not self._all_errored(ready):
            return False
        try:
            ray.get([self.workers[r].reset.remote() for r in survivors], timeout=30)
            stopped_s = time.monotonic() - t0
            infos = self._wait_ready([w.describe.remote() for w in self.workers], 60.0, "workers")
        except Cancelled:
            raise
        except (ray.exceptions.RayError, KuangchaoError):
            return False
        job = self.store.get(self.job_id)
        self._record_workers(job, infos)
        self._form_group(spec, infos)
        self._apply(start, f"rank {rank} replaced in place on {node}; "
                                    f"{len(survivors)} survivor(s) kept their processes")
        self.store.annotate_restart(self.job_id, {
            "path": "in_place", "spare": spare is not None, "teardown_s": round(stopped_s, 3),
            "placement_s": round(time.monotonic() - t0 - stopped_s, 3)})
        self._start_spares(spec)  # replace the spare just used
        return True

    @staticmethod
    def _all_errored(refs: list[Any]) -> bool:
        """Whether every one of these finished `run` calls failed (none completed the job)."""
        for ref in refs:
            try:
                ray.get(ref)
                return False
            except ray.exceptions.RayActorError:
                return False  # another rank died too: start over from the queue
            except Exception:
                continue
        return True

    def _start_spares(self, spec: JobSpec) -> None:
        """With `spare_workers`, keep one warm process on every node the job uses."""
        if not spec.fault_tolerance.spare_workers:
            return
        job = self.store.get(self.job_id)
        for node_id in {p.node_id for p in job.placement} - set(self.spares):
            self.spares[node_id] = ray.remote(SpareWorker).options(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()

    def _take_spare(self, rank: int, slot: PlacedRank | None, spec: JobSpec) -> Any | None:
        """A warm spare on the failed rank's node, made that rank; None when there is none."""
        spare = self.spares.pop(slot.node_id, None) if slot else None
        if spare is None:
            return None
        # A spare still warming up is further along than a fresh actor would be.
        ready, _ = ray.wait([spare.__ray_ready__.remote()], timeout=SPARE_WAIT_S)
        if not ready:
            ray.kill(spare, no_restart=True)
            return None
        ft = spec.fault_tolerance
        gpus = self.infos[rank]["gpu_ids"] if rank < len(self.infos) else []
        try:
            grant = self._grants([rank])[rank]
            ray.get(spare.adopt.remote(self.job_id, rank, self.world,
                                       worker_settings(self.settings, grant), gpus,
                                       slot.node if slot else "",
                                       (ft.heartbeat_interval_s, ft.heartbeat_timeout_s),
                                       grant, self.authority),
                    timeout=30)
        except ray.exceptions.RayError:
            ray.kill(spare, no_restart=True)
            return None
        return spare


def node_lost(node_id: str | None) -> bool:
    """Whether a node is gone: Ray says so, or its raylet no longer takes connections.

    Ray marks a node dead only after its health checks fail for a while
    (tens of seconds); a refused connection to the raylet says it at once.
    """
    if not node_id:
        return False
    entry = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if entry is None or not entry.get("Alive"):
        return True
    try:
        with socket.create_connection((entry["NodeManagerAddress"], entry["NodeManagerPort"]),
                                      timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # slow or filtered is not proof of death; heartbeats decide
