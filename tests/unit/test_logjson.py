"""Control-plane log records as JSON lines."""

from __future__ import annotations

import json
import logging

from kuangchao.platform.observability.logjson import JsonFormatter, use_json_logs


def _record(msg: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("kuangchao.platform.scheduling.scheduler", logging.WARNING, __file__, 1, msg,
                            (), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_a_record_carries_job_rank_module_and_its_extras():
    line = JsonFormatter("controller", job_id="j1").format(
        _record("rank 3 died", rank=3, node="n0", took=object()))
    out = json.loads(line)
    assert out["module"] == "controller" and out["job_id"] == "j1" and out["rank"] == 3
    assert out["level"] == "WARNING" and out["node"] == "n0" and out["took"].startswith("<object")
    assert "\n" not in line


def test_a_record_names_its_own_job_over_the_process_default():
    out = json.loads(JsonFormatter("scheduler").format(_record("admitted", job_id="j9")))
    assert out["job_id"] == "j9" and out["rank"] is None


def test_installing_twice_keeps_one_handler():
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        use_json_logs("api")
        use_json_logs("api")
        assert sum(isinstance(h.formatter, JsonFormatter) for h in root.handlers) == 1
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
