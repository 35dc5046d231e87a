"""Fakes for driving `JobController` without Ray: a worker group, a heartbeat
watch and credentials that behave like the real ones at their seams.

A test scripts what the ranks do as a queue of steps; each `poll` of the
group takes the next step (a rank's death, an error, a heartbeat verdict or a
store action) and, once the script is spent, every rank still running returns
its result: the job's final checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuangchao.platform.execution.heartbeat import Verdict
from kuangchao.platform.execution.members import GroupSnapshot, Outcome
from kuangchao.platform.execution.reachability import NodeReach
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank


def final_checkpoint(folder: Path, step: int) -> dict[str, Any]:
    """A verified (empty) checkpoint folder at `step`, as a rank's `run` returns it."""
    path = folder / f"step_{step:08d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"format": 3, "step": step, "files": {},
                                                    "checksum": "crc32"}))
    return {"checkpoint": {"path": str(path), "step": step}, "final_loss": 1.5, "steps": step}


@dataclass
class Step:
    """One poll's worth of what happens: outcomes, verdicts, or an action on the store."""

    outcomes: list[Outcome] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    action: Callable[[], None] | None = None
    dead: list[tuple[int, str]] = field(default_factory=list)  # what `dead_ranks` says now


class FakeWatch:
    """The heartbeat watch: hands out the verdicts the group's script queued."""

    def __init__(self, group: FakeGroup, ranks: list[int], *_: Any, hosts: Any = None,
                 nodes: Any = None, peer_wait_s: float | None = None) -> None:
        self.group, self.ranks, self.hosts = group, ranks, hosts or {}
        self.classifier = type("Classifier", (), {"heartbeat_timeout_s": 10.0})()
        group.watches.append(self)

    def poll(self) -> list[Verdict]:
        verdicts, self.group.verdicts = self.group.verdicts, []
        return verdicts

    def last_beat(self, rank: int) -> None:
        return None

    def agent_gone(self, rank: int) -> None:
        return None

    def collect_stacks(self, suspects: list[int], silent: Any = ()) -> dict[int, str]:
        return {r: f"stacks of {r}" for r in suspects}


class FakeCredentials:
    authority = None

    def __init__(self) -> None:
        self.retired = 0

    def public_key(self) -> str:
        return "-----BEGIN PUBLIC KEY----- (fake)"

    def within_job(self, path: Path | str) -> Path:
        return Path(path)

    def retire(self, store: Any) -> None:
        self.retired += 1


class FakeSpares:
    """The spare pool's face to a relocation: the nodes holding standby spares."""

    def __init__(self) -> None:
        self.standby: list[str] = []
        self.ids: dict[str, str] = {}  # name -> Ray node id, where a test names them

    def standby_names(self) -> list[str]:
        return list(self.standby)

    def standby_nodes(self) -> dict[str, str]:
        return {n: self.ids.get(n, f"id-{n}") for n in self.standby}

    def tick(self, spec: Any) -> None:
        self.ticks = getattr(self, "ticks", 0) + 1


