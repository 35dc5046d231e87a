"""The job store's contract, written once and run twice: against `MemoryStore`
(tests/unit/test_store_contract.py) and against the Redis `JobStore` on a real
Redis (tests/integration/test_store_contract.py). Every test takes a fresh
`store` fixture; where the two stores disagree, Redis is right.

No Redis import here: the unit tier imports this module.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kuangchao.platform.errors import JobNotFound, StoreUnavailable
from kuangchao.platform.jobs.encoding import EVENT_CAP, LOG_CAP, METRICS_CAP
from kuangchao.platform.jobs.state import JobRecord, JobState, admit, cancel, fail, start
from kuangchao.platform.observability import metrics


def job(i: int, **kw) -> JobRecord:
    return JobRecord(id=f"j{i:03d}", name="j", spec={}, created_at=1000.0 + i, **kw)


def bump(field: str):
    return lambda j: (replace(j, **{field: getattr(j, field) + 1}), None)


def finished_count(store, state: str, queue: str = "default") -> float:
    (field,) = metrics.increments(metrics.JOBS_FINISHED, 1.0, {"state": state, "queue": queue})
    return store.metric_fields().get(field, 0.0)


# -- records ------------------------------------------------------------------------
def test_create_stores_version_one_its_event_the_active_set_and_a_wake_up(store):
    out = store.create(job(1), event_message="from the API")
    got = store.get("j001")
    assert out.version == got.version == 1 and got.state is JobState.QUEUED and got == out
    (event,) = store.events("j001")
    assert event == {"ts": 1001.0, "type": "state", "from": None, "to": "QUEUED",
                     "message": "from the API"}
    assert [j.id for j in store.list_active()] == ["j001"]
    t0 = time.monotonic()
    store.wait_for_wake(5.0)  # the create woke the scheduler
    assert time.monotonic() - t0 < 1.0


def test_get_of_an_unknown_job_raises_job_not_found(store):
    with pytest.raises(JobNotFound):
        store.get("nope")
    with pytest.raises(JobNotFound):
        store.update("nope", bump("restarts"))


@pytest.mark.parametrize("bad", ["j001:events", "j001:*", "*", "j00?", "../j001", "", "j001 "])
def test_an_id_that_is_no_job_id_is_a_missing_job_even_where_it_names_a_key(store, bad):
    store.create(job(1))
    store.add_event("j001", {"type": "note"})  # `j001:events` is a key, not a job
    with pytest.raises(JobNotFound):
        store.get(bad)


def test_list_gives_the_newest_oldest_first_and_the_active_set_keeps_old_waiting_jobs(store):
    for i in (3, 0, 2, 1, 4):
        store.create(job(i))
    assert [j.id for j in store.list(limit=3)] == ["j002", "j003", "j004"]
    assert [j.id for j in store.list()] == ["j000", "j001", "j002", "j003", "j004"]
    assert len(store.list(limit=0)) == 5 and len(store.list(limit=50)) == 5  # as ZRANGE reads it
    store.update("j002", lambda j: cancel(j, "done"))
    assert [j.id for j in store.list_active()] == ["j000", "j001", "j003", "j004"]
    assert store.get("j002").state is JobState.CANCELLED
    assert store.list_active()[0].created_at == 1000.0


def test_list_pages_back_from_the_newest(store):
    for i in range(7):
        store.create(job(i))
    ids = lambda jobs: [j.id[1:] for j in jobs]  # noqa: E731
    assert ids(store.list(3)) == ["004", "005", "006"]
    assert ids(store.list(3, before=3)) == ["001", "002", "003"]
    assert ids(store.list(3, before=6)) == ["000"]
    assert store.list(3, before=7) == [] and store.list(3, before=100) == []


def test_list_orders_jobs_created_at_the_same_time_by_id(store):
    for name in ("b", "a", "c"):
        store.create(JobRecord(id=name, name=name, spec={}, created_at=5.0))
    assert [j.id for j in store.list()] == ["a", "b", "c"]
    assert [j.id for j in store.list_active()] == ["a", "b", "c"]


def raced_once(store, change, rival):
    """`change`, wrapped so that on its first run `rival` is committed between its
    read and its write; returns the wrapper and the list of records it was given."""
    seen: list[JobRecord] = []

    def run(j):
        seen.append(j)
        if len(seen) == 1:
            store.update(j.id, rival)
        return change(j)
    return run, seen


def test_update_retries_on_a_version_conflict_and_loses_no_write(store):
    store.create(job(1))
    run, seen = raced_once(store, bump("preemptions"), bump("restarts"))
    out = store.update("j001", run)
    assert [j.version for j in seen] == [1, 2]  # ran again on the rival's record
    assert out.restarts == 1 and out.preemptions == 1 and out.version == 3
    assert store.get("j001") == out


def test_update_returns_none_and_writes_nothing_when_fn_returns_none(store):
    store.create(job(1))
    assert store.update("j001", lambda j: None) is None
    assert store.get("j001").version == 1 and len(store.events("j001")) == 1


def test_update_gives_up_with_store_unavailable_under_endless_contention(store):
    store.create(job(1))

    def always_raced(j):
        store.update(j.id, bump("restarts"))
        return bump("preemptions")(j)
    with pytest.raises(StoreUnavailable):
        store.update("j001", always_raced, attempts=3)
    got = store.get("j001")
    assert got.restarts == 3 and got.preemptions == 0 and got.version == 4


def test_update_appends_its_event_stamped_and_with_unjsonable_values_as_text(store):
    store.create(job(1))
    before = time.time()
    store.update("j001", lambda j: (j, {"type": "note", "path": Path("/x/y")}))
    event = store.events("j001")[-1]
    assert event["type"] == "note" and event["path"] == "/x/y" and event["ts"] >= before - 1
    store.update("j001", lambda j: (j, {"type": "note", "ts": 7.0}))
    assert store.events("j001")[-1]["ts"] == 7.0  # an event's own time is kept


def test_a_finishing_commit_leaves_the_active_set_drops_targets_and_counts_once(store):
    store.create(job(7))
    store.register_target("j007", 0, {"addr": "h:1", "pid": 1})
    assert finished_count(store, "FAILED") == 0
    out = store.update("j007", lambda j: fail(j, "boom"))
    assert out.state is JobState.FAILED and out.version == 2
    event = store.events("j007")[-1]
    assert event["to"] == "FAILED" and event["message"] == "boom"
    assert store.list_active() == [] and store.targets(["j007"]) == {"j007": {}}
    assert finished_count(store, "FAILED") == 1
    # a later change of the finished record (an annotation) does not count it again
    store.update("j007", lambda j: (replace(j, message="later"), None))
    assert finished_count(store, "FAILED") == 1 and store.get("j007").message == "later"


def test_a_running_job_stays_active_and_uncounted(store):
    store.create(job(1))
    store.update("j001", lambda j: admit(j, "admitted"))
    store.update("j001", lambda j: start(j, "placed"))
    assert store.get("j001").state is JobState.RUNNING
    assert [j.id for j in store.list_active()] == ["j001"]
    assert store.metric_fields() == {}


def test_events_keep_the_newest_event_cap_whoever_appends_them(store):
    store.create(job(1))
    for i in range(EVENT_CAP + 1):
        store.add_event("j001", {"type": "n", "i": i})
    store.update("j001", lambda j: (j, {"type": "last"}))
    events = store.events("j001")
    assert len(events) == EVENT_CAP
    assert events[0]["i"] == 2 and events[-2]["i"] == EVENT_CAP and events[-1]["type"] == "last"


def test_events_read_from_an_offset_and_from_the_end(store):
    for i in range(5):
        store.add_event("j9", {"type": "n", "i": i})
    assert [e["i"] for e in store.events("j9", 3)] == [3, 4]
    assert [e["i"] for e in store.events("j9", -2)] == [3, 4]
    assert [e["i"] for e in store.events("j9", -50)] == [0, 1, 2, 3, 4]
    assert store.events("j9", 9) == [] and store.events("unknown") == []


def test_annotations_fill_only_missing_fields_of_the_newest_entry(store):
    store.create(job(1, restart_log=({"cause": "died"},), resize_log=({"to_world_size": 4},)))
    assert store.annotate_restart("j001", {"cause": "other", "restore_s": 1.5, "x": None}) is not None
    assert store.get("j001").restart_log == ({"cause": "died", "restore_s": 1.5},)
    assert store.annotate_restart("j001", {"restore_s": 9.0}) is None  # nothing new: no write
    assert store.get("j001").version == 2
    store.annotate_resize("j001", {"requested_at": 10.0})
    assert store.get("j001").resize_log == ({"to_world_size": 4, "requested_at": 10.0},)
    store.create(job(2))
    assert store.annotate_restart("j002", {"restore_s": 1.0}) is None  # no restart at all


def test_close_resize_stamps_the_open_entry_for_its_world_size_once(store):
    store.create(job(1, resize_log=({"to_world_size": 4, "requested_at": 10.0},)))
    assert store.close_resize("j001", 12.5, world_size=2) is None  # another size
    closed = store.close_resize("j001", 12.5, world_size=4)
    assert closed == {"to_world_size": 4, "requested_at": 10.0, "first_step_at": 12.5, "resize_s": 2.5}
    assert store.get("j001").resize_log == (closed,)
    assert store.close_resize("j001", 13.0, world_size=4) is None  # already closed


def test_claim_controller_returns_the_one_recorded_before(store):
    assert store.controller("j1") is None
    assert store.claim_controller("j1", "ctl/1") is None
    assert store.claim_controller("j1", "ctl/2") == "ctl/1"
    assert store.controller("j1") == "ctl/2" and store.controller("j2") is None


def test_concurrent_writers_lose_no_update(store):
    store.create(job(1))

    def writer():
        for _ in range(20):
            store.update("j001", bump("restarts"), attempts=200)
    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = store.get("j001")
    assert got.restarts == 80 and got.version == 81


# -- streams ------------------------------------------------------------------------
def test_a_log_line_longer_than_the_cap_keeps_its_head_and_says_it_was_cut(store):
    from kuangchao.platform.jobs.encoding import LOG_LINE_BYTES

    store.create(job(1))
    store.add_logs("j001", [{"rank": 0, "message": "x" * (10 * LOG_LINE_BYTES), "extra": "y" * 5000},
                            {"rank": 1, "message": "short"}])
    long, short = store.logs("j001")
    assert long["truncated"] is True and long["message"].startswith("x" * 100)
    assert "characters cut" in long["message"] and long["extra"] == "[cut]"
    assert len(json.dumps(long)) <= LOG_LINE_BYTES
    assert short == {"rank": 1, "message": "short"}


def test_logs_and_curve_points_keep_their_caps(store):
    store.add_logs("j1", [])
    store.add_metrics("j1", [])
    assert store.logs("j1") == [] and store.metrics("j1") == []
    store.add_logs("j1", [{"i": i, "at": Path("/p")} for i in range(LOG_CAP + 3)])
    logs = store.logs("j1")
    assert len(logs) == LOG_CAP and logs[0] == {"i": 3, "at": "/p"}
    store.add_metrics("j1", [{"step": i} for i in range(METRICS_CAP + 2)])
    store.add_metrics("j1", [{"step": -1}])
    points = store.metrics("j1")
    assert len(points) == METRICS_CAP and points[0] == {"step": 3} and points[-1] == {"step": -1}
    assert store.metrics("j1", METRICS_CAP - 2) == [{"step": METRICS_CAP + 1}, {"step": -1}]
    assert [r["i"] for r in store.logs("j1", -2)] == [LOG_CAP + 1, LOG_CAP + 2]


def test_progress_merges_fields_and_writes_initial_loss_once(store):
    assert store.progress("j1") == {}
    store.set_progress("j1", {"step": 1, "loss": 2.5, "initial_loss": 2.5})
    store.set_progress("j1", {"step": 2, "loss": 1.5, "initial_loss": 9.0})
    store.set_progress("j1", {"initial_loss": 8.0})
    store.set_progress("j1", {})
    assert store.progress("j1") == {"step": 2, "loss": 1.5, "initial_loss": 2.5}


def test_checkpoints_are_listed_in_commit_order(store):
    assert store.checkpoints("j1") == []
    store.add_checkpoint("j1", {"step": 10, "path": "/c/10"})
    store.add_checkpoint("j1", {"step": 20, "path": "/c/20"})
    assert [c["step"] for c in store.checkpoints("j1")] == [10, 20]


def test_reports_are_taken_once_in_order_and_answered(store):
    assert store.take_reports("j1") == []
    store.post_report("j1", {"kind": "numeric_fault", "id": "r1", "where": Path("/w")})
    store.post_report("j1", {"kind": "first_step", "id": "r2"})
    store.post_report("j2", {"kind": "first_step", "id": "other"})
    assert [r["id"] for r in store.take_reports("j1")] == ["r1", "r2"]
    assert store.take_reports("j1") == [] and len(store.take_reports("j2")) == 1
    assert store.report_answer("j1", "r1") is None
    store.answer_report("j1", "r1", {"roll_back": True})
    assert store.report_answer("j1", "r1") == {"roll_back": True}
    assert store.report_answer("j2", "r1") is None


def test_a_report_answer_expires_after_its_ttl(store):
    store.answer_report("j1", "r1", {"roll_back": False}, ttl_s=1)
    assert store.report_answer("j1", "r1") == {"roll_back": False}
    time.sleep(1.3)
    assert store.report_answer("j1", "r1") is None


def test_samples_are_recorded_as_text_and_forgotten_from_a_step(store):
    assert store.samples("j1") == {}
    store.record_samples("j1", {})
    store.record_samples("j1", {"1/2/0": "0:4", "1/2/1": "4:8", "2/2/0": "8:12", "10/2/0": 12})
    store.forget_samples_from("j1", 2)
    assert store.samples("j1") == {"1/2/0": "0:4", "1/2/1": "4:8"}
    store.forget_samples_from("j1", 99)
    store.record_samples("j1", {"1/2/0": "0:5"})
    assert store.samples("j1") == {"1/2/0": "0:5", "1/2/1": "4:8"}
    store.record_samples("j1", {"3/2/0": 7})
    assert store.samples("j1")["3/2/0"] == "7"


# -- control flags ----------------------------------------------------------------
def test_cancel_is_a_flag_that_wakes_the_scheduler(store):
    assert not store.cancel_requested("j1")
    store.request_cancel("j1")
    assert store.cancel_requested("j1") and not store.cancel_requested("j2")
    t0 = time.monotonic()
    store.wait_for_wake(5.0)
    assert time.monotonic() - t0 < 1.0


def test_preempt_and_resize_flags_set_and_clear(store):
    assert not store.preempt_requested("j1") and not store.resize_requested("j1")
    assert store.preempt_reason("j1") is None
    store.request_preempt("j1", "big")
    assert store.preempt_reason("j1") == "big"
    store.request_resize("j1")
    assert store.preempt_requested("j1") and store.resize_requested("j1")
    store.clear_preempt("j1")
    assert not store.preempt_requested("j1") and store.resize_requested("j1")
    store.clear_resize("j1")
    store.clear_resize("j1")  # clearing twice is harmless
    assert not store.resize_requested("j1")


def test_publishing_a_generation_signals_a_rejoin_only_when_asked(store):
    assert store.generation("j1") is None and store.rejoin_requested("j1") == 0
    gen2 = {"gen": 2, "world_size": 4, "ranks": {"0": 0}}
    store.publish_generation("j1", gen2, signal=True)
    assert store.generation("j1") == gen2 and store.rejoin_requested("j1") == 2
    store.clear_rejoin("j1")
    assert store.rejoin_requested("j1") == 0 and store.generation("j1") == gen2
    store.publish_generation("j1", {"gen": 3}, signal=True)
    store.publish_generation("j1", {"gen": 4}, signal=False)  # a group formed from scratch
    assert store.generation("j1") == {"gen": 4} and store.rejoin_requested("j1") == 0


def test_stack_requests_are_answered_once_per_rank(store):
    store.answer_stacks("j1", 1, "old stacks")
    store.request_stacks("j1", [0, 1])
    assert store.stacks("j1", [0, 1]) == {}  # a new request drops the earlier answers
    assert store.stack_requested("j1", 0) and store.stack_requested("j1", 1)
    assert not store.stack_requested("j1", 2)
    store.answer_stacks("j1", 0, "Thread main ...")
    assert not store.stack_requested("j1", 0) and store.stack_requested("j1", 1)
    assert store.stacks("j1", [0, 1, 2]) == {0: "Thread main ..."}


def test_a_stack_request_expires_after_its_ttl(store):
    store.request_stacks("j1", [0], ttl_s=1)
    time.sleep(1.3)
    assert not store.stack_requested("j1", 0)


def test_wait_for_wake_times_out_and_one_wait_drains_every_wake_up(store):
    t0 = time.monotonic()
    store.wait_for_wake(0.3)
    assert time.monotonic() - t0 >= 0.25
    for reason in ("a", "b", ""):
        store.wake_scheduler(reason)
    store.wait_for_wake(5.0)
    t0 = time.monotonic()
    store.wait_for_wake(0.3)  # the backlog went with the first wait
    assert time.monotonic() - t0 >= 0.25


def test_a_wake_up_from_another_thread_ends_the_wait(store):
    threading.Timer(0.2, store.wake_scheduler, args=("late",)).start()
    t0 = time.monotonic()
    store.wait_for_wake(10.0)
    assert 0.1 <= time.monotonic() - t0 < 5.0


# -- node health --------------------------------------------------------------------
def test_node_failures_are_counted_within_their_window(store):
    assert store.record_node_failure("n1", 100.0, window_s=60) == [100.0]
    assert store.record_node_failure("n1", 130.0, window_s=60) == [100.0, 130.0]
    assert store.record_node_failure("n1", 130.0, window_s=60) == [100.0, 130.0]  # same instant
    assert store.record_node_failure("n1", 160.0, window_s=60) == [130.0, 160.0]  # 100 is out
    assert store.record_node_failure("n1", 120.0, window_s=60) == [120.0, 130.0, 160.0]
    assert store.record_node_failure("n2", 500.0, window_s=60) == [500.0]


def test_quarantine_and_release_of_a_node(store):
    assert store.quarantine() == {} and store.release_node("n1") is False
    store.record_node_failure("n1", 100.0, window_s=600)
    entry = {"since": 1.0, "until": 2.0, "failures": 3, "reason": "flaky", "node_id": "abc"}
    store.quarantine_node("n1", entry)
    store.quarantine_node("n2", {"since": 1.0})
    assert store.quarantine() == {"n1": entry, "n2": {"since": 1.0}}
    assert store.release_node("n1") is True and store.release_node("n1") is False
    assert store.quarantine() == {"n2": {"since": 1.0}}
    assert store.record_node_failure("n1", 101.0, window_s=600) == [101.0]  # history cleared too


def test_cluster_info_is_stored_by_name(store):
    assert store.info("nodes") is None
    store.set_info("nodes", {"n1": {"gpus": 8}})
    store.set_info("queues", {"q": {}})
    assert store.info("nodes") == {"n1": {"gpus": 8}} and store.info("queues") == {"q": {}}


# -- metrics and scrape targets --------------------------------------------------------
def test_recorders_add_to_the_cluster_hash_or_the_jobs_own(store):
    store.recorder().inc(metrics.RESTARTS, cause="died", job="j1")
    store.recorder().inc(metrics.RESTARTS, 2.0, cause="died", job="j1")
    store.recorder("j1").observe(metrics.FAILURE_DETECTION, 3.0, cause="died")
    store.recorder("j1").observe(metrics.FAILURE_DETECTION, float("nan"), cause="died")
    (restarts,) = metrics.increments(metrics.RESTARTS, 1.0, {"cause": "died", "job": "j1"})
    assert store.metric_fields() == {restarts: 3.0}
    job_fields = store.metric_fields("j1")
    assert job_fields == metrics.increments(metrics.FAILURE_DETECTION, 3.0, {"cause": "died"})
    assert store.metric_fields("j2") == {}


def test_scrape_targets_register_and_leave_only_for_their_own_process(store):
    assert store.targets([]) == {} and store.targets(["j1"]) == {"j1": {}}
    store.register_target("j1", 0, {"addr": "h:1", "pid": 11})
    store.register_target("j1", 1, {"addr": "h:2", "pid": 12})
    store.unregister_target("j1", 1, pid=99)  # another process holds rank 1 now
    store.unregister_target("j1", 0, pid=11)
    store.unregister_target("j1", 5, pid=11)
    (entry,) = store.targets(["j1"])["j1"].items()
    assert entry[0] == "1" and '"h:2"' in entry[1]


# -- retention ----------------------------------------------------------------------
TERMINAL = tuple(s.value for s in JobState if s.is_terminal)


def finished_at(store, i: int, at: float) -> str:
    """Job `i`, failed, as if it had finished at `at`."""
    store.create(job(i))
    store.update(f"j{i:03d}", lambda j: fail(j, "boom"))
    store.update(f"j{i:03d}", lambda j: (replace(j, finished_at=at), None))
    return f"j{i:03d}"


def test_a_purge_forgets_a_job_finished_before_the_cutoff_and_every_key_it_left(store):
    gone = finished_at(store, 1, at=500.0)
    store.add_logs(gone, [{"rank": 0, "message": "hello"}])
    store.add_metrics(gone, [{"step": 1, "loss": 2.0}])
    store.set_progress(gone, {"step": 3, "loss": 1.5})
    store.add_checkpoint(gone, {"step": 3, "path": "/c/3"})
    store.record_samples(gone, {"1/2/0": "0:4"})
    store.claim_controller(gone, "ctl/1")
    store.request_cancel(gone)
    store.recorder(gone).observe(metrics.FAILURE_DETECTION, 3.0, cause="died")
    store.fence(gone, ["11@n0"])
    store.create(job(2))  # another job's keys stay
    store.set_progress("j002", {"step": 1})
    assert store.purge_finished(gone, 600.0, TERMINAL) == "purged"
    with pytest.raises(JobNotFound):
        store.get(gone)
    assert [j.id for j in store.list()] == ["j002"]
    assert [j.id for j in store.list_active()] == ["j002"]
    assert store.events(gone) == [] and store.logs(gone) == [] and store.metrics(gone) == []
    assert store.progress(gone) == {} and store.checkpoints(gone) == [] and store.samples(gone) == {}
    assert store.controller(gone) is None and not store.cancel_requested(gone)
    assert store.metric_fields(gone) == {} and store.fenced(gone) == set()
    assert store.progress("j002") == {"step": 1} and len(store.events("j002")) == 1


def test_a_purge_keeps_a_job_that_runs_or_finished_at_or_after_the_cutoff(store):
    store.create(job(1))
    recent = finished_at(store, 2, at=600.0)
    assert store.purge_finished("j001", 1e12, TERMINAL) == "kept"  # queued, however old
    assert store.purge_finished(recent, 600.0, TERMINAL) == "kept"
    assert store.purge_finished(recent, 600.0, ("SUCCEEDED",)) == "kept"  # not in `terminal`
    assert store.get("j001").state is JobState.QUEUED and store.get(recent).finished_at == 600.0
    assert [e.get("to") for e in store.events(recent)] == ["QUEUED", "FAILED"]
    assert store.purge_finished(recent, 600.5, TERMINAL) == "purged"
    assert [j.id for j in store.list()] == ["j001"]


@pytest.mark.parametrize("bad", ["*", "j00?", "j001:events", ""])
def test_a_purge_of_what_is_no_job_id_deletes_nothing(store, bad):
    finished_at(store, 1, at=1.0)
    assert store.purge_finished(bad, 1e12, TERMINAL) == "kept"
    assert store.get("j001").state is JobState.FAILED
