"""`kc doctor` on an object store: what --checkpoint-path names, the round trips (on
fsspec's in-process memory store and stand-ins), and the findings made from the
facts of here and of every node. The live store: tests/process/test_doctor_store.py."""

import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import main
from kuangchao.platform.runtime.doctor import healthy, here_findings, nodes_findings, split_fix
from kuangchao.platform.runtime.doctor_store import (
    DOCTOR_DIR,
    bounded,
    checkpoint_target,
    examine_store,
    here_facts,
    node_check,
    node_name,
    node_outcome,
    nodes_facts,
    roundtrip,
)
from kuangchao.platform.storage import objects
from kuangchao.platform.storage.objects import StoreCredentials
from kuangchao.platform.storage.urls import ObjectUrl, parse

MS = {"write": 12.3, "read": 4.56, "list": 3.0, "delete": 20.0}


def by_check(findings):
    return {f.check: f for f in findings}


# -- what --checkpoint-path names ------------------------------------------------------------

def test_urls_and_paths_are_told_apart():
    assert checkpoint_target("s3://ckpt/runs/") == ObjectUrl("s3", "ckpt", "runs")
    assert checkpoint_target("/data/ckpt") == Path("/data/ckpt")
    assert checkpoint_target("runs/a:b") == Path("runs/a:b")
    assert checkpoint_target("file:///data/ckpt") == Path("/data/ckpt")


@pytest.mark.parametrize("text, says", [
    ("nope://bucket/p", "unknown URL scheme 'nope'"),
    ("s3://", "names no bucket"),
    ("s3://ckpt/a/../b", "'..' segment"),
    ("s3://ckpt/p?x=1", "no query"),
    ("s3:/ckpt/p", "without '//'; write s3://bucket/prefix"),
    ("s3:ckpt", "without '//'"),
])
def test_a_malformed_url_or_unknown_scheme_is_refused_with_what_to_write(text, says):
    with pytest.raises(ValueError, match=None) as err:
        checkpoint_target(text)
    assert says in str(err.value)


def test_the_cli_exits_2_on_a_bad_url_and_passes_a_good_one_on(monkeypatch):
    seen = []
    monkeypatch.setattr("kuangchao.platform.runtime.doctor_probe.examine",
                        lambda settings, target: seen.append(target) or [])
    runner = CliRunner()
    bad = runner.invoke(main.app, ["doctor", "--checkpoint-path", "nope://bucket/p"])
    assert bad.exit_code == 2 and "error: --checkpoint-path: unknown URL scheme 'nope'" in bad.output
    assert "Traceback" not in bad.output and not seen
    assert runner.invoke(main.app, ["doctor", "--checkpoint-path", "s3://ckpt/prod"]).exit_code == 0
    assert runner.invoke(main.app, ["doctor", "--checkpoint-path", "/tmp/ck"]).exit_code == 0
    assert seen == [ObjectUrl("s3", "ckpt", "prod"), Path("/tmp/ck")]


# -- round trips and deadlines ----------------------------------------------------------------

@pytest.fixture
def memory():
    fs = objects.filesystem("memory")
    fs.pipe_file("kc-doctor-test/seed", b"x")
    yield fs
    fs.rm("kc-doctor-test", recursive=True)


def test_from_here_on_a_working_store_reports_each_operation_and_leaves_nothing(memory):
    facts = here_facts(parse("memory://kc-doctor-test/runs"), token="t1")
    assert facts["probe"] == f"memory://kc-doctor-test/runs/{DOCTOR_DIR}/t1/probe"
    assert set(facts["ms"]) == {"write", "read", "list", "delete"} and facts["rounds"] == 3
    f = by_check(here_findings(facts))
    assert f["checkpoint-store"].status == "ok" and f["checkpoint-rw"].status == "ok"
    assert " ms" in f["checkpoint-rw"].message and "(median of 3)" in f["checkpoint-rw"].message
    assert [p for p in memory.find("kc-doctor-test") if "probe" in p] == []


def test_from_here_a_missing_bucket_is_named(memory):
    f = here_findings(here_facts(parse("memory://kc-doctor-none/runs")))
    assert [(x.check, x.status) for x in f] == [("checkpoint-store", "fail")]
    assert "'kc-doctor-none' does not exist" in f[0].message and f[0].fix.startswith("create it")


class Altering:
    """A store that hands back other bytes than it was given, and refuses deletes."""

    def __init__(self, refuse_delete=False):
        self.refuse_delete, self.deleted = refuse_delete, []

    def pipe_file(self, path, data):
        pass

    def cat_file(self, path):
        return b"something else"

    def ls(self, path, detail=False):
        return [f"{path}/probe"]

    def rm_file(self, path):
        if self.refuse_delete:
            raise PermissionError("Access Denied")
        self.deleted.append(path)


