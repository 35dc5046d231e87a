"""Fencing ranks the controller replaced (docs/fault-tolerance.md, 'Fencing'): the rank's
lease (workers/fence.py) and what waits on it (heartbeat, job log, checkpoint files),
the controller's fence set and its watch ignoring stale beats. An in-memory stand-in
for Redis and explicit clocks; no process, no socket."""

from __future__ import annotations

import fnmatch
import os
import threading
import time

import pytest

from kuangchao.platform.execution.beat_table import BeatTable
from kuangchao.platform.execution.fencing import fence_failed, replaced_by
from kuangchao.platform.execution.heartbeat import Classifier
from kuangchao.platform.execution.recovery import Failure
from kuangchao.platform.execution.watch import RankHost, RankWatch
from kuangchao.platform.jobs import keys, redis_client
from kuangchao.platform.jobs.fences import member
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.redis_acl import grant_job_user
from kuangchao.platform.jobs.state import JobRecord, PlacedRank
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.workers import fence as fencing
from kuangchao.workers.checkpoint.files import ChecksummingFileSystem
from kuangchao.workers.errors import FencedError
from kuangchao.workers.runtime import beat_client
from kuangchao.workers.runtime import heartbeat as heartbeat_module
from kuangchao.workers.runtime.heartbeat import Heartbeat
from kuangchao.workers.runtime.joblog import JobLogSink

