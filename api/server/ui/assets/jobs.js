// #/jobs: the jobs the caller's tenant may see, filtered by state and queue.

import {get} from "./api.js";
import {STATES, announce, fmtNum, fmtTime, h, stateBadge} from "./dom.js";

// Filters outlive a visit to a job's page and back.
const filters = {state: "", queue: ""};

function select(id, label, options, value, onChange) {
  const el = h("select", {id, name: id},
    [h("option", {value: "", text: "All"}), ...options.map((o) => h("option", {value: o, text: o}))]);
  el.value = value;
  el.addEventListener("change", () => onChange(el.value));
  return [h("label", {for: id, text: label}), el];
}

export function mount(main, ctx) {
  const heading = h("h1", {text: "Jobs"});
  const queueBox = h("span", {class: "filter"});
  const stateBox = h("span", {class: "filter"}, select("filter-state", "State", STATES, filters.state,
    (v) => { filters.state = v; draw(); }));
  const count = h("p", {class: "muted", id: "jobs-count"});
  const tbody = h("tbody");
  const tableEl = h("table", {class: "jobs", "aria-describedby": "jobs-count"}, [
    h("caption", {class: "visually-hidden", text: "Jobs, newest first"}),
    h("thead", {}, h("tr", {}, ["Job", "Name", "State", "Queue", "Tenant", "Step", "Loss", "Created"]
      .map((t) => h("th", {scope: "col", text: t})))),
    tbody,
  ]);
  main.append(heading,
    h("div", {class: "toolbar", role: "group", "aria-label": "Filters"}, [stateBox, queueBox]),
    count, tableEl);
  if (ctx.can("job.submit")) main.append(h("p", {}, h("a", {href: "#/submit", text: "Submit a job"})));

  let all = [];
  let queues = [];
  let lastSummary = "";
  const rows = new Map();  // job id -> <tr>, reused so focus on a link survives a refresh

  function row(job) {
    let tr = rows.get(job.id);
    if (!tr) {
      tr = h("tr", {"data-job": job.id});
      for (let i = 0; i < 8; i += 1) tr.append(h("td"));
      tr.cells[0].append(h("a", {href: `#/jobs/${encodeURIComponent(job.id)}`, text: job.id}));
      rows.set(job.id, tr);
    }
    const p = job.progress || {};
    const cells = [null, job.name, null, job.queue, job.tenant,
      `${p.step ?? 0}/${p.total_steps ?? "?"}`, fmtNum(p.loss, 4), fmtTime(job.created_at)];
    cells.forEach((text, i) => {
      if (text !== null && tr.cells[i].textContent !== text) tr.cells[i].textContent = text;
    });
    if (tr.dataset.state !== job.state) {
      tr.dataset.state = job.state;
      tr.cells[2].replaceChildren(stateBadge(job.state));
    }
    return tr;
  }

  function drawQueueFilter() {
    const names = [...new Set([...queues, ...all.map((j) => j.queue)])].sort();
    const known = [...queueBox.querySelectorAll("option")].map((o) => o.value).slice(1);
    if (known.join("\n") === names.join("\n")) return;
    const focused = document.activeElement && document.activeElement.id === "filter-queue";
    queueBox.replaceChildren(...select("filter-queue", "Queue", names, filters.queue,
      (v) => { filters.queue = v; draw(); }));
    if (focused) document.getElementById("filter-queue").focus();
  }

  function draw() {
    drawQueueFilter();
    const shown = all.filter((j) => (!filters.state || j.state === filters.state)
      && (!filters.queue || j.queue === filters.queue)).reverse();
    const trs = shown.map(row);
    const same = trs.length === tbody.rows.length && trs.every((tr, i) => tbody.rows[i] === tr);
    if (!same) tbody.replaceChildren(...trs);
    if (!shown.length) {
      tbody.replaceChildren(h("tr", {}, h("td", {colspan: 8, class: "muted",
        text: all.length ? "No job matches the filters." : "No jobs yet."})));
    }
    const running = all.filter((j) => j.state === "RUNNING").length;
    const summary = `${shown.length} of ${all.length} jobs shown; ${running} running`;
    count.textContent = summary;
    // Announce only changes, not every poll, or a screen reader would never stop talking.
    if (lastSummary && summary !== lastSummary) announce(summary);
    lastSummary = summary;
  }

  return {
    async refresh() {
      const [jobsDoc, queueDoc] = await Promise.all([get("/v1/jobs"), get("/v1/queues")]);
      all = jobsDoc.jobs;
      queues = queueDoc.queues.map((q) => q.name);
      const ids = new Set(all.map((j) => j.id));
      for (const id of rows.keys()) if (!ids.has(id)) rows.delete(id);
      draw();
    },
    dispose() {},
  };
}
