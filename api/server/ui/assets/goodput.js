// Goodput: where a job's (or the cluster's) wall-clock time went. The job page
// shows its `goodput` field (GET /v1/jobs/ID); the cluster page the sums of
// GET /v1/goodput. Productive time plus the causes add up to the wall time.

import {fmtNum, h, table} from "./dom.js";

export const CAUSES = ["startup", "checkpoint", "detection", "recovery", "redone", "queueing",
  "preemption", "other"];

function fmtSpan(s) {
  if (typeof s !== "number") return "-";
  if (s >= 3600) return `${fmtNum(s / 3600, 3)} h`;
  if (s >= 60) return `${fmtNum(s / 60, 3)} min`;
  return `${fmtNum(s, 3)} s`;
}

function pct(r) {
  return typeof r === "number" ? `${(100 * r).toFixed(1)}%` : "-";
}

/** A bar of the wall time split: productive first, then each cause (its share as width). */
function bar(productive, byCause, wall) {
  const parts = [["productive", productive], ...CAUSES.map((c) => [c, byCause[c]])];
  const el = h("div", {class: "goodput-bar", "aria-hidden": "true"});
  for (const [cause, secs] of parts) {
    if (typeof secs !== "number" || secs <= 0 || !(wall > 0)) continue;
    const seg = h("span", {class: `gp-${cause}`, title: `${cause}: ${fmtSpan(secs)}`});
    seg.style.width = `${(100 * secs) / wall}%`;
    el.append(seg);
  }
  return el;
}

function causeTable(caption, productive, byCause, wall) {
  const rows = [["productive", productive], ...CAUSES.map((c) => [c, byCause[c]])];
  return table(caption, ["Where", "Time", "Share"],
    rows.map(([cause, secs]) => [cause, fmtSpan(secs),
      typeof secs === "number" && wall > 0 ? pct(secs / wall) : "-"]), {class: "goodput"});
}

/** The job page's block for `job.goodput` (absent on a listing, null numbers with a reason). */
export function goodputBlock(g) {
  if (!g) return [h("p", {class: "muted", text: "Not reported by this server."})];
  const by = g.by_cause || {};
  const head = typeof g.ettr === "number"
    ? `ETTR ${pct(g.ettr)} of ${fmtSpan(g.wall_s)}${g.live ? " so far" : ""}`
    : "ETTR not known";
  const out = [h("p", {id: "goodput-ettr", "data-ettr": g.ettr ?? "", text: head})];
  if (typeof g.wall_s === "number") {
    out.push(bar(g.productive_s, by, g.wall_s),
      causeTable("Wall-clock time by where it went", g.productive_s, by, g.wall_s));
  }
  if (g.reason) out.push(h("p", {class: "muted", text: g.reason}));
  return out;
}

/** The cluster page's block for GET /v1/goodput. */
export function clusterBlock(doc) {
  const line = (label, t) => `${label}: ETTR ${pct(t.ettr)} over ${t.jobs} job(s), `
    + `${fmtSpan(t.wall_s)} of wall-clock time`;
  return [
    h("p", {id: "cluster-ettr", "data-ettr": doc.all.ettr ?? "", text: line("All", doc.all)}),
    h("p", {class: "muted", text: `${line("Active", doc.active)}; ${line("finished", doc.finished)}.`
      + " Weighted by each job's wall-clock time."}),
    bar(doc.all.productive_s, doc.all.by_cause, doc.all.wall_s),
    causeTable("Wall-clock time of these jobs by where it went", doc.all.productive_s,
      doc.all.by_cause, doc.all.wall_s),
  ];
}
