"""The console's goodput blocks (api/server/ui/assets/goodput.js) on a stand-in DOM,
under node: the job page's ETTR line and split, a job whose split is unknown, and
the cluster page's time-weighted sums."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.process.test_console_chart import ASSETS, FAKE_DOM

SPLIT = {"wall_s": 200.0, "ettr": 0.75, "productive_s": 150.0, "lost_s": 50.0,
         "by_cause": {"startup": 10.0, "checkpoint": 5.0, "detection": 2.0, "recovery": 13.0,
                      "redone": 20.0, "queueing": 0.0, "preemption": 0.0, "other": 0.0},
         "since": 1.0, "as_of": 201.0, "live": True, "open_cause": "productive", "reason": None}
UNKNOWN = {**SPLIT, "wall_s": None, "ettr": None, "productive_s": None,
           "reason": "the job's records could not be split by cause (see the API log)"}
CLUSTER = {"all": {"jobs": 2, "wall_s": 400.0, "productive_s": 300.0, "ettr": 0.75,
                   "by_cause": SPLIT["by_cause"]},
           "active": {"jobs": 1, "wall_s": 200.0, "productive_s": 150.0, "ettr": 0.75,
                      "by_cause": SPLIT["by_cause"]},
           "finished": {"jobs": 1, "wall_s": 200.0, "productive_s": 150.0, "ettr": 0.75,
                        "by_cause": SPLIT["by_cause"]}, "jobs": []}

SCRIPT = r"""
import "./fake_dom.js";
// The stand-in DOM has no style object; the bar sets widths through it (CSSOM).
Object.defineProperty(Object.getPrototypeOf(document.createElement("div")), "style",
  {get() { return this._style ??= {}; }});
const {goodputBlock, clusterBlock} = await import("./goodput.js");
const [split, unknown, cluster] = JSON.parse(process.argv[2]);
const texts = (nodes) => nodes.map((n) => n.textContent);
const rows = (nodes) => nodes.flatMap((n) => n.all((e) => e.tag === "tr"))
  .map((tr) => tr.all((e) => e.tag === "td").map((td) => td.textContent)).filter((r) => r.length);
const widths = (nodes) => nodes.flatMap((n) => n.all((e) => /^gp-/.test(e.attrs.class || "")))
  .map((e) => [e.attrs.class, e.style.width]);
const job = goodputBlock(split);
const none = goodputBlock(unknown);
const all = clusterBlock(cluster);
console.log(JSON.stringify({job: texts(job), rows: rows(job), widths: widths(job),
  none: texts(none), cluster: texts(all)}));
"""


@pytest.fixture(scope="module")
def shown(tmp_path_factory) -> dict:
    node = shutil.which("node")
    assert node is not None, "the console's goodput test runs goodput.js under Node.js: " \
                             "install nodejs"
    work = tmp_path_factory.mktemp("goodput")
    for name in ("goodput.js", "dom.js"):
        shutil.copy(ASSETS / name, work / name)
    (work / "package.json").write_text('{"type": "module"}')
    (work / "fake_dom.js").write_text(FAKE_DOM)
    (work / "run.js").write_text(SCRIPT)
    out = subprocess.run([node, "run.js", json.dumps([SPLIT, UNKNOWN, CLUSTER])], cwd=work,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_job_block_leads_with_the_ettr_of_the_time_so_far(shown):
    assert shown["job"][0] == "ETTR 75.0% of 3.33 min so far"


def test_the_job_block_lists_productive_then_every_cause_with_its_share(shown):
    assert shown["rows"][0] == ["productive", "2.5 min", "75.0%"]
    assert ["redone", "20 s", "10.0%"] in shown["rows"]
    assert [r[0] for r in shown["rows"]][1:] == ["startup", "checkpoint", "detection", "recovery",
                                                 "redone", "queueing", "preemption", "other"]
    # The bar draws only the parts that took time, each at its share of the wall time.
    assert shown["widths"][0] == ["gp-productive", "75%"]
    assert ["gp-queueing", "0%"] not in shown["widths"]


def test_a_split_that_could_not_be_made_says_why(shown):
    assert shown["none"] == ["ETTR not known",
                             "the job's records could not be split by cause (see the API log)"]


def test_the_cluster_block_weights_by_wall_clock_time(shown):
    assert shown["cluster"][0] == "All: ETTR 75.0% over 2 job(s), 6.67 min of wall-clock time"
    assert "Weighted by each job's wall-clock time." in shown["cluster"][1]
