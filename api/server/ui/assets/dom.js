// DOM helpers. Every piece of data reaches the page through textContent or
// setAttribute, never innerHTML: job names, log lines and error messages are
// user input.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") el.textContent = String(v);
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of [].concat(children ?? [])) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** An HTML element: h("a", {href: "#/jobs", text: name}). */
export function h(tag, attrs, children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element (same attribute rules as h). */
export function s(tag, attrs, children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Announce a short status to screen readers (the polite live region). */
export function announce(message) {
  const el = document.getElementById("status");
  // Clearing first makes a repeated message be read again.
  el.textContent = "";
  window.setTimeout(() => { el.textContent = message; }, 50);
}

export function fmtTime(ts) {
  if (typeof ts !== "number") return "-";
  const d = new Date(ts * 1000);
  return d.toLocaleString(undefined, {hour12: false});
}

export function fmtNum(v, digits = 3) {
  if (typeof v !== "number" || !Number.isFinite(v)) return "-";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
  return Number(v.toPrecision(digits)).toString();
}

export function fmtBytes(n) {
  if (typeof n !== "number") return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${fmtNum(n)} ${units[i]}`;
}

export const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
export const STATES = ["QUEUED", "PLACING", "RUNNING", "RECOVERING", "RESIZING",
  "SUCCEEDED", "FAILED", "CANCELLED"];

/** A state badge: the state's name as text, its colour from a class. */
export function stateBadge(state) {
  return h("span", {class: `badge st-${String(state).toLowerCase()}`, text: state});
}

/** A definition list from [label, value-or-node] pairs; empty values are skipped. */
export function dl(rows) {
  const out = h("dl", {class: "facts"});
  for (const [k, v] of rows) {
    if (v === null || v === undefined || v === "") continue;
    out.append(h("dt", {text: k}), h("dd", {}, [v]));
  }
  return out;
}

/** A table with a caption, header cells and rows of strings or nodes. */
export function table(caption, headers, rows, attrs = {}) {
  return h("table", attrs, [
    h("caption", {text: caption}),
    h("thead", {}, h("tr", {}, headers.map((t) => h("th", {scope: "col", text: t})))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, [c]))))),
  ]);
}

/** The stable colour slot of a job id (CSS classes job-c0 .. job-c11). */
export function jobColour(id) {
  let hsh = 0;
  for (const ch of String(id)) hsh = (hsh * 31 + ch.charCodeAt(0)) >>> 0;
  return `job-c${hsh % 12}`;
}
