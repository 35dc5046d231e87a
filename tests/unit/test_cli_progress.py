"""The live progress of `kc submit --wait` and `kc train` (api/cli/progress.py)."""

from __future__ import annotations

import io

from typer.testing import CliRunner

from kuangchao.api.cli.progress import ProgressView, format_bar, format_line, format_live

FULL = {"step": 120, "total_steps": 500, "loss": 2.34123, "lr": 3e-4, "tokens_per_s": 12345.0,
        "mem_bytes": 1.2 * 2**30, "comm_share": 0.14}


def job(state="RUNNING", **progress):
    return {"id": "tiny-1a2b3c4d", "state": state, "progress": progress}


def test_bar_fills_in_proportion_and_shows_step_over_total():
    assert format_bar({"step": 120, "total_steps": 500}, 20) == "[####................] 120/500"
    assert format_bar({"step": 500, "total_steps": 500}, 10) == "[##########] 500/500"
    assert format_bar({"step": 0, "total_steps": 500}, 5) == "[.....] 0/500"
    # Past the total (a resumed count) never overflows the bar.
    assert format_bar({"step": 900, "total_steps": 500}, 4) == "[####] 900/500"


def test_bar_without_a_total_or_step():
    assert format_bar({"step": 7, "total_steps": None}, 4) == "[....] 7/?"
    assert format_bar({}, 3) == "[...] 0/?"


def test_plain_line_has_every_reported_field():
    assert format_line(FULL) == ("step 120/500 loss 2.3412 lr 3.0e-04 12.3k tok/s mem 1.2 GiB "
                                 "comm 14%")


def test_missing_fields_are_left_out():
    # What workers report today: no lr, memory or communication share yet.
    assert format_line({"step": 3, "total_steps": 10, "loss": 1.5, "tokens_per_s": 850.0}) == \
        "step 3/10 loss 1.5000 850 tok/s"
    assert format_line({"step": 3, "total_steps": 10}) == "step 3/10"
    # Values that are not numbers are not shown.
    assert format_line({"step": 3, "total_steps": 10, "loss": None, "lr": "x", "mem_bytes": True,
                        "comm_share": None}) == "step 3/10"


def test_units():
    line = format_line({"step": 1, "tokens_per_s": 2.5e6, "mem_bytes": 512, "comm_share": 1.5})
    assert line == "step 1/? 2.5M tok/s mem 512 B comm 100%"
    assert "mem 80.0 GiB" in format_line({"step": 1, "mem_bytes": 80 * 2**30})
    assert "loss nan" in format_line({"step": 1, "loss": float("nan")})


def test_live_line_fits_the_terminal():
    line = format_live(FULL, columns=100)
    assert line.startswith("[") and "] 120/500  loss 2.3412  lr 3.0e-04  12.3k tok/s  " \
        "mem 1.2 GiB  comm 14%" in line
    assert len(line) <= 99
    assert len(format_live(FULL, columns=40)) <= 39
    bar = format_live({"step": 250, "total_steps": 500}, columns=200)
    assert bar == "[" + "#" * 15 + "." * 15 + "] 250/500"  # at most 30 cells


def test_live_view_redraws_one_line_and_ends_it():
    view = ProgressView(live=True, columns=120)
    first = view.frame(job("QUEUED", step=0, total_steps=500) | {"waiting_for": "4 GPUs"})
    assert first == "\r\033[Ktiny-1a2b3c4d QUEUED (waiting: 4 GPUs)"
    drawn = view.frame(job(**FULL))
    assert drawn.startswith("\r\033[K[") and "120/500  loss 2.3412" in drawn
    assert "\n" not in drawn
    assert view.frame(job(**FULL)) == ""  # nothing new: nothing written
    assert view.last_step == 120
    recovering = view.frame(job("RECOVERING", **FULL))
    assert recovering.endswith("  RECOVERING")
    assert view.end() == "\n"
    assert ProgressView(live=True).end() == ""  # nothing drawn, nothing to end


