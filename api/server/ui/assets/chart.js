// The loss curve: an SVG line through one circle per logged step. Each circle
// carries data-step (the integration test counts them) and a <title> that
// browsers show as a tooltip.

import {fmtNum, h, s} from "./dom.js";

const W = 640;
const H = 240;
const M = {left: 56, right: 16, top: 12, bottom: 32};

export function lossChart(label = "Loss curve") {
  const svg = s("svg", {class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label,
    preserveAspectRatio: "xMidYMid meet"});
  const empty = h("p", {class: "muted", text: "No loss reported yet."});
  const figure = h("figure", {class: "chart-box"}, [svg, empty]);
  let drawn = null;

  function update(points) {
    // Only points with a finite loss can be placed; the rest (a step that
    // logged only throughput) stay out of the curve.
    const pts = points.filter((p) => typeof p.loss === "number" && Number.isFinite(p.loss));
    // Redraw only when something changed: a rolled-back step is replaced in
    // place, so the count alone would miss it.
    const sig = pts.map((p) => `${p.step}:${p.loss}`).join(",");
    if (sig === drawn) return;
    drawn = sig;
    empty.hidden = pts.length > 0;
    svg.replaceChildren();
    if (!pts.length) return;
    const steps = pts.map((p) => p.step);
    const losses = pts.map((p) => p.loss);
    const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
    let [y0, y1] = [Math.min(...losses), Math.max(...losses)];
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }  // a flat curve still needs a scale
    const sx = (v) => M.left + (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)) * (W - M.left - M.right);
    const sy = (v) => M.top + (1 - (v - y0) / (y1 - y0)) * (H - M.top - M.bottom);
    const bottom = H - M.bottom;
    svg.append(
      s("line", {class: "axis", x1: M.left, y1: M.top, x2: M.left, y2: bottom}),
      s("line", {class: "axis", x1: M.left, y1: bottom, x2: W - M.right, y2: bottom}),
      s("text", {class: "tick", x: M.left - 6, y: sy(y1) + 4, "text-anchor": "end", text: fmtNum(y1, 4)}),
      s("text", {class: "tick", x: M.left - 6, y: sy(y0) + 4, "text-anchor": "end", text: fmtNum(y0, 4)}),
      s("text", {class: "tick", x: sx(x0), y: bottom + 18, "text-anchor": "start", text: `step ${x0}`}),
      s("text", {class: "tick", x: sx(x1), y: bottom + 18, "text-anchor": "end", text: `step ${x1}`}),
      s("polyline", {class: "line", points: pts.map((p) => `${sx(p.step).toFixed(1)},${sy(p.loss).toFixed(1)}`)
        .join(" ")}),
    );
    const dots = s("g", {class: "points"});
    for (const p of pts) {
      dots.append(s("circle", {cx: sx(p.step).toFixed(1), cy: sy(p.loss).toFixed(1), r: 3,
        "data-step": p.step}, s("title", {text: `step ${p.step}: loss ${fmtNum(p.loss, 5)}`})));
    }
    svg.append(dots);
    const last = pts[pts.length - 1];
    svg.setAttribute("aria-label", `${label}: ${pts.length} logged steps from step ${x0} to ${x1}; `
      + `loss ${fmtNum(pts[0].loss, 4)} at first, ${fmtNum(last.loss, 4)} at step ${last.step}`);
  }

  return {el: figure, update};
}
