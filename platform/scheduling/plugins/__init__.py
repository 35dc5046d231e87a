"""Scheduling as plugins over a snapshot.

A cycle takes one immutable `Snapshot` (snapshot.py; the scheduler keeps it
across cycles and applies only what changed: ../snapshot_keeper.py) and runs a
policy over it. The gang policy (gang.py) is a composition: for each queued job in order
it asks the quota, admission, preemption, elastic-shrink and backfill plugins
in turn, and then the elastic plugins for the running jobs. Every plugin is a
small class behind a Protocol (interface.py), pure (no Ray, Redis or torch),
and returns frozen decisions (decisions.py); the composition alone records
their effect on the cycle's ledger (cycle.py). Policies are picked by name
(registry.py).
"""
