"""Node agents' records, pure: the record's encoding (binary, and the text one of
earlier versions), the ack's, their bulk decoding (node_columns.py), and which
source each rank's beat is taken from (platform/execution/relayed.py), fed to
the columnar classifier the watch uses (beat_table.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kuangchao.platform.execution.beat_table import BeatTable, ScanUpdate
from kuangchao.platform.execution.relayed import AUTO_MIN_RANKS, RelayView, agents_wanted
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import (
    ENTRY,
    HEADER,
    Ack,
    decode_node_record,
    encode_node_record,
    encode_text_record,
)
from kuangchao.platform.protocol.node_columns import gather
from kuangchao.platform.spec.jobspec import JobSpec


def beat(rank: int, seq: int, node: str = "n0", step: int = 5, phase: str = "train") -> Beat:
    return Beat(rank, step, phase, 1000 + rank, node, 100.0 + seq, 99.0, seq)


def record(node: str, seq: int, beats: list[Beat]) -> bytes:
    return encode_node_record(node, 42, 100.0 + seq, seq, beats)


def test_a_record_carries_each_ranks_own_beat_under_its_node():
    beats = [beat(0, 3, "n|0"), beat(5, 7, "n|0", phase="col|lective")]
    rec = decode_node_record(record("n|0", 2, beats))
    assert rec is not None and (rec.node, rec.agent_pid, rec.seq) == ("n|0", 42, 2)
    assert rec.beats == {0: beats[0], 5: beats[1]}  # binary: no separator to escape
    assert len(record("n0", 1, [beat(0, 1)] * 8)) == HEADER.size + 2 + 8 * ENTRY.size
    long = decode_node_record(record("n0", 1, [beat(0, 1, phase="a-phase-named-at-length")]))
    assert long is not None and long.beats[0].phase == "a-phase-named-at"  # its first 16 bytes


def test_a_text_record_of_an_earlier_agent_still_decodes():
    rec = decode_node_record(encode_text_record("n|0", 42, 102.0, 2, [beat(0, 3, "n_0")]))
    assert rec is not None and rec.node == "n_0" and rec.beats[0] == beat(0, 3, "n_0")
    text = encode_text_record("n0", 42, 102.0, 2, [beat(0, 3)]).encode()
    got = gather([(0, text)])
    assert got.entries["rank"].tolist() == [0] and got.agents == {0: 42} and not got.bad


def test_an_empty_record_and_malformed_ones():
    assert decode_node_record(record("n0", 1, [])).beats == {}
    good = record("n0", 1, [beat(0, 1)])
    assert decode_node_record(good[:-1]) is None  # its length does not match its count
    assert decode_node_record(good + b"x") is None
    assert decode_node_record("garbage") is None
    text = encode_text_record("n0", 1, 2.0, 3, [beat(0, 1)])
    assert decode_node_record(text.replace("|train", "")) is None  # fields misaligned
    assert decode_node_record(text.replace("1|n0", "x|n0", 1)) is None
    got = gather([(0, good), (1, good[:-1]), (2, b"garbage"), (3, record("n3", 1, [beat(9, 1)]))])
    assert got.bad == [1, 2] and got.record.tolist() == [0, 3]
    assert got.entries["rank"].tolist() == [0, 9] and got.counts == {0: 1, 3: 1}


def beats_of(update: ScanUpdate, nodes: list[str]) -> dict[int, Beat | None]:
    """One scan's beat per rank, as the classifier takes it."""
    out = dict(update.direct)
    out.update({r: None for r in update.absent})
    for rank, row, node in zip(update.ranks.tolist(), update.entries, update.nodes.tolist(),
                               strict=True):
        out[rank] = Beat(rank, int(row["step"]), row["phase"].decode(), int(row["pid"]),
                         nodes[node], float(row["ts"]), float(row["progress_ts"]),
                         int(row["seq"]))
    return out


def test_an_ack_round_trips_and_a_broken_one_is_none():
    ack = Ack(5.0, {123: 9}, ["123@n0"], {"cancel": True}, [2], 77)
    assert Ack.decode(ack.encode()) == ack
    assert Ack.decode("{") is None and Ack.decode('{"ts": 1}') is None


