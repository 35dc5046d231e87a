"""The quarantine policy: when failures say a node is bad, and for how long."""

from __future__ import annotations

from kuangchao.platform.cluster.quarantine import QuarantinePolicy, active


def test_failures_outside_the_window_do_not_count():
    p = QuarantinePolicy(failures=3, window_s=100)
    assert not p.should_quarantine([0.0, 50.0, 160.0], now=160.0)  # 0 is out of the window
    assert p.should_quarantine([70.0, 100.0, 160.0], now=160.0)


def test_zero_failures_turns_quarantine_off():
    p = QuarantinePolicy(failures=0)
    assert not p.enabled and not p.should_quarantine([1.0] * 10, now=1.0)


def test_policy_from_environment(monkeypatch):
    monkeypatch.setenv("KC_QUARANTINE_FAILURES", "5")
    monkeypatch.setenv("KC_QUARANTINE_WINDOW_S", "30")
    monkeypatch.setenv("KC_QUARANTINE_S", "90")
    p = QuarantinePolicy.from_env()
    assert (p.failures, p.window_s, p.duration_s) == (5, 30.0, 90.0)


def test_only_unexpired_entries_are_active():
    stored = {"a": {"until": 10.0}, "b": {"until": 30.0}}
    assert list(active(stored, now=20.0)) == ["b"]
