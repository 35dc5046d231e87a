"""`permission.audit_log`: a job's audit records also go to its own file, under the audit roots."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord
from kuangchao.platform.security.audit import AuditLog, AuditRecord
from kuangchao.platform.security.job_audit import JobAuditFiles, append_line


def _job(store: MemoryStore, job_id: str, audit_log: str | None) -> None:
    perm = {"audit_log": audit_log} if audit_log is not None else {}
    store.create(JobRecord(id=job_id, name=job_id, spec={"permission": perm}, created_at=1.0))


@pytest.fixture
def setup(tmp_path):
    root = tmp_path / "audit-root"
    store = MemoryStore()
    trail = AuditLog(store, tmp_path / "main" / "audit.jsonl",
                     job_files=JobAuditFiles(store, (str(root),)))
    return store, trail, root


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_jobs_records_are_appended_to_its_audit_log_as_in_the_main_trail(setup, tmp_path):
    store, trail, root = setup
    target = root / "team-a" / "j1" / "audit.jsonl"
    _job(store, "j1", str(target))
    _job(store, "j2", None)
    trail.record(AuditRecord("alice", "job.submit", "job/j1", "allow", job="j1"))
    trail.record(AuditRecord("alice", "job.submit", "job/j2", "allow", job="j2"))
    trail.record(AuditRecord("alice", "key.create", "key/k1", "allow"))  # no job
    trail.record(AuditRecord("worker-0", "all_reduce", "job/j1", "deny", "expired", job="j1"))
    main = (tmp_path / "main" / "audit.jsonl").read_text().splitlines()
    assert len(main) == 4
    mine = target.read_text().splitlines()
    assert mine == [main[0], main[3]]  # the same JSON lines, nothing of other jobs
    assert [r["action"] for r in _lines(target)] == ["job.submit", "all_reduce"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    for folder in (root / "team-a", root / "team-a" / "j1"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [r["job"] for r in trail.read(job="j1")] == ["j1", "j1"]  # the stream still has them


def test_the_spec_is_looked_up_once_per_job(setup):
    store, trail, root = setup
    _job(store, "j1", str(root / "j1.jsonl"))
    calls = []
    real = store.get
    store.get = lambda job_id: calls.append(job_id) or real(job_id)  # type: ignore[method-assign]
    for _ in range(5):
        trail.record(AuditRecord("a", "token.renew", "token/t", "allow", job="j1"))
    assert calls == ["j1"] and len((root / "j1.jsonl").read_text().splitlines()) == 5
    # A job not stored yet is asked for again, and found once it is.
    trail.record(AuditRecord("a", "job.read", "job/j9", "deny", job="j9"))
    _job(store, "j9", str(root / "j9.jsonl"))
    trail.record(AuditRecord("a", "job.submit", "job/j9", "allow", job="j9"))
    assert [r["action"] for r in _lines(root / "j9.jsonl")] == ["job.submit"]


def test_a_symlinked_folder_planted_later_does_not_redirect_the_copy(setup, tmp_path, caplog):
    store, trail, root = setup
    target = root / "team" / "audit.jsonl"
    _job(store, "j1", str(target))
    trail.record(AuditRecord("a", "job.submit", "job/j1", "allow", job="j1"))
    assert target.is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target.unlink()
    (root / "team").rmdir()
    (root / "team").symlink_to(elsewhere)  # after admission: points out of the root
    with caplog.at_level(logging.WARNING, "kuangchao.platform.security.audit"):
        trail.record(AuditRecord("a", "job.cancel", "job/j1", "allow", job="j1"))
        trail.record(AuditRecord("a", "job.cancel", "job/j1", "allow", job="j1"))
    assert list(elsewhere.iterdir()) == []
    warnings = [r for r in caplog.records if "permission.audit_log" in r.getMessage()]
    assert len(warnings) == 1  # said once per job and cause
    main = (tmp_path / "main" / "audit.jsonl").read_text().splitlines()
    assert len(main) == 3  # the main record is never lost to it
    assert len(trail.read(job="j1")) == 3


def test_a_symlink_at_the_file_itself_is_not_followed(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (root / "audit.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        append_line(str(root / "audit.jsonl"), "{}\n", (str(root),))
    assert victim.read_text() == "keep\n"


def test_paths_outside_the_roots_or_not_files_are_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    roots = (str(root),)
    for bad in (str(tmp_path / "out.jsonl"), str(root / ".." / "out.jsonl"), str(root)):
        with pytest.raises(OSError, match="not a regular file|outside the audit roots|not a file below"):
            append_line(bad, "{}\n", roots)
    assert not (tmp_path / "out.jsonl").exists()
    os.mkfifo(root / "pipe")
    with pytest.raises(OSError):  # a FIFO neither blocks the writer nor takes the line
        append_line(str(root / "pipe"), "{}\n", roots)
    append_line(str(root / "ok.jsonl"), "{}\n", roots)
    append_line(str(root / "ok.jsonl"), "{}\n", roots)
    assert (root / "ok.jsonl").read_text() == "{}\n{}\n"


def test_a_root_that_is_a_symlink_is_the_operators_and_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    append_line(str(tmp_path / "link" / "j" / "a.jsonl"), "{}\n", (str(tmp_path / "link"),))
    assert (real / "j" / "a.jsonl").read_text() == "{}\n"


def test_the_main_trail_file_named_as_a_jobs_log_gets_no_second_copy(tmp_path):
    store = MemoryStore()
    main = tmp_path / "audit.jsonl"
    trail = AuditLog(store, main, job_files=JobAuditFiles(store, (str(tmp_path),)))
    _job(store, "j1", str(main))
    trail.record(AuditRecord("a", "job.submit", "job/j1", "allow", job="j1"))
    assert len(main.read_text().splitlines()) == 1


def test_the_trusted_writers_copy_under_kc_audit_root(tmp_path, monkeypatch):
    from kuangchao.platform.settings import audit_roots

    monkeypatch.setenv("KC_AUDIT_ROOT", str(tmp_path / "roots"))
    store = MemoryStore()
    _job(store, "j1", str(tmp_path / "roots" / "j1.jsonl"))
    AuditLog(store, tmp_path / "audit.jsonl", audit_roots()).record(
        AuditRecord("a", "job.submit", "job/j1", "allow", job="j1"))
    assert (tmp_path / "roots" / "j1.jsonl").is_file()
    assert AuditLog(store, tmp_path / "x.jsonl").job_files is None  # no roots: no copies
    assert AuditLog(None, tmp_path / "x.jsonl", audit_roots()).job_files is None
