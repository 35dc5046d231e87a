"""How `kc status` words a recovery."""

from kuangchao.api.render import restart_timings


def test_restart_line_names_the_path_and_each_timing_it_has():
    line = restart_timings({"path": "in_place", "spare": True, "detected_after_s": 0.041,
                            "teardown_s": 0.08, "restore_s": 0.125})
    assert line == ("path in_place (warm spare); detected after 0.04s, teardown 0.08s, "
                    "restore 0.12s")


def test_restart_line_without_timings_yet():
    assert restart_timings({"path": "requeue"}) == "path requeue; "
