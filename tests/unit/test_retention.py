"""Finished jobs leave the store after `KC_JOB_RETENTION_DAYS` (platform/scheduling/retention.py),
stepped on the in-memory store with clocks the test holds; and numeric settings that are not
numbers exit 2 naming the variable."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from kuangchao.api.cli.main import main
from kuangchao.platform.env_numbers import env_number
from kuangchao.platform.errors import ClusterError
from kuangchao.platform.jobs.memory import MemoryStore
from kuangchao.platform.jobs.state import JobRecord, JobState, cancel, fail
from kuangchao.platform.scheduling import retention
from kuangchao.platform.scheduling.retention import DAY_S, FIRST_SWEEP_S, SWEEP_S, RetentionSweep
from kuangchao.platform.settings import DEFAULT_JOB_RETENTION_DAYS, Settings

NOW = 100 * DAY_S


class Clocks:
    def __init__(self) -> None:
        self.wall, self.mono = NOW, 0.0


class Trail:
    def __init__(self) -> None:
        self.records: list = []

    def record(self, rec) -> None:
        self.records.append(rec)


def add(store: MemoryStore, i: int, created: float, finished: float | None,
        end=fail) -> str:
    job_id = f"j{i:04d}"
    store.create(JobRecord(id=job_id, name="j", spec={}, created_at=created))
    if finished is not None:
        store.update(job_id, lambda j: end(j, "over"))
        store.update(job_id, lambda j: (replace(j, finished_at=finished), None))
    return job_id


def sweep_of(store, days=30.0, trail=None) -> tuple[RetentionSweep, Clocks]:
    c = Clocks()
    return RetentionSweep(store, days, trail, clock=lambda: c.wall, monotonic=lambda: c.mono), c


def test_a_sweep_forgets_only_jobs_finished_longer_ago_than_the_retention_and_audits_each():
    store, trail = MemoryStore(), Trail()
    old_failed = add(store, 1, NOW - 40 * DAY_S, NOW - 39 * DAY_S)
    old_cancelled = add(store, 2, NOW - 35 * DAY_S, NOW - 31 * DAY_S, end=cancel)
    finished_lately = add(store, 3, NOW - 40 * DAY_S, NOW - 29 * DAY_S)  # ran 11 days
    old_but_queued = add(store, 4, NOW - 90 * DAY_S, None)
    new = add(store, 5, NOW - DAY_S, NOW - 0.5 * DAY_S)
    sweep, _ = sweep_of(store, trail=trail)
    assert sorted(sweep.sweep()) == [old_failed, old_cancelled]
    assert sorted(j.id for j in store.list()) == [finished_lately, old_but_queued, new]
    assert store.events(old_failed) == [] and sweep.purged_total == 2
    assert sorted(r.resource for r in trail.records) == [f"job/{old_failed}", f"job/{old_cancelled}"]
    rec = trail.records[0]
    assert rec.principal == "kc-scheduler" and rec.action == "job.purge"
    assert rec.decision == "allow" and "KC_JOB_RETENTION_DAYS" in rec.reason
    assert sweep.sweep() == []  # nothing more is due


def test_sweeps_come_a_minute_after_start_then_every_sweep_s_and_zero_keeps_everything():
    store = MemoryStore()
    add(store, 1, 0.0, 1.0)
    sweep, clocks = sweep_of(store)
    assert not sweep.due()  # the first scheduling cycles come first
    clocks.mono += FIRST_SWEEP_S
    assert sweep.due()
    sweep.sweep()
    assert not sweep.due()
    clocks.mono += SWEEP_S
    assert sweep.due()
    forever, _ = sweep_of(store, days=0)
    add(store, 2, 0.0, 1.0)
    assert not forever.due() and forever.sweep() == []
    assert [j.id for j in store.list()] == ["j0002"]


def test_a_backlog_is_purged_a_bounded_batch_per_sweep_paging_through_the_index(monkeypatch):
    monkeypatch.setattr(retention, "PAGE", 3)
    monkeypatch.setattr(retention, "MAX_PER_SWEEP", 5)
    store = MemoryStore()
    for i in range(12):  # jobs still queued in between: skipped on every page
        add(store, i, float(i), 1000.0 + i if i % 3 else None)
    sweep, _ = sweep_of(store)
    first = sweep.sweep()
    assert len(first) == 5
    second = sweep.sweep()
    assert len(second) == 3 and not set(first) & set(second)
    assert sorted(j.id for j in store.list()) == [f"j{i:04d}" for i in (0, 3, 6, 9)]
    assert all(j.state is JobState.QUEUED for j in store.list())


def test_an_index_entry_whose_record_is_gone_is_dropped():
    store = MemoryStore()
    ghost = add(store, 1, 5.0, 6.0)
    del store._jobs.text[ghost]  # as if the record had been deleted by hand
    sweep, _ = sweep_of(store)
    assert sweep.sweep() == [] and store.list() == []
    assert store._jobs.order == []


def test_retention_days_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("KC_JOB_RETENTION_DAYS", raising=False)
    assert Settings.from_env().job_retention_days == DEFAULT_JOB_RETENTION_DAYS
    monkeypatch.setenv("KC_JOB_RETENTION_DAYS", "7.5")
    assert Settings.from_env().job_retention_days == 7.5
    monkeypatch.setenv("KC_JOB_RETENTION_DAYS", "0")
    assert Settings.from_env().job_retention_days == 0


@pytest.mark.parametrize(("raw", "integer", "says"), [
    ("a month", False, "is not a number"), ("nan", False, "is not a number"),
    ("inf", False, "is not a number"), ("-1", False, "is below 0"),
    ("2.5", True, "is not a whole number"), ("three", True, "is not a whole number"),
])
def test_a_numeric_setting_that_is_no_such_number_names_the_variable_and_the_fix(raw, integer, says):
    with pytest.raises(ClusterError) as exc:
        env_number("KC_X", 3, integer=integer, environ={"KC_X": raw})
    assert f"KC_X={raw!r}" in exc.value.message or f"KC_X={raw}" in exc.value.message
    assert says in exc.value.message and "(default 3) or unset it" in exc.value.message
    assert env_number("KC_X", 3, integer=integer, environ={"KC_X": " "}) == 3
    assert env_number("KC_X", 3, integer=True, environ={"KC_X": "4"}) == 4


@pytest.mark.parametrize(("name", "raw"), [("KC_JOB_RETENTION_DAYS", "a month"),
                                           ("KC_QUARANTINE_FAILURES", "abc")])
def test_kc_exits_2_on_a_bad_numeric_setting_without_a_traceback(monkeypatch, capsys, tmp_path,
                                                                 name, raw):
    monkeypatch.setenv("KC_HOME", str(tmp_path))
    monkeypatch.setenv(name, raw)
    monkeypatch.setattr(sys, "argv", ["kc", "list"])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{name}=" in err and "Traceback" not in err