def test_a_store_that_alters_bytes_fails_the_read_and_cleans_up():
    store = Altering()
    out = roundtrip(store, parse("s3://b/p/.kc-doctor/x/probe"))
    assert out["stage"] == "read" and "differ from the 64 written" in out["error"]
    assert store.deleted == ["b/p/.kc-doctor/x/probe"] and "left" not in out


def test_a_refused_delete_names_the_credentials_and_what_is_left():
    class NoDelete(Altering):
        def cat_file(self, path):
            return self.last

        def pipe_file(self, path, data):
            self.last = data

    out = roundtrip(NoDelete(refuse_delete=True), parse("s3://b/p/.kc-doctor/x/probe"))
    assert out["stage"] == "delete" and "refused the credentials" in out["error"]
    f = by_check(here_findings({"url": "s3://b/p", "probe": "s3://b/p/.kc-doctor/x/probe", **out}))
    assert f["checkpoint-rw"].status == "fail"
    assert f["checkpoint-rw"].message.startswith("cannot delete s3://b/p/.kc-doctor/x/probe from here")
    assert "AWS_ACCESS_KEY_ID" in f["checkpoint-rw"].fix


def test_bounded_gives_up_at_its_deadline_and_passes_errors_on():
    hang = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="probe did not finish within 0 s"):
        bounded(hang.wait, 0.2, "probe")
    assert time.monotonic() - start < 2
    hang.set()
    with pytest.raises(KeyError):
        bounded(lambda: {}["x"], 1, "x")
    assert bounded(lambda: 7, 1, "x") == 7


# -- the judgements ---------------------------------------------------------------------------

def test_a_storage_message_is_split_at_its_fix():
    url = parse("s3://ckpt/p")
    msg, fix = split_fix(objects.describe_failure(RuntimeError("Connect timeout on endpoint"), url))
    assert msg.startswith("the object store for s3://ckpt/p cannot be reached")
    assert fix == "check AWS_ENDPOINT_URL and the network"
    assert split_fix("the object store refused s3://x: boom") == ("the object store refused s3://x: boom", "")


def test_a_probe_failure_skips_the_rest():
    facts = {"url": "s3://ckpt/p", "stage": "probe",
             "error": "the object store did not answer within 30 s (probe of s3://ckpt/p); check "
                      "that it is up"}
    f = here_findings(facts)
    assert len(f) == 1 and f[0].status == "fail" and f[0].fix == "check that it is up"


NODES = [{"node": "gpu-a", "probe": "s3://c/p/.kc-doctor/t/aa/probe", "ms": MS, "rounds": 3},
         {"node": "gpu-b", "probe": "s3://c/p/.kc-doctor/t/bb/probe", "ms": {**MS, "write": 90.0},
          "rounds": 3}]
BASE = {"url": "s3://c/p", "base": "s3://c/p/.kc-doctor/t", "mode": "scoped", "scope": "prefix"}


def test_every_node_ok_names_the_slowest_and_the_scoped_keys():
    [f] = nodes_findings({**BASE, "nodes": NODES})
    assert f.check == "checkpoint-nodes" and f.status == "ok"
    assert f.message == ("all 2 node(s) write, read, list and delete under s3://c/p/.kc-doctor/t "
                         "with keys scoped to that prefix, as jobs' ranks get them; slowest gpu-b: "
                         "write 90 ms, read 4.6 ms, list 3.0 ms, delete 20 ms")


def test_shared_mode_says_the_nodes_were_given_the_operators_keys():
    [f] = nodes_findings({**BASE, "mode": "shared", "scope": "shared", "nodes": NODES})
    assert f.status == "ok" and "the nodes were given them for this check" in f.message
    assert "KC_OBJECT_STORE_CREDENTIALS=shared" in f.message


