"""Heartbeat records and the controller's classifier (platform/execution/heartbeat.py),
with explicit clocks. Every case runs against both classifiers: the per-rank one
and the columnar `BeatTable` (beat_table.py) that jobs with node agents use."""

import sys

import pytest

from kuangchao.platform.execution.beat_table import BeatTable
from kuangchao.platform.execution.heartbeat import Classifier
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.beats import read_beats
from kuangchao.platform.protocol.heartbeat import Beat

TIMEOUT, HANG = 10.0, 60.0
WALL0 = 1_700_000_000.0  # wall clock (beat ts) at monotonic 0


@pytest.fixture(params=["Classifier", "BeatTable"], autouse=True)
def _judge(request, monkeypatch):
    """Each case with `Classifier` as written, and with `BeatTable` in its place."""
    if request.param == "BeatTable":
        monkeypatch.setattr(sys.modules[__name__], "Classifier", BeatTable)


def beat(rank=0, seq=1, ts=WALL0, progress_ts=None, step=5, phase="forward") -> Beat:
    return Beat(rank, step, phase, 4242, "node-a", ts, ts if progress_ts is None else progress_ts, seq)


def classifier(ranks=(0,), grace_s=0.0, start=0.0) -> Classifier:
    c = Classifier(list(ranks), heartbeat_timeout_s=TIMEOUT, hang_timeout_s=HANG, grace_s=grace_s)
    c.start(start)
    return c


# -- the record ------------------------------------------------------------------

def test_beat_round_trips_through_its_encoding():
    b = Beat(3, 12, "backward", 4242, "node-a", WALL0 + 0.125, WALL0 - 7.5, 99)
    assert Beat.decode(3, b.encode()) == b
    assert Beat.decode(3, b.encode().encode()) == b  # bytes from a client without decode_responses


def test_beat_encoding_keeps_milliseconds_and_escapes_the_separator_in_free_text():
    # Node names and phases (`ctx.phase(name)`) come from outside: a "|" in
    # either must not make a live rank's beat undecodable.
    decoded = Beat.decode(0, Beat(0, 1, "eval|val", 1, "rack|7", 12.3456, 10.0001, 2).encode())
    assert decoded is not None
    assert decoded.node == "rack_7" and decoded.phase == "eval_val"
    assert decoded.ts == pytest.approx(12.346) and decoded.progress_ts == pytest.approx(10.0)


@pytest.mark.parametrize("raw", [
    "", "garbage", "1|forward|2|n|3.0|3.0",  # too few fields
    "1|forward|2|n|3.0|3.0|4|extra",  # too many
    "x|forward|2|n|3.0|3.0|4", "1|forward|2|n|later|3.0|4", "1|forward|2|n|3.0|3.0|4.5",
    b"\xff\xfe|forward|2|n|3.0|3.0|4",  # undecodable bytes
    '{"step": 1}',  # the JSON an older writer might have left
])
def test_malformed_beats_decode_to_none(raw):
    assert Beat.decode(0, raw) is None


def test_stalled_is_time_on_the_same_step_by_the_ranks_own_clock():
    assert beat(ts=WALL0 + 30, progress_ts=WALL0).stalled_s == 30
    assert beat(ts=WALL0, progress_ts=WALL0 + 1).stalled_s == 0  # never negative


# -- the classifier -------------------------------------------------------------------

def test_fresh_beats_give_no_verdict():
    c = classifier(ranks=(0, 1))
    for t in range(0, 30):
        beats = {r: beat(r, seq=t + 1, ts=WALL0 + t) for r in (0, 1)}
        assert c.observe(beats, now=float(t), wall=WALL0 + t) == []
    assert c.last_beat(1) == beats[1]


