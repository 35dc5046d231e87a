"""The console's loss chart (api/server/ui/assets/chart.js) on a stand-in DOM, under node.

The browser test (tests/integration/test_console.py) counts the training curve's
`[data-step]` markers; this checks, without a browser, that the eval loss is a
second series (`data-eval-step`, dashed, on the same scale) with a legend, and
that it never adds to those markers. Skipped where node is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[2] / "api" / "server" / "ui" / "assets"

# Just enough of the DOM for dom.js and chart.js: elements with attributes,
# children, textContent and the `hidden` property, and a selector by attribute.
FAKE_DOM = r"""
class Node {}
class Text extends Node { constructor(t) { super(); this.text = t; } }
class El extends Node {
  constructor(tag, ns) {
    super(); this.tag = tag; this.ns = ns; this.attrs = {}; this.kids = []; this.text = "";
  }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return this.attrs[k] ?? null; }
  append(...cs) { this.kids.push(...cs); }
  replaceChildren(...cs) { this.kids = [...cs]; }
  addEventListener() {}
  set textContent(t) { this.kids = []; this.text = t; }
  get textContent() { return this.text + this.kids.map((c) => c.textContent ?? c.text).join(""); }
  get hidden() { return "hidden" in this.attrs; }
  set hidden(v) { if (v) this.attrs.hidden = ""; else delete this.attrs.hidden; }
  all(pred) { const out = []; for (const c of this.kids) if (c instanceof El) {
    if (pred(c)) out.push(c); out.push(...c.all(pred)); } return out; }
}
globalThis.Node = Node;
globalThis.document = {createElement: (t) => new El(t, "html"),
  createElementNS: (ns, t) => new El(t, ns), createTextNode: (t) => new Text(t)};
"""

SCRIPT = r"""
import "./fake_dom.js";
const {lossChart} = await import("./chart.js");
const chart = lossChart("Loss per logged step");
const [svg, legend, empty] = chart.el.kids;
const snap = () => ({
  steps: svg.all((e) => "data-step" in e.attrs).map((e) => +e.attrs["data-step"]),
  evalSteps: svg.all((e) => "data-eval-step" in e.attrs).map((e) => +e.attrs["data-eval-step"]),
  lines: svg.all((e) => e.tag === "polyline").map((e) => e.attrs.class),
  evalTitles: svg.all((e) => "data-eval-step" in e.attrs).map((e) => e.kids[0].textContent),
  label: svg.attrs["aria-label"],
  legendHidden: legend.hidden, emptyHidden: empty.hidden,
  keys: legend.kids.filter((k) => !k.hidden).map((k) => k.textContent),
});
const out = [];
chart.update([]);
out.push(snap());
chart.update([{step: 1, loss: 3}, {step: 2, loss: 2.5}]);
out.push(snap());
chart.update([{step: 1, loss: 3, eval_loss: null}, {step: 2, loss: 2.5, eval_loss: 2.75},
              {step: 3, loss: 2.25}, {step: 4, loss: null, eval_loss: 2.5}]);
out.push(snap());
console.log(JSON.stringify(out));
"""


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> list[dict]:
    node = shutil.which("node")
    assert node is not None, "the console's chart test runs chart.js under Node.js: install nodejs"
    work = tmp_path_factory.mktemp("chart")
    for name in ("chart.js", "dom.js"):
        shutil.copy(ASSETS / name, work / name)
    (work / "package.json").write_text('{"type": "module"}')
    (work / "fake_dom.js").write_text(FAKE_DOM)
    (work / "run.js").write_text(SCRIPT)
    out = subprocess.run([node, "run.js"], cwd=work, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_empty_chart_says_so_and_hides_the_legend(snapshots):
    first = snapshots[0]
    assert first["steps"] == [] and first["legendHidden"] and not first["emptyHidden"]


def test_without_evaluations_only_the_training_curve_and_its_key_show(snapshots):
    train = snapshots[1]
    assert train["steps"] == [1, 2] and train["evalSteps"] == [] and train["lines"] == ["line"]
    assert not train["legendHidden"] and train["emptyHidden"]
    assert [k.startswith("Training loss") for k in train["keys"]] == [True]


def test_evaluated_steps_draw_a_second_series_with_a_legend(snapshots):
    both = snapshots[2]
    assert both["steps"] == [1, 2, 3]  # the training markers the browser test counts
    assert both["evalSteps"] == [2, 4] and both["lines"] == ["line", "line eval"]
    assert both["evalTitles"] == ["step 2: eval loss 2.75", "step 4: eval loss 2.5"]
    assert [k.split(" (")[0] for k in both["keys"]] == ["Training loss", "Eval loss"]
    assert "2 evaluations; eval loss 2.75 at step 2, 2.5 at step 4" in both["label"]
