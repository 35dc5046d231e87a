// #/jobs/ID: one job: state, progress, throughput, goodput, plan, loss curve,
// events, recoveries, checkpoints and placement, with Cancel for roles that may.

import {ApiError, api, enc, get} from "./api.js";
import {lossChart} from "./chart.js";
import {TERMINAL, announce, dl, fmtBytes, fmtNum, fmtTime, h, stateBadge, table} from "./dom.js";
import {recoveries, timeline} from "./events.js";
import {goodputBlock} from "./goodput.js";

function section(title, id, children = []) {
  return h("section", {"aria-labelledby": id}, [h("h2", {id, text: title}), ...children]);
}

function progressBar(step, total) {
  const known = typeof total === "number" && total > 0;
  const fill = h("div", {class: "fill"});
  // CSSOM writes are allowed by the CSP's style-src 'self'; style attributes are not.
  fill.style.width = `${known ? Math.min(100, (100 * step) / total) : 0}%`;
  return h("div", {class: "progress", role: "progressbar", "aria-label": "Training progress",
    "aria-valuemin": 0, "aria-valuemax": known ? total : null, "aria-valuenow": step,
    "aria-valuetext": known ? `step ${step} of ${total}` : `step ${step}`}, fill);
}

function scalars(obj) {
  return Object.entries(obj || {}).filter(([, v]) => v !== null && typeof v !== "object")
    .map(([k, v]) => [k.replace(/_/g, " "), typeof v === "number" ? fmtNum(v, 4) : String(v)]);
}

