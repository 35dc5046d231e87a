"""Node agents' records, pure: the record's encoding, the ack's, and which source
each rank's beat is taken from (platform/execution/relayed.py), fed to the real
classifier."""

from __future__ import annotations

from kuangchao.platform.execution.heartbeat import Classifier
from kuangchao.platform.execution.relayed import AUTO_MIN_RANKS, RelayView, agents_wanted
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import (
    Ack,
    NodeRecord,
    decode_node_record,
    encode_node_record,
)
from kuangchao.platform.spec.jobspec import JobSpec


def beat(rank: int, seq: int, node: str = "n0", step: int = 5, phase: str = "train") -> Beat:
    return Beat(rank, step, phase, 1000 + rank, node, 100.0 + seq, 99.0, seq)


def record(node: str, seq: int, beats: list[Beat]) -> NodeRecord:
    rec = decode_node_record(encode_node_record(node, 42, 100.0 + seq, seq, beats))
    assert rec is not None
    return rec


def test_a_record_carries_each_ranks_own_beat_under_its_node():
    beats = [beat(0, 3), beat(5, 7, phase="col|lective")]
    rec = record("n|0", 2, beats)
    assert (rec.node, rec.agent_pid, rec.seq) == ("n_0", 42, 2)
    assert rec.beats[0] == beats[0]._replace(node="n_0")
    assert rec.beats[5].phase == "col_lective" and rec.beats[5].seq == 7


def test_an_empty_record_and_malformed_ones():
    assert record("n0", 1, []).beats == {}
    good = encode_node_record("n0", 1, 2.0, 3, [beat(0, 1)])
    assert decode_node_record(good.replace("|train", "")) is None  # fields misaligned
    assert decode_node_record("garbage") is None
    assert decode_node_record(good.replace("1|n0", "x|n0", 1)) is None


def test_an_ack_round_trips_and_a_broken_one_is_none():
    ack = Ack(5.0, {123: 9}, ["123@n0"], {"cancel": True}, [2], 77)
    assert Ack.decode(ack.encode()) == ack
    assert Ack.decode("{") is None and Ack.decode('{"ts": 1}') is None


def test_covered_ranks_come_from_the_record_others_from_their_own_keys():
    view = RelayView({0: "n0", 1: "n0", 2: "n1"})
    assert view.direct_ranks() == [0, 1, 2]
    out = view.merge({"n0": record("n0", 1, [beat(0, 1)]), "n1": None},
                     {0: None, 1: beat(1, 4), 2: beat(2, 4, "n1")})
    assert out[0] == beat(0, 1) and out[1] == beat(1, 4) and out[2] == beat(2, 4, "n1")
    assert view.direct_ranks() == [1, 2]  # rank 0's own key is no longer read
    # Rank 1 is relayed from now on; rank 0 dropped out of the record (it fell back).
    out = view.merge({"n0": record("n0", 2, [beat(1, 5)]), "n1": None}, {1: None, 2: None})
    assert out[1] == beat(1, 5) and out[0] is None
    assert view.direct_ranks() == [0, 2]
    assert view.agent_gone(1) is None and view.agent_gone(0) is None


def test_a_dead_agent_leaves_its_ranks_silent_though_they_beat_on_their_own():
    view = RelayView({0: "n0", 1: "n0"})
    view.merge({"n0": record("n0", 1, [beat(0, 1), beat(1, 1)])}, {})
    out = view.merge({"n0": None}, {})
    assert out == {0: None, 1: None}
    assert view.agent_gone(0) == "n0" and view.agent_gone(1) == "n0"
    assert view.direct_ranks() == []
    # It comes back: its ranks are relayed again, and the node is no longer gone.
    view.merge({"n0": record("n0", 9, [beat(0, 2), beat(1, 2)])}, {})
    assert view.agent_gone(0) is None


def test_the_classifier_judges_a_dead_agents_ranks_expired_and_spares_a_rank_without_one():
    view = RelayView({0: "n0", 1: "n1"})
    clf = Classifier([0, 1], heartbeat_timeout_s=2.0, hang_timeout_s=60.0)
    clf.start(0.0)
    now, seq = 0.0, 0
    while now < 1.0:
        seq += 1
        beats = view.merge({"n0": record("n0", seq, [beat(0, seq)]), "n1": None},
                           {1: beat(1, seq, "n1")})
        assert clf.observe(beats, now, wall=100.0 + seq) == []
        now += 0.5
    verdicts = []
    while not verdicts and now < 10:  # the agent on n0 dies; rank 1 beats on
        seq += 1
        verdicts = clf.observe(view.merge({"n0": None}, {1: beat(1, seq, "n1")}), now,
                               wall=100.0 + seq)
        now += 0.5
    assert [(v.rank, v.kind) for v in verdicts] == [(0, "expired")]
    assert 2.0 < now <= 1.0 + 2.0 + 1.0
    assert view.agent_gone(0) == "n0" and view.agent_gone(1) is None


def test_auto_starts_agents_for_large_jobs_only():
    def spec(world: int, mode: str) -> JobSpec:
        return JobSpec.model_validate({
            "task": {"name": "a"}, "parallel": {"data_parallel_size": world},
            "fault_tolerance": {"node_agents": mode}})

    assert not agents_wanted(spec(4, "auto")) and agents_wanted(spec(AUTO_MIN_RANKS, "auto"))
    assert agents_wanted(spec(2, "on")) and not agents_wanted(spec(AUTO_MIN_RANKS, "off"))
