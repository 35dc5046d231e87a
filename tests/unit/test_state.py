"""The job state machine."""

import pytest

from kuangchao.platform.errors import InvalidTransition
from kuangchao.platform.jobs import state
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


# -- named operations: each applies from some states, is a no-op (None) where another
# path got there first or the job finished, and the table refuses the rest.
LIVE = {s for s in JobState if not s.is_terminal}
OPERATIONS = {  # name: (apply, applies from, target, refused from)
    "admit": (lambda j: state.admit(j, "admitted"), {JobState.QUEUED}, JobState.PLACING, set()),
    "start": (lambda j: state.start(j, "running"),
              {JobState.PLACING, JobState.RECOVERING, JobState.RESIZING}, JobState.RUNNING,
              {JobState.QUEUED}),
    "resume_after_rollback": (lambda j: state.resume_after_rollback(j, "rolled back"),
                              {JobState.RECOVERING}, JobState.RUNNING, set()),
    "recover": (lambda j: state.recover(j, "rank 1 died", {"restart": j.restarts + 1}),
                {JobState.PLACING, JobState.RUNNING, JobState.RESIZING}, JobState.RECOVERING,
                {JobState.QUEUED}),
    "resize": (lambda j: state.resize(j, "growing"), {JobState.RUNNING, JobState.RECOVERING},
               JobState.RESIZING, set()),
    "settle_resize": (lambda j: state.settle_resize(j, "generation 2"), {JobState.RESIZING},
                      JobState.RUNNING, set()),
    "requeue": (lambda j: state.requeue(j, "preempted"), LIVE - {JobState.QUEUED}, JobState.QUEUED,
                {JobState.QUEUED}),
    "finish": (lambda j: state.finish(j, "done"), {JobState.RUNNING, JobState.RESIZING},
               JobState.SUCCEEDED, {JobState.QUEUED, JobState.PLACING, JobState.RECOVERING}),
    "fail": (lambda j: state.fail(j, "boom"), LIVE, JobState.FAILED, set()),
    "cancel": (lambda j: state.cancel(j, "stop"), LIVE, JobState.CANCELLED, set()),
}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
@pytest.mark.parametrize("current", list(JobState))
def test_operation_applies_from_its_states_and_is_a_no_op_elsewhere(name, current):
    apply, sources, target, refused = OPERATIONS[name]
    if current in sources:
        new, event = apply(job(current))
        assert new.state is target and (event["from"], event["to"]) == (current.value, target.value)
    elif current in refused:
        with pytest.raises(InvalidTransition):
            apply(job(current))
    else:
        assert apply(job(current)) is None


def test_recover_counts_a_restart_and_logs_its_entry():
    new, _ = state.recover(job(JobState.RUNNING), "rank 1 died", {"restart": 1, "rank": 1})
    assert new.restarts == 1 and new.restart_log == ({"restart": 1, "rank": 1},)
    assert new.message == "rank 1 died"


def test_requeue_gives_the_placement_back_and_only_from_restricts_it():
    placed = JobRecord(id="j", name="j", spec={}, state=JobState.RECOVERING,
                       placement=(PlacedRank(0, "n0", "id0", "leaf0", gpu=0),), preempting_for="x")
    new, _ = state.requeue(placed, "re-placing", only_from=JobState.RECOVERING)
    assert new.state is JobState.QUEUED and new.placement == () and new.preempting_for is None
    assert state.requeue(job(JobState.RUNNING), "re-placing", only_from=JobState.RECOVERING) is None


def test_cancel_only_queued_leaves_a_placed_job_to_its_controller():
    assert state.cancel(job(JobState.RUNNING), "stop", only_queued=True) is None
    new, _ = state.cancel(job(JobState.QUEUED), "stop", only_queued=True)
    assert new.state is JobState.CANCELLED and new.finished_at is not None
