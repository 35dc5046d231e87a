"""`kc doctor`'s judgements, from facts (pure: the probes are tested live)."""

from kuangchao.platform.runtime.doctor import (
    clock_skew,
    healthy,
    local_versions,
    redis_findings,
    storage_findings,
    versions_across_nodes,
)

NODE = {"python": "3.11.7", "torch": "2.13.0+cu126", "ray": "2.60.0", "cuda": "12.6",
        "nccl": "2.27.3"}


def by_check(findings):
    return {f.check: f for f in findings}


def test_an_nccl_mismatch_between_nodes_is_named_with_its_fix():
    nodes = [{**NODE, "node": "gpu-a"}, {**NODE, "node": "gpu-b"},
             {**NODE, "node": "gpu-c", "nccl": "2.18.1", "torch": "2.4.1+cu121", "cuda": "12.1"}]
    f = by_check(versions_across_nodes(nodes))
    assert f["nccl-match"].status == "fail"
    assert f["nccl-match"].message == ("NCCL differs between nodes: 2.18.1 on gpu-c; "
                                       "2.27.3 on gpu-a, gpu-b")
    assert "same torch build" in f["nccl-match"].fix
    assert f["torch-match"].status == "fail" and "2.4.1+cu121 on gpu-c" in f["torch-match"].message
    assert f["python-match"].status == "ok" and f["ray-match"].status == "ok"
    assert not healthy(list(f.values()))


def test_matching_nodes_and_a_cpu_machine_are_healthy():
    cpu = {**NODE, "torch": "2.13.0+cpu", "cuda": None, "nccl": None}
    findings = versions_across_nodes([{**cpu, "node": n} for n in "abc"])
    findings += local_versions({**cpu, "gpus": 0})
    assert healthy(findings)
    assert by_check(findings)["cuda"].status == "info"
    assert "nccl-match" not in by_check(findings)  # nothing to compare without CUDA


def test_unsupported_local_versions_fail_with_what_to_install():
    f = by_check(local_versions({"python": "3.10.4", "torch": "2.3.0", "ray": "2.41.0"}))
    assert {f[k].status for k in ("python", "torch", "ray")} == {"fail"}
    assert "torch==2.13.0" in f["torch"].fix and "ray[default]>=2.58" in f["ray"].fix
    assert by_check(local_versions({"python": "3.11.2", "torch": None, "ray": "2.60.0"}))[
        "torch"].message == "torch is not installed"


def test_a_stopped_redis_and_one_without_acl_rights():
    down = by_check(redis_findings({"url": "redis://127.0.0.1:1/0",
                                    "error": "Connection refused"}))["redis"]
    assert down.status == "fail" and "Connection refused" in down.message
    assert "KC_REDIS_URL" in down.fix
    f = by_check(redis_findings({"url": "redis://h:6379/0", "version": "7.2.4", "user": "kc",
                                 "acl": False, "acl_error": "NOPERM"}))
    assert f["redis"].status == "ok" and f["redis-acl"].status == "warn"
    assert "KC_REDIS_JOB_ACL=0" in f["redis-acl"].fix
    assert by_check(redis_findings({"url": "u", "version": "5.0.7", "acl": True}))[
        "redis"].status == "fail"


def test_clock_skew_and_storage_thresholds():
    assert clock_skew([{"node": "a", "skew_s": 0.01}])[0].status == "ok"
    assert clock_skew([{"node": "a", "skew_s": 0.01}, {"node": "b", "skew_s": -1.2}])[0].status == "warn"
    bad = clock_skew([{"node": "b", "skew_s": 9.0}])[0]
    assert bad.status == "fail" and "(b)" in bad.message and "chrony" in bad.fix
    assert storage_findings({"path": "/c", "free_gb": 500})[0].status == "ok"
    assert storage_findings({"path": "/c", "free_gb": 5})[0].status == "warn"
    ro = storage_findings({"path": "/c", "error": "Read-only file system"})[0]
    assert ro.status == "fail" and "writable" in ro.fix
