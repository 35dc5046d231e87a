// #/cluster: nodes grouped by leaf switch, NVLink islands inside each node,
// each GPU coloured by the job holding it and labelled with the rank; and
// the queues with their quota bars; and the goodput of the caller's jobs. A
// GPU held by a job the caller may not see reads "in use" and names no job.

import {get} from "./api.js";
import {fmtTime, h, jobColour} from "./dom.js";
import {clusterBlock} from "./goodput.js";

const HOLDING = new Set(["PLACING", "RUNNING", "RECOVERING", "RESIZING"]);

/** gpu -> {job, rank, hidden} from the API's gpu_map. */
function gpuMap(node) {
  const map = new Map();
  for (const g of node.gpu_map || []) map.set(g.gpu, g);
  return map;
}

/**
 * For an API without gpu_map: derive it from the placements of the jobs the
 * caller sees; a used GPU no visible job claims is someone else's (hidden).
 */
function deriveGpuMaps(nodes, jobs) {
  const held = new Map();
  for (const j of jobs) {
    if (!HOLDING.has(j.state)) continue;
    for (const p of j.placement || []) {
      for (const g of (p.gpus && p.gpus.length ? p.gpus : [p.gpu])) {
        if (g !== null && g !== undefined) held.set(`${p.node}/${g}`, {job: j.id, rank: p.rank});
      }
    }
  }
  for (const n of nodes) {
    n.gpu_map = Array.from({length: n.gpus}, (_, g) => {
      const mine = held.get(`${n.name}/${g}`);
      if (mine) return {gpu: g, ...mine, hidden: false};
      const used = (n.used_gpus || []).includes(g);
      return {gpu: g, job: null, rank: null, hidden: used};
    });
  }
}

function gpuCell(node, gpu, use, names) {
  const job = use && !use.hidden && use.job ? use.job : "";
  const rank = job && use.rank !== null && use.rank !== undefined ? String(use.rank) : "";
  let cls = "gpu free";
  let parts = [h("span", {class: "gpu-id", text: `GPU ${gpu}`}), h("span", {text: "free"})];
  let title = `GPU ${gpu} on ${node.name}: free`;
  if (use && use.hidden) {
    cls = "gpu hidden";
    parts = [h("span", {class: "gpu-id", text: `GPU ${gpu}`}), h("span", {text: "in use"})];
    title = `GPU ${gpu} on ${node.name}: in use by a job of another tenant`;
  } else if (job) {
    cls = `gpu used ${jobColour(job)}`;
    parts = [h("span", {class: "gpu-id", text: `GPU ${gpu}`}),
      h("span", {class: "gpu-rank", text: rank ? `rank ${rank}` : "in use"}),
      h("span", {class: "gpu-job", text: names.get(job) || job})];
    title = `GPU ${gpu} on ${node.name}: job ${names.get(job) || job} (${job})${rank ? `, rank ${rank}` : ""}`;
  }
  return h("li", {class: cls, title, "data-node": node.name, "data-gpu": gpu, "data-job": job,
    "data-rank": rank, "data-hidden": use && use.hidden ? "true" : "false"}, parts);
}

/**
 * The node's GPU type ("h100-80gb", and the model Ray detected on real GPUs),
 * "emulated at 0.5x" on a fake node slowed down, and which values an operator set.
 */
function gpuType(node) {
  const parts = [node.gpu_type ? `type ${node.gpu_type}` : "type unknown"];
  if (node.accelerator) parts.push(`Ray sees ${node.accelerator}`);
  if (node.emulated_speed !== null && node.emulated_speed !== undefined) {
    parts.push(`emulated at ${node.emulated_speed}x`);
  }
  const set = Object.keys(node.overrides || {});
  if (set.length) parts.push(`set by an operator: ${set.join(", ").replace(/_/g, " ")}`);
  return h("p", {class: "gpu-type", "data-gpu-type": node.gpu_type || "",
    "data-emulated-speed": node.emulated_speed ?? "", text: parts.join(" · ")});
}

export function nodeCard(node, names) {
  const map = gpuMap(node);
  const status = [];
  if (node.alive === false) status.push(h("p", {class: "flag lost", text: "LOST: its raylet is gone"}));
  if (node.quarantine) {
    const q = node.quarantine;
    status.push(h("p", {class: "flag quarantined", text: `QUARANTINED until ${fmtTime(q.until)}`
      + (q.reason ? ` (${q.reason})` : "")}));
  }
  if (!status.length) status.push(h("p", {class: "flag healthy", text: "healthy"}));
  const inIsland = new Set();
  const islands = (node.nvlink || []).map((isl, i) => {
    isl.forEach((g) => inIsland.add(g));
    return h("div", {class: "island"}, [
      h("p", {class: "island-label", text: `NVLink island ${i}: GPUs ${isl.join(", ")}`}),
      h("ul", {class: "gpus"}, isl.map((g) => gpuCell(node, g, map.get(g), names))),
    ]);
  });
  const loose = Array.from({length: node.gpus}, (_, g) => g).filter((g) => !inIsland.has(g));
  if (loose.length) {
    islands.push(h("div", {class: "island loose"}, [
      h("p", {class: "island-label", text: "No NVLink"}),
      h("ul", {class: "gpus"}, loose.map((g) => gpuCell(node, g, map.get(g), names))),
    ]));
  }
  const id = `node-${node.name.replace(/[^A-Za-z0-9_-]/g, "_")}`;
  const cls = ["node", node.alive === false ? "is-lost" : "", node.quarantine ? "is-quarantined" : ""];
  return h("article", {class: cls.join(" ").trim(), "data-node": node.name, "aria-labelledby": id}, [
    h("h4", {id, text: node.name}),
    ...status,
    h("p", {class: "muted", text: `${node.free_gpus ?? "?"} of ${node.gpus} GPUs free`}),
    gpuType(node),
    ...(node.problems || []).map((p) => h("p", {class: "flag problem", text: p})),
    ...islands,
  ]);
}

