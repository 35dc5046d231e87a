"""Which Ray token a process presents: the local stack's, found through
`$KC_HOME/cluster.json`, only when it connects to that stack."""

from __future__ import annotations

import json
import os

import pytest

from kuangchao.platform.runtime.ray_connect import ray_token_env, use_cluster_token


@pytest.fixture
def stack_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(k, "")  # recorded, so what use_cluster_token sets is undone after
        monkeypatch.delenv(k)
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"ray_address": "127.0.0.1:6390", "ray_token_file": str(tmp_path / "ray-token")}))
    return tmp_path


def test_the_recorded_stacks_token_is_used_for_that_stack(stack_home):
    for address in (None, "auto", "127.0.0.1:6390"):
        os.environ.pop("RAY_AUTH_MODE", None)
        assert use_cluster_token(address) is True
        assert os.environ["RAY_AUTH_MODE"] == "token"
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(stack_home / "ray-token")


def test_the_record_wins_over_an_inherited_token_of_another_stack(stack_home, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere/ray-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "another-stacks-token")
    assert use_cluster_token("127.0.0.1:6390")
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(stack_home / "ray-token")
    assert "RAY_AUTH_TOKEN" not in os.environ  # it would win over the path


def test_another_address_or_no_record_leaves_the_environment_alone(stack_home, monkeypatch):
    assert use_cluster_token("10.0.0.5:6379") is False
    assert "RAY_AUTH_MODE" not in os.environ
    (stack_home / "cluster.json").write_text(json.dumps({"ray_address": "127.0.0.1:6390"}))
    assert use_cluster_token(None) is False and "RAY_AUTH_MODE" not in os.environ
    assert ray_token_env({}) == {}
