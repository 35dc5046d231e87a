// The events timeline of a job, and the recovery and resize records whose
// timings (detection, teardown, placement, restore, first step) the platform
// writes on the job itself.

import {fmtNum, fmtTime, h, table} from "./dom.js";

// Icon (decorative; the type is always written out) and colour class per event type.
const KINDS = {
  failure: ["✖", "ev-failure"],
  permission_denied: ["⊘", "ev-failure"],
  quarantine: ["⚠", "ev-warn"],
  checkpoint_skipped: ["⚠", "ev-warn"],
  preempt: ["⏏", "ev-preempt"],
  resize: ["⇅", "ev-resize"],
  resize_requested: ["⇅", "ev-resize"],
  scale: ["⇅", "ev-resize"],
  cancel: ["■", "ev-cancel"],
  waiting: ["…", "ev-info"],
  placement: ["◎", "ev-info"],
};
const STATE_KINDS = {
  RUNNING: ["▶", "ev-ok"], SUCCEEDED: ["✔", "ev-ok"], RECOVERING: ["↻", "ev-recover"],
  RESIZING: ["⇅", "ev-resize"], FAILED: ["✖", "ev-failure"], CANCELLED: ["■", "ev-cancel"],
};
const LABELS = {
  detected_after_s: "detected after", resize_s: "resized in", teardown_s: "teardown",
  placement_s: "placement", restore_s: "restore", first_step_s: "first step",
  from_world_size: "from ranks", to_world_size: "to ranks", from_replicas: "from replicas",
  to_replicas: "to replicas", last_heartbeat_at: "last heartbeat", failed_at: "failed at",
};
const HIDDEN = new Set(["ts", "type", "message", "from", "to", "node_id"]);

function fieldText(key, value) {
  const label = LABELS[key] || key.replace(/_/g, " ");
  if (key.endsWith("_at") && typeof value === "number") return `${label}: ${fmtTime(value)}`;
  if (key.endsWith("_s") && typeof value === "number") return `${label}: ${fmtNum(value)} s`;
  // Ids, ranks and steps are integers and print as they are (no "15,633" for a pid).
  return `${label}: ${typeof value === "number" && !Number.isInteger(value) ? fmtNum(value, 6) : value}`;
}

function eventItem(e) {
  const isState = e.type === "state";
  const [icon, cls] = (isState ? STATE_KINDS[e.to] : KINDS[e.type]) || ["•", "ev-info"];
  const title = isState ? `${e.from || "new"} → ${e.to}` : String(e.type);
  const fields = Object.entries(e)
    .filter(([k, v]) => !HIDDEN.has(k) && v !== null && typeof v !== "object"
      && !(k === "cause" && v === e.message))
    .map(([k, v]) => h("li", {text: fieldText(k, v)}));
  return h("li", {class: `event ${cls}`, "data-type": e.type}, [
    h("span", {class: "ev-icon", "aria-hidden": "true", text: icon}),
    h("time", {class: "ev-time", text: fmtTime(e.ts)}),
    h("span", {class: "ev-type", text: title}),
    e.message ? h("span", {class: "ev-msg", text: e.message}) : null,
    fields.length ? h("ul", {class: "ev-fields"}, fields) : null,
  ]);
}

const MAX_SHOWN = 300;

/** The timeline element and an update(events) that redraws it when it grew. */
export function timeline() {
  const list = h("ol", {class: "timeline", "aria-label": "Events, oldest first"});
  const note = h("p", {class: "muted"});
  const el = h("div", {}, [note, list]);
  let shown = 0;
  function update(events) {
    if (events.length === shown) return;
    shown = events.length;
    const tail = events.slice(-MAX_SHOWN);
    note.textContent = events.length > tail.length
      ? `Showing the newest ${tail.length} of ${events.length} events.` : "";
    list.replaceChildren(...tail.map(eventItem));
    if (!events.length) list.replaceChildren(h("li", {class: "muted", text: "No events yet."}));
  }
  return {el, update};
}

const secs = (v) => (typeof v === "number" ? `${fmtNum(v)} s` : "-");

/** Tables of the job's recoveries and resizes, or null when it had none. */
export function recoveries(job) {
  const out = [];
  const restarts = job.restart_log || [];
  if (restarts.length) {
    out.push(table("Recoveries: how each failure was detected and how long each phase took",
      ["#", "Kind", "Cause", "Path", "Detected after", "Teardown", "Placement", "Restore",
        "First step", "Resumed at step"],
      restarts.map((r, i) => [String(r.restart ?? i + 1), r.kind || "-", r.cause || "-",
        `${r.path || "-"}${r.spare ? " (warm spare)" : ""}`, secs(r.detected_after_s),
        secs(r.teardown_s), secs(r.placement_s), secs(r.restore_s), secs(r.first_step_s),
        r.resumed_step ?? "-"]), {class: "recoveries"}));
  }
  const resizes = job.resize_log || [];
  if (resizes.length) {
    out.push(table("Resizes", ["From", "To", "Cause", "Path", "Took"],
      resizes.map((r) => [`${r.from ?? "?"} replicas`, `${r.to ?? "?"} replicas`, r.cause || "-",
        r.path || "-", typeof r.resize_s === "number" ? secs(r.resize_s) : "in progress"]),
      {class: "resizes"}));
  }
  return out;
}
