"""Starting a local stack's Ray head: ports kc picks, and a head that fails to start.

`ray start` itself is replaced by a stand-in that exits as told; what is under
test is kc's own logic around it (which ports, which temp dir, when to retry,
what the error says). The real head starts in every integration test.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kuangchao.platform.errors import ClusterError
from kuangchao.platform.runtime import procs, ray_nodes
from kuangchao.platform.runtime.localcluster import UpOptions


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = procs._ephemeral_low()
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for port in ports:
        assert procs._BAND_LOW <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free when handed out


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        picks = iter([busy] * 3 + list(range(busy + 1, busy + 50)))
        monkeypatch.setattr(procs, "_BAND_LOW", 1024)
        monkeypatch.setattr(procs, "_ephemeral_low", lambda: 65535)

        class Scripted:
            def randrange(self, lo, hi):
                return next(picks)

        monkeypatch.setattr(procs.random, "SystemRandom", Scripted)
        assert procs.free_port() != busy


class _Exit:
    def __init__(self, rc: int):
        self.rc = rc

    def wait(self, timeout: float) -> int:
        return self.rc


@pytest.fixture()
def fake_ray(monkeypatch, tmp_path):
    """`ray start` that fails the first `fails` times, writing a log line each time."""
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    monkeypatch.setenv("KC_HOME", str(home))
    calls: list[list[str]] = []
    plan = {"fails": 0}

    def ray_start(args, env, log_name):
        calls.append(args)
        with open(home / "logs" / log_name, "a") as f:
            f.write(f"try {len(calls)}: GCS port in use\n")
        return _Exit(1 if len(calls) <= plan["fails"] else 0)

    monkeypatch.setattr(ray_nodes, "ray_start", ray_start)
    monkeypatch.setattr(ray_nodes.procs, "matching", lambda needles: set())
    return calls, plan


def _state(tmp_path: Path) -> dict:
    temp = tmp_path / "kc-temp"
    temp.mkdir()
    return {"temp_dir": str(temp), "ray_token_file": str(tmp_path / "tok"),
            "redis_url": "redis://x", "redis_prefix": "p:"}


def _flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


def test_a_head_that_fails_on_kc_chosen_ports_is_retried_on_fresh_ones(fake_ray, tmp_path):
    calls, plan = fake_ray
    plan["fails"] = 1
    state = _state(tmp_path)
    first_temp = state["temp_dir"]
    port = ray_nodes._start_head(state, UpOptions(cluster=Path("c.yaml"), dashboard_port=0))
    assert len(calls) == 2
    assert _flag(calls[0], "port") != _flag(calls[1], "port")
    assert _flag(calls[0], "dashboard-port") != _flag(calls[1], "dashboard-port")
    assert _flag(calls[1], "temp-dir") == state["temp_dir"] != first_temp
    assert not Path(first_temp).exists()  # the failed try's session is gone
    assert state["ray_port"] == port == int(_flag(calls[1], "port"))


def test_a_head_that_keeps_failing_says_so_with_the_end_of_its_log(fake_ray, tmp_path):
    calls, plan = fake_ray
    plan["fails"] = 99
    with pytest.raises(ClusterError) as err:
        ray_nodes._start_head(_state(tmp_path), UpOptions(cluster=Path("c.yaml")))
    assert len(calls) == ray_nodes.HEAD_TRIES
    assert f"failed {ray_nodes.HEAD_TRIES} time(s)" in str(err.value)
    assert f"try {ray_nodes.HEAD_TRIES}: GCS port in use" in str(err.value)


def test_a_port_the_user_named_is_not_swapped_for_another(fake_ray, tmp_path):
    calls, plan = fake_ray
    plan["fails"] = 1
    with pytest.raises(ClusterError, match="failed 1 time"):
        ray_nodes._start_head(_state(tmp_path), UpOptions(cluster=Path("c.yaml"), ray_port=6390))
    assert [_flag(c, "port") for c in calls] == ["6390"]
