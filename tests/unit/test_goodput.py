"""The goodput ledger (platform/observability/goodput.py) stepped with in-memory facts, and the
facts read from a job's stored records (platform/jobs/goodput_facts.py)."""

from __future__ import annotations

import random

import pytest

from kuangchao.platform.jobs.goodput_facts import TRIMMED, job_goodput
from kuangchao.platform.jobs.state import JobRecord, JobState
from kuangchao.platform.observability.goodput import (
    CAUSES,
    Failure,
    Kept,
    Stall,
    State,
    Step,
    account,
    total,
)


def created(ts=0.0):
    return State(ts, "QUEUED", None)


def run(placed, running):
    return [State(placed, "PLACING", "QUEUED"), State(running, "RUNNING", "PLACING")]


def steps(first_ts, first, last, every=1.0, log=1):
    """Step facts from `first` to `last`, `every` seconds apart, every `log`-th logged."""
    return [Step(first_ts + (s - first) * every, s) for s in range(first, last + 1)
            if s == first or s % log == 0]


def adds_up(g, wall):
    assert g.wall_s == pytest.approx(wall)
    assert g.productive_s + sum(g.by_cause.values()) == pytest.approx(wall, rel=1e-9)
    assert set(g.by_cause) == set(CAUSES)
    assert all(v >= -1e-9 for v in g.by_cause.values())