def test_failed_nodes_each_get_a_finding_with_their_fix():
    refused = objects.describe_failure(PermissionError("Access Denied"), parse("s3://c/p/x/probe"))
    nodes = [NODES[0],
             {"node": "gpu-b", "probe": "s3://c/p/.kc-doctor/t/bb/probe", "stage": "write",
              "error": refused},
             node_outcome("gpu-c", None, 60),
             node_outcome("gpu-d", RuntimeError("The node with node id abc has died"), 60),
             {"node": "gpu-e", "probe": "s3://c/p/.kc-doctor/t/ee/probe", "stage": "list",
              "error": "the object store for s3://c/p cannot be reached: timeout; check "
                       "AWS_ENDPOINT_URL and the network"}]
    f = nodes_findings({**BASE, "nodes": nodes})
    assert not healthy(f)
    fails = [x for x in f if x.check == "checkpoint-node"]
    assert [x.status for x in fails] == ["fail"] * 4
    assert fails[0].message.startswith("node gpu-b: cannot write s3://c/p/.kc-doctor/t/bb/probe: "
                                       "the object store refused the credentials")
    assert "KC_OBJECT_STORE_ROLE_ARN" in fails[0].fix
    assert fails[1].message == "node gpu-c did not answer within 60 s (checking the store there)"
    assert "raylet log" in fails[1].fix
    assert "has died" in fails[2].message
    assert "reachable from node gpu-e" in fails[3].fix
    summary = by_check(f)["checkpoint-nodes"]
    assert summary.status == "ok" and summary.message.startswith("1 of 5 node(s)")


def test_a_refused_grant_an_unrun_dispatch_and_a_failed_release():
    [f] = nodes_findings({**BASE, "grant_error": "the object store has no IAM API for per-job roles "
                          "(iam:CreateRole: x); with MinIO, set KC_OBJECT_STORE_ROLE_ARN"})
    assert f.status == "fail" and "cannot mint credentials scoped to s3://c/p/.kc-doctor/t" in f.message
    [f] = nodes_findings({**BASE, "dispatch_error": "could not run the check on the nodes: lost"})
    assert f.status == "fail" and "ray status" in f.fix
    f = by_check(nodes_findings({**BASE, "nodes": NODES, "release_error": "AccessDenied"}))
    assert f["checkpoint-cleanup"].status == "warn"
    assert nodes_findings({**BASE, "nodes": []})[0].status == "warn"


def test_ray_results_become_facts():
    assert node_name({"Labels": {"kc.io/node": "node-2"}, "NodeManagerAddress": "10.0.0.2"}) == "node-2"
    assert node_name({"Labels": {}, "NodeManagerAddress": "10.0.0.2"}) == "10.0.0.2"
    assert node_outcome("n", {"host": "h", "ms": MS, "rounds": 3}, 60)["node"] == "n"
    assert node_outcome("n", None, 60)["stage"] == "answer"


# -- the per-node flow with stand-ins for Ray and the vendor ----------------------------------

class Vendor:
    def __init__(self, mode="scoped", refuse=None):
        self.mode, self.refuse, self.calls = mode, refuse, []

    def grant(self, job_id, write_url, read_urls=()):
        self.calls.append(("grant", job_id, write_url))
        if self.refuse:
            raise self.refuse
        return StoreCredentials("k", "s", "t", scope="prefix" if self.mode == "scoped" else "shared")

    def release(self, job_id):
        self.calls.append(("release", job_id))
        return True


def test_nodes_get_a_grant_for_the_doctor_prefix_only_and_it_is_released(memory):
    vendor, seen = Vendor(), []

    def dispatch(base, creds_json, deadline_s):  # what ray_dispatch does, in this process
        seen.append(StoreCredentials.from_json(creds_json))
        return [node_outcome(n, node_check(f"{base}/{n}", creds_json, deadline_s), 60)
                for n in ("n1", "n2")]

    facts = nodes_facts(parse("memory://kc-doctor-test/runs"), dispatch, vendor, token="t9")
    base = f"memory://kc-doctor-test/runs/{DOCTOR_DIR}/t9"
    assert vendor.calls == [("grant", "kc-doctor-t9", base), ("release", "kc-doctor-t9")]
    assert seen[0].key == "k" and facts["base"] == base
    [f] = nodes_findings(facts)
    assert f.status == "ok" and f.message.startswith("all 2 node(s)")

    def lost(base, creds_json, deadline_s):
        raise ConnectionError("Ray is gone")

    vendor = Vendor()
    facts = nodes_facts(parse("memory://kc-doctor-test/runs"), lost, vendor, token="t8")
    assert vendor.calls[-1] == ("release", "kc-doctor-t8") and "Ray is gone" in facts["dispatch_error"]


def test_without_a_cluster_the_store_is_checked_from_here_only(memory):
    f = by_check(examine_store(parse("memory://kc-doctor-test/runs"), {"address": "h:6379",
                                                                       "error": "nothing listens"}))
    assert f["checkpoint-rw"].status == "ok" and f["checkpoint-nodes"].status == "info"
    assert f["checkpoint-nodes"].message == ("no Ray cluster is reachable at h:6379: "
                                             "memory://kc-doctor-test/runs was checked from this "
                                             "machine only")
