"""`kc doctor --checkpoint-path s3://...` against a real S3 server that enforces IAM (moto).

From here: a working store (latency in the message, nothing left behind), a
missing bucket, wrong credentials, a frozen server (a fail within the deadline,
no hang). The per-node part with the real vendor (a role of its own, released)
and `node_check` run in this process for two stand-in nodes: what Ray would
run on each (the Ray dispatch itself is the integration suite's). And the CLI
end to end without a Ray cluster: the store checked from here only, said so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from kuangchao.platform.runtime.doctor import here_findings, nodes_findings
from kuangchao.platform.runtime.doctor_store import (
    DOCTOR_DIR,
    here_facts,
    node_check,
    node_outcome,
    nodes_facts,
)
from kuangchao.platform.runtime.procs import free_port
from kuangchao.platform.security.object_credentials import ObjectCredentialVendor, role_name
from kuangchao.platform.storage.objects import StoreCredentials, filesystem
from kuangchao.platform.storage.urls import parse
from tests.s3server import AWS_VARS_TO_CLEAR, S3Server

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "kc-doctor"
URL = parse(f"s3://{BUCKET}/prod")


@pytest.fixture(scope="module")
def s3():
    with S3Server(enforce_auth=True) as server, pytest.MonkeyPatch.context() as mp:
        server.use_admin_env(mp)
        server.create_bucket(BUCKET)
        yield server


def by_check(findings):
    return {f.check: f for f in findings}


def leftovers() -> list[str]:
    return [p for p in filesystem("s3").find(BUCKET) if DOCTOR_DIR in p]


def test_a_working_store_reports_latency_and_leaves_nothing(s3):
    f = by_check(here_findings(here_facts(URL)))
    assert f["checkpoint-store"].status == "ok", f
    assert f["checkpoint-rw"].status == "ok", f["checkpoint-rw"]
    assert f["checkpoint-rw"].message.startswith("write, read, list and delete from here: write ")
    assert " ms, read " in f["checkpoint-rw"].message and "(median of 3)" in f["checkpoint-rw"].message
    assert leftovers() == []


def test_a_missing_bucket_is_named(s3):
    [f] = here_findings(here_facts(parse("s3://kc-no-such-bucket/prod")))
    assert f.check == "checkpoint-store" and f.status == "fail"
    assert "bucket 'kc-no-such-bucket' does not exist" in f.message
    assert "create it" in f.fix


def test_wrong_credentials_are_named(s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    [f] = here_findings(here_facts(URL))
    assert f.status == "fail" and "refused the credentials" in f.message, f
    assert "AWS_SECRET_ACCESS_KEY" in f.fix


def test_a_frozen_store_fails_within_the_deadline(s3):
    start = time.monotonic()
    with s3.frozen():
        [f] = here_findings(here_facts(URL, deadline_s=3))
    assert time.monotonic() - start < 10
    assert f.status == "fail" and f.message == (f"the object store at {s3.endpoint} did not answer "
                                                f"within 3 s (probe of {URL})")
    assert "AWS_ENDPOINT_URL" in f.fix


def _in_process(base, creds_json, deadline_s):
    """What ray_dispatch runs on every node, run here for two stand-in nodes."""
    return [node_outcome(n, node_check(f"{base}/{n}", creds_json, deadline_s), deadline_s + 30)
            for n in ("node-1", "node-2")]


def test_nodes_check_with_keys_of_the_doctors_own_prefix_then_released(s3, monkeypatch):
    monkeypatch.delenv("KC_OBJECT_STORE_CREDENTIALS", raising=False)  # the default: scoped,
    monkeypatch.delenv("KC_OBJECT_STORE_ROLE_ARN", raising=False)  # a role of the doctor's own
    seen = []

    def dispatch(base, creds_json, deadline_s):
        seen.append(json.loads(creds_json))
        # The keys reach the doctor's prefix only: the bucket's other objects are refused.
        fs = filesystem("s3", StoreCredentials.from_json(creds_json))
        with pytest.raises((PermissionError, ClientError)):
            fs.pipe_file(f"{BUCKET}/prod/job-x/model.pt", b"not yours")
        return _in_process(base, creds_json, deadline_s)

    facts = nodes_facts(URL, dispatch, token="t1")  # the vendor `kc doctor` makes
    assert seen[0]["key"] != s3.admin_env()["AWS_ACCESS_KEY_ID"] and seen[0]["scope"] == "prefix"
    assert seen[0]["expires_at"] - time.time() < 16 * 60  # STS's shortest session, not a job's 12 h
    [f] = nodes_findings(facts)
    assert f.status == "ok" and f.message.startswith(
        f"all 2 node(s) write, read, list and delete under {URL}/{DOCTOR_DIR}/t1 with keys scoped")
    with pytest.raises(ClientError):  # released: the doctor's role is gone
        s3.client("iam").get_role(RoleName=role_name("kc-doctor-t1"))
    assert leftovers() == []


def test_shared_mode_gives_the_nodes_the_operators_keys_and_says_so(s3):
    facts = nodes_facts(URL, _in_process, ObjectCredentialVendor(mode="shared"))
    [f] = nodes_findings(facts)
    assert f.status == "ok" and "the nodes were given them for this check" in f.message


def _kc(*args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in AWS_VARS_TO_CLEAR}
    env.update(KC_HOME=str(tmp_path), RAY_ADDRESS=f"127.0.0.1:{free_port()}",
               KC_RAY_ADDRESS=f"127.0.0.1:{free_port()}")
    env.pop("KC_REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "kuangchao.api.cli", "doctor", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=90)


def test_the_cli_checks_the_store_from_here_when_no_cluster_is_up(s3, tmp_path):
    out = _kc("--checkpoint-path", f"{URL}", "--json", tmp_path=tmp_path)
    assert out.returncode == 1, out.stderr  # no Redis, no Ray: those fail
    f = {x["check"]: x for x in json.loads(out.stdout)["findings"]}
    assert f["checkpoint-store"]["status"] == "ok" and f["checkpoint-rw"]["status"] == "ok"
    assert f["checkpoint-nodes"]["status"] == "info"
    assert f"{URL} was checked from this machine only" in f["checkpoint-nodes"]["message"]
    bad = _kc("--checkpoint-path", "s3:/kc-doctor/prod", tmp_path=tmp_path)
    assert bad.returncode == 2 and "write s3://bucket/prefix" in bad.stderr
    assert "Traceback" not in bad.stderr