def test_covered_ranks_come_from_the_record_others_from_their_own_keys():
    view = RelayView({0: "n0", 1: "n0", 2: "n1"})
    assert view.direct_ranks() == [0, 1, 2] and view.nodes == ["n0", "n1"]
    out = beats_of(view.update([record("n0", 1, [beat(0, 1)]), None],
                               {0: None, 1: beat(1, 4), 2: beat(2, 4, "n1")}), view.nodes)
    assert out[0] == beat(0, 1) and out[1] == beat(1, 4) and out[2] == beat(2, 4, "n1")
    assert view.direct_ranks() == [1, 2]  # rank 0's own key is no longer read
    # Rank 1 is relayed from now on; rank 0 dropped out of the record (it fell back).
    out = beats_of(view.update([record("n0", 2, [beat(1, 5)]), None], {1: None, 2: None}),
                   view.nodes)
    assert out[1] == beat(1, 5) and out[0] is None
    assert view.direct_ranks() == [0, 2]
    assert view.agent_gone(1) is None and view.agent_gone(0) is None


def test_an_unchanged_record_is_not_decoded_again_and_a_stray_rank_is_ignored():
    view = RelayView({0: "n0", 1: "n1"})
    first = record("n0", 1, [beat(0, 1), beat(1, 1)])  # rank 1 was placed on n1, not n0
    update = view.update([first, None], {})
    assert update.ranks.tolist() == [0] and view.direct_ranks() == [1]
    again = view.update([first, None], {1: None})
    assert len(again.ranks) == 0 and list(again.absent) == [] and again.direct == {1: None}


def test_a_dead_agent_leaves_its_ranks_silent_though_they_beat_on_their_own():
    view = RelayView({0: "n0", 1: "n0"})
    view.update([record("n0", 1, [beat(0, 1), beat(1, 1)])], {})
    out = view.update([None], {})
    assert sorted(out.absent) == [0, 1] and len(out.ranks) == 0
    assert view.agent_gone(0) == "n0" and view.agent_gone(1) == "n0"
    assert view.direct_ranks() == []
    # It comes back: its ranks are relayed again, and the node is no longer gone.
    view.update([record("n0", 9, [beat(0, 2), beat(1, 2)])], {})
    assert view.agent_gone(0) is None
    # A record that does not decode is as if the agent wrote none, each scan it stays.
    for _ in range(2):
        assert sorted(view.update([b"KNB2 broken"], {}).absent) == [0, 1]
        assert view.agent_gone(0) == "n0"


def test_the_classifier_judges_a_dead_agents_ranks_expired_and_spares_a_rank_without_one():
    view = RelayView({0: "n0", 1: "n1"})
    clf = BeatTable([0, 1], heartbeat_timeout_s=2.0, hang_timeout_s=60.0, nodes=view.nodes)
    clf.start(0.0)
    now, seq = 0.0, 0
    while now < 1.0:
        seq += 1
        update = view.update([record("n0", seq, [beat(0, seq)]), None], {1: beat(1, seq, "n1")})
        assert clf.observe(update, now, wall=100.0 + seq) == []
        now += 0.5
    assert clf.last_beat(0) == beat(0, seq) and clf.last_beat(1) == beat(1, seq, "n1")
    verdicts = []
    while not verdicts and now < 10:  # the agent on n0 dies; rank 1 beats on
        seq += 1
        verdicts = clf.observe(view.update([None, None], {1: beat(1, seq, "n1")}), now,
                               wall=100.0 + seq)
        now += 0.5
    assert [(v.rank, v.kind) for v in verdicts] == [(0, "expired")]
    assert verdicts[0].last == beat(0, 2)
    assert 2.0 < now <= 1.0 + 2.0 + 1.0
    assert view.agent_gone(0) == "n0" and view.agent_gone(1) is None


def test_a_hung_rank_in_a_record_is_flagged_and_one_starting_up_is_not():
    view = RelayView({r: f"n{r // 8}" for r in range(64)})
    clf = BeatTable(range(64), 10.0, 5.0, pids={r: 1000 + r for r in range(64)}, nodes=view.nodes)
    clf.start(0.0)
    verdicts = []
    for seq in range(1, 5):
        rows = {node: [] for node in view.nodes}
        for r in range(64):
            b = beat(r, seq)._replace(node=view.node_of[r], ts=100.0 + 3 * seq,
                                      progress_ts=100.0 + 3 * seq)
            if r == 9:
                b = b._replace(progress_ts=90.0, phase="collective")  # stalled: hung
            if r == 10:
                b = b._replace(progress_ts=90.0, phase="init")  # starting up: untimed
            if r == 11:
                b = b._replace(pid=7)  # not the process placed there: as if none came
            rows[view.node_of[r]].append(b)
        raws = [record(n, seq, rows[n]) for n in view.nodes]
        verdicts = clf.observe(view.update(raws, {}), float(seq), wall=100.0 + 3 * seq)
    assert [(v.rank, v.kind) for v in verdicts] == [(9, "hung")]
    assert verdicts[0].last.phase == "collective" and verdicts[0].last.node == "n1"
    assert clf.last_beat(11) is None and bool(np.all(clf.present[np.arange(64) != 11]))