function queueItem(q, clusterGpus) {
  const cap = q.limit_gpus ?? (q.guaranteed_gpus || clusterGpus);
  const scale = Math.max(cap, q.gpus_in_use, q.guaranteed_gpus || 0, 1);
  const fill = h("div", {class: `fill${q.limit_gpus !== null && q.gpus_in_use >= q.limit_gpus ? " full" : ""}`});
  fill.style.width = `${(100 * q.gpus_in_use) / scale}%`;
  const bar = h("div", {class: "quota", "aria-hidden": "true"}, [fill]);
  if (q.guaranteed_gpus) {
    const mark = h("div", {class: "guarantee"});
    mark.style.left = `${(100 * q.guaranteed_gpus) / scale}%`;
    bar.append(mark);
  }
  const limit = q.limit_gpus === null || q.limit_gpus === undefined ? "no limit" : `limit ${q.limit_gpus}`;
  return h("li", {class: "queue", "data-queue": q.name}, [
    h("span", {class: "queue-name", text: q.name}),
    bar,
    h("span", {class: "queue-text", text: `${q.gpus_in_use} GPUs in use · guaranteed ${q.guaranteed_gpus || 0}`
      + ` · ${limit} · ${q.running} running, ${q.queued} queued`}),
  ]);
}

export function mount(main) {
  const queues = h("ul", {class: "queues", "aria-label": "Queues"});
  const policy = h("p", {class: "muted"});
  const legend = h("ul", {class: "legend", "aria-label": "Jobs on the map"});
  const map = h("div", {class: "map"});
  const updated = h("p", {class: "muted"});
  const goodput = h("div");
  main.append(h("h1", {text: "Cluster"}),
    h("section", {"aria-labelledby": "sec-queues"}, [h("h2", {id: "sec-queues", text: "Queues"}), policy, queues]),
    h("section", {"aria-labelledby": "sec-nodes"}, [h("h2", {id: "sec-nodes", text: "Nodes by leaf switch"}),
      updated, legend, map]),
    h("section", {"aria-labelledby": "sec-goodput"}, [h("h2", {id: "sec-goodput", text: "Goodput (ETTR)"}),
      goodput]));
  let drawn = "";

  function draw(nodeDoc, queueDoc, names) {
    const nodes = nodeDoc.nodes;
    const total = nodes.reduce((a, n) => a + (n.gpus || 0), 0);
    policy.textContent = `Policy ${queueDoc.policy}; preemption ${queueDoc.preemption ? "on" : "off"}.`;
    queues.replaceChildren(...queueDoc.queues.map((q) => queueItem(q, total)));
    const leaves = new Map();
    for (const n of nodes) {
      if (!leaves.has(n.leaf)) leaves.set(n.leaf, []);
      leaves.get(n.leaf).push(n);
    }
    map.replaceChildren(...[...leaves.keys()].sort().map((leaf) => {
      const id = `leaf-${String(leaf).replace(/[^A-Za-z0-9_-]/g, "_")}`;
      return h("section", {class: "leaf", "aria-labelledby": id, "data-leaf": leaf}, [
        h("h3", {id, text: `Leaf switch ${leaf}`}),
        h("div", {class: "nodes"}, leaves.get(leaf).map((n) => nodeCard(n, names))),
      ]);
    }));
    const onMap = new Set(nodes.flatMap((n) => (n.gpu_map || []).filter((g) => g.job && !g.hidden)
      .map((g) => g.job)));
    legend.replaceChildren(...[...onMap].sort().map((id) => h("li", {}, [
      h("span", {class: `swatch ${jobColour(id)}`, "aria-hidden": "true"}),
      h("a", {href: `#/jobs/${encodeURIComponent(id)}`, text: `${names.get(id) || id} (${id})`}),
    ])));
    if (!nodes.length) map.replaceChildren(h("p", {class: "muted", text: "The registry has no nodes yet."}));
  }

  return {
    async refresh() {
      const [nodeDoc, queueDoc, jobsDoc, goodputDoc] = await Promise.all([get("/v1/nodes"),
        get("/v1/queues"), get("/v1/jobs"), get("/v1/goodput").catch(() => null)]);
      goodput.replaceChildren(...(goodputDoc ? clusterBlock(goodputDoc)
        : [h("p", {class: "muted", text: "Goodput is not available from this server."})]));
      if (nodeDoc.nodes.some((n) => !Array.isArray(n.gpu_map))) deriveGpuMaps(nodeDoc.nodes, jobsDoc.jobs);
      const names = new Map(jobsDoc.jobs.map((j) => [j.id, j.name]));
      updated.textContent = `Registry view of ${fmtTime(nodeDoc.updated_at)}.`;
      // Redraw only on change, so a focused legend link keeps its focus between polls.
      const sig = JSON.stringify([nodeDoc.nodes, queueDoc, [...names]]);
      if (sig === drawn) return;
      drawn = sig;
      draw(nodeDoc, queueDoc, names);
    },
    dispose() {},
  };
}
