"""What `kc debug` makes of the ranks' answers (platform/jobs/debugreq.py)."""

from __future__ import annotations

from kuangchao.platform.jobs.debugreq import DebugRequest, comm_report, gradient_report


def _grads(**params) -> dict:
    return {"step": 7, "params": {k: list(v) for k, v in params.items()}}


def test_identical_replicas_have_zero_divergence():
    same = _grads(w=(2.0, 0.1, 0.5, "aa"), b=(1.0, 0.0, 0.2, "bb"))
    report = gradient_report({0: same, 1: same, 2: same})
    assert report["identical"] and report["max_divergence"] == 0.0 and report["diverged"] == []
    assert report["params"] == 2 and report["ranks"] == 3 and report["step"] == 7


def test_the_parameter_that_differs_most_comes_first():
    r0 = _grads(w=(2.0, 0.1, 0.5, "aa"), b=(1.0, 0.0, 0.2, "bb"), c=(3.0, 0, 1, "cc"))
    r1 = _grads(w=(2.0, 0.1, 0.5, "aa"), b=(1.5, 0.0, 0.2, "b2"), c=(3.0, 0, 1, "c2"))
    report = gradient_report({0: r0, 1: r1})
    assert not report["identical"]
    assert [row["param"] for row in report["diverged"]] == ["b", "c"]
    assert report["diverged"][0]["divergence"] == 0.5 / 1.5 and report["diverged"][0]["rank"] == 1
    assert 0 < report["diverged"][1]["divergence"] < 1e-9  # same norm, other bits: still named


def test_a_parameter_missing_on_a_replica_is_infinite_divergence():
    report = gradient_report({0: _grads(w=(1, 0, 0, "a")), 1: _grads()})
    assert report["diverged"][0]["param"] == "w" and report["max_divergence"] == float("inf")


def _comm(ranks, pending=None) -> dict:
    return {"groups": [{"name": "world", "backend": "gloo", "rank": 0, "size": len(ranks),
                        "ranks": ranks, "generation": 0}], "pending": pending}


def test_consistent_groups_are_healthy():
    report = comm_report({0: _comm([0, 1]), 1: _comm([0, 1])})
    assert report["healthy"] and report["problems"] == []


def test_a_rank_order_mismatch_is_flagged():
    report = comm_report({0: _comm([0, 1, 2]), 1: _comm([0, 2, 1]), 2: _comm([0, 1, 2])})
    assert not report["healthy"]
    assert "group world: ranks disagree" in report["problems"][0]
    assert "rank 1: [0, 2, 1]" in report["problems"][0]


def test_ranks_waiting_in_different_collectives_are_flagged():
    a = {"op": "all_reduce (mean loss)", "group": "world", "waited_s": 12.0}
    b = {"op": "all_reduce (DDP bucket 0)", "group": "world", "waited_s": 11.5}
    report = comm_report({0: _comm([0, 1], a), 1: _comm([0, 1], b)})
    assert not report["healthy"] and "different collectives" in report["problems"][0]
    one = comm_report({0: _comm([0, 1], a), 1: _comm([0, 1])})
    assert "rank(s) [1] in none" in one["problems"][0]


def test_requests_round_trip_and_garbage_reads_as_none():
    req = DebugRequest("abc123abc123", "gradient", step=5, steps=1, ts=1.0)
    assert DebugRequest.from_json(req.to_json()) == req
    assert DebugRequest.from_json("{not json") is None and DebugRequest.from_json(None) is None
