// The loss curve: an SVG line through one circle per logged step. Each circle
// carries data-step (the integration test counts them) and a <title> that
// browsers show as a tooltip. Steps where the trainer evaluated the held-out
// split (points with eval_loss, every training.eval_interval steps) draw a
// second, dashed series on the same scale, with square markers carrying
// data-eval-step (not data-step: the training curve's count stays its own).
// A legend under the chart names the two.

import {fmtNum, h, s} from "./dom.js";

const W = 640;
const H = 240;
const M = {left: 56, right: 16, top: 12, bottom: 32};

const finite = (v) => typeof v === "number" && Number.isFinite(v);

// A short sample of a series' line and marker, for the legend.
function sample(cls) {
  return s("svg", {class: `chart-key ${cls}`, viewBox: "0 0 28 12", width: 28, height: 12,
    "aria-hidden": "true", focusable: "false"}, [
    s("line", {class: "line", x1: 1, y1: 6, x2: 27, y2: 6}),
    cls === "eval" ? s("rect", {x: 11, y: 3, width: 6, height: 6}) : s("circle", {cx: 14, cy: 6, r: 3}),
  ]);
}

export function lossChart(label = "Loss curve") {
  const svg = s("svg", {class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label,
    preserveAspectRatio: "xMidYMid meet"});
  const empty = h("p", {class: "muted", text: "No loss reported yet."});
  const trainKey = h("li", {}, [sample("train"), "Training loss (global mean per logged step)"]);
  const evalKey = h("li", {}, [sample("eval"), "Eval loss (held-out split, per evaluation)"]);
  const legend = h("ul", {class: "legend chart-legend", "aria-label": "Loss curve legend", hidden: true},
    [trainKey, evalKey]);
  const figure = h("figure", {class: "chart-box"}, [svg, legend, empty]);
  let drawn = null;

  function update(points) {
    // Only points with a finite loss can be placed; the rest (a step that
    // logged only throughput) stay out of the curve.
    const pts = points.filter((p) => finite(p.loss));
    const evs = points.filter((p) => finite(p.eval_loss));
    // Redraw only when something changed: a rolled-back step is replaced in
    // place, so the count alone would miss it.
    const sig = pts.map((p) => `${p.step}:${p.loss}`).join(",") + "|"
      + evs.map((p) => `${p.step}:${p.eval_loss}`).join(",");
    if (sig === drawn) return;
    drawn = sig;
    const any = pts.length > 0 || evs.length > 0;
    empty.hidden = any;
    legend.hidden = !any;
    trainKey.hidden = !pts.length;
    evalKey.hidden = !evs.length;
    svg.replaceChildren();
    if (!any) return;
    const steps = [...pts, ...evs].map((p) => p.step);
    const losses = [...pts.map((p) => p.loss), ...evs.map((p) => p.eval_loss)];
    const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
    let [y0, y1] = [Math.min(...losses), Math.max(...losses)];
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }  // a flat curve still needs a scale
    const sx = (v) => M.left + (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)) * (W - M.left - M.right);
    const sy = (v) => M.top + (1 - (v - y0) / (y1 - y0)) * (H - M.top - M.bottom);
    const bottom = H - M.bottom;
    const line = (cls, series, key) => s("polyline", {class: cls,
      points: series.map((p) => `${sx(p.step).toFixed(1)},${sy(p[key]).toFixed(1)}`).join(" ")});
    svg.append(
      s("line", {class: "axis", x1: M.left, y1: M.top, x2: M.left, y2: bottom}),
      s("line", {class: "axis", x1: M.left, y1: bottom, x2: W - M.right, y2: bottom}),
      s("text", {class: "tick", x: M.left - 6, y: sy(y1) + 4, "text-anchor": "end", text: fmtNum(y1, 4)}),
      s("text", {class: "tick", x: M.left - 6, y: sy(y0) + 4, "text-anchor": "end", text: fmtNum(y0, 4)}),
      s("text", {class: "tick", x: sx(x0), y: bottom + 18, "text-anchor": "start", text: `step ${x0}`}),
      s("text", {class: "tick", x: sx(x1), y: bottom + 18, "text-anchor": "end", text: `step ${x1}`}),
    );
    if (pts.length) svg.append(line("line", pts, "loss"));
    if (evs.length) svg.append(line("line eval", evs, "eval_loss"));
    const dots = s("g", {class: "points"});
    for (const p of pts) {
      dots.append(s("circle", {cx: sx(p.step).toFixed(1), cy: sy(p.loss).toFixed(1), r: 3,
        "data-step": p.step}, s("title", {text: `step ${p.step}: loss ${fmtNum(p.loss, 5)}`})));
    }
    const marks = s("g", {class: "points eval"});
    for (const p of evs) {
      marks.append(s("rect", {x: (sx(p.step) - 3.5).toFixed(1), y: (sy(p.eval_loss) - 3.5).toFixed(1),
        width: 7, height: 7, "data-eval-step": p.step},
      s("title", {text: `step ${p.step}: eval loss ${fmtNum(p.eval_loss, 5)}`})));
    }
    svg.append(dots, marks);
    const parts = [];
    if (pts.length) {
      const last = pts[pts.length - 1];
      parts.push(`${pts.length} logged steps from step ${pts[0].step} to ${last.step}; `
        + `loss ${fmtNum(pts[0].loss, 4)} at first, ${fmtNum(last.loss, 4)} at step ${last.step}`);
    }
    if (evs.length) {
      const last = evs[evs.length - 1];
      parts.push(`${evs.length} evaluations; eval loss ${fmtNum(evs[0].eval_loss, 4)} at step `
        + `${evs[0].step}, ${fmtNum(last.eval_loss, 4)} at step ${last.step}`);
    }
    svg.setAttribute("aria-label", `${label}: ${parts.join("; ")}`);
  }

  return {el: figure, update};
}