P, JOB, NODE = "kc:", "j-1", "node-a"
TIMEOUT, MARGIN, INTERVAL = 10.0, 2.0, 1.0
WRITES = {"set", "hset", "hsetnx", "rpush", "ltrim", "delete", "sadd", "expire"}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeRedis:
    """Just the commands a rank's heartbeat sends; `down` makes every call fail as a cut
    network does, and `sent` records every command that reached the "server"."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}
        self.sent: list[tuple] = []
        self.down = False

    def _run(self, name: str, *args, **kw):
        if self.down:
            raise OSError("Redis out of reach")
        self.sent.append((name, *args))
        if name == "set":
            self.data[args[0]] = args[1]
            return True
        if name == "get":
            return self.data.get(args[0])
        if name == "exists":
            return int(args[0] in self.data)
        if name == "sismember":
            return args[1] in self.data.get(args[0], set())
        if name == "delete":
            return int(self.data.pop(args[0], None) is not None)
        return 1

    def __getattr__(self, name: str):
        return lambda *args, **kw: self._run(name, *args, **kw)

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)

    def writes(self) -> list[tuple]:
        return [c for c in self.sent if c[0] in WRITES]


class FakePipeline:
    def __init__(self, client: FakeRedis) -> None:
        self.client, self.queued = client, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name: str):
        return lambda *args, **kw: self.queued.append((name, args, kw))

    def execute(self, raise_on_error: bool = True) -> list:
        if self.client.down:
            raise OSError("Redis out of reach")
        return [self.client._run(n, *a, **kw) for n, a, kw in self.queued]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def exits() -> list[int]:
    return []


@pytest.fixture
def fence(clock, exits) -> fencing.Fence:
    return fencing.Fence(clock=clock, on_exit=exits.append)


@pytest.fixture
def process_fence(fence):
    """`fence` as this process's, for the code that asks the process's own."""
    previous = fencing.use(fence)
    yield fence
    fencing.use(previous)


def heartbeat(client: FakeRedis, fence: fencing.Fence) -> Heartbeat:
    hb = Heartbeat(client, P, JOB, 2, NODE, INTERVAL, TIMEOUT, fence=fence)
    hb.carry()
    fence.arm(TIMEOUT, MARGIN)  # what `start` does, without its thread
    return hb


def fence_me(client: FakeRedis) -> None:
    client.data.setdefault(keys.fenced(P, JOB), set()).add(member(os.getpid(), NODE))


# -- the lease, pure -------------------------------------------------------------------

def test_the_lease_lapses_once_the_ttl_less_the_margin_has_passed_since_the_last_ack():
    lease = fencing.Lease(TIMEOUT, granted_at=0.0, margin_s=MARGIN)
    assert not lease.lapsed(8.0) and lease.lapsed(8.01)  # 10 s TTL less 2 s in flight
    lease.renew(5.0)
    assert not lease.lapsed(13.0) and lease.lapsed(13.5) and lease.left_s(12.0) == 1.0
    lease.renew(1.0)  # an old answer arriving late never moves the lease back
    assert lease.since == 5.0
    assert fencing.Lease(1.0, 0.0, margin_s=5.0).length_s == 0.0


def test_the_exit_bound_is_one_beat_period_and_one_socket_timeout():
    assert fencing.exit_bound_s(0.5, beat_client.client_timeout_s(5.0)) == pytest.approx(
        0.5 + 5.0 / 3)


def test_a_process_without_a_heartbeat_holds_no_lease_and_writes_freely(fence, clock):
    clock.t += 10**6
    assert fence.lease_ok() and fence.wait_lease(0) and not fence.lapsed()
    fence.check("anything")


def test_a_lapsed_lease_holds_checks_until_renewed(fence, clock):
    fence.arm(TIMEOUT, MARGIN)
    clock.t += 9.0
    assert fence.lapsed() and not fence.lease_ok() and not fence.is_fenced()
    assert fence.wait_lease(timeout=0.05) is False
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (fence.check("a shard"), done.set()))
    waiter.start()
    assert not done.wait(0.2)  # the write waits
    fence.renew(clock())
    assert done.wait(5) and fence.lease_ok()
    waiter.join()


def test_fencing_says_why_once_exits_with_its_code_and_every_check_raises(fence, exits, capfd):
    fence.arm(TIMEOUT)
    fence.fence("rank 2 was replaced")
    fence.fence("again")
    assert exits == [fencing.EXIT_FENCED] == [75]
    err = capfd.readouterr().err
    assert err.count("kuangchao: fenced: rank 2 was replaced") == 1 and "code 75" in err
    assert fence.is_fenced() and not fence.lease_ok() and fence.wait_lease() is False
    with pytest.raises(FencedError, match="rank 2 was replaced"):
        fence.check("checkpoint file rank_2.pt")


def test_a_fence_wakes_a_write_waiting_on_a_lapsed_lease(fence, clock):
    fence.arm(TIMEOUT)
    clock.t += 11.0
    raised: list[BaseException] = []

    def write() -> None:
        try:
            fence.check("the manifest")
        except FencedError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=write)
    waiter.start()
    time.sleep(0.1)
    fence.fence("replaced")
    waiter.join(5)
    assert len(raised) == 1


def test_a_heartbeat_stopped_in_good_standing_gives_its_lease_up_a_lapsed_one_keeps_it(
        fence, clock):
    fence.arm(TIMEOUT)
    fence.disarm()
    assert fence.lease is None
    fence.arm(TIMEOUT)
    clock.t += 11.0
    fence.disarm()
    assert fence.lapsed()


# -- the heartbeat thread's side -----------------------------------------------------

def test_every_beat_asks_first_whether_this_process_was_fenced_and_renews_the_lease(fence,
                                                                                     clock):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    clock.t += 7.0
    hb.beat_once()
    assert client.sent[0] == ("sismember", keys.fenced(P, JOB), member(os.getpid(), NODE))
    assert client.sent[1][0] == "set" and client.sent[1][1] == keys.beat(P, JOB, 2)
    assert fence.lease.since == clock.t and hb.beats_sent == 1


def test_a_started_heartbeat_holds_a_lease_of_the_ttl_less_its_socket_timeout(fence):
    client = FakeRedis()
    client.connection_pool = type("Pool", (), {"connection_kwargs": {"socket_timeout": 3.0}})()
    hb = Heartbeat(client, P, JOB, 0, NODE, INTERVAL, TIMEOUT, fence=fence).start()
    assert fence.lease.length_s == pytest.approx(TIMEOUT - 3.0)
    hb.stop()
    assert fence.lease is None  # stopped in good standing: no lease to keep any more
    # A TTL shorter than the socket timeout keeps two thirds of itself, more than a beat.
    hb = Heartbeat(client, P, JOB, 0, NODE, 0.2, 0.4, fence=fence).start()
    assert fence.lease.length_s == pytest.approx(0.4 * 2 / 3)
    hb.stop()


def test_a_lapsed_rank_writes_nothing_while_redis_is_out_of_reach(fence, clock):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    hb.beat_once()
    client.down = True
    hb.publish({"step": 9, "loss": 1.0}, {"step": 9, "loss": 1.0})
    for _ in range(3):
        clock.t += 4.0
        with pytest.raises(OSError):
            hb.beat_once()
    assert fence.lapsed()
    client.down, before = False, len(client.sent)
    fence_me(client)
    hb.beat_once()  # Redis answers again: the rank reads the fence before anything else
    assert client.sent[before:] == [("sismember", keys.fenced(P, JOB), member(os.getpid(), NODE))]
    assert [c for c in client.writes() if c[1] != keys.beat(P, JOB, 2)] == []  # no progress


def test_lapsed_and_not_fenced_renews_the_lease_and_the_beats_resume(fence, clock, exits):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    hb.publish({"step": 9})
    clock.t += 11.0  # Redis was away for everyone; the controller fenced no one
    hb.beat_once()
    assert [c[0] for c in client.sent[:2]] == ["sismember", "sismember"]  # read, then beat
    assert ("hset", keys.progress(P, JOB)) in [c[:2] for c in client.sent]
    assert fence.lease_ok() and not exits


def test_lapsed_and_fenced_exits_and_never_writes_again(fence, clock, exits):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    fence_me(client)
    clock.t += 11.0
    hb.beat_once()
    hb.flush()
    hb.rename(5)
    hb.stop()
    assert exits == [75] and fence.is_fenced()
    assert client.writes() == []
    with pytest.raises(FencedError):
        fence.check("checkpoint file __2_0.distcp")


def test_a_rank_fenced_while_its_lease_held_learns_it_with_its_next_beat(fence, exits):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    hb.beat_once()
    fence_me(client)  # a heal raced the controller: the rank had renewed before the fence
    hb.beat_once()
    assert exits == [75]
    sent = len(client.sent)
    hb.beat_once()
    assert len(client.sent) == sent  # nothing more


def test_a_job_user_that_cannot_read_the_fence_set_beats_as_before(fence, clock):
    client = FakeRedis()
    hb = heartbeat(client, fence)
    nope = heartbeat_module.redis.exceptions.NoPermissionError("NOPERM")
    client.sismember = lambda *a: (_ for _ in ()).throw(nope)
    clock.t += 11.0
    hb.beat_once()
    assert fence.lease_ok() and not fence.is_fenced()


# -- the job log -------------------------------------------------------------------------

class FakeLogStore:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add_logs(self, job_id: str, batch: list[dict]) -> None:
        self.lines += [r["message"] for r in batch]


def test_the_job_log_holds_lines_while_the_lease_is_lapsed_and_drops_them_once_fenced(
        fence, clock):
    store = FakeLogStore()
    sink = JobLogSink(store, JOB, 2, interval_s=3600, fence=fence)
    try:
        fence.arm(TIMEOUT)
        sink.emit("before")
        sink.flush()
        clock.t += 11.0
        sink.emit("held")
        sink.flush()
        assert store.lines == ["before"]
        fence.renew(clock())
        sink.flush()
        assert store.lines == ["before", "held"]
        clock.t += 11.0
        sink.emit("from a replaced rank")
        fence.fence("replaced")
        sink.emit("after")
        sink.flush()
    finally:
        sink.close()
    assert store.lines == ["before", "held"]


# -- checkpoint writes ---------------------------------------------------------------

def test_a_fenced_rank_opens_no_checkpoint_file(process_fence, tmp_path):
    process_fence.arm(TIMEOUT)
    process_fence.fence("replaced")
    with pytest.raises(FencedError), ChecksummingFileSystem().create_stream(tmp_path / "s", "wb"):
        pass
    assert not (tmp_path / "s").exists()
    with open(tmp_path / "r", "wb"):
        pass
    with ChecksummingFileSystem().create_stream(tmp_path / "r", "rb"):
        pass  # reading is no write


def test_a_fenced_rank_neither_writes_nor_commits_a_checkpoint(process_fence, tmp_path):
    import torch

    from kuangchao.workers.checkpoint.manager import CheckpointManager
    from kuangchao.workers.errors import CheckpointError

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, "job-f", 0, 1, "h")
    process_fence.arm(TIMEOUT)
    assert manager.save(1, model, opt, {}).step == 1
    process_fence.fence("replaced")
    with pytest.raises(CheckpointError, match="FencedError"):
        manager.save(2, model, opt, {})
    assert [p.name for p in (tmp_path / "job-f").iterdir()] == ["step_00000001"]


# -- the controller's side ----------------------------------------------------------------

WALL0 = 1_700_000_000.0


def beat(pid: int, seq: int, node: str = NODE) -> Beat:
    return Beat(0, 5, "train", pid, node, WALL0 + seq, WALL0 + seq, seq)


@pytest.mark.parametrize("judge", [Classifier, BeatTable])
def test_the_classifier_counts_beats_only_from_the_placed_process_and_never_a_fenced_one(judge):
    c = judge([0, 1], TIMEOUT, 600.0, pids={0: 111})
    c.fenced = frozenset({member(222, NODE)})
    c.start(0.0)
    for t in range(1, 12):  # rank 0's old process and a fenced one keep beating
        beats = {0: beat(999, t), 1: beat(222, t)}
        verdicts = c.observe(beats, now=float(t), wall=WALL0 + t)
    assert {(v.rank, v.kind) for v in verdicts} == {(0, "expired"), (1, "expired")}
    assert c.last_beat(0) is None
    fresh = judge([0], TIMEOUT, 600.0, pids={0: 111})
    fresh.start(0.0)
    for t in range(1, 30):
        assert fresh.observe({0: beat(111, t)}, now=float(t), wall=WALL0 + t) == []


def placed(store: MemoryStore) -> None:
    store.create(JobRecord(id=JOB, name=JOB, spec={}, world_size=3, placement=(
        PlacedRank(0, "n0", "id-n0", "l0", pid=100), PlacedRank(1, "n1", "id-n1", "l0", pid=101),
        PlacedRank(2, "n1", "id-n1", "l0", pid=102))))


def test_a_lost_node_fences_every_rank_placed_there_and_says_so():
    store = MemoryStore(prefix=P)
    placed(store)
    lost = Failure("node_lost", "cut off", rank=1, node="n1", pid=101, node_id="id-n1")
    assert [p.rank for p in replaced_by(lost, store.get(JOB).placement)] == [1, 2]
    fence_failed(store, JOB, lost)
    assert store.fenced(JOB) == {"101@n1", "102@n1"}
    [event] = [e for e in store.events(JOB) if e["type"] == "fenced"]
    assert event["pids"] == [101, 102] and "pid 102 on n1" in event["message"]


def test_a_failed_rank_fences_its_own_process_only_and_a_quiet_fence_says_nothing():
    store = MemoryStore(prefix=P)
    placed(store)
    fence_failed(store, JOB, Failure("expired", "silent", rank=1, node="n1", pid=101,
                                     node_id="id-n1"), quiet=True)
    assert store.fenced(JOB) == {"101@n1"}
    assert not [e for e in store.events(JOB) if e["type"] == "fenced"]
    fence_failed(store, JOB, Failure("placement", "no node"))  # no process: nothing
    assert store.fenced(JOB) == {"101@n1"}


def test_the_watch_reads_the_fence_set_and_ignores_a_fenced_processs_beats(clock):
    store = MemoryStore(prefix=P)
    watch = RankWatch(store, JOB, [0], TIMEOUT, 600.0, INTERVAL,
                      hosts={0: RankHost(os.getpid(), None, None)}, clock=clock)
    for _ in range(30):
        clock.t += 0.5
        store.put_beat(JOB, 0, beat(os.getpid(), int(clock.t * 2)).encode(), TIMEOUT)
        assert watch.poll() == []
    store.fence(JOB, [member(os.getpid(), NODE)])
    verdicts = []
    while not verdicts:
        clock.t += 0.5
        store.put_beat(JOB, 0, beat(os.getpid(), int(clock.t * 2)).encode(), TIMEOUT)
        verdicts = watch.poll()
    assert verdicts[0].kind == "expired" and clock.t > 115.0 + TIMEOUT


def test_a_controller_run_fences_the_ranks_of_a_node_cut_off(tmp_path):
    from kuangchao.platform.cluster.quarantine import QuarantinePolicy
    from kuangchao.platform.execution.controller import JobController
    from kuangchao.platform.execution.heartbeat import Verdict
    from kuangchao.platform.settings import Settings
    from tests.unit.controller_fakes import FakeCredentials, FakeGroup, Step, placed_job

    store = MemoryStore(prefix=P)
    spec = {"task": {"name": "t"}, "checkpoint": {"path": str(tmp_path / "ckpt")},
            "parallel": {"data_parallel_size": 3, "micro_batch_size": 8,
                         "gradient_accumulation_steps": 2}}
    placed_job(store, "j1", spec, ["n0", "n1", "n1"])
    group = FakeGroup(tmp_path / "ckpt" / "j1", [Step(verdicts=[Verdict(2, "expired", 10.5, None)])])
    group.unreachable = {"id-n1": "network"}
    settings = Settings(redis_url="redis://10.0.0.2:6380/0", redis_prefix=P, ray_address=None,
                        api_url="http://127.0.0.1:1", quarantine=QuarantinePolicy())
    ctl = JobController("j1", settings, store=store, poll_s=0.0, group=group,
                        watch_factory=group.watch_factory, credentials=FakeCredentials())
    ctl.resizer.relocate_wait_s = 0.5  # no scheduler answers here: the job requeues soon
    ctl.run()
    [fenced] = [e for e in store.events("j1") if e["type"] == "fenced"]
    assert fenced["ranks"] == [1, 2] and fenced["node"] == "n1"
    assert store.fenced("j1") == {f"{pid}@n1" for pid in fenced["pids"]} and len(fenced["pids"]) == 2
    failure = next(e for e in store.events("j1") if e["type"] == "failure")
    assert failure["kind"] == "node_lost"


# -- the store-side guard ------------------------------------------------------------

def test_the_jobs_redis_user_may_read_its_fence_set_and_never_write_it():
    class Admin:
        def execute_command(self, *args):
            self.args = args

    admin = Admin()
    grant_job_user(admin, P, JOB)
    rules = admin.args
    fence_key = keys.fenced(P, JOB)
    assert f"%R~{fence_key}" in rules
    writable = [r[1:] for r in rules if r.startswith("~")]
    assert writable and not any(fnmatch.fnmatchcase(fence_key, pat) for pat in writable)
    assert not fence_key.startswith(keys.job_prefix(P, JOB))


def test_a_ranks_redis_connections_drop_unsent_bytes_when_they_close():
    class Sock:
        def __init__(self) -> None:
            self.opts: list[tuple] = []

        def setsockopt(self, *opt) -> None:
            self.opts.append(opt)

    class Base:
        def _connect(self):
            return Sock()

    import socket
    import struct

    sock = redis_client._abortive_class(Base)()._connect()
    assert sock.opts == [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))]
    client = beat_client.heartbeat_client("redis://127.0.0.1:1/0", TIMEOUT)
    assert client.connection_pool.connection_class.abortive
    assert beat_client.socket_timeout(client) == pytest.approx(TIMEOUT / 3)