@pytest.mark.parametrize("still_stored", [True, False])
def test_rank_without_a_new_beat_for_the_timeout_expires(still_stored):
    c = classifier()
    last = beat(seq=1, ts=WALL0 + 1)
    assert c.observe({0: last}, now=1.0, wall=WALL0 + 1) == []
    # The same beat read again (key not yet expired) or no key at all: nothing new.
    again = {0: last if still_stored else None}
    assert c.observe(again, now=11.0, wall=WALL0 + 11) == []  # exactly the timeout: not yet
    [v] = c.observe(again, now=11.5, wall=WALL0 + 11.75)
    assert v.rank == 0 and v.kind == "expired" and v.last == last
    assert v.detected_after_s == pytest.approx(10.75)  # from the last beat's ts, by wall time
    assert "stopped heartbeating" in v.describe(TIMEOUT)


def test_a_new_seq_with_the_same_payload_counts_as_fresh():
    c = classifier()
    c.observe({0: beat(seq=1)}, now=1.0, wall=WALL0)
    assert c.observe({0: beat(seq=2)}, now=10.0, wall=WALL0 + 9) == []
    assert c.observe({0: beat(seq=2)}, now=19.0, wall=WALL0 + 18) == []
    assert [v.kind for v in c.observe({0: beat(seq=2)}, now=20.5, wall=WALL0 + 19.5)] == ["expired"]


def test_live_beats_with_stalled_progress_are_hung():
    c = classifier()
    stuck_since = WALL0
    for t in (1, 30, 60):  # stalled 60 s: not more than the hang timeout yet
        b = beat(seq=t, ts=WALL0 + t, progress_ts=stuck_since, phase="collective")
        assert c.observe({0: b}, now=float(t), wall=WALL0 + t) == []
    b = beat(seq=61, ts=WALL0 + 61, progress_ts=stuck_since, step=7, phase="collective")
    [v] = c.observe({0: b}, now=61.0, wall=WALL0 + 61)
    assert v.kind == "hung" and v.detected_after_s == pytest.approx(61) and v.last == b
    assert "hung" in v.describe(TIMEOUT) and "step 7" in v.describe(TIMEOUT)


def test_a_rank_still_in_init_is_never_hung():
    c = classifier()
    b = beat(seq=500, ts=WALL0 + 500, progress_ts=WALL0, step=0, phase="init")
    assert c.observe({0: b}, now=500.0, wall=WALL0 + 500) == []


def test_a_rank_whose_train_function_returned_is_never_hung():
    c = classifier()
    b = beat(seq=500, ts=WALL0 + 500, progress_ts=WALL0, step=100, phase="done")
    assert c.observe({0: b}, now=500.0, wall=WALL0 + 500) == []


def test_a_hung_rank_that_also_stops_beating_is_reported_expired():
    c = classifier()
    b = beat(seq=1, ts=WALL0 + 100, progress_ts=WALL0)
    assert [v.kind for v in c.observe({0: b}, now=1.0, wall=WALL0 + 100)] == ["hung"]
    assert [v.kind for v in c.observe({0: None}, now=11.5, wall=WALL0 + 110.5)] == ["expired"]


# -- peer_wait_s: a silent rank its peers wait on ----------------------------------------

def waiting_peers(ranks=(0, 1), peer_wait_s=2.0) -> Classifier:
    c = Classifier(list(ranks), heartbeat_timeout_s=TIMEOUT, hang_timeout_s=HANG,
                   peer_wait_s=peer_wait_s)
    c.start(0.0)
    return c


def scan(t, silent, waiting=(0,), last=None, phase="forward", stepping=False):
    """Every 0.5 s: the `waiting` ranks beat, stuck at step 5 since t=0 (or `stepping`);
    the `silent` ones left their beat at t=0 (still stored: its key has not expired)."""
    out = {r: last or beat(r, seq=1, ts=WALL0) for r in silent}
    for r in waiting:
        out[r] = beat(r, seq=int(t * 2) + 1, ts=WALL0 + t, phase=phase,
                      progress_ts=WALL0 + t if stepping else WALL0,
                      step=5 + int(t * 4) if stepping else 5)
    return out