def test_ledger_splits_a_clean_run_into_queueing_startup_productive_checkpoint_and_tail():
    facts = [created(), *run(10, 12), *steps(15, 1, 20, log=10),
             Step(24, 10, checkpoint=True), Stall(25, 1.0),  # a synchronous save of step 10
             Step(34.5, 20, checkpoint=True), Stall(35.5, 1.0),  # the final checkpoint
             State(36, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 36.0, facts, live=False)
    adds_up(g, 36)
    assert g.by_cause["queueing"] == pytest.approx(10)
    # PLACING at 10 to the first step at 15, less that step's own second (measured after).
    assert g.by_cause["startup"] == pytest.approx(4)
    assert g.by_cause["checkpoint"] == pytest.approx(2)
    assert g.by_cause["other"] == pytest.approx(1)  # after the last step: not the save's
    assert g.productive_s == pytest.approx(19)
    assert g.ettr == pytest.approx(19 / 36)
    assert g.open_cause is None and g.to_json()["live"] is False


def failure_run():
    return [created(), *run(0, 1), *steps(2, 1, 20, log=10),
            Step(11, 10, checkpoint=True),
            Failure(24.5, 25.0),  # last good heartbeat at 24.5, declared at 25
            State(25.01, "RECOVERING", "RUNNING"), State(26, "QUEUED", "RECOVERING"),
            State(27, "PLACING", "QUEUED"), State(28, "RUNNING", "PLACING"),
            *steps(30, 11, 20, log=10),  # restored step 10: the first step is 11
            State(40, "SUCCEEDED", "RUNNING")]


def test_ledger_counts_detection_recovery_and_redone_steps_after_a_failure():
    g = account(0.0, 40.0, failure_run(), live=False)
    adds_up(g, 40)
    assert g.by_cause["detection"] == pytest.approx(0.5)
    assert g.by_cause["queueing"] == pytest.approx(1)  # the requeue, waiting to be placed again
    # Declared at 25 to RECOVERING's requeue at 26, then PLACING at 27 to the first step at
    # 30, less that step's own second.
    assert g.by_cause["recovery"] == pytest.approx(3)
    # Steps 11-20 (10 s) and the 3.5 s since the last logged step were rolled back to 10.
    assert g.by_cause["redone"] == pytest.approx(13.5)
    assert g.productive_s == pytest.approx(20)


def test_ledger_keeps_a_survivors_work_when_the_run_continues_past_the_failure():
    # A live recovery: the survivors resume at step 23, the step they were at.
    facts = [created(), *run(0, 1), *steps(2, 1, 20, log=10), Failure(24.5, 25.0),
             State(25, "RECOVERING", "RUNNING"), State(26, "RESIZING", "RECOVERING"),
             State(27, "RUNNING", "RESIZING"), *steps(28, 24, 30, log=10),
             State(35, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 35.0, facts, live=False)
    adds_up(g, 35)
    # The tail after step 20 (3.5 s at 1 s/step) held steps 21-23.5; only the half step
    # the failure interrupted is redone.
    assert g.by_cause["redone"] == pytest.approx(0.5)


def test_ledger_redoes_nothing_when_the_survivors_kept_their_work():
    # The same failure, but the record says the survivors kept their state (`Kept`: a live
    # refill, RECOVERING straight back to RUNNING): the half step the failure interrupted
    # is lost to detection, not redone.
    facts = [created(), *run(0, 1), *steps(2, 1, 20, log=10), Failure(24.5, 25.0),
             Kept(25.0), State(25, "RECOVERING", "RUNNING"), State(27, "RUNNING", "RECOVERING"),
             *steps(28, 24, 30, log=10), State(35, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 35.0, facts, live=False)
    adds_up(g, 35)
    assert g.by_cause["redone"] == 0
    assert g.by_cause["detection"] == pytest.approx(0.5 + 0.5)  # the half step, then to 25
    assert g.by_cause["recovery"] == pytest.approx(2)  # 25 to step 24 at 28, less its second


def test_job_goodput_reads_a_live_recovery_from_the_restart_log():
    events = [{"ts": 0.0, "type": "state", "from": None, "to": "QUEUED"},
              {"ts": 0.0, "type": "state", "from": "QUEUED", "to": "PLACING"},
              {"ts": 0.5, "type": "state", "from": "PLACING", "to": "RUNNING"},
              {"ts": 9.0, "type": "failure", "failed_at": 9.0, "detected_after_s": 0.1,
               "progress_step": 70, "progress_at": 8.5},
              {"ts": 9.0, "type": "state", "from": "RUNNING", "to": "RECOVERING"},
              {"ts": 10.0, "type": "state", "from": "RECOVERING", "to": "RUNNING"},
              {"ts": 20.0, "type": "state", "from": "RUNNING", "to": "SUCCEEDED"}]
    # Step 1 s apart at first; the steps after 70 were faster than that rate, so the
    # estimate of the stretch to the failure overshoots the survivors' step 71.
    points = [{"step": 1, "ts": 1.0}, {"step": 50, "ts": 6.0}, {"step": 72, "ts": 10.5},
              {"step": 100, "ts": 15.0}]
    entry = {"restart": 1, "path": "live", "failed_at": 9.0, "survivor_stall_s": 1.5,
             "resumed_step": 71}
    for log, redone in (((), True), ((entry,), False)):
        job = record(state=JobState.SUCCEEDED, finished_at=20.0, restart_log=log)
        g = job_goodput(job, events, points, [], {}, now=99.0)
        adds_up(g, 20)
        assert (g.by_cause["redone"] > 0) is redone, g.by_cause


def test_ledger_counts_a_numeric_rollback_in_place():
    facts = [created(), *run(0, 1), *steps(2, 1, 20, log=5), Step(12, 10, checkpoint=True),
             Failure(22.2, 22.2), State(22.3, "RECOVERING", "RUNNING"),
             State(23, "RUNNING", "RECOVERING"), *steps(24, 11, 15, log=5),
             State(30, "CANCELLED", "RUNNING")]
    g = account(0.0, 30.0, facts, live=False)
    adds_up(g, 30)
    assert g.by_cause["detection"] == 0
    assert g.by_cause["redone"] == pytest.approx(10 + 1.2)  # steps 11-20, and the NaN step
    assert g.by_cause["recovery"] == pytest.approx(0.8)  # 22.2 to 24, less step 11's second


def test_ledger_counts_a_preemption_from_checkpoint_and_yield_to_the_next_first_step():
    facts = [created(), *run(0, 1), *steps(2, 1, 15, log=5), Step(16, 15, checkpoint=True),
             Stall(17, 1.0), State(18, "QUEUED", "RUNNING"), State(30, "PLACING", "QUEUED"),
             State(31, "RUNNING", "PLACING"), *steps(33, 16, 20, log=5),
             State(40, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 40.0, facts, live=False)
    adds_up(g, 40)
    assert g.by_cause["checkpoint"] == pytest.approx(1)
    # 17 to 18 yielding, 18 to 30 queued after the preemption, 30 to 33 placing and
    # restoring, less step 16's second.
    assert g.by_cause["preemption"] == pytest.approx(15)
    assert g.by_cause["queueing"] == 0 and g.by_cause["redone"] == 0


def test_ledger_subtracts_a_background_checkpoints_staging_only():
    facts = [created(), *run(0, 0), *steps(1, 1, 20, log=10),
             Step(10.5, 10, checkpoint=True), Stall(10.8, 0.3), State(21, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 21.0, facts, live=False)
    adds_up(g, 21)
    assert g.by_cause["checkpoint"] == pytest.approx(0.3)


def test_ledger_of_a_live_job_extends_its_open_interval_to_now():
    facts = [created(), *run(1, 2), *steps(3, 1, 10)]
    g = account(0.0, 15.0, facts, live=True)
    adds_up(g, 15)
    assert g.open_cause == "productive" and g.to_json()["live"] is True
    later = g.extended(20.0)
    adds_up(later, 20)
    assert later.productive_s == pytest.approx(g.productive_s + 5)
    queued = account(0.0, 5.0, [created()], live=True).extended(9.0)
    assert queued.by_cause["queueing"] == pytest.approx(9) and queued.ettr == 0


def test_ledger_gives_the_same_split_whatever_the_order_the_facts_come_in():
    facts = failure_run()
    want = account(0.0, 40.0, facts, live=False)
    for seed in range(5):
        shuffled = list(facts)
        random.Random(seed).shuffle(shuffled)
        got = account(0.0, 40.0, shuffled, live=False)
        assert got.by_cause == pytest.approx(want.by_cause)
        assert got.productive_s == pytest.approx(want.productive_s)


def test_ledger_handles_skewed_and_late_facts_without_losing_or_doubling_time():
    facts = [Step(-5, 3),  # before the job existed: clamped to its creation
             created(), *run(0, 1), *steps(2, 1, 10),
             Failure(9.0, 12.0),  # the beat looked older than the last step (clock skew)
             State(12, "RECOVERING", "RUNNING"), State(13, "QUEUED", "RECOVERING"),
             Step(13.5, 11),  # a late report while queued: ignored
             State(14, "PLACING", "QUEUED"), State(15, "RUNNING", "PLACING"),
             Stall(15.5, 50.0),  # a stall longer than any training since: capped
             *steps(16, 11, 15), State(21, "SUCCEEDED", "RUNNING"),
             Step(99, 99)]  # after the end: dropped
    g = account(0.0, 21.0, facts, live=False)
    adds_up(g, 21)
    assert g.by_cause["detection"] == pytest.approx(1)  # from the last step at 11, not 9
    assert 0 <= g.ettr <= 1


def test_ledger_of_an_unknown_start_counts_it_as_other_with_the_reason():
    facts = [State(50, "RUNNING", "PLACING"), *steps(55, 1, 5)]
    g = account(0.0, 60.0, facts, live=True, reason=TRIMMED)
    adds_up(g, 60)
    assert g.by_cause["other"] == pytest.approx(50)
    assert g.to_json()["reason"] == TRIMMED


def test_total_weights_each_job_by_its_wall_clock_time():
    a = account(0.0, 10.0, [created(), *run(0, 0), *steps(1, 1, 10)], live=False)
    b = account(0.0, 30.0, [created()], live=True)
    t = total([a, b])
    assert t["jobs"] == 2 and t["wall_s"] == pytest.approx(40)
    assert t["ettr"] == pytest.approx(a.productive_s / 40)
    assert t["productive_s"] + sum(t["by_cause"].values()) == pytest.approx(40)
    assert total([])["ettr"] is None


def record(**kw):
    base = {"id": "j-00000001", "name": "j", "spec": {}, "created_at": 0.0}
    return JobRecord(**{**base, **kw})


def test_job_goodput_reads_events_curve_checkpoints_and_progress():
    events = [{"ts": 0.0, "type": "state", "from": None, "to": "QUEUED"},
              {"ts": 1.0, "type": "state", "from": "QUEUED", "to": "PLACING"},
              {"ts": 2.0, "type": "state", "from": "PLACING", "to": "RUNNING"},
              {"ts": 8.0, "type": "failure", "failed_at": 8.0, "detected_after_s": 1.0,
               "last_heartbeat_at": 7.0, "kind": "died"},
              {"ts": 8.0, "type": "state", "from": "RUNNING", "to": "RECOVERING"},
              {"ts": 9.0, "type": "state", "from": "RECOVERING", "to": "RUNNING"},
              {"ts": 14.0, "type": "state", "from": "RUNNING", "to": "SUCCEEDED"}]
    points = [{"step": 1, "ts": 3.0}, {"step": 4, "ts": 6.0}, {"step": 3, "ts": 11.0},
              {"step": 5, "ts": 13.0}]
    ckpts = [{"step": 2, "committed_at": 4.5, "blocked_s": 0.5, "write_s": 0.4}]
    job = record(state=JobState.SUCCEEDED, finished_at=14.0)
    g = job_goodput(job, events, points, ckpts, {"step": 5, "updated_at": 13.0}, now=99.0)
    adds_up(g, 14)
    assert g.reason is None
    assert g.by_cause["detection"] == pytest.approx(1)
    assert g.by_cause["redone"] > 0 and g.by_cause["recovery"] > 0


def test_job_goodput_never_raises_on_odd_or_old_records():
    odd = [None, 3, {"type": "state"}, {"ts": "x", "type": "state", "to": "RUNNING"},
           {"ts": 5.0, "type": "failure", "failed_at": "soon"},
           {"ts": float("nan"), "type": "state", "to": "QUEUED"}]
    job = record(state=JobState.RUNNING, resize_log=({"path": "live", "formed_s": "x"}, 7))
    g = job_goodput(job, odd, [{"step": -1, "ts": 1.0}, {"step": 2.5}, "x"],
                    [{"step": 1}, {"committed_at": 2.0, "step": 1, "blocked_s": -1}, None],
                    {"step": "NaN"}, now=10.0)
    adds_up(g, 10)
    assert g.reason == TRIMMED
    assert job_goodput(record(), [], [], [], {}, now=0.0).to_json()["ettr"] is None


def test_ledger_never_reads_a_late_checkpoint_step_as_a_rollback():
    facts = [created(), *run(0, 0), *steps(1, 1, 20, log=2),
             Step(12.5, 10, checkpoint=True),  # estimated from the commit: after step 12
             State(21, "SUCCEEDED", "RUNNING")]
    g = account(0.0, 21.0, facts, live=False)
    adds_up(g, 21)
    assert g.by_cause["redone"] == 0


def test_job_goodput_counts_steps_past_the_last_logged_one_from_the_failures_progress():
    # Logged every 50 steps; rank 0 had reported step 70 when rank 1 died, whose last
    # beat is older than step 50: the steps 51-70 were trained, then restored from 50.
    events = [{"ts": 0.0, "type": "state", "from": None, "to": "QUEUED"},
              {"ts": 0.0, "type": "state", "from": "QUEUED", "to": "PLACING"},
              {"ts": 0.5, "type": "state", "from": "PLACING", "to": "RUNNING"},
              {"ts": 9.0, "type": "failure", "failed_at": 9.0, "detected_after_s": 4.0,
               "progress_step": 70, "progress_at": 8.0},
              {"ts": 9.0, "type": "state", "from": "RUNNING", "to": "RECOVERING"},
              {"ts": 9.5, "type": "state", "from": "RECOVERING", "to": "RUNNING"},
              {"ts": 20.0, "type": "state", "from": "RUNNING", "to": "SUCCEEDED"}]
    points = [{"step": 1, "ts": 1.0}, {"step": 50, "ts": 6.0}, {"step": 51, "ts": 10.0},
              {"step": 100, "ts": 15.0}]
    job = record(state=JobState.SUCCEEDED, finished_at=20.0)
    g = job_goodput(job, events, points, [{"step": 50, "committed_at": 6.0}], {}, now=99.0)
    adds_up(g, 20)
    assert g.by_cause["redone"] == pytest.approx(2.0)  # steps 51-70, at 6.0 to 8.0
    assert g.by_cause["detection"] == pytest.approx(1.0)  # from step 70 to the declaration
