"""What a rank checks as it starts: that Redis and the Ray head answer from its node."""

from __future__ import annotations

import socket

import pytest

from kuangchao.workers.errors import Unreachable
from kuangchao.workers.runtime.reach import check_control_plane, gcs_target, redis_target, unreachable


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_targets_come_from_the_urls_the_rank_was_given():
    assert redis_target("redis://kc-job-x:pw@198.18.3.2:6400/0") == ("198.18.3.2", 6400)
    assert redis_target("redis://h") == ("h", 6379)
    assert gcs_target("198.18.3.1:22267") == ("198.18.3.1", 22267)


def test_a_listening_port_is_reachable_and_a_closed_one_is_named_with_its_error():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        dead = closed_port()
        out = unreachable({"Redis": ("127.0.0.1", port), "the Ray head (GCS)": ("127.0.0.1", dead)},
                          timeout_s=2)
    assert list(out) == ["the Ray head (GCS)"] and f"127.0.0.1:{dead}" in out["the Ray head (GCS)"]


def test_a_rank_that_cannot_reach_redis_says_so_from_its_node():
    port = closed_port()
    with pytest.raises(Unreachable, match=rf"rank 3 on node node-1 .*cannot reach Redis at "
                                          rf"127\.0\.0\.1:{port}.*127\.0\.0\.1 works only"):
        check_control_plane(3, "node-1", f"redis://:pw@127.0.0.1:{port}/0")