def test_a_silent_rank_its_peers_wait_on_is_failed_before_the_timeout():
    c = waiting_peers()
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):  # silent 2 s: not more than peer_wait_s yet
        assert c.observe(scan(t, silent=[1]), now=t, wall=WALL0 + t) == []
    [v] = c.observe(scan(2.5, silent=[1]), now=2.5, wall=WALL0 + 2.5)
    assert v.rank == 1 and v.kind == "expired" and v.detected_after_s == pytest.approx(2.5)
    assert v.peers_waited_s == pytest.approx(2.5)
    assert "while every other rank waited on it (2.5s without progress)" in v.describe(TIMEOUT)


def test_a_silent_rank_whose_peers_still_step_waits_for_the_full_timeout():
    c = waiting_peers()
    for t in [x / 2 for x in range(0, 21)]:  # 0 .. 10 s
        assert c.observe(scan(t, silent=[1], stepping=True), now=t, wall=WALL0 + t) == []
    [v] = c.observe(scan(10.5, silent=[1], stepping=True), now=10.5, wall=WALL0 + 10.5)
    assert v.rank == 1 and v.kind == "expired" and v.peers_waited_s is None


@pytest.mark.parametrize("phase", ["init", "done"])
def test_peers_in_an_untimed_phase_confirm_nothing(phase):
    c = waiting_peers()
    for t in (0.5, 2.5, 5.0, 9.5):
        assert c.observe(scan(t, silent=[1], phase=phase), now=t, wall=WALL0 + t) == []


def test_without_peer_wait_a_silent_rank_waits_for_the_timeout_and_alone_too():
    off, alone = waiting_peers(peer_wait_s=None), waiting_peers(ranks=(1,))
    for t in (0.0, 2.5, 5.0, 9.5):
        assert off.observe(scan(t, silent=[1]), now=t, wall=WALL0 + t) == []
        assert alone.observe(scan(t, silent=[1], waiting=()), now=t, wall=WALL0 + t) == []


def test_every_silent_rank_is_failed_when_the_rest_wait_and_none_when_one_steps():
    c = waiting_peers(ranks=(0, 1, 2, 3))
    assert c.observe(scan(0.0, silent=[1, 3], waiting=(0, 2)), now=0.0, wall=WALL0) == []
    got = c.observe(scan(2.5, silent=[1, 3], waiting=(0, 2)), now=2.5, wall=WALL0 + 2.5)
    assert sorted(v.rank for v in got) == [1, 3]
    mixed = waiting_peers(ranks=(0, 1, 2))
    for t in (0.0, 2.5, 5.0):
        beats = {**scan(t, silent=[1], waiting=(0,)), **scan(t, silent=[], waiting=(2,), stepping=True)}
        assert mixed.observe(beats, now=t, wall=WALL0 + t) == []


def test_a_peer_whose_beat_is_missing_this_scan_confirms_nothing():
    c = waiting_peers(ranks=(0, 1, 2))
    for t in (0.0, 1.0, 2.0):
        assert c.observe(scan(t, silent=[1], waiting=(0, 2)), now=t, wall=WALL0 + t) == []
    beats = scan(2.5, silent=[1], waiting=(0, 2))
    beats[2] = None  # its key gone a moment (it is still fresh: it beat at t=2)
    assert c.observe(beats, now=2.5, wall=WALL0 + 2.5) == []


def test_store_failure_holds_verdicts_for_the_grace_period_then_they_resume():
    c = classifier(ranks=(0, 1, 2), grace_s=5.0)
    live = lambda t: {0: beat(0, seq=int(t * 10), ts=WALL0 + t)}  # noqa: E731
    c.observe({**live(1), 1: beat(1, seq=1, ts=WALL0 + 1), 2: beat(2, seq=1, ts=WALL0 + 1)},
              now=1.0, wall=WALL0 + 1)
    c.store_failed(now=2.0)  # held until 2 + timeout + grace = 17
    # Rank 1 never beats again; rank 2 beats but is stalled long past the hang timeout.
    hung = beat(2, seq=2, ts=WALL0 + 16, progress_ts=WALL0 - 100)
    assert c.observe({**live(16), 1: None, 2: hung}, now=16.9, wall=WALL0 + 16.9) == []
    verdicts = c.observe({**live(17), 1: None, 2: hung}, now=17.0, wall=WALL0 + 17)
    assert {(v.rank, v.kind) for v in verdicts} == {(1, "expired"), (2, "hung")}


