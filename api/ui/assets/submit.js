// #/submit: paste or upload a job YAML, validate it (a dry run), submit it.
// A 422 lists every problem as "field.path: message"; nothing but the
// answer's `detail` is ever shown, so no stack trace can reach the page.

import {ApiError, api} from "./api.js";
import {announce, h} from "./dom.js";

const MAX_FILE = 1 << 20;  // a job spec is a few KiB; refuse anything absurd before reading it

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
  const file = h("input", {id: "spec-file", type: "file", accept: ".yaml,.yml,.json,application/yaml"});
  const validate = h("button", {type: "button", id: "validate", text: "Validate"});
  const submit = h("button", {type: "submit", id: "submit", class: "primary", text: "Submit"});
  const errors = h("ul", {id: "spec-errors", class: "errors", role: "alert"});
  const result = h("p", {id: "spec-result", class: "ok", role: "status"});
  const form = h("form", {id: "submit-form", novalidate: true}, [
    h("div", {class: "field"}, [
      h("label", {for: "spec", text: "Job spec (YAML or JSON)"}),
      h("p", {id: "spec-help", class: "muted"}, ["Paste a whole spec: ", h("code", {text: "extends:"}),
        " is resolved from files by ", h("code", {text: "kc submit FILE"}), ", not here."]),
      spec,
    ]),
    h("div", {class: "field"}, [h("label", {for: "spec-file", text: "Load a YAML file"}), file]),
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
      const {status, data} = await api(`/v1/jobs${dryRun ? "?dry_run=true" : ""}`,
        {method: "POST", body: spec.value, type: "application/yaml"});
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
    const f = file.files && file.files[0];
    if (!f) return;
    if (f.size > MAX_FILE) {
      show([`${f.name}: ${f.size} bytes is too large for a job spec`]);
      return;
    }
    spec.value = await f.text();
    show([], `Loaded ${f.name}; Validate or Submit it.`);
  });

  return {async refresh() {}, dispose() {}};
}
