"""What the security tests share: a victim job of one tenant, running on the
session's stack, and a submitter key of another tenant (the attacker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Stack, wait_for

# What must stay as it was on the victim's record while it is attacked.
UNCHANGED = ("id", "tenant", "owner", "queue", "priority", "world_size", "gpus", "spec",
             "restarts", "preemptions")


class Attacker:
    """A REST caller holding only a submitter key of tenant `red`."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.url, self.key = stack.state["api_url"], key
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.http, name)


@pytest.fixture(scope="module")
def attacker(stack: Stack) -> Iterator[Attacker]:
    made = stack.client.create_key("mallory", "red", "submitter")
    out = Attacker(stack, made["key"])
    try:
        yield out
    finally:
        out.http.close()
        stack.client.revoke_key(made["key_id"])


@pytest.fixture(scope="module")
def victim(stack: Stack) -> Iterator[dict[str, Any]]:
    """A job of tenant `default` (the admin key's), training until cancelled."""
    doc = stack.job_doc(task={"name": "victim"}, training={"steps": 1_000_000, "seed": 3,
                                                           "log_interval": 50})
    job = stack.client.submit(doc)
    running = wait_for(lambda: (j := stack.client.get(job["id"]))["state"] == "RUNNING"
                       and j["progress"]["step"] > 0 and j, 300, "the victim to train")
    try:
        yield dict(running)
    finally:
        stack.client.cancel(job["id"])
        stack.wait_state(job["id"], {"CANCELLED", "FAILED", "SUCCEEDED"}, timeout=120)


def assert_untouched(stack: Stack, before: dict[str, Any]) -> dict[str, Any]:
    """The victim is as it was and still training; the control plane answers."""
    step = before["progress"]["step"]
    now = wait_for(lambda: (j := stack.client.get(before["id"]))["progress"]["step"] > step and j,
                   120, "the victim to keep training")
    assert now["state"] == "RUNNING", now.get("message")
    assert {k: now.get(k) for k in UNCHANGED} == {k: before.get(k) for k in UNCHANGED}
    assert stack.client.health()["status"] == "ok"
    return now
