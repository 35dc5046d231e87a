"""The job state machine."""

import pytest

from kuangchao.platform.errors import InvalidTransition
from kuangchao.platform.jobs.state import ALLOWED, JobRecord, JobState, PlacedRank, transition


def job(state=JobState.QUEUED) -> JobRecord:
    return JobRecord(id="j1", name="j", spec={}, state=state, created_at=100.0)


def test_transition_sets_started_at_when_job_first_runs():
    running, event = transition(job(JobState.PLACING), JobState.RUNNING, now=200.0)
    assert running.started_at == 200.0 and running.finished_at is None
    assert event == {"ts": 200.0, "type": "state", "from": "PLACING", "to": "RUNNING", "message": ""}


def test_transition_sets_finished_at_and_message_when_job_fails():
    failed, _ = transition(job(JobState.RUNNING), JobState.FAILED, "boom", now=300.0)
    assert failed.finished_at == 300.0 and failed.message == "boom"


def test_transition_clears_waiting_reason_when_job_leaves_queue():
    queued = JobRecord(id="j", name="j", spec={}, waiting_for="needs 8 GPUs")
    placed, _ = transition(queued, JobState.PLACING)
    assert placed.waiting_for is None


@pytest.mark.parametrize("terminal", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_transition_refuses_any_change_when_job_is_terminal(terminal):
    assert terminal.is_terminal and not ALLOWED[terminal]
    with pytest.raises(InvalidTransition, match="already finished"):
        transition(job(terminal), JobState.RUNNING)


def test_transition_refuses_queued_to_succeeded():
    with pytest.raises(InvalidTransition):
        transition(job(), JobState.SUCCEEDED)


def test_every_state_is_in_the_table_and_reachable_from_queued():
    assert set(ALLOWED) == set(JobState)
    seen, frontier = {JobState.QUEUED}, [JobState.QUEUED]
    while frontier:
        for nxt in ALLOWED[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(JobState)


def test_record_round_trips_through_json():
    rec = JobRecord(id="j", name="n", spec={"a": 1}, state=JobState.RUNNING,
                    placement=(PlacedRank(rank=0, node="n0", node_id="x", leaf="l0", gpu=1,
                                          pid=5, gpus=(1,)),))
    assert JobRecord.from_json(rec.to_json()) == rec