def test_store_failure_does_not_blame_ranks_for_beats_it_could_not_read():
    c = classifier(grace_s=0.0)
    c.observe({0: beat(seq=1, ts=WALL0 + 1)}, now=1.0, wall=WALL0 + 1)
    c.store_failed(now=9.0)  # the last read failed: fresh_at moves to 9, held until 19
    assert c.observe({0: None}, now=19.0, wall=WALL0 + 19) == []  # 10 s since 9: not more
    [v] = c.observe({0: None}, now=19.5, wall=WALL0 + 19.5)
    assert v.kind == "expired" and v.detected_after_s == pytest.approx(18.5)


def test_repeated_store_failures_extend_the_hold():
    c = classifier(grace_s=0.0)
    c.observe({0: beat(seq=1)}, now=1.0, wall=WALL0)
    for t in (2.0, 5.0, 8.0):
        c.store_failed(now=t)
    assert c.observe({0: None}, now=17.9, wall=WALL0 + 17.9) == []  # held until 8 + 10
    assert [v.kind for v in c.observe({0: None}, now=18.5, wall=WALL0 + 18.5)] == ["expired"]


def test_a_rank_that_never_beats_gets_the_timeout_from_start():
    c = classifier(ranks=(0, 1), start=100.0)
    first = {0: beat(0, seq=1, ts=WALL0), 1: None}
    assert c.observe(first, now=105.0, wall=WALL0 + 5) == []
    assert c.observe({0: beat(0, seq=2, ts=WALL0 + 10), 1: None}, now=110.0, wall=WALL0 + 10) == []
    [v] = c.observe({0: beat(0, seq=3, ts=WALL0 + 10.5), 1: None}, now=110.5, wall=WALL0 + 10.5)
    assert v.rank == 1 and v.kind == "expired" and v.last is None
    assert v.detected_after_s == pytest.approx(10.5)  # from start(), on the monotonic clock
    assert "no heartbeat within 10s of starting" in v.describe(TIMEOUT)


def test_observe_before_start_starts_the_clock():
    c = Classifier([0], heartbeat_timeout_s=TIMEOUT, hang_timeout_s=HANG)
    assert c.observe({0: None}, now=50.0, wall=WALL0) == []
    assert c.started
    assert c.observe({0: None}, now=60.0, wall=WALL0 + 10) == []
    assert [v.kind for v in c.observe({0: None}, now=60.1, wall=WALL0 + 10.1)] == ["expired"]


# -- read_beats against a stand-in client --------------------------------------------------

class FakePipeline:
    def __init__(self, data):
        self.data, self.queued = data, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def mget(self, keys):
        self.queued.append(list(keys))

    def execute(self):
        return [[self.data.get(k) for k in batch] for batch in self.queued]


class FakeClient:
    def __init__(self, data):
        self.data, self.pipelines = data, []

    def pipeline(self, transaction=True):
        assert transaction is False
        self.pipelines.append(FakePipeline(self.data))
        return self.pipelines[-1]


def test_read_beats_reads_every_rank_in_chunks_with_one_pipeline():
    beats = {r: beat(r, seq=r + 1, ts=WALL0 + r) for r in range(7) if r != 4}
    data = {keys.beat("p:", "j1", r): b.encode() for r, b in beats.items()}
    data[keys.beat("p:", "j1", 5)] = "not a beat"
    client = FakeClient(data)
    out = read_beats(client, "p:", "j1", range(7), chunk=3)
    assert out == {0: beats[0], 1: beats[1], 2: beats[2], 3: beats[3], 4: None, 5: None, 6: beats[6]}
    [pipe] = client.pipelines
    assert [len(batch) for batch in pipe.queued] == [3, 3, 1]
