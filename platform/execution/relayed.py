"""Which source each rank's beat comes from: its node agent's record, or its own key.

Pure: the controller's watch (watch.py) and bench/heartbeats.py feed it what
one scan read, and it answers one beat (or None) per rank for the `Classifier`.

The rule, per rank:
- A rank its node's agent lists is *covered*: its beat comes from the agent's
  record alone, and its own key is not read.
- A covered rank stays covered while its agent's record is missing. A dead agent
  is then a lost node: its ranks' beats stop, and they expire as a dead rank's
  would, `heartbeat_timeout_s` after the agent's last record. (Ranks that fell
  back to their own keys meanwhile are not counted: their node's agent, the
  part of the node the controller watches, is gone.)
- A rank the agent's record no longer lists, or whose node has no agent, is read
  from its own key, from the next scan on: a rank falls back to its own key
  when its agent's acks stop, and takes its beat file away (workers/runtime/
  beat_relay.py); a rank that cannot reach the agent's folder never wrote one.
"""

from __future__ import annotations

from collections.abc import Mapping

from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import NodeRecord
from kuangchao.platform.spec.jobspec import JobSpec

# `node_agents: auto` starts agents for jobs this large: below it, the per-rank keys
# cost Redis and the scan little, and an agent costs a process on every node.
AUTO_MIN_RANKS = 64


def agents_wanted(spec: JobSpec) -> bool:
    mode = spec.fault_tolerance.node_agents
    return mode == "on" or (mode == "auto" and spec.world_size >= AUTO_MIN_RANKS)


class RelayView:
    """Merges node records and own keys into one beat per rank.

    Args:
        node_of: rank -> the node it was placed on (the name its agent writes under).
    """

    def __init__(self, node_of: Mapping[int, str]) -> None:
        self.node_of = dict(node_of)
        self.nodes = sorted(set(self.node_of.values()))
        self.ranks_of: dict[str, list[int]] = {n: [] for n in self.nodes}
        for rank, node in sorted(self.node_of.items()):
            self.ranks_of[node].append(rank)
        self.covered: dict[int, str] = {}
        self.agents_seen: dict[str, int] = {}  # node -> the agent pid last seen
        self.gone: set[str] = set()  # nodes whose agent was seen and whose record is gone
        self._direct = list(self.node_of)

    def direct_ranks(self) -> list[int]:
        """The ranks whose own keys the next scan reads."""
        return self._direct

    def merge(self, records: Mapping[str, NodeRecord | None],
              direct: Mapping[int, Beat | None]) -> dict[int, Beat | None]:
        """One scan's beats: for each rank, from its agent's record if it is covered,
        else from its own key (None where neither has one)."""
        out: dict[int, Beat | None] = dict(direct)
        covered = self.covered
        changed = False
        for node in self.nodes:
            rec = records.get(node)
            if rec is None:
                if node in self.agents_seen:
                    self.gone.add(node)
                for rank in self.ranks_of[node]:
                    if rank in covered:
                        out[rank] = None
                continue
            self.agents_seen[node] = rec.agent_pid
            self.gone.discard(node)
            listed = rec.beats
            for rank in self.ranks_of[node]:
                beat = listed.get(rank)
                if beat is not None:
                    out[rank] = beat
                    if rank not in covered:
                        covered[rank], changed = node, True
                elif rank in covered:
                    del covered[rank]  # fell back: read its own key from the next scan
                    out.setdefault(rank, None)
                    changed = True
        if changed:
            self._direct = [r for r in self.node_of if r not in covered]
        return out

    def agent_gone(self, rank: int) -> str | None:
        """The node of `rank`'s agent when the rank is covered and its agent's record is
        gone (a dead agent: the node is lost to the controller), else None."""
        node = self.covered.get(rank)
        return node if node is not None and node in self.gone else None
