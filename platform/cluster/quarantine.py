"""Node quarantine: a node that keeps failing jobs stops receiving them.

Pure policy; the store keeps each node's failure times and the quarantine
list, the controller reports failures, and the scheduler leaves quarantined
nodes out until their quarantine ends or an operator releases them
(`kc node release NAME`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kuangchao.platform.env_numbers import env_number

# Failure kinds that say something about the node. A NaN loss, a user's
# exception or a cancelled job do not.
NODE_FAULT_KINDS = frozenset({"died", "expired", "hung", "node_lost"})


@dataclass(frozen=True)
class QuarantinePolicy:
    """Quarantine a node after `failures` within `window_s`, for `duration_s`.

    A node whose raylet vanished is held back at once for `lost_node_s`:
    long enough for Ray to declare it dead (which takes tens of seconds),
    so that the job it failed is not placed straight back onto it.
    """

    failures: int = 3
    window_s: float = 600.0
    duration_s: float = 1800.0
    lost_node_s: float = 120.0

    @classmethod
    def from_env(cls) -> QuarantinePolicy:
        """`KC_QUARANTINE_FAILURES`, `KC_QUARANTINE_WINDOW_S`, `KC_QUARANTINE_S`.

        Raises:
            ClusterError: One of them is not a number, or is negative.
        """
        d = cls()
        return cls(failures=int(env_number("KC_QUARANTINE_FAILURES", d.failures, integer=True)),
                   window_s=env_number("KC_QUARANTINE_WINDOW_S", d.window_s),
                   duration_s=env_number("KC_QUARANTINE_S", d.duration_s))

    @property
    def enabled(self) -> bool:
        return self.failures > 0

    def recent(self, failure_times: list[float], now: float) -> list[float]:
        return [t for t in failure_times if now - t <= self.window_s]

    def should_quarantine(self, failure_times: list[float], now: float) -> bool:
        return self.enabled and len(self.recent(failure_times, now)) >= self.failures


def active(quarantine: dict[str, dict], now: float) -> dict[str, dict]:
    """The entries of a stored quarantine list that have not yet expired."""
    return {name: q for name, q in quarantine.items() if float(q.get("until", 0)) > now}


def holds(active_entries: dict[str, dict], node) -> bool:
    """Whether an active entry keeps `node` (a NodeInfo) out of new placements.

    An entry for a lost raylet names its node id and holds only that raylet,
    not a new one that joined under the same name.
    """
    entry = active_entries.get(node.name)
    if entry is None:
        return False
    lost_id = entry.get("node_id")
    return lost_id is None or lost_id == node.node_id
