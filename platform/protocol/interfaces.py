"""The names of what a capability token may grant a rank: the collectives it may run
and the other interfaces (checkpoints, heartbeats, metrics).

One vocabulary for the job spec (`permission.collectives`), the tokens that
carry it (platform/security/tokens.py), the metrics that count refusals, and
the guarded collectives in the ranks; so it sits below all of them.
"""

COLLECTIVES = frozenset({"broadcast", "all_reduce", "all_gather", "reduce_scatter", "send", "recv",
                         "barrier", "all_to_all"})
INTERFACES = COLLECTIVES | {"checkpoint_read", "checkpoint_write", "heartbeat", "metrics_read"}
