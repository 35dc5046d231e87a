"""What the console reads, on the real Redis: the loss curve's points, and the
cluster map's per-GPU holders with other tenants' jobs hidden."""

from __future__ import annotations

import dataclasses

import pytest

from kuangchao.platform.control.operations import node_view
from kuangchao.platform.jobs.state import JobRecord, JobState, PlacedRank
from kuangchao.workers.runtime.heartbeat import Heartbeat

pytestmark = pytest.mark.integration


def test_every_logged_step_keeps_its_point_though_progress_merges(store):
    hb = Heartbeat(store.r, store.p, "jm", 0, "node-0")
    hb.carry()
    for step in (1, 10, 20):  # three reports before one beat: progress keeps the newest only
        hb.publish({"step": step, "loss": 5.0 - step / 10}, {"step": step, "loss": 5.0 - step / 10})
    hb.publish({"step": 21})  # an unlogged step adds no point
    hb.beat_once()
    hb.publish({"step": 30, "loss": 1.5}, {"step": 30, "loss": 1.5})
    hb.flush()
    assert store.progress("jm")["step"] == 30
    points = store.metrics("jm")
    assert [p["step"] for p in points] == [1, 10, 20, 30]
    assert points[2]["loss"] == pytest.approx(3.0)
    assert [p["step"] for p in store.metrics("jm", 3)] == [30]


def test_the_store_path_appends_points_too(store):
    store.add_metrics("js", [{"step": 1, "loss": 2.0}])
    store.add_metrics("js", [{"step": 2, "loss": 1.0}])
    assert [p["loss"] for p in store.metrics("js")] == [2.0, 1.0]


def test_node_view_names_rank_and_job_per_gpu_and_hides_other_tenants(store):
    store.set_info("nodes", {"nodes": [{"name": "n0", "gpus": 4, "leaf": "l0",
                                        "nvlink": [[0, 1], [2, 3]], "alive": True}]})
    mine = JobRecord(id="mine", name="m", spec={}, tenant="a", state=JobState.RUNNING,
                     placement=(PlacedRank(0, "n0", "x", "l0", gpu=0, gpus=(0,)),
                                PlacedRank(1, "n0", "x", "l0", gpu=1, gpus=(1,))))
    theirs = dataclasses.replace(mine, id="theirs", tenant="b",
                                 placement=(PlacedRank(0, "n0", "x", "l0", gpu=3, gpus=(3,)),))
    store.create(mine)
    store.create(theirs)
    view = node_view(store, lambda tenant: tenant == "a")["nodes"][0]
    assert view["jobs"] == ["mine"] and view["used_gpus"] == [0, 1, 3]
    by_gpu = {g["gpu"]: g for g in view["gpu_map"]}
    assert (by_gpu[1]["job"], by_gpu[1]["rank"], by_gpu[1]["hidden"]) == ("mine", 1, False)
    assert (by_gpu[2]["job"], by_gpu[2]["hidden"]) == (None, False)
    assert by_gpu[3] == {"gpu": 3, "job": None, "rank": None, "hidden": True}
    everyone = node_view(store)["nodes"][0]
    assert everyone["jobs"] == ["mine", "theirs"] and everyone["gpu_map"][3]["job"] == "theirs"
