"""bench/check.py: a result line says met or missed from its own fields."""

from __future__ import annotations

import json

import pytest

from bench import check


def line(**kw):
    base = {"bench": "b", "metric": "m", "unit": "s", "ours": 1.0, "baseline": 2.0, "ratio": 0.5,
            "target": 1.0, "better": "lower", "target_on": "ratio"}
    return {**base, **kw}


@pytest.mark.parametrize("fields,want", [
    ({}, "met"),                                                        # 0.5 <= 1.0
    ({"target": 0.4}, "missed"),
    ({"better": "higher", "target": 0.4}, "met"),                       # a floor: 0.5 >= 0.4
    ({"better": "higher", "target": 0.8}, "missed"),                    # submit_rps 0.08 vs 0.5
    ({"target_on": "ours", "target": 100, "ours": 116.0, "baseline": 1715.0,
      "ratio": 116 / 1715}, "missed"),                                  # an absolute goal
    ({"target_on": "ours", "target": 0, "ours": 0.0, "baseline": 3.0, "ratio": 0.0}, "met"),
    ({"target": None}, "informative"),
    ({"ours": None, "ratio": None, "error": "the run failed"}, "failed"),
    ({"baseline": None, "ratio": None, "error": "Ray Train never noticed"}, "failed"),
    ({"target_on": "state", "target": "SUCCEEDED", "state": "SUCCEEDED", "baseline": None,
      "ratio": None}, "met"),
    ({"target_on": "state", "target": "SUCCEEDED", "state": "FAILED", "baseline": None,
      "ratio": None}, "missed"),
])
def test_verdict_reads_direction_and_what_the_target_bounds(fields, want):
    assert check.verdict(line(**fields)) == want


@pytest.mark.parametrize("fields,needle", [
    ({"better": "up"}, "'better'"),
    ({"ratio": 0.9}, "not ours / baseline"),
    ({"ours": None, "ratio": None}, "without an 'error'"),
    ({"target_on": "nowhere"}, "not a field"),
    ({"target_on": "ours", "target": "fast"}, "must be a number"),
    ({"ours": float("nan")}, "finite number"),
])
def test_malformed_lines_are_named(fields, needle):
    assert any(needle in p for p in check.problems(line(**fields)))


def test_missing_fields_are_listed():
    bad = line()
    del bad["better"]
    assert check.problems(bad) == ["missing field 'better'"]
    assert check.verdict(bad) == "failed"


def test_ratio_of_zero_over_zero_is_zero_and_x_over_zero_is_null():
    assert check.ratio_of(0.0, 0.0) == 0.0
    assert check.ratio_of(3.0, 0.0) is None
    assert check.ratio_of(None, 1.0) is None


def test_the_cli_writes_the_table_and_flags_malformed_lines(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    good = line(metric="good")
    results.write_text(json.dumps(good) + "\n" + json.dumps(line(metric="bad", ratio=9.0)) + "\n")
    md = tmp_path / "r.md"
    assert check.main([str(results), "--markdown", str(md)]) == 1
    table = md.read_text()
    assert "| b | good | s | 1 | 2 | 0.5 | ratio <= 1 | met |" in table
    assert "| b | bad |" in table and "failed" in table
    assert "malformed line bad" in capsys.readouterr().err


def test_the_cli_refuses_a_missing_file_with_exit_2(tmp_path, capsys):
    assert check.main([str(tmp_path / "none.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err
