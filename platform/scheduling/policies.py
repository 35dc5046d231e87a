"""Scheduling policies, at the import path the scheduler, the driver, the API and the
benchmarks use. They are built from plugins over a snapshot: see plugins/.
"""

from __future__ import annotations

from kuangchao.platform.scheduling.plugins.decisions import Admit, Decision, Preempt, Resize, Wait
from kuangchao.platform.scheduling.plugins.fifo import FifoPolicy
from kuangchao.platform.scheduling.plugins.gang import GangPolicy
from kuangchao.platform.scheduling.plugins.interface import AdmissionPolicy
from kuangchao.platform.scheduling.plugins.preemption import MAX_VICTIM_CANDIDATES
from kuangchao.platform.scheduling.plugins.registry import POLICIES, make_policy
from kuangchao.platform.scheduling.plugins.snapshot import Snapshot, job_shape, order_key, shape_of

__all__ = ["MAX_VICTIM_CANDIDATES", "POLICIES", "Admit", "AdmissionPolicy", "Decision", "FifoPolicy",
           "GangPolicy", "Preempt", "Resize", "Snapshot", "Wait", "job_shape", "make_policy",
           "order_key", "shape_of"]
