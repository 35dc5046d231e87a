"""Slow links (stragglers): the verdict, the trigger, the event, and what `kc debug comm`
makes of a probe (workers/trainer/links.py, platform/jobs/debugreq.py, api/cli/debug.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kuangchao.api.cli import debug as cli_debug
from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.debugreq import comm_report, slow_links
from kuangchao.platform.observability import metrics as m
from kuangchao.workers.runtime.telemetry import WorkerTelemetry
from kuangchao.workers.trainer import links
from kuangchao.workers.trainer.links import CommTrigger, LinkWatch, slow_nodes, straggler_event

# -- the verdict -------------------------------------------------------------------------


def test_two_nodes_one_under_half_the_other_is_slow():
    assert slow_nodes({"node-1": 1.9, "node-2": 0.05}) == ["node-2"]
    assert slow_nodes({"node-1": 1.9, "node-2": 1.0}) == []  # over half: not slow


def test_four_nodes_name_every_slow_one_against_the_best():
    rates = {"a": 2.0, "b": 0.9, "c": 1.8, "d": 0.3}
    assert slow_nodes(rates) == ["b", "d"]
    assert slow_nodes(rates, ratio=0.1) == []


def test_equal_rates_name_none():
    assert slow_nodes({"a": 1.5, "b": 1.5, "c": 1.5, "d": 1.5}) == []


def test_a_node_without_a_rate_is_not_judged_and_one_rate_judges_nothing():
    assert slow_nodes({"a": 2.0, "b": None, "c": 0.1}) == ["c"]
    assert slow_nodes({"a": 2.0, "b": None}) == []
    assert slow_nodes({"a": 0.01}) == [] and slow_nodes({}) == []


# -- the trigger ---------------------------------------------------------------------------


def _fed(trigger: CommTrigger, *comm: float) -> CommTrigger:
    for c in comm:
        trigger.observe(c, c / 0.2)
    return trigger


def test_the_baseline_is_the_median_of_the_first_steps():
    t = _fed(CommTrigger(), *[0.01] * 9, 5.0)  # one slow warm-up step does not move it
    assert t.baseline == pytest.approx(0.01) and t.baseline_share == pytest.approx(0.05)
    assert t.current() is None and not t.due(1000.0)  # no recent steps yet


def test_a_rise_over_three_times_the_baseline_and_the_floor_makes_it_due():
    t = _fed(CommTrigger(), *[0.02] * 10)
    _fed(t, 0.02, 0.02, 0.02, 0.02)
    assert not t.due(0.0)  # four recent steps: not enough
    _fed(t, 0.07)
    assert not t.due(0.0)  # the median of the last five is still 0.02
    _fed(t, 0.07, 0.07)
    assert t.current() == (pytest.approx(0.07), pytest.approx(0.35)) and t.due(0.0)


def test_a_rise_under_the_floor_or_under_three_times_is_not_due():
    tiny = _fed(CommTrigger(), *[0.001] * 10, *[0.04] * 5)  # 40x, but 40 ms
    assert not tiny.due(0.0)
    mild = _fed(CommTrigger(), *[0.1] * 10, *[0.29] * 5)  # 2.9x
    assert not mild.due(0.0)
    _fed(mild, *[0.31] * 5)
    assert mild.due(0.0)


def test_at_most_one_probe_a_minute():
    t = _fed(CommTrigger(), *[0.02] * 10, *[0.5] * 5)
    assert t.due(100.0)
    t.probed(100.0)
    assert not t.due(159.0) and t.due(160.0)
    seeded = _fed(CommTrigger(last_probe=100.0), *[0.02] * 10, *[0.5] * 5)
    assert not seeded.due(130.0)  # a probe of the previous generation counts


# -- the watch in the loop: checks every CHECK_EVERY steps, on every rank --------------------


class _Ctx(SimpleNamespace):
    def any_rank(self, flag: bool, what: str) -> bool:
        self.asked.append(flag)
        return flag or self.peer_says


def _ctx(world: int = 2, peer_says: bool = False) -> _Ctx:
    tel = WorkerTelemetry("j", 0, "node-1")
    return _Ctx(world_size=world, telemetry=tel, asked=[], peer_says=peer_says,
                spec=SimpleNamespace(training=SimpleNamespace(steps=1000)))


def _step(ctx: _Ctx, watch: LinkWatch, done: int, comm: float) -> None:
    ctx.telemetry.values[m.WORKER_COMM_SECONDS.name] = comm
    ctx.telemetry.values[m.WORKER_COMM_SHARE.name] = comm / 0.2
    watch.after_step(done)


def test_the_watch_probes_once_at_the_baseline_then_asks_every_ten_steps(monkeypatch):
    probes = []
    monkeypatch.setattr(links, "probe", lambda ctx, trigger: probes.append(trigger) or {
        "rates": {"node-1": 1.0, "node-2": 1.0}})
    ctx = _ctx()
    watch = LinkWatch(ctx)
    for done in range(1, 21):
        _step(ctx, watch, done, 0.02)
    # Step 10: the baseline is in, every rank probes without a vote; step 20: nothing due.
    assert len(probes) == 1 and ctx.asked == [False]
    for done in range(21, 31):
        _step(ctx, watch, done, 0.5)
    # The first probe did not start the minute between probes: the rise is probed at once.
    assert ctx.asked[-1] is True and len(probes) == 2
    for done in range(31, 41):
        _step(ctx, watch, done, 0.5)
    assert ctx.asked[-1] is False and len(probes) == 2  # within the minute
    # A peer that is due takes this rank along, whatever its own trigger says.
    other = _ctx(peer_says=True)
    other_watch = LinkWatch(other)
    for done in range(1, 21):
        _step(other, other_watch, done, 0.0)
    assert other.asked == [False] and len(probes) == 4


def test_a_restart_mid_run_probes_once_its_own_baseline_is_in(monkeypatch):
    probes = []
    monkeypatch.setattr(links, "probe", lambda ctx, trigger: probes.append(trigger) or {
        "rates": {"node-1": 1.0, "node-2": 1.0}})
    ctx = _ctx()
    watch = LinkWatch(ctx)  # resumed at step 105: its 10th step is 114, the check at 120
    for done in range(106, 120):
        _step(ctx, watch, done, 0.02)
    assert probes == [] and ctx.asked == [False]  # step 110: only five steps in
    _step(ctx, watch, 120, 0.02)
    assert len(probes) == 1 and ctx.asked == [False]


def test_one_rank_never_checks_and_one_node_stops_checking(monkeypatch):
    ctx = _ctx(world=1)
    watch = LinkWatch(ctx)
    for done in range(1, 31):
        _step(ctx, watch, done, 0.5)
    assert ctx.asked == []
    probes = []
    monkeypatch.setattr(links, "probe", lambda ctx, trigger: probes.append(1) or {
        "rates": {"node-1": 1.0}})
    ctx = _ctx(peer_says=True)
    watch = LinkWatch(ctx)
    for done in range(1, 31):
        _step(ctx, watch, done, 0.0)
    # The first probe found one node: nothing to compare, ever.
    assert probes == [1] and ctx.asked == []


# -- the event -----------------------------------------------------------------------------


def test_the_straggler_event_names_the_node_and_what_was_measured():
    result = {"at": 12.0, "rates": {"node-1": 0.45, "node-3": 0.05}, "best_gbps": 0.45,
              "slow": ["node-3"]}
    event = straggler_event("node-3", result, (0.12, 0.8))
    assert event == {
        "ts": 12.0, "type": "straggler", "node": "node-3", "gbps": 0.05, "best_gbps": 0.45,
        "comm_share": 0.8, "comm_share_before": 0.12,
        "message": "node node-3's link measured 0.05 Gbit/s to the control plane, against 0.45 "
                   "for the best node; the job's communication share rose from 12% to 80%: "
                   "a slow link (straggler)"}
    bare = straggler_event("node-3", result, (None, None))
    assert "share" not in bare["message"] and bare["comm_share"] is None
    assert "comm_share_before" not in bare


def test_the_probe_key_is_in_the_jobs_own_key_space():
    key = keys.link_probe("kc:", "j-1", "node-3")
    assert key == "kc:job:j-1:linkprobe:node-3" and key.startswith(keys.job_prefix("kc:", "j-1"))


# -- kc debug comm -------------------------------------------------------------------------

PROBE = {"at": 1000.0, "rates": {"node-1": 1.9, "node-2": 1.8, "node-3": 0.05},
         "best_gbps": 1.9, "slow": ["node-3"]}


def _answer(rank: int, node: str, links_: dict | None) -> dict:
    return {"rank": rank, "node": node, "collectives_done": 40, "pending": None, "last": None,
            "links": links_,
            "groups": [{"name": "world", "backend": "gloo", "rank": rank, "size": 2,
                        "ranks": [0, 1], "generation": 0}]}


def test_the_comm_report_names_the_slow_links_of_the_newest_probe_and_stays_healthy():
    older = {**PROBE, "at": 900.0, "slow": ["node-2"]}
    report = comm_report({0: _answer(0, "node-1", PROBE), 1: _answer(1, "node-3", older)})
    assert report["healthy"] and report["problems"] == []
    assert report["slow_links"] == [{"node": "node-3", "gbps": 0.05, "best_gbps": 1.9,
                                     "at": 1000.0}]
    assert comm_report({0: _answer(0, "node-1", None)})["slow_links"] == []


def test_slow_links_leave_out_what_is_not_a_probe():
    junk = {0: {"links": "x"}, 1: {"links": {"at": "soon", "rates": [], "slow": [3, "n"]}}, 2: 5}
    assert slow_links(junk) == [{"node": "n", "gbps": None, "best_gbps": None, "at": None}]


def test_comm_lines_print_a_slow_link():
    report = {"ranks": {"0": _answer(0, "node-1", PROBE)}, "problems": [], "healthy": True,
              "slow_links": [{"node": "node-3", "gbps": 0.05, "best_gbps": 1.9, "at": 1000.0}]}
    lines = cli_debug.comm_lines(report, now=1042.0)
    assert lines[-2] == "no inconsistency between the ranks' groups"
    assert lines[-1] == "slow link: node-3 (0.05 Gbit/s; best 1.9, measured 42s ago)"
    # From a server without the summary: the ranks' own view of the probe.
    del report["slow_links"]
    assert cli_debug.comm_lines(report, now=1042.0)[-1].startswith("slow link: node-3 (0.05")
    report["ranks"]["0"]["links"] = None
    assert not any(line.startswith("slow link") for line in cli_debug.comm_lines(report))


def test_kc_debug_comm_names_the_slow_node_in_text_and_json(monkeypatch):
    answers = {0: _answer(0, "node-1", PROBE), 1: _answer(1, "node-3", PROBE)}
    body = {"job": "j", "kind": "comm", "request": "r", "missing": [], **comm_report(answers)}
    # What the CLI gets back is JSON: rank keys are strings.
    body = json.loads(json.dumps(body))
    monkeypatch.setattr(cli_debug, "client", lambda: SimpleNamespace(debug=lambda *a: body))
    runner = CliRunner()
    text = runner.invoke(cli_debug.debug_app, ["comm", "j"])
    assert text.exit_code == 0, text.output
    assert "slow link: node-3 (0.05 Gbit/s; best 1.9" in text.output
    as_json = runner.invoke(cli_debug.debug_app, ["comm", "j", "--json"])
    assert as_json.exit_code == 0, as_json.output
    out = json.loads(as_json.output)
    assert out["slow_links"][0]["node"] == "node-3"
    assert out["ranks"]["1"]["links"]["rates"]["node-3"] == 0.05


def _probe_with_rounds(monkeypatch, *rounds):
    """`links.probe` on one rank whose rounds of measurement give `rounds`, in order."""
    given = iter(rounds)
    monkeypatch.setattr(links, "_round", lambda ctx, leaders, payload: dict(next(given)))
    ctx = SimpleNamespace(world_size=1, rank=0, node="a", telemetry=None, is_chief=False)
    return links.probe(ctx)


def test_a_node_slow_in_one_round_only_is_measured_again_and_not_named(monkeypatch):
    result = _probe_with_rounds(monkeypatch, {"a": 2.0, "b": 0.3}, {"a": 1.9, "b": 1.8})
    assert result["slow"] == [] and result["rates"] == {"a": 2.0, "b": 1.8}


def test_a_node_slow_in_both_rounds_is_named(monkeypatch):
    result = _probe_with_rounds(monkeypatch, {"a": 2.0, "b": 0.3}, {"a": 1.0, "b": 0.05})
    assert result["slow"] == ["b"] and result["rates"] == {"a": 2.0, "b": 0.3}


def test_no_second_round_when_nobody_seems_slow(monkeypatch):
    result = _probe_with_rounds(monkeypatch, {"a": 2.0, "b": 1.5})  # a second would raise
    assert result["slow"] == [] and result["best_gbps"] == 2.0
