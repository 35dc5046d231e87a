"""The code of a job's ranks, against the live stack: a custom entrypoint
(kuangchao.workers.security_drill) that tries, from inside the Ray cluster and
with the credentials its ranks were handed, to mint or revoke another job's
tokens, to read the control plane's secrets or another job's keys, to take the
head's secrets or CPUs, and to reach another job's checkpoints through a
symlink. Each attempt is refused, audited, and the victim trains on untouched."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import wait_for

from .conftest import assert_untouched

pytestmark = pytest.mark.integration

DRILL = "kuangchao.workers.security_drill:train"
ATTACKS = 14  # workers/security_drill.py tries this many


def test_a_ranks_code_cannot_mint_revoke_or_read_beyond_its_job(stack, attacker, victim):
    t0 = time.time() - 1
    doc = stack.job_doc(task={"name": "drill"}, entrypoint=DRILL, args={"victim": victim["id"]},
                        parallel={"data_parallel_size": 1, "micro_batch_size": 4})
    resp = attacker.post("/v1/jobs", json=doc)
    assert resp.status_code == 201, resp.text
    drill = resp.json()["id"]
    done = wait_for(lambda: (j := attacker.get(f"/v1/jobs/{drill}").json())["state"]
                    in ("SUCCEEDED", "FAILED", "CANCELLED") and j, 300, "the drill to end")
    logs = attacker.get(f"/v1/jobs/{drill}/logs", params={"module": "train"}).json()["logs"]
    tried = {line["attack"]: line for line in logs if "attack" in line}
    assert len(tried) == ATTACKS, [line["message"] for line in logs]
    not_refused = [a for a, line in tried.items() if not line["refused"]]
    assert not_refused == [], not_refused
    assert done["state"] == "SUCCEEDED", done.get("message")
    # The authority said why, and the Redis refusals came from Redis' ACL.
    for name in ("authority.grant_workers without a credential", "authority.revoke_job of the victim"):
        assert "control plane's alone" in tried[name]["detail"], tried[name]
    assert "NOPERM" in tried["redis: read the control plane's credential"]["detail"].upper() \
        or "permission" in tried["redis: read the control plane's credential"]["detail"].lower()
    # The head gave a task pinned there no secret and no CPU; the planted
    # symlink was refused as one, not for want of a checkpoint.
    assert "holds none of" in tried["head: read the control plane's secrets from a task pinned "
                                     "there"]["detail"]
    cpu = tried["head: run a task that asks for a CPU there"]["detail"]
    assert "TaskUnschedulableError" in cpu or "never scheduled" in cpu, cpu
    assert "symlink" in tried["checkpoint: load the victim's folder through a symlink in its "
                              "own"]["detail"]
    assert "already runs its job" in tried["controller: run the victim's controller a second "
                                          "time"]["detail"]
    refused = wait_for(lambda: [r for r in stack.client.audit(since=t0, action="deny")
                                if r["action"].startswith("authority.")], 30,
                       "the authority's refusals in the audit trail")
    assert {r["action"] for r in refused} >= {"authority.grant_workers", "authority.revoke_job",
                                             "authority.grant_module"}
    assert all(r["job"] == victim["id"] for r in refused)
    # Nothing of the victim moved: no token revoked, no cancel, no restart.
    assert not [r for r in stack.client.audit(job=victim["id"], since=t0)
                if r["action"] == "token.revoke"]
    assert_untouched(stack, victim)