export function mount(main, ctx, {id}) {
  const heading = h("h1", {text: `Job ${id}`});
  const subtitle = h("p", {class: "muted", text: `id ${id}`});
  const actions = h("div", {class: "toolbar", role: "group", "aria-label": "Job actions"});
  const summary = h("div");
  const progress = h("div");
  const goodput = h("div");
  const plan = h("div");
  const chart = lossChart("Loss per logged step");
  const chartNote = h("p", {class: "muted"});
  const events = timeline();
  const recov = h("div");
  const ckpts = h("div");
  const placement = h("div");
  main.append(heading, subtitle, actions,
    section("Summary", "sec-summary", [summary]),
    section("Progress and throughput", "sec-progress", [progress]),
    section("Goodput (ETTR)", "sec-goodput", [goodput]),
    section("Plan", "sec-plan", [plan]),
    section("Loss curve", "sec-loss", [chart.el, chartNote]),
    section("Events", "sec-events", [events.el, recov]),
    section("Checkpoints", "sec-ckpt", [ckpts]),
    section("Placement", "sec-placement", [placement]));

  const points = new Map();  // step -> point; a step logged again after a rollback replaces the old one
  const eventList = [];
  let metricsNext = 0;
  let eventsNext = 0;
  let job = null;
  let confirming = false;
  let terminalReads = 0;
  let settled = false;  // terminal, and read twice since (late metrics land on the first)

  function drawActions() {
    const items = [h("a", {href: `#/jobs/${enc(id)}/logs`, text: "Logs"})];
    if (ctx.grafana) {
      items.push(h("a", {href: `${ctx.grafana}/d/kc-job?var-job=${enc(id)}`, target: "_blank",
        rel: "noopener noreferrer", text: "Grafana dashboard", id: "grafana-link"}));
    }
    const cancellable = job && !TERMINAL.has(job.state) && ctx.can("job.cancel");
    if (cancellable && !confirming) {
      items.push(h("button", {type: "button", id: "cancel-job", text: "Cancel job",
        onclick: () => { confirming = true; drawActions(); document.getElementById("cancel-keep").focus(); }}));
    } else if (cancellable) {
      items.push(h("span", {class: "confirm", role: "group", "aria-labelledby": "cancel-q"}, [
        h("span", {id: "cancel-q", text: `Cancel ${job.name}? Its ranks stop and it cannot be resumed.`}),
        h("button", {type: "button", id: "cancel-confirm", class: "danger", text: "Yes, cancel job",
          onclick: doCancel}),
        h("button", {type: "button", id: "cancel-keep", text: "No, keep it",
          onclick: () => { confirming = false; drawActions(); document.getElementById("cancel-job").focus(); }}),
      ]));
    }
    actions.replaceChildren(...items);
  }

  async function doCancel() {
    confirming = false;
    try {
      const {data} = await api(`/v1/jobs/${enc(id)}/cancel`, {method: "POST"});
      job = {...job, ...data};
      announce(`Cancel requested for job ${id}`);
    } catch (exc) {
      if (exc instanceof ApiError) announce(`Cancel failed: ${exc.message}`);
    }
    drawActions();
    heading.focus();
  }

  function drawJob() {
    heading.textContent = `Job ${job.name}`;
    const p = job.progress || {};
    const badge = stateBadge(job.state);
    badge.id = "job-state";
    summary.replaceChildren(dl([
      ["State", badge], ["Queue", job.queue], ["Tenant", job.tenant],
      ["Owner", job.owner], ["Priority", job.priority], ["World size", job.world_size],
      ["GPUs", job.gpus], ["Restarts", job.restarts], ["Preemptions", job.preemptions],
      ["Queue position", job.queue_position], ["Waiting for", job.waiting_for],
      // With spare_workers: each warm spare's node and state (warm, warming, failed).
      ["Warm spares", (job.spares || []).map((s) => `${s.node} ${s.state}`
        + (s.standby ? " (standby)" : "")).join(", ")],
      ["Created", fmtTime(job.created_at)], ["Started", fmtTime(job.started_at)],
      ["Finished", fmtTime(job.finished_at)], ["Message", job.message],
    ]));
    const step = p.step ?? 0;
    const elastic = (job.max_replicas ?? 1) > (job.min_replicas ?? 1);
    progress.replaceChildren(
      h("p", {id: "progress-text", text: `Step ${step} of ${p.total_steps ?? "?"}`}),
      progressBar(step, p.total_steps),
      dl([
        ["Loss", `${fmtNum(p.loss, 5)} (initial ${fmtNum(p.initial_loss, 5)})`],
        ["Eval loss", typeof p.eval_loss === "number" ? `${fmtNum(p.eval_loss, 5)} (held-out split)` : null],
        // A mixture of experts' routing at the last logged step (progress.moe; null when dense).
        ["Experts", p.moe ? `imbalance ${fmtNum(p.moe.imbalance)}x over ${p.moe.expert_load.length} `
          + `experts, ${fmtNum(p.moe.dropped_tokens)} dropped, aux loss ${fmtNum(p.moe.aux_loss, 4)}` : null],
        ["Throughput", typeof p.tokens_per_s === "number" ? `${fmtNum(p.tokens_per_s)} tokens/s` : "-"],
        ["Measured step time", typeof job.measured_step_s === "number"
          ? `${fmtNum(job.measured_step_s)} s/step` : "-"],
        ["Replicas", elastic ? `${job.replicas} (elastic ${job.min_replicas}..${job.max_replicas})` : null],
        ["Samples seen", elastic ? `${job.samples_seen} (global batch ${job.global_batch})` : null],
      ]));
    goodput.replaceChildren(...goodputBlock(job.goodput));
    plan.replaceChildren(job.plan ? dl(scalars(job.plan))
      : h("p", {class: "muted", text: "Hand-written layout (no planner plan)."}));
    recov.replaceChildren(...recoveries(job));
    const cks = job.checkpoints || [];
    ckpts.replaceChildren(cks.length
      ? table(`${cks.length} committed checkpoint(s), oldest first`,
        ["Step", "Path", "Size", "Write", "Committed"],
        cks.map((c) => [String(c.step), c.path, fmtBytes(c.bytes),
          typeof c.write_s === "number" ? `${fmtNum(c.write_s)} s` : "-", fmtTime(c.committed_at)]),
        {class: "checkpoints"})
      : h("p", {class: "muted", text: "No checkpoint yet."}));
    const pl = job.placement || [];
    placement.replaceChildren(pl.length
      ? table("Rank to node and GPU", ["Rank", "Node", "GPU(s)", "Leaf", "PID"],
        pl.map((r) => [String(r.rank), r.node, (r.gpus && r.gpus.length ? r.gpus : [r.gpu ?? "-"]).join(", "),
          r.leaf, r.pid ?? "-"]), {class: "placement", id: "placement-table"})
      : h("p", {class: "muted", text: "Not placed (queued, or finished and released)."}));
  }

  async function readMetrics() {
    try {
      // Page through: a long job's first visit may need several calls.
      for (let i = 0; i < 20; i += 1) {
        const doc = await get(`/v1/jobs/${enc(id)}/metrics?start=${metricsNext}`);
        for (const pt of doc.points) points.set(pt.step, pt);
        const moved = doc.next !== metricsNext;
        metricsNext = doc.next;
        if (!moved || !doc.points.length) break;
      }
      chartNote.textContent = "";
    } catch (exc) {
      if (!(exc instanceof ApiError) || exc.status === 401) throw exc;
      chartNote.textContent = `Metrics unavailable: ${exc.message}`;
    }
    chart.update([...points.values()].sort((a, b) => a.step - b.step));
  }

  async function readEvents() {
    const doc = await get(`/v1/jobs/${enc(id)}/events?start=${eventsNext}`);
    eventList.push(...doc.events);
    eventsNext = doc.next;
    events.update(eventList);
  }

  return {
    async refresh() {
      if (settled) return;
      let fresh;
      try {
        fresh = await get(`/v1/jobs/${enc(id)}`);
      } catch (exc) {
        if (exc instanceof ApiError && exc.status === 404) {
          heading.textContent = "Job not found";
          subtitle.textContent = exc.message;
          settled = true;
          return;
        }
        throw exc;
      }
      const changed = !job || job.state !== fresh.state;
      if (job && changed) announce(`Job ${fresh.name} is now ${fresh.state}`);
      job = fresh;
      drawJob();
      if (changed) drawActions();
      await Promise.all([readMetrics(), readEvents()]);
      // A finished job changes no more; stop asking.
      if (TERMINAL.has(job.state)) {
        terminalReads += 1;
        settled = terminalReads >= 2;
      }
    },
    dispose() {},
  };
}