def test_auto_starts_agents_for_large_jobs_only():
    def spec(world: int, mode: str) -> JobSpec:
        return JobSpec.model_validate({
            "task": {"name": "a"}, "parallel": {"data_parallel_size": world},
            "fault_tolerance": {"node_agents": mode}})

    assert not agents_wanted(spec(4, "auto")) and agents_wanted(spec(AUTO_MIN_RANKS, "auto"))
    assert agents_wanted(spec(2, "on")) and not agents_wanted(spec(AUTO_MIN_RANKS, "off"))


def test_a_large_jobs_start_with_partial_records_covers_exactly_the_listed_ranks():
    view = RelayView({r: f"n{r // 8:04d}" for r in range(2048 * 8)})
    raws = [record(n, 1, [beat(8 * i + k, 1, n) for k in range(0, 8, 2)])
            for i, n in enumerate(view.nodes)]  # half of each node's ranks have started
    update = view.update(raws, {})
    assert len(update.ranks) == 8192
    assert view.direct_ranks() == [r for r in range(2048 * 8) if r % 2]


@pytest.mark.parametrize("seed", range(5))
def test_the_columnar_scan_judges_as_the_per_rank_classifier_fed_the_same_beats(seed):
    """Seeded random scans (ranks dropping out of records, agents dying, stale pids,
    fenced processes, stalls, start-up): the `BeatTable` fed each `ScanUpdate` and
    the per-rank `Classifier` fed the beats it stands for give the same verdicts."""
    import random

    from kuangchao.platform.execution.heartbeat import Classifier
    from kuangchao.platform.jobs.fences import member

    rng = random.Random(seed)
    node_of = {r: f"n{r // 4}" for r in range(16)}
    pids = {r: 1000 + r for r in range(16)}
    view = RelayView(node_of)
    table = BeatTable(range(16), 3.0, 4.0, pids=pids, nodes=view.nodes)
    plain = Classifier(list(range(16)), 3.0, 4.0, pids=pids)
    seq = {r: 0 for r in range(16)}
    progress = {r: 100.0 for r in range(16)}
    held: dict[int, Beat | None] = {}  # what the old merge handed on: the same beat objects
    flagged = 0
    for scan in range(120):
        now, wall = scan * 0.5, 100.0 + scan * 0.5
        if scan % 40 == 20:  # a fence set only grows while a job is watched
            victim = rng.randrange(16)
            fenced = table.fenced | {member(1000 + victim, node_of[victim])}
            table.fenced = plain.fenced = fenced
        raws: list[bytes | None] = []
        for node in view.nodes:
            if rng.random() < 0.15:
                raws.append(None)  # the agent's record expired
                continue
            if rng.random() < 0.3 and scan:
                raws.append(view._last[view.nodes.index(node)])  # unchanged since the last scan
                continue
            listed = []
            for rank in (r for r, n in node_of.items() if n == node):
                if rng.random() < 0.1:
                    continue  # fell out of the record
                if rng.random() < 0.7:
                    seq[rank] += 1
                if rng.random() < 0.6:
                    progress[rank] = wall
                phase = rng.choice(["train", "train", "collective", "init"])
                pid = pids[rank] if rng.random() < 0.95 else 7
                listed.append(Beat(rank, seq[rank], phase, pid, node, wall, progress[rank],
                                   seq[rank]))
            raws.append(record(node, scan, listed))
        direct = {r: (beat(r, seq[r], node_of[r])._replace(pid=pids[r], ts=wall,
                                                            progress_ts=progress[r])
                      if rng.random() < 0.5 else None) for r in view.direct_ranks()}
        update = view.update(raws, direct)
        held.update(beats_of(update, view.nodes))
        got = table.observe(update, now, wall)
        want = plain.observe(dict(held), now, wall)
        assert [(v.rank, v.kind, round(v.detected_after_s, 6), v.last) for v in got] == [
            (v.rank, v.kind, round(v.detected_after_s, 6), v.last) for v in want], scan
        flagged += len(got)
    assert flagged > 20  # the scans did exercise the verdicts
