// #/submit: paste or upload a job YAML, validate it (a dry run), submit it.
// A 422 lists every problem as "field.path: message"; nothing but the
// answer's `detail` is ever shown, so no stack trace can reach the page.
// A YAML that `extends:` another is uploaded together with it (select both):
// the page sends them as one bundle and the server merges them, as `kc submit`
// does from disk; the server reads no file of its own.

import {ApiError, api} from "./api.js";
import {announce, h} from "./dom.js";

const MAX_FILE = 1 << 20;  // a job spec is a few KiB; refuse anything absurd before reading it
const MAX_FILES = 16;  // the server's limit for a bundle
const BUNDLE = "application/vnd.kuangchao.bundle+json";

// The file names a YAML's top-level `extends:` points at (the file name only:
// an upload carries no folders). The server parses for real; this only picks
// which uploaded file is the job and which are its bases.
function parentOf(text) {
  const m = /^extends:[ \t]*["']?([^"'#\s]+)/m.exec(text);
  return m ? m[1].split("/").pop() : null;
}

function problems(exc) {
  if (Array.isArray(exc.detail)) {
    return exc.detail.map((d) => (d.field ? `${d.field}: ${d.msg}` : String(d.msg)));
  }
  return [exc.message];
}

export function mount(main, ctx) {
  main.append(h("h1", {text: "Submit a job"}));
  if (!ctx.can("job.submit")) {
    main.append(h("p", {id: "submit-denied",
      text: `Your role (${ctx.who.role}) may not submit jobs. Ask an admin for a submitter key.`}));
    return {async refresh() {}, dispose() {}};
  }
  const spec = h("textarea", {id: "spec", name: "spec", rows: 22, cols: 80, spellcheck: "false",
    autocomplete: "off", "aria-describedby": "spec-help"});
  const file = h("input", {id: "spec-file", type: "file", multiple: true,
    accept: ".yaml,.yml,.json,application/yaml", "aria-describedby": "spec-file-help"});
  const bases = h("p", {id: "spec-bases", class: "muted", role: "status"});
  let jobFile = "";        // the uploaded job file's name, when files were uploaded
  let baseFiles = {};      // name -> text of the files its extends: chain names
  const validate = h("button", {type: "button", id: "validate", text: "Validate"});
  const submit = h("button", {type: "submit", id: "submit", class: "primary", text: "Submit"});
  const errors = h("ul", {id: "spec-errors", class: "errors", role: "alert"});
  const result = h("p", {id: "spec-result", class: "ok", role: "status"});
  const form = h("form", {id: "submit-form", novalidate: true}, [
    h("div", {class: "field"}, [
      h("label", {for: "spec", text: "Job spec (YAML or JSON)"}),
      h("p", {id: "spec-help", class: "muted"}, ["Paste a whole spec, or load files below. A pasted ",
        h("code", {text: "extends:"}), " needs its base files loaded with it."]),
      spec,
    ]),
    h("div", {class: "field"}, [
      h("label", {for: "spec-file", text: "Load YAML files"}),
      h("p", {id: "spec-file-help", class: "muted"}, ["Select the job file and the files its ",
        h("code", {text: "extends:"}), " names (e.g. tiny-gpt.yaml and base.yaml)."]),
      file, bases,
    ]),
    h("div", {class: "toolbar"}, [validate, submit]),
  ]);
  main.append(form, errors, result);

  function show(list, ok = "") {
    errors.replaceChildren(...list.map((t) => h("li", {text: t})));
    result.textContent = ok;
  }

  async function send(dryRun) {
    if (!spec.value.trim()) {
      show(["spec: paste a job spec or load a file first"]);
      spec.focus();
      return;
    }
    for (const b of [validate, submit]) b.disabled = true;
    form.setAttribute("aria-busy", "true");
    try {
      const bundled = Object.keys(baseFiles).length > 0;
      const body = bundled
        ? JSON.stringify({main: jobFile, files: {...baseFiles, [jobFile]: spec.value}})
        : spec.value;
      const {status, data} = await api(`/v1/jobs${dryRun ? "?dry_run=true" : ""}`,
        {method: "POST", body, type: bundled ? BUNDLE : "application/yaml"});
      if (status === 201) {  // submitted (a server without dry runs submits on Validate too)
        announce(`Submitted job ${data.id}`);
        window.location.hash = `#/jobs/${encodeURIComponent(data.id)}`;
        return;
      }
      const name = data && data.spec && data.spec.task ? data.spec.task.name : "";
      show([], `Valid${name ? `: task ${name}` : ""}. Submit queues it.`);
    } catch (exc) {
      if (!(exc instanceof ApiError) || exc.status === 401) throw exc;
      show(exc.status === 422 ? problems(exc) : [`the server refused it (${exc.status}): ${exc.message}`]);
    } finally {
      for (const b of [validate, submit]) b.disabled = false;
      form.removeAttribute("aria-busy");
    }
  }

  validate.addEventListener("click", () => send(true).catch(() => {}));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    send(false).catch(() => {});
  });
  file.addEventListener("change", async () => {
    const picked = Array.from(file.files || []);
    if (!picked.length) return;
    const big = picked.filter((f) => f.size > MAX_FILE);
    if (picked.length > MAX_FILES || big.length) {
      show(big.length ? big.map((f) => `${f.name}: ${f.size} bytes is too large for a job spec`)
        : [`${picked.length} files: load at most ${MAX_FILES}`]);
      return;
    }
    const texts = {};
    for (const f of picked) texts[f.name] = await f.text();
    // The job is the file no other loaded file extends; with several, the first.
    const named = new Set(Object.values(texts).map(parentOf).filter(Boolean));
    jobFile = picked.map((f) => f.name).find((n) => !named.has(n)) || picked[0].name;
    spec.value = texts[jobFile];
    delete texts[jobFile];
    baseFiles = texts;
    const others = Object.keys(baseFiles);
    bases.textContent = others.length ? `Sent with it for extends: ${others.join(", ")}.` : "";
    show([], `Loaded ${jobFile}; Validate or Submit it.`);
  });
  return {async refresh() {}, dispose() {}};
}