class FakeGroup:
    """A worker group whose ranks follow a script. `calls` records what the controller did."""

    def __init__(self, checkpoints: Path, script: list[Step] | None = None,
                 lost_nodes: set[str] | None = None, final_step: int = 10) -> None:
        self.checkpoints, self.script = checkpoints, list(script or [])
        self.lost_nodes = lost_nodes or set()
        self.final_step = final_step
        self.members: list[dict[str, Any]] = []
        self.pgs: list[str] = []
        self.running: set[int] = set()
        self.calls: list[tuple] = []
        self.verdicts: list[Verdict] = []
        self.watches: list[FakeWatch] = []
        self.pg_history: list[list[str]] = []  # the placement groups after each reshape
        self.dead: list[tuple[int, str]] = []
        self.survivors_stop = True
        self.results: Callable[[int], Any] = lambda rank: final_checkpoint(
            self.checkpoints, self.final_step)
        self.next_pid = 1000
        self.keeper_plan: Callable[[], Any] = lambda: None
        self.keepers_ahead: Callable[[dict[str, str]], None] = lambda nodes: None
        self.plans: list[tuple[tuple[int, ...], Any]] = []  # what each `run` carried
        self.spares = FakeSpares()

    def ensure_agents(self, placement: Any) -> None:
        self.agent_nodes = sorted({p.node for p in placement})

    def watch_factory(self, store: Any, job_id: str, ranks: list[int], *args: Any,
                      **kw: Any) -> FakeWatch:
        return FakeWatch(self, ranks, *args, **kw)

    def _info(self, slot: PlacedRank) -> dict[str, Any]:
        self.next_pid += 1
        return {"pid": self.next_pid, "ip": "10.0.0.1", "host": slot.node,
                "node_id": slot.node_id, "gpu_ids": list(slot.gpus)}

    # -- the group's interface -------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def infos(self) -> list[dict[str, Any]]:
        return list(self.members)

    @property
    def placed(self) -> bool:
        return bool(self.pgs)

    def start(self, placement: Any, spec: Any) -> list[dict[str, Any]]:
        self.calls.append(("start", len(placement)))
        rpr = spec.elastic_range.ranks_per_replica
        self.members = [self._info(p) for p in placement]
        self.pgs = [f"pg-r{r}" for r in range(0, len(placement), rpr)]
        return self.infos

    def describe(self, timeout_s: float, ranks: Any = None) -> list[dict[str, Any]]:
        return self.infos

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 29400

    def formed(self, keys: list[str]) -> bool:
        return True

    def join(self, generation: dict[str, Any]) -> str:
        self.calls.append(("join", generation["gen"], generation["world_size"]))
        return "gloo"

    def run(self, doc: dict[str, Any], ranks: Any = None, join: Any = None,
            join_timeout_s: float = 0) -> None:
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        self.calls.append(("run", tuple(ranks)))
        self.plans.append((tuple(ranks), self.keeper_plan()))
        self.running |= set(ranks)

    def poll(self, timeout_s: float, skip: set[int] = frozenset()) -> list[Outcome]:
        if self.script:
            step = self.script.pop(0)
            if step.action:
                step.action()
            self.verdicts += step.verdicts
            self.dead = step.dead
            out = [o for o in step.outcomes if o.rank not in skip]
            for o in out:
                self.running.discard(o.rank)
            return out
        done = sorted(r for r in self.running if r not in skip)
        self.running.clear()
        return [Outcome(r, value=self.results(r)) for r in done]

    def finished(self) -> list[Outcome]:
        return []

    def dead_ranks(self) -> list[tuple[int, str]]:
        return self.dead

    def node_lost(self, node_id: str | None) -> bool:
        return node_id in self.lost_nodes

    def lost_among(self, node_ids: set[str]) -> frozenset[str]:
        self.calls.append(("lost_among", tuple(sorted(node_ids))))
        return frozenset(n for n in node_ids if n in self.lost_nodes)

    def reach(self, node_id: str, redis: tuple[str, int]) -> NodeReach:
        """What a probe of the node finds: `unreachable` maps node ids to
        "network" (no answer) or "redis" (answers, cannot reach Redis)."""
        self.calls.append(("reach", node_id))
        cut = getattr(self, "unreachable", {}).get(node_id)
        return NodeReach(cut != "network", "timed out" if cut == "redis" else "")

    def stop(self, rank: int, host: Any, node_id: Any, hard: bool) -> None:
        self.calls.append(("stop", rank, hard))
        self.running.discard(rank)

    def replace(self, rank: int, slot: PlacedRank | None) -> bool:
        self.calls.append(("replace", rank))
        assert slot is not None
        self.members[rank] = self._info(slot)
        return False

    def survivors_stopped(self, ranks: list[int], timeout_s: float) -> bool:
        self.running -= set(ranks)
        return self.survivors_stop

    def reset(self, ranks: list[int]) -> None:
        self.calls.append(("reset", tuple(ranks)))

    def start_spares(self, node_ids: set[str]) -> None:
        self.calls.append(("spares", tuple(sorted(node_ids))))

    def snapshot(self) -> GroupSnapshot:
        return GroupSnapshot(tuple(dict(m) for m in self.members), tuple(self.pgs))

    def restore(self, snap: GroupSnapshot) -> None:
        self.members, self.pgs = [dict(m) for m in snap.members], list(snap.pgs)

    def reshape(self, order: list[int], joiners: list[tuple[list[PlacedRank], Any]],
                spares: bool = False) -> int:
        self.calls.append(("reshape", tuple(order), len(joiners)))
        # As the real group: the new ranks' nodes get their keepers started ahead.
        self.keepers_ahead({s.node: s.node_id for slots, _ in joiners for s in slots if s.node_id})
        # A warm spare on each refilled slot's node, as `start_spares` kept one there.
        taken = sum(len(slots) for slots, _ in joiners if spares)
        if taken:
            self.calls.append(("spares_taken", taken))
        rpr = max(1, len(self.members) // max(1, len(self.pgs)))
        kept = [order[i] // rpr for i in range(0, len(order), rpr)]
        self.pgs = [self.pgs[i] for i in kept] + [pg or f"pg-new{i}"
                                                  for i, (_, pg) in enumerate(joiners)]
        self.members = [self.members[r] for r in order] + [
            self._info(s) for slots, _ in joiners for s in slots]
        self.pg_history.append(list(self.pgs))
        # A rank keeps running across the change; the ones that moved take their new number.
        self.running = set(range(len(order)))
        return taken

    def release(self, snap: GroupSnapshot, leaving: list[int], wait_s: float) -> None:
        self.calls.append(("release", tuple(leaving)))

    def drop_pgs(self, pgs: list[Any]) -> None:
        self.calls.append(("drop_pgs", tuple(pgs)))

    def teardown(self) -> None:
        self.calls.append(("teardown",))
        self.members, self.pgs, self.running = [], [], set()


def placed_job(store: Any, job_id: str, spec: dict[str, Any], nodes: list[str]) -> JobRecord:
    """A job in PLACING on `nodes` (one rank each)."""
    placement = tuple(PlacedRank(r, n, f"id-{n}", "leaf0") for r, n in enumerate(nodes))
    job = JobRecord(id=job_id, name=job_id, spec=spec, state=JobState.PLACING,
                    world_size=len(nodes), gpus=0, replicas=len(nodes), placement=placement)
    store.create(job)
    return store.get(job_id)


def ask_resize(store: Any, job_id: str, to: int, cause: str, new_nodes: list[str] = (),
               for_job: str | None = None) -> None:
    """What the scheduler does: a resize request on the record, the slots it reserved
    for the new ranks appended to the placement, and the flag for the controller."""
    def ask(j: JobRecord):
        added = tuple(PlacedRank(j.world_size + i, n, f"id-{n}", "leaf0")
                      for i, n in enumerate(new_nodes))
        return dataclasses.replace(j, placement=j.placement + added, resize={
            "to": to, "from": j.replicas, "cause": cause, "for_job": for_job,
            "requested_at": time.time()}), None
    store.update(job_id, ask)
    store.request_resize(job_id)
