"""How `kc status` words a recovery."""

from kuangchao.api.cli.render import restart_timings


def test_restart_line_names_the_path_and_each_timing_it_has():
    line = restart_timings({"path": "in_place", "spare": True, "detected_after_s": 0.041,
                            "teardown_s": 0.08, "restore_s": 0.125})
    assert line == ("path in_place (warm spare); detected after 0.04s, teardown 0.08s, "
                    "restore 0.12s")


def test_restart_line_without_timings_yet():
    assert restart_timings({"path": "requeue"}) == "path requeue; "


def test_status_of_an_elastic_job_shows_its_size_samples_and_resizes(capsys):
    from kuangchao.api.cli.render import print_job

    print_job({"id": "e", "name": "e", "state": "RUNNING", "world_size": 2, "restarts": 1,
               "replicas": 2, "min_replicas": 1, "max_replicas": 3, "desired_replicas": None,
               "samples_seen": 480, "global_batch": 24, "progress": {"step": 20},
               "resize_log": [{"from": 3, "to": 2, "cause": "node_lost", "path": "live",
                               "resize_s": 0.41},
                              {"from": 2, "to": 3, "cause": "grow", "path": "live"}]})
    out = capsys.readouterr().out
    assert "replicas     2 (elastic 1..3)" in out
    assert "samples      480 (global batch 24)" in out
    assert "resize       3 -> 2 replicas (node_lost, live): 0.41s to the first step" in out
    assert "resize       2 -> 3 replicas (grow, live): in progress" in out


def test_status_names_each_warm_spare_and_its_state(capsys):
    from kuangchao.api.cli.render import print_job

    print_job({"id": "s", "name": "s", "state": "RUNNING", "world_size": 2, "restarts": 1,
               "progress": {"step": 3},
               "spares": [{"node": "n1", "state": "warm", "standby": False},
                          {"node": "n3", "state": "warming", "standby": True}]})
    assert "spares       n1 warm, n3 warming (standby)" in capsys.readouterr().out


def test_job_output_reaches_the_terminal_escaped_not_obeyed(capsys):
    from kuangchao.api.cli.render import print_events, print_log_lines

    hostile = "loss 1.0\x1b[2J\x1b]0;owned\x07\r\u202eexe.txt \x9b1A"
    print_log_lines([{"rank": 0, "message": hostile + "\nline two\tok"}], as_json=False)
    print_events([{"ts": 1.0, "type": "note", "message": hostile}])
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\u202e\x9b")
    assert "\\x1b[2J\\x1b]0;owned\\x07\\r\\u202eexe.txt \\x9b1A" in out
    assert "\nline two\tok" in out  # newlines and tabs are text
    print_log_lines([{"rank": 0, "message": hostile}], as_json=True)
    assert "\\u001b[2J" in capsys.readouterr().out  # JSON escapes them itself


def test_status_line_of_goodput_names_the_ratio_and_the_largest_losses_first():
    from kuangchao.api.cli.render import goodput_line

    g = {"ettr": 0.871, "wall_s": 4320.0, "by_cause": {"startup": 40.0, "recovery": 310.0,
                                                        "redone": 120.0, "other": 0.1}}
    assert goodput_line(g) == "ETTR 87.1% of 1.2h: lost recovery 310s, redone 120s, startup 40s"
    assert goodput_line({"ettr": None, "wall_s": None, "reason": "could not"}) == "- (could not)"
