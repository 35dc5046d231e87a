"""bench/goodput_sim.py: projected ETTR under published failure rates, calibrated on Llama 3."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench import goodput_sim as gs
from bench.goodput_sim import CAUSES, SETTINGS, SIZES, Event, Inputs

DAYS = 54


@pytest.fixture(scope="module")
def by_size():
    """Every setting at every size, with the kc-measured defaults (shared by several tests)."""
    return {n: gs.project(Inputs(), n, DAYS) for n in SIZES}


def test_calibration_lands_within_5_points_of_llama3_when_disk_only_with_llama3_costs():
    cal = gs.calibrate()
    assert cal["within"]
    assert abs(cal["ettr"] - 0.90) <= 0.05, cal


def test_best_setting_reaches_097_at_16384_gpus_with_kc_measured_costs(by_size):
    best = max(p.ettr for p in by_size[16_384].values())
    assert best >= 0.97
    assert by_size[16_384]["survivors_keep_work"].ettr == best


@pytest.mark.parametrize("gpus", SIZES)
def test_settings_order_survivors_over_peer_memory_over_disk_only_when_failures_happen(
        by_size, gpus):
    p = by_size[gpus]
    assert p["survivors_keep_work"].ettr >= p["peer_memory"].ettr >= p["disk_only"].ettr


@pytest.mark.parametrize("setting", SETTINGS)
def test_ettr_falls_when_gpus_grow(by_size, setting):
    ettrs = [by_size[n][setting].ettr for n in SIZES]
    assert ettrs == sorted(ettrs, reverse=True) and ettrs[0] > ettrs[-1]


@pytest.mark.parametrize("gpus", [1_024, 16_384])
def test_lost_time_by_cause_and_productive_time_add_up_to_wall_clock(by_size, gpus):
    for p in by_size[gpus].values():
        assert set(p.lost_h) == set(CAUSES)
        assert p.productive_h + sum(p.lost_h.values()) == pytest.approx(DAYS * 24, rel=1e-9)
        assert p.ettr == pytest.approx(p.productive_h / (DAYS * 24), rel=1e-9)
        assert all(h >= 0 for h in p.lost_h.values())


def test_one_run_adds_up_when_failures_crowd_restarts():
    inp = replace(Inputs(), failures_per_gpu_day=Inputs().failures_per_gpu_day * 200)
    wall = 3 * gs.DAY_S
    events = gs.draw_events(inp, 16_384, wall, gs.random.Random(7))
    for setting in SETTINGS:
        acct = gs.simulate_run(gs.costs(inp, 16_384, setting), setting, events, wall)
        assert sum(acct.values()) == pytest.approx(wall, rel=1e-12)


def test_projection_is_the_same_for_a_seed_and_differs_for_another():
    a = gs.project(Inputs(), 4_096, DAYS, runs=5, seed=3)
    b = gs.project(Inputs(), 4_096, DAYS, runs=5, seed=3)
    c = gs.project(Inputs(), 4_096, DAYS, runs=5, seed=4)
    assert a == b
    assert a["disk_only"].ettr != c["disk_only"].ettr


def test_ettr_is_limited_only_by_startup_and_checkpoints_when_nothing_fails():
    inp = replace(Inputs(), failures_per_gpu_day=0.0, planned_per_day=0.0)
    wall = DAYS * gs.DAY_S
    for setting, p in gs.project(inp, 16_384, DAYS, runs=2).items():
        c = gs.costs(inp, 16_384, setting)
        up = wall - c.startup
        stalls = up // c.cycle * c.ckpt_stall  # whole cycles' saves ...
        stalls += (up // c.cycle) * c.steps_per_ckpt * c.peer_stall  # ... and peer copies
        rest = up % c.cycle
        stalls += math.floor(min(rest, c.train_wall) / c.step_wall) * c.peer_stall
        stalls += max(0.0, rest - c.train_wall)
        assert p.interruptions == 0
        assert p.lost_h["detection"] == p.lost_h["restart"] == p.lost_h["redone"] == 0
        assert p.lost_h["startup"] * 3600 == pytest.approx(c.startup)
        assert p.ettr == pytest.approx(1 - (c.startup + stalls) / wall, abs=1e-6)
        assert p.ettr < 1


def test_disk_only_redoes_everything_since_the_last_commit_when_a_save_is_still_writing():
    c = gs.costs(Inputs(), 16_384, "disk_only")
    during_write = c.train_wall + c.write_s / 2  # the first save has not committed yet
    cut = gs.up_period(c, during_write, "disk_only", "local")
    assert cut["productive"] == 0  # all of it, the next cycle's first moments too, is redone
    assert cut["redone"] == pytest.approx(during_write - c.ckpt_stall)
    after = gs.up_period(c, c.train_wall + c.write_s + 1.0, "disk_only", "local")
    assert after["productive"] == pytest.approx(c.steps_per_ckpt * c.step_s)


def test_peer_memory_redoes_one_more_step_when_the_last_copy_had_not_landed():
    inp = replace(Inputs(), link_Bps=1e8)  # a slow link: each copy takes ~3.5 s
    c = gs.costs(inp, 16_384, "peer_memory")
    assert 0 < c.peer_copy_s < c.step_s
    landed = gs.up_period(c, 3 * c.step_wall + c.peer_copy_s + 0.1, "peer_memory", "local")
    in_flight = gs.up_period(c, 3 * c.step_wall + 0.1, "peer_memory", "local")
    assert landed["productive"] == pytest.approx(3 * c.step_s)
    assert in_flight["productive"] == pytest.approx(2 * c.step_s)
    kept = gs.up_period(c, 3 * c.step_wall + 0.1, "survivors_keep_work", "local")
    assert kept["productive"] == pytest.approx(3 * c.step_s)  # survivors hold their state


def test_a_failure_during_a_restart_starts_the_restart_over():
    c = gs.costs(Inputs(), 16_384, "disk_only")
    first = c.startup + 100.0
    second = first + c.detect + c.restart / 2
    wall = second + c.detect + c.restart + 60.0
    acct = gs.simulate_run(c, "disk_only", [Event(first, "job_wide"), Event(second, "local")],
                           wall)
    assert acct["restart"] == pytest.approx(c.restart / 2 + c.restart)
    assert acct["detection"] == pytest.approx(2 * c.detect)
    assert acct["productive"] + acct["redone"] + acct["checkpoint"] == pytest.approx(160.0)


@pytest.mark.parametrize("change,message", [
    ({"failures_per_gpu_day": -1.0}, "failures_per_gpu_day must be >= 0"),
    ({"planned_per_day": -0.5}, "planned_per_day must be >= 0"),
    ({"storage_total_Bps": 0.0}, "storage_total_Bps must be > 0"),
    ({"link_Bps": 0.0}, "link_Bps must be > 0"),
    ({"hang_fraction": 1.5}, "hang_fraction is a share"),
    ({"hang_fraction": 0.6, "job_wide_fraction": 0.6}, "hang_fraction \\+ job_wide_fraction"),
    ({"ckpt_interval_steps": 0}, "ckpt_interval_steps must be a whole number"),
    ({"step_s": float("nan")}, "step_s must be a finite number"),
])
def test_inputs_refuse_bad_values_with_the_field_named(change, message):
    with pytest.raises(ValueError, match=message):
        Inputs(**change)


def test_projection_refuses_fewer_gpus_than_one_replica():
    with pytest.raises(ValueError, match="smaller than one data-parallel replica"):
        gs.project(Inputs(), 64, DAYS)


def test_load_inputs_takes_the_measured_lines_and_reanchors_restart_growth(tmp_path):
    results = tmp_path / "latest.jsonl"
    lines = [{"bench": "recovery", "metric": "mttr_s", "ours": 12.0},
             {"bench": "recovery", "metric": "crash_detect_ms", "ours": 250.0},
             {"bench": "ckpt_io", "metric": "s3_ckpt_throughput", "ours": 5e8},
             {"bench": "goodput", "metric": "survivor_stall_s", "ours": 1.5},
             {"bench": "recovery", "metric": "mttr_s_warm_spares", "ours": 9.0},
             {"bench": "placement", "metric": "solve_ms_p50", "ours": 5.0},
             {"bench": "recovery", "metric": "hang_detect_s", "ours": None}]
    results.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    inp, applied = gs.load_inputs(results)
    assert (inp.mttr_s, inp.crash_detect_s, inp.storage_rank_Bps) == (12.0, 0.25, 5e8)
    assert inp.survivor_stall_s == 1.5  # goodput's own measurement wins over the stand-in
    assert inp.restart_s_per_doubling == round(gs.per_doubling(12.0, 2), 1)
    assert applied == sorted(["mttr_s", "crash_detect_s", "storage_rank_Bps",
                              "survivor_stall_s", "restart_s_per_doubling"])


def test_cli_prints_the_tables_and_the_calibration(capsys):
    assert gs.main(["--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "16,384 GPUs" in out and "calibration:" in out
    assert all(f"| {s} |" in out for s in SETTINGS)


def test_cli_json_has_every_setting_and_size(capsys):
    assert gs.main(["--runs", "2", "--gpus", "1024", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["detail"]) == set(SETTINGS)
    assert set(rep["ettr_by_gpus"]["disk_only"]) == {str(n) for n in SIZES}


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "64"], "gpus (64) is smaller than one data-parallel replica"),
    (["--days", "0"], "days must be > 0"),
    (["--inputs", "/nonexistent/results.jsonl"], "cannot read --inputs"),
])
def test_cli_exits_2_with_the_message_and_no_traceback_on_bad_input(capsys, argv, message):
    assert gs.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_exits_2_when_a_measured_bandwidth_is_zero(capsys, tmp_path):
    results = tmp_path / "bad.jsonl"
    results.write_text(json.dumps({"bench": "ckpt_io", "metric": "s3_ckpt_throughput",
                                   "ours": 0.0}) + "\n")
    assert gs.main(["--inputs", str(results)]) == 2
    assert "storage_rank_Bps must be > 0" in capsys.readouterr().err
