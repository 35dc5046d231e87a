"""Node agents on the real Redis, without Ray: a rank's heartbeat thread hands its
beats to an agent through files, and the agent writes one record per node.

Each rank here is a real `Heartbeat` thread with its own lease (`Fence`), each agent a
real `NodeAgent` thread; the controller's side is the real `RankWatch`. Ray's part
(an agent actor killed on a live cluster) is in test_fault_infra.py."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from kuangchao.platform.execution.watch import RankWatch
from kuangchao.platform.jobs.fences import member
from kuangchao.workers import fence as fencing
from kuangchao.workers.runtime.beat_relay import BeatRelay
from kuangchao.workers.runtime.heartbeat import Heartbeat
from kuangchao.workers.runtime.node_agent import NodeAgent

from .conftest import wait_for

pytestmark = pytest.mark.integration

INTERVAL, TIMEOUT = 0.2, 1.5


class Node:
    """One fake node's folder, its agent (optional) and its ranks."""

    def __init__(self, store, job: str, name: str, folder, agent: bool) -> None:
        self.store, self.job, self.name, self.folder = store, job, name, folder
        self.agent = NodeAgent(store.r, store.p, job, name, INTERVAL, TIMEOUT,
                               folder=folder).start() if agent else None
        self.ranks: dict[int, Heartbeat] = {}
        self.exits: list[int] = []

    def rank(self, rank: int) -> Heartbeat:
        hb = Heartbeat(self.store.r, self.store.p, self.job, rank, self.name, INTERVAL, TIMEOUT,
                       fence=fencing.Fence(on_exit=self.exits.append))
        hb.carry()
        hb.relay = BeatRelay(self.folder, rank, fresh_s=2 * INTERVAL)
        self.ranks[rank] = hb.start()
        return hb

    def record(self):
        records, _ = self.store.relayed_beats(self.job, [self.name], [])
        return records[self.name]

    def kill_agent(self) -> None:
        """The agent stops as a killed process would: its folder stays, its record expires."""
        assert self.agent is not None
        self.agent._stop.set()
        self.agent._thread.join(timeout=5)

    def close(self) -> None:
        for hb in self.ranks.values():
            hb.stop()
        if self.agent is not None:
            self.agent.stop()


@pytest.fixture
def job():
    return f"relay-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def nodes(store, job, tmp_path):
    made: list[Node] = []

    def make(name: str, agent: bool) -> Node:
        made.append(Node(store, job, name, tmp_path / name, agent))
        return made[-1]

    yield make
    for node in made:
        node.close()


def quiet_for(watch: RankWatch, seconds: float) -> None:
    """Poll like the controller (twice a beat period) for `seconds`; no verdict may come."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert watch.poll() == []
        time.sleep(INTERVAL / 2)


def first_verdicts(watch: RankWatch, timeout: float) -> tuple[list, float]:
    t0 = time.monotonic()
    verdicts = wait_for(watch.poll, timeout, "a verdict", interval=INTERVAL / 2)
    return verdicts, time.monotonic() - t0


def test_a_relayed_rank_leaves_redis_to_its_agent_which_carries_its_lease_flags_and_fence(
        store, job, nodes):
    n0 = nodes("n0", agent=True)
    hb = n0.rank(0)
    wait_for(lambda: (rec := n0.record()) is not None and 0 in rec.beats and hb.relay.relayed,
             30, "the agent to relay rank 0")
    # Once relayed, the rank writes no key of its own: the one it wrote before expires.
    wait_for(lambda: store.beats(job, [0])[0] is None, 3 * TIMEOUT, "rank 0's own key to go")
    assert hb.fence.lease_ok(), "the agent's acks renew the rank's lease"
    assert n0.record().beats[0].pid == os.getpid()
    watch = RankWatch(store, job, [0], TIMEOUT, 60.0, INTERVAL, nodes={0: "n0"})
    quiet_for(watch, TIMEOUT + 4 * INTERVAL)

    # The job's flags and a stack request reach the rank through the agent's ack.
    store.request_cancel(job)
    wait_for(lambda: hb.flags.get("cancel"), 10, "the cancel flag through the agent")
    store.request_stacks(job, [0])
    stacks = wait_for(lambda: store.stacks(job, [0]).get(0), 10, "rank 0's stacks")
    assert f"pid {os.getpid()} on n0" in stacks
    # Progress is the rank's own to send: it still reaches Redis.
    hb.publish({"step": 7})
    wait_for(lambda: (store.progress(job) or {}).get("step") == 7, 10, "progress")

    # Fenced: the ack names the process, and it exits without another own round trip.
    store.fence(job, [member(os.getpid(), "n0")])
    wait_for(lambda: n0.exits == [fencing.EXIT_FENCED], 10, "the fenced rank to exit")


def test_a_dead_agent_is_a_lost_node_and_a_rank_without_an_agent_is_still_watched(
        store, job, nodes):
    n0, n1 = nodes("n0", agent=True), nodes("n1", agent=False)
    n0.rank(0)
    n1.rank(1)
    wait_for(lambda: (rec := n0.record()) is not None and 0 in rec.beats, 30,
             "the agent on n0 to relay rank 0")
    watch = RankWatch(store, job, [0, 1], TIMEOUT, 60.0, INTERVAL, nodes={0: "n0", 1: "n1"})
    quiet_for(watch, TIMEOUT + 4 * INTERVAL)
    assert store.beats(job, [1])[1] is not None, "with no agent, rank 1 beats on its own key"

    n0.kill_agent()
    verdicts, took = first_verdicts(watch, 5 * TIMEOUT)
    assert [(v.rank, v.kind) for v in verdicts] == [(0, "expired")]
    assert took <= TIMEOUT + 4 * INTERVAL + 1.0, took  # its last record, then the TTL
    assert watch.agent_gone(0) == "n0" and watch.agent_gone(1) is None
    # Rank 0 itself lives on and fell back to its own key; the node is lost all the same.
    wait_for(lambda: store.beats(job, [0])[0] is not None, 10, "rank 0 to fall back")

    n1.ranks[1].stop(delete=False)  # rank 1 dies: its key expires
    verdicts = wait_for(lambda: [v for v in watch.poll() if v.rank == 1], 5 * TIMEOUT,
                        "rank 1's verdict", interval=INTERVAL / 2)
    assert verdicts[0].kind == "expired" and watch.agent_gone(1) is None
