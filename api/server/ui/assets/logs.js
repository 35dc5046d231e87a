// #/jobs/ID/logs: the job's log lines from every rank, followed live with the
// API's cursor. Lines are user output: each goes in with textContent.

import {enc, get} from "./api.js";
import {h} from "./dom.js";

const MAX_LINES = 2000;  // the page keeps the newest; `kc logs` has them all

export function mount(main, ctx, {id}) {
  const rankInput = h("input", {id: "log-rank", type: "number", min: 0, inputmode: "numeric"});
  const moduleSel = h("select", {id: "log-module"}, ["", "train", "worker", "stdout", "stderr",
    "heartbeat"].map((m) => h("option", {value: m, text: m || "All"})));
  const follow = h("input", {id: "log-follow", type: "checkbox", checked: true});
  // A scrolling region: focusable, so keyboard users can scroll it too.
  const out = h("ol", {class: "logs", "aria-label": "Log lines, oldest first", tabindex: 0});
  const count = h("p", {class: "muted"});
  main.append(
    h("h1", {text: `Logs of job ${id}`}),
    h("p", {}, h("a", {href: `#/jobs/${enc(id)}`, text: "Back to the job"})),
    h("div", {class: "toolbar", role: "group", "aria-label": "Log filters"}, [
      h("label", {for: "log-rank", text: "Rank"}), rankInput,
      h("label", {for: "log-module", text: "Module"}), moduleSel,
      h("span", {}, [follow, h("label", {for: "log-follow", text: "Scroll to new lines"})]),
    ]),
    count, out);

  let lines = [];
  let next = 0;

  function matches(rec) {
    const rank = rankInput.value === "" ? null : Number(rankInput.value);
    return (rank === null || rec.rank === rank) && (!moduleSel.value || rec.module === moduleSel.value);
  }

  function line(rec) {
    const who = rec.rank !== null && rec.rank !== undefined ? `rank ${rec.rank}` : (rec.module || "");
    const ts = typeof rec.ts === "number" ? new Date(rec.ts * 1000).toLocaleTimeString(undefined,
      {hour12: false}) : "";
    return h("li", {class: `log lv-${String(rec.level || "info").toLowerCase()}`}, [
      h("span", {class: "log-ts", text: ts}), h("span", {class: "log-who", text: `[${who}]`}),
      h("span", {class: "log-msg", text: String(rec.message ?? "")}),
    ]);
  }

  function draw() {
    const shown = lines.filter(matches);
    out.replaceChildren(...shown.map(line));
    count.textContent = `${shown.length} line(s) shown`;
    // Scroll the list only; scrollIntoView would move the whole page too.
    if (follow.checked) out.scrollTop = out.scrollHeight;
  }
  rankInput.addEventListener("input", draw);
  moduleSel.addEventListener("change", draw);

  return {
    async refresh() {
      const doc = await get(`/v1/jobs/${enc(id)}/logs?start=${next}`);
      next = doc.next;
      if (!doc.logs.length && lines.length) return;
      lines = lines.concat(doc.logs).slice(-MAX_LINES);
      draw();
    },
    dispose() {},
  };
}
