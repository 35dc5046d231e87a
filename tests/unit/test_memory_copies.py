"""Peer-memory checkpoints, the pure rules (platform/protocol/memory_copies.py): what a
keeper holds, which step a job restores from memory, which nodes keep a rank's copies."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

from kuangchao.platform.errors import CopyRefused
from kuangchao.platform.protocol.memory_copies import (
    CopyLayout,
    CopyMeta,
    CopyStore,
    checksum,
    choose_restore,
    keeper_load,
    keeper_name,
    keeper_prefix,
    mismatch,
    peer_shortfall,
    peers_for,
)

LAYOUT = CopyLayout(world_size=4, spec_hash="abc123")


def copy(rank: int, step: int, data: bytes | None = None, layout: CopyLayout = LAYOUT):
    data = data if data is not None else f"state of rank {rank} at step {step}".encode()
    return CopyMeta(rank, step, len(data), checksum(data), layout), data


def put(store: CopyStore, rank: int, step: int, **kw) -> list[int]:
    return store.put(*copy(rank, step, **kw))


# -- the store ---------------------------------------------------------------------------


def test_a_copy_comes_back_as_it_went_in_with_its_size_and_checksum():
    store = CopyStore(max_bytes=1024, clock=lambda: 42.0)
    meta, data = copy(1, 7)
    assert store.put(meta, data) == []
    got_meta, got = store.get(1, 7)
    assert got == data and got_meta.size == len(data) and got_meta.crc32 == checksum(data)
    assert got_meta.stored_at == 42.0 and got_meta.layout == LAYOUT
    assert mismatch(got_meta, got, LAYOUT) is None
    assert store.get(1, 8) is None and store.get(0, 7) is None
    assert store.bytes_held() == len(data)


def test_the_two_newest_copies_of_each_rank_are_kept():
    store = CopyStore(max_bytes=1024)
    put(store, 0, 1)
    put(store, 0, 2)
    assert put(store, 0, 3) == [1]
    put(store, 1, 2)
    assert store.steps(0) == {2, 3} and store.steps(1) == {2}
    assert [(m.rank, m.step) for m in store.list()] == [(0, 2), (0, 3), (1, 2)]
    assert [m.step for m in store.list(rank=0)] == [2, 3]


def test_a_put_of_a_held_step_replaces_it():
    store = CopyStore(max_bytes=1024)
    put(store, 0, 5, data=b"first")
    put(store, 0, 5, data=b"second!")
    assert store.get(0, 5)[1] == b"second!" and store.bytes_held() == len(b"second!")
    assert store.steps(0) == {5}


def test_a_put_of_an_older_step_drops_the_newer_copies_of_the_abandoned_run():
    # A rank goes back only after a restore: what it held past that step is the old run's.
    store = CopyStore(max_bytes=1024)
    for step in (8, 9):
        put(store, 0, step)
        put(store, 1, step)
    assert put(store, 0, 6) == [8, 9]
    assert store.steps(0) == {6} and store.steps(1) == {8, 9}  # other ranks untouched
    put(store, 0, 7)
    assert store.steps(0) == {6, 7}


def test_a_put_under_a_new_layout_drops_the_old_layouts_copies():
    store = CopyStore(max_bytes=1024)
    put(store, 0, 10)
    put(store, 0, 11)
    resized = CopyLayout(world_size=2, spec_hash="abc123")
    assert put(store, 0, 12, layout=resized) == [10, 11]
    assert store.steps(0) == {12} and store.steps(0, LAYOUT) == set()
    assert store.steps(0, resized) == {12}


def test_a_copy_over_the_bound_is_refused_naming_the_setting_and_nothing_changes():
    store = CopyStore(max_bytes=2 * 1024 * 1024)
    put(store, 0, 1)
    before = store.bytes_held()
    with pytest.raises(CopyRefused) as info:
        put(store, 0, 2, data=b"x" * (2 * 1024 * 1024 + 1))
    assert info.value.reason == "too_large"
    assert "checkpoint.in_memory.max_mb_per_rank" in str(info.value) and "2.0 MB" in str(info.value)
    assert store.steps(0) == {1} and store.bytes_held() == before
    put(store, 0, 3, data=b"x" * (2 * 1024 * 1024))  # exactly the bound is fine


def test_a_copy_whose_bytes_do_not_match_its_checksum_or_size_is_refused():
    store = CopyStore(max_bytes=1024)
    meta, data = copy(0, 1)
    with pytest.raises(CopyRefused) as info:
        store.put(meta, data[:-1] + b"?")
    assert info.value.reason == "checksum" and "CRC-32" in str(info.value)
    with pytest.raises(CopyRefused, match="bytes"):
        store.put(meta, data + b"more")
    with pytest.raises(CopyRefused) as info:
        store.put(CopyMeta(-1, 1, meta.size, meta.crc32, LAYOUT), data)
    assert info.value.reason == "malformed"
    assert store.list() == []


def test_what_a_keeper_holds_is_bounded_by_the_spec():
    bound = 1000
    store = CopyStore(max_bytes=bound)
    for step in range(1, 30):
        for rank in range(3):
            put(store, rank, step, data=bytes([step]) * (bound - step))
    stats = store.stats()
    assert stats["copies"] == 6 and stats["ranks"] == 3
    assert stats["bytes"] == store.bytes_held() <= stats["bound_bytes"] == 2 * bound * 3
    assert stats["steps"] == {"0": [28, 29], "1": [28, 29], "2": [28, 29]}  # the two newest


def test_drop_frees_one_copy_a_rank_or_everything():
    store = CopyStore(max_bytes=1024)
    for rank in (0, 1):
        for step in (1, 2):
            put(store, rank, step, data=b"1234")
    assert store.drop(rank=0, step=1) == 4
    assert store.drop(rank=1) == 8
    assert store.drop() == 4 and store.bytes_held() == 0 and store.list() == []
    assert store.drop() == 0


def test_a_store_needs_a_positive_bound():
    with pytest.raises(ValueError):
        CopyStore(max_bytes=0)
    with pytest.raises(ValueError):
        CopyStore(max_bytes=10, keep=0)


# -- descriptions and verification -------------------------------------------------------


def test_a_description_round_trips_through_json_and_a_broken_one_is_refused():
    meta, _ = copy(2, 9)
    assert CopyMeta.from_json(meta.to_json()) == meta
    with pytest.raises(CopyRefused) as info:
        CopyMeta.from_json({"rank": 1, "step": 2})
    assert info.value.reason == "malformed"
    with pytest.raises(CopyRefused):
        CopyMeta.from_json({**meta.to_json(), "step": "nine"})


def test_mismatch_names_what_is_wrong_with_a_fetched_copy():
    meta, data = copy(3, 11)
    assert mismatch(meta, None) is not None
    assert "bytes" in mismatch(meta, data[:5])
    flipped = bytes([data[0] ^ 1]) + data[1:]
    assert "CRC-32" in mismatch(meta, flipped)
    other = CopyLayout(world_size=8, spec_hash="abc123")
    assert "written by 4 ranks" in mismatch(meta, data, other)
    assert "spec" in mismatch(meta, data, CopyLayout(4, "zzz"))
    assert mismatch(meta, data) is None and mismatch(meta, memoryview(data), LAYOUT) is None


def test_copy_refused_survives_pickling_with_its_reason():
    exc = pickle.loads(pickle.dumps(CopyRefused("too_large", "over the bound")))
    assert exc.reason == "too_large" and "over the bound" in str(exc)


def test_keeper_names_are_per_job_and_node():
    assert keeper_name("j1", "node-a") != keeper_name("j1", "node-b")
    assert keeper_name("j1", "node-a").startswith(keeper_prefix("j1"))
    assert not keeper_name("j10", "a").startswith(keeper_prefix("j1"))


# -- choosing the step ------------------------------------------------------------------


def test_the_newest_step_every_rank_has_is_chosen():
    assert choose_restore(None, {0: {9, 10}, 1: {9, 10}}, 2) == 10
    # a failure mid-push: rank 1 never got step 10 out
    assert choose_restore(None, {0: {9, 10}, 1: {8, 9}}, 2) == 9
    assert choose_restore(5, {0: [9, 10], 1: (10, 9)}, 2) == 10


def test_a_memory_copy_is_never_older_than_the_disk_checkpoint():
    assert choose_restore(10, {0: {9, 10}, 1: {10}}, 2) == 10  # as new is enough
    assert choose_restore(11, {0: {9, 10}, 1: {9, 10}}, 2) is None
    assert choose_restore(0, {0: {3}}, 1) == 3


def test_no_step_without_a_copy_for_every_rank():
    assert choose_restore(None, {0: {1, 2}, 1: {3, 4}}, 2) is None
    assert choose_restore(None, {0: {1, 2}}, 2) is None  # rank 1 found nothing
    assert choose_restore(None, {0: {1}, 1: set()}, 2) is None
    assert choose_restore(None, {}, 1) is None
    assert choose_restore(None, {0: {1}}, 0) is None
    # ranks beyond the world are ignored: a copy of a rank the job no longer has
    assert choose_restore(None, {0: {4}, 1: {4}, 2: {5}}, 2) == 4


# -- where the copies go ----------------------------------------------------------------


def nodes(n_nodes: int, per_node: int) -> dict[int, str]:
    return {r: f"n{r // per_node}" for r in range(n_nodes * per_node)}


def test_peers_are_other_nodes_distinct_and_deterministic():
    node_of = nodes(4, 2)
    for rank, node in node_of.items():
        peers = peers_for(rank, node_of, 2)
        assert len(peers) == 2 == len(set(peers)) and node not in peers
        assert peers == peers_for(rank, dict(reversed(node_of.items())), 2)


@pytest.mark.parametrize("n_nodes, per_node, replicas", [(2, 1, 1), (3, 4, 1), (4, 8, 2),
                                                         (5, 3, 3), (8, 1, 7), (3, 2, 2)])
def test_every_node_keeps_as_many_copies_as_it_sends_out(n_nodes, per_node, replicas):
    node_of = nodes(n_nodes, per_node)
    kept = Counter(p for r in node_of for p in peers_for(r, node_of, replicas))
    assert set(kept.values()) == {per_node * replicas}, kept
    assert keeper_load(node_of, replicas) == {f"n{k}": per_node * (1 + replicas)
                                              for k in range(n_nodes)}


def test_uneven_nodes_still_spread_the_copies():
    node_of = {0: "a", 1: "a", 2: "a", 3: "b", 4: "c"}
    kept = Counter(p for r in node_of for p in peers_for(r, node_of, 1))
    assert sum(kept.values()) == 5 and max(kept.values()) - min(kept.values()) <= 1
    # a's three ranks do not all land on one node
    assert {peers_for(r, node_of, 1)[0] for r in (0, 1, 2)} == {"b", "c"}


def test_fewer_other_nodes_than_replicas_gives_every_other_node_and_says_so():
    node_of = {0: "a", 1: "b"}
    assert peers_for(0, node_of, 3) == ["b"]
    assert "2 nodes" in peer_shortfall(node_of, 3)
    assert peer_shortfall(node_of, 1) is None
    single = {0: "a", 1: "a"}
    assert peers_for(1, single, 1) == []
    assert "one node" in peer_shortfall(single, 1)
    assert peers_for(0, node_of, 0) == []
    with pytest.raises(KeyError):
        peers_for(7, node_of, 1)


def test_a_keeper_plan_round_trips_through_json():
    from kuangchao.platform.protocol.memory_copies import KeeperPlan

    plan = KeeperPlan({"a": keeper_name("j", "a"), "b": keeper_name("j", "b")}, {0: "a", 1: "b"})
    doc = plan.to_json()
    assert doc["node_of"] == {"0": "a", "1": "b"}  # JSON keys are text
    assert KeeperPlan.from_json(doc) == plan and plan.namespace == "kuangchao"


# -- the spec section ---------------------------------------------------------------------


def _errors(in_memory) -> dict[str, str]:
    from kuangchao.platform.errors import SpecError
    from kuangchao.platform.spec.jobspec import validate_spec

    with pytest.raises(SpecError) as info:
        validate_spec({"checkpoint": {"in_memory": in_memory}})
    return dict(info.value.errors)


def test_in_memory_is_off_unless_asked_and_replicas_default_to_one():
    from kuangchao.platform.spec.jobspec import validate_spec

    assert validate_spec({}).checkpoint.in_memory is None
    section = validate_spec({"checkpoint": {"in_memory": {"interval_steps": 1,
                                                          "max_mb_per_rank": 512}}}).checkpoint.in_memory
    assert (section.interval_steps, section.replicas, section.max_mb_per_rank) == (1, 1, 512)
    assert section.max_bytes_per_rank == 512 * 1024 * 1024
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        section.replicas = 2  # frozen, as every section


@pytest.mark.parametrize("in_memory, field, words", [
    ({"interval_steps": 1}, "max_mb_per_rank", "required"),
    ({"max_mb_per_rank": 8}, "interval_steps", "required"),
    ({"interval_steps": 0, "max_mb_per_rank": 8}, "interval_steps", "greater than or equal to 1"),
    ({"interval_steps": 1, "max_mb_per_rank": 0}, "max_mb_per_rank", "greater than or equal to 1"),
    ({"interval_steps": 1, "max_mb_per_rank": 8 << 30}, "max_mb_per_rank", "less than or equal"),
    ({"interval_steps": 1, "max_mb_per_rank": 8, "replicas": 0}, "replicas", "greater than"),
    ({"interval_steps": 1, "max_mb_per_rank": 8, "replica": 2}, "replica", "unknown field"),
])
def test_a_bad_in_memory_section_names_the_field(in_memory, field, words):
    errors = _errors(in_memory)
    assert set(errors) == {f"checkpoint.in_memory.{field}"}, errors
    assert words in errors[f"checkpoint.in_memory.{field}"]