def test_plain_view_prints_a_line_only_when_the_step_or_state_changes():
    view = ProgressView(live=False)
    out = io.StringIO()
    polls = [job("QUEUED", step=0), job("RUNNING", step=0), job(step=1, loss=3.0),
             job(step=1, loss=3.0), job(step=2, loss=2.9), job(step=2, loss=2.9),
             job("SUCCEEDED", step=2, loss=2.9)]
    for p in polls:
        out.write(view.frame(p))
    out.write(view.end())
    assert out.getvalue().splitlines() == [
        "tiny-1a2b3c4d QUEUED", "tiny-1a2b3c4d RUNNING", "step 1/? loss 3.0000",
        "step 2/? loss 2.9000", "tiny-1a2b3c4d SUCCEEDED"]
    assert "\r" not in out.getvalue()


def test_job_text_is_terminal_safe_in_the_view():
    view = ProgressView(live=True)
    hostile = job("QUEUED", step=0) | {"waiting_for": "gpu\x1b]0;owned\x07\nnext"}
    frame = view.frame(hostile)
    assert frame.startswith("\r\033[K")
    rest = frame[len("\r\033[K"):]
    assert "\x1b" not in rest and "\x07" not in rest and "\n" not in rest


def test_submit_wait_follows_with_plain_lines_when_not_a_terminal(monkeypatch):
    from kuangchao.api.cli import main

    states = iter([job("RUNNING", step=1, total_steps=2, loss=3.0),
                   job("SUCCEEDED", step=2, total_steps=2, loss=2.0)])

    class FakeClient:
        def submit(self, doc):
            return {"id": "tiny-1a2b3c4d", "state": "QUEUED"}

        def wait(self, job_id, on_update=None):
            last = None
            for j in states:
                on_update(j)
                last = j
            return last

    monkeypatch.setattr(main, "client", lambda: FakeClient())
    monkeypatch.setattr(main, "load_job_doc", lambda path, sets: {})
    monkeypatch.setattr(main, "print_job", lambda j: None)
    result = CliRunner().invoke(main.app, ["submit", "job.yaml", "--wait"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["tiny-1a2b3c4d RUNNING", "step 1/2 loss 3.0000",
                                          "tiny-1a2b3c4d SUCCEEDED", "step 2/2 loss 2.0000"]


def test_version():
    from kuangchao.api.cli import main
    from kuangchao.platform.version import __version__

    result = CliRunner().invoke(main.app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"kc {__version__}\n"


def test_train_follows_the_job_it_drives_from_the_store(monkeypatch):
    import sys
    import threading
    import types

    from kuangchao.api.cli import main
    from kuangchao.platform.control import operations as jobs
    from kuangchao.platform.jobs.memory import MemoryStore
    from kuangchao.platform.jobs.store import JobStore
    from kuangchao.platform.spec.jobspec import validate_spec

    store = MemoryStore()
    spec = validate_spec({"task": {"name": "tiny"}, "training": {"steps": 4},
                          "model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32}})
    job_id = jobs.submit(store, spec, driver="external").id
    monkeypatch.setattr(JobStore, "from_url", classmethod(lambda cls, url, prefix="kc:": store))

    polled = threading.Event()
    frame = ProgressView.frame

    def seen(self, job):
        polled.set()
        return frame(self, job)

    monkeypatch.setattr(ProgressView, "frame", seen)

    def run_as_driver(doc, settings=None, on_submitted=None):
        on_submitted(job_id)
        assert polled.wait(10)  # the follower's first poll finds the job queued
        return {"id": job_id, "state": "SUCCEEDED",
                "progress": {"step": 4, "total_steps": 4, "loss": 1.25, "tokens_per_s": 900.0}}

    # The real driver module loads torch and Ray; `kc train` imports it when it runs.
    fake = types.ModuleType("kuangchao.platform.runtime.driver")
    fake.run_as_driver = run_as_driver
    monkeypatch.setitem(sys.modules, "kuangchao.platform.runtime.driver", fake)
    monkeypatch.setattr(main, "load_job_doc", lambda path, sets: {})
    monkeypatch.setattr(main, "print_job", lambda j: None)
    result = CliRunner().invoke(main.app, ["train", "--config", "job.yaml"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"{job_id} QUEUED", f"{job_id} SUCCEEDED",
                                          "step 4/4 loss 1.2500 900 tok/s"]
