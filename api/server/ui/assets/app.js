// The console's shell: sign-in, hash routing, and the poll loop that keeps the
// page current. Pages are modules with mount(main, ctx, params) returning
// {refresh, dispose}; only the shell polls, so one hidden tab costs nothing.

import {AuthError, clearKey, get, getKey, setKey, setUnauthorizedHandler} from "./api.js";
import {h} from "./dom.js";
import * as cluster from "./cluster.js";
import * as job from "./job.js";
import * as jobs from "./jobs.js";
import * as logs from "./logs.js";
import * as submit from "./submit.js";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

const ctx = {
  who: null,
  grafana: document.documentElement.dataset.grafanaUrl || "",
  can(permission) { return Boolean(this.who && this.who.permissions.includes(permission)); },
};

let current = null;   // the mounted page
let generation = 0;   // bumped on every navigation; a stale poll loop sees it and stops
let timer = null;
let errorEl = null;
let polling = false;  // one refresh at a time, even when visibility flips mid-request
let pending = false;

function parseRoute() {
  const hash = window.location.hash || "#/jobs";
  if (!hash.startsWith("#/")) return null;  // an in-page anchor (the skip link)
  const parts = hash.slice(2).split("?")[0].split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "jobs" && parts[1] && parts[2] === "logs") {
    return {name: "jobs", page: logs, params: {id: parts[1]}};
  }
  if (parts[0] === "jobs" && parts[1]) return {name: "jobs", page: job, params: {id: parts[1]}};
  if (parts[0] === "submit") return {name: "submit", page: submit, params: {}};
  if (parts[0] === "cluster") return {name: "cluster", page: cluster, params: {}};
  return {name: "jobs", page: jobs, params: {}};
}

function showError(message) {
  if (errorEl && errorEl.textContent !== message) errorEl.textContent = message;
}

async function tick(gen) {
  if (gen !== generation || document.hidden || !current) return;
  if (polling) {  // a refresh is in flight: run once more when it ends
    pending = true;
    return;
  }
  polling = true;
  let signedOut = false;
  try {
    await current.refresh();
    if (gen === generation) showError("");
  } catch (exc) {
    signedOut = exc instanceof AuthError;  // the sign-in view has taken over
    if (!signedOut && gen === generation) showError(exc.message);
  } finally {
    polling = false;
  }
  if (signedOut) return;
  if (pending) {
    pending = false;
    tick(generation);
  } else if (gen === generation && !document.hidden) {
    window.clearTimeout(timer);
    timer = window.setTimeout(() => tick(gen), POLL_MS);
  }
}

function unmount() {
  generation += 1;
  window.clearTimeout(timer);
  if (current && current.dispose) current.dispose();
  current = null;
}

function navigate() {
  if (!ctx.who) return;
  const route = parseRoute();
  if (!route) return;
  unmount();
  for (const a of document.querySelectorAll("nav a[data-route]")) {
    if (a.dataset.route === route.name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const main = $("main");
  errorEl = h("p", {class: "error", role: "alert"});
  main.replaceChildren(errorEl);
  current = route.page.mount(main, ctx, route.params);
  // Move focus to the new page's heading so keyboard and screen-reader
  // users start there, as after a full page load.
  const heading = main.querySelector("h1");
  if (heading) {
    heading.setAttribute("tabindex", "-1");
    heading.focus({preventScroll: true});
  }
  tick(generation);
}

function showSignIn(message) {
  unmount();
  ctx.who = null;
  clearKey();
  $("main").replaceChildren();
  $("app").hidden = true;
  $("who").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
  const input = $("api-key");
  input.value = "";
  input.focus();
}

function showApp(who) {
  ctx.who = who;
  $("who-text").textContent = `${who.name} · tenant ${who.tenant} · role ${who.role}`;
  $("who").hidden = false;
  $("nav-submit").hidden = !ctx.can("job.submit");
  $("signin").hidden = true;
  $("signin-error").textContent = "";
  $("app").hidden = false;
  navigate();
}

async function signIn(key) {
  setKey(key);
  try {
    showApp(await get("/v1/whoami"));
  } catch (exc) {
    if (!(exc instanceof AuthError)) showSignIn(exc.message);
  }
}

setUnauthorizedHandler((message) => showSignIn(message));

$("signin-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) {
    $("signin-error").textContent = "Enter an API key.";
    return;
  }
  signIn(key);
});
$("sign-out").addEventListener("click", () => showSignIn("Signed out."));
window.addEventListener("hashchange", navigate);
document.addEventListener("visibilitychange", () => {
  // Stop polling while the tab is hidden; catch up at once when it returns.
  window.clearTimeout(timer);
  if (!document.hidden && current) tick(generation);
});

if (getKey()) signIn(getKey());
else showSignIn("");
