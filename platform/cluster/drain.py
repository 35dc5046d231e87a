"""Drain notices: nodes that Ray is about to take away, and how the node view shows them.

An operator (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds
N`) or an autoscaler reclaiming a spot node asks Ray's GCS to drain a node. The GCS keeps
the table of nodes being drained, `{node_id_hex: deadline_ms}` (0: no deadline), until the
node is gone or the drain ends. Only the GCS writes it: no rank can mark a node draining
through kuangchao's Redis, because the registry and the job controllers read the table from
Ray, never from a key a job may write.

Here that table becomes `DrainNotice`s and marks on the registry's node view. The
scheduler then treats a draining node as it treats a quarantined one (gone for new
placements; platform/scheduling/scheduler.py), and each job's controller moves its ranks
off (platform/execution/drain.py). Pure: the readers pass the raw table in, and whatever
Ray hands over (an unknown node id, a deadline in the past, a malformed entry) never
raises here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kuangchao.platform.cluster.topology import NodeInfo

# Ray's node ids are 28 bytes in hex; anything else in the table is not a node of ours.
_NODE_ID = re.compile(r"[0-9a-f]{8,128}")


@dataclass(frozen=True)
class DrainNotice:
    """One node that Ray is draining.

    Attributes:
        node_id: The Ray node id (hex).
        deadline: When Ray (or whoever drains it) kills the node, in epoch seconds;
            None when the drain has no deadline.
    """

    node_id: str
    deadline: float | None = None

    def remaining_s(self, now: float) -> float | None:
        """Seconds left before the deadline (0 once it passed); None without a deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - now)

    def describe(self, now: float) -> str:
        return describe_deadline(self.deadline, now)


def describe_deadline(deadline: float | None, now: float) -> str:
    """`deadline in 18 s`, `deadline passed 3 s ago`, `no deadline`."""
    if deadline is None:
        return "no deadline"
    left = deadline - now
    return f"deadline in {left:.0f} s" if left >= 0 else f"deadline passed {-left:.0f} s ago"


def notices_from(raw: object) -> dict[str, DrainNotice]:
    """Ray's table of draining nodes, `{node_id_hex: deadline_ms}`, as notices by node id.

    Entries that are not a node id and a number are skipped; a deadline of 0, a negative
    one or one that is not finite means no deadline (Ray writes 0 for none).
    """
    if not isinstance(raw, Mapping):
        return {}
    out: dict[str, DrainNotice] = {}
    for node_id, deadline_ms in raw.items():
        if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id.lower()):
            continue
        out[node_id.lower()] = DrainNotice(node_id.lower(), _deadline_s(deadline_ms))
    return out


def _deadline_s(deadline_ms: object) -> float | None:
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int | float):
        return None
    if not math.isfinite(deadline_ms) or deadline_ms <= 0:
        return None
    return deadline_ms / 1000.0


def mark_draining(nodes: tuple[NodeInfo, ...],
                  notices: Mapping[str, DrainNotice]) -> tuple[NodeInfo, ...]:
    """The node view with each draining node marked, and its deadline; notices that name
    no node of the view (a node already gone, the head) are left out."""
    return tuple(dataclasses.replace(n, draining=True, drain_deadline=notices[n.node_id].deadline)
                 if n.node_id in notices else n for n in nodes)
