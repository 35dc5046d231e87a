"""The web console at /ui, in a real headless Chromium against the session's
live stack: submit and follow a job, the loss curve and the cluster map
against the API, spec errors, roles, tenants, keyboard use, screenshots.

Screenshots land in test-artifacts/console/ at the repository root.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from kuangchao.platform.spec.jobspec import deep_merge, resolve_extends

from .conftest import ROOT, wait_for
from .console_page import CHROMEDRIVER, CHROMIUM, Console, Rest, png_facts, start_browser

pytestmark = pytest.mark.integration

ARTIFACTS = ROOT / "test-artifacts" / "console"
JOB_DEADLINE = 300  # seconds for a job to be placed, run and finish on a loaded CI machine
BAD_SPEC = "task:\n  name: console-bad\ntraining:\n  steps: -1\n  bogus_key: 3\n"


def uid() -> str:
    return uuid.uuid4().hex[:6]


def gpus_of(rank: dict) -> list[int]:
    return list(rank.get("gpus") or [rank["gpu"]])


@pytest.fixture(scope="module")
def browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        assert Path(path).exists(), f"{path} is missing: `apt-get install -y chromium chromium-driver`"
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def ui(browser, stack) -> Iterator[Console]:
    console = Console(browser, stack.state["api_url"])
    yield console
    problems = console.js_problems()
    assert not problems, f"script errors or CSP violations in the browser: {problems}"


@pytest.fixture(scope="module")
def admin(stack) -> Rest:
    return Rest(stack.state["api_url"], stack.key)


def new_key(admin: Rest, tenant: str, role: str) -> dict:
    return admin("POST", "/v1/admin/keys", json={"name": f"{role}-{tenant}", "tenant": tenant,
                                                  "role": role})


@pytest.fixture(scope="module")
def people(admin) -> dict[str, str]:
    """Keys of two tenants: A (submitter, viewer) and B (submitter)."""
    a, b = f"con-a-{uid()}", f"con-b-{uid()}"
    return {"tenant_a": a, "tenant_b": b,
            "a_submitter": new_key(admin, a, "submitter")["key"],
            "a_viewer": new_key(admin, a, "viewer")["key"],
            "b_submitter": new_key(admin, b, "submitter")["key"]}


@pytest.fixture(scope="module")
def runner(stack, admin, people):
    """A long job of tenant A in queue team-b: it holds GPUs while the tests
    look at the map. Submitted at once, cancelled at the end."""
    doc = stack.job_doc(task={"name": f"console-runner-{uid()}", "queue": "team-b"},
                        training={"steps": 200_000, "seed": 7, "log_interval": 5},
                        checkpoint={"interval_steps": 50,
                                    "path": str(Path(stack.env["KC_HOME"]) / "ckpt")},
                        # A warm spare takes over the rank the last test kills, in seconds.
                        fault_tolerance={"spare_workers": True})
    job = Rest(stack.state["api_url"], people["a_submitter"]).submit(doc)
    try:
        yield job
    finally:
        admin.cancel_quietly(job["id"])


def running_placement(admin: Rest, job_id: str) -> list[dict]:
    """The job's placement, once it is RUNNING with a GPU for every rank."""
    def ready():
        j = admin.job(job_id)
        assert j["state"] not in ("FAILED", "CANCELLED", "SUCCEEDED"), j
        pl = j["placement"]
        return j["state"] == "RUNNING" and pl and all(gpus_of(p) != [None] for p in pl) and pl
    return wait_for(ready, JOB_DEADLINE, f"job {job_id} to run")


def metric_points(admin: Rest, job_id: str) -> list[dict]:
    return admin("GET", f"/v1/jobs/{job_id}/metrics")["points"]


def shrink(stack, name: str) -> dict:
    """What makes tiny-gpt finish in seconds, still logging every 5 steps."""
    return {"task": {"name": name},
            "model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32},
            "data": {"max_bytes": 200_000},
            "parallel": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
            "optimizer": {"warmup_steps": 2},
            "training": {"steps": 30, "log_interval": 5},
            "checkpoint": {"interval_steps": 10, "path": str(Path(stack.env["KC_HOME"]) / "ckpt")}}


def tiny_gpt(stack, name: str) -> dict:
    """examples/tiny-gpt.yaml with `extends` merged, shrunk (for jobs set up through the API)."""
    return deep_merge(resolve_extends(ROOT / "examples" / "tiny-gpt.yaml"), shrink(stack, name))


def map_cells_for(ui: Console, job_id: str) -> dict[tuple[str, int], str]:
    return {(c["node"], c["gpu"]): c["rank"] for c in ui.gpu_cells() if c["job"] == job_id}


def hide_tab(ui: Console, hidden: bool) -> float:
    """Make the page think its tab is hidden (or shown again); returns the page's clock."""
    return ui.js("Object.defineProperty(document, 'hidden', {configurable: true, get: () => arguments[0]});"
                 "const t = performance.now(); document.dispatchEvent(new Event('visibilitychange'));"
                 "return t;", hidden)


def fetches_since(ui: Console, t: float) -> int:
    return ui.js("return performance.getEntriesByType('resource').filter("
                 "e => e.initiatorType === 'fetch' && e.startTime > arguments[0]).length", t)


def test_console_is_served_offline_with_strict_headers(stack, monkeypatch):
    base = stack.state["api_url"]
    for path in ("/ui", "/ui/", "/ui/assets/app.js", "/ui/assets/console.css"):
        resp = httpx.get(base + path)  # no key: the console is static
        assert resp.status_code == 200, path
        csp = resp.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert resp.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(base + "/ui/assets/..%2F..%2Fapp.py").status_code == 404
    page = httpx.get(base + "/ui").text
    assert "<style" not in page and " style=" not in page and "<script>" not in page
    # Nothing from a CDN: no asset names another host (the SVG namespace is a name, not a load).
    from kuangchao.api.server.routers.ui import ASSETS
    for asset in ASSETS.iterdir():
        text = asset.read_text().replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, asset.name
    # KC_GRAFANA_URL reaches the page escaped; a non-http(s) one is dropped.
    from fastapi.testclient import TestClient

    from kuangchao.api.server.app import create_app
    client = TestClient(create_app())
    monkeypatch.setenv("KC_GRAFANA_URL", 'https://grafana.example/"><script>x</script>')
    assert 'data-grafana-url="https://grafana.example/&quot;&gt;&lt;script&gt;' in client.get("/ui").text
    monkeypatch.setenv("KC_GRAFANA_URL", "javascript:alert(1)")
    assert 'data-grafana-url=""' in client.get("/ui").text


def test_submit_from_the_console_and_follow_the_job(stack, admin, ui, runner):
    name = f"console-tiny-{uid()}"
    # The example as it is, with the base its `extends:` names: the page sends both.
    examples = [ROOT / "examples" / "tiny-gpt.yaml", ROOT / "examples" / "base.yaml"]
    child = deep_merge(yaml.safe_load(examples[0].read_text()), shrink(stack, name))

    who = ui.sign_in(stack.key)
    assert "role admin" in who and "tenant default" in who
    # The key lives in this tab's sessionStorage, never in localStorage.
    assert ui.js("return sessionStorage.getItem('kc.apiKey')") == stack.key
    assert ui.js("return localStorage.length") == 0

    ui.find("nav a[href='#/submit']").click()
    ui.wait(lambda d: ui.find("#spec").is_displayed(), 30, "the submit page")
    ui.find("#spec-file").send_keys("\n".join(str(p) for p in examples))
    ui.wait(lambda d: ui.find("#spec").get_attribute("value") == examples[0].read_text(), 30,
            "tiny-gpt.yaml, the file no other extends, in the textarea")
    assert "base.yaml" in ui.find("#spec-bases").text
    # Shrunk in the textarea, as a user would edit it; `extends: base.yaml` stays.
    ui.js("const t = document.getElementById('spec'); t.value = arguments[0];"
          "t.dispatchEvent(new Event('input'));", yaml.safe_dump(child, sort_keys=False))
    ui.find("#validate").click()
    ui.wait(lambda d: ui.find("#spec-result").text.startswith("Valid"), 30, "the dry run to pass")
    assert name not in {j["name"] for j in admin.jobs()}, "Validate must queue nothing"

    ui.find("#submit").click()
    ui.wait(lambda d: d.execute_script("return location.hash").startswith(f"#/jobs/{name}"), 30,
            "the job's page after submitting")
    job_id = ui.js("return location.hash").removeprefix("#/jobs/")
    assert admin.job(job_id)["name"] == name

    # While the job starts: polling stops while the tab is hidden and resumes when shown.
    ui.wait(lambda d: ui.all("#job-state"), 30, "the job's page")
    hidden_at = hide_tab(ui, True)
    time.sleep(5)  # an observation window of 2.5 poll periods, not a wait for a condition
    assert fetches_since(ui, hidden_at + 100) == 0, "the console polled from a hidden tab"
    shown_at = hide_tab(ui, False)
    ui.wait(lambda d: fetches_since(ui, shown_at) > 0, 10, "polling to resume")
    ui.wait(lambda d: ui.find("#job-state").text == "SUCCEEDED", JOB_DEADLINE, f"{job_id} to succeed")

    # One loss-curve point per logged step: rank 0 logs step 1, every log_interval, and the last.
    steps, every = child["training"]["steps"], child["training"]["log_interval"]
    cadence = {1, steps, *range(every, steps + 1, every)}
    logged = {p["step"] for p in metric_points(admin, job_id) if p["loss"] is not None}
    assert logged == cadence
    ui.wait(lambda d: sorted(ui.loss_steps()) == sorted(cadence), 30, "the curve to hold every logged step")
    assert len(ui.loss_steps()) == len(cadence)  # no step drawn twice
    bar = ui.find("[role=progressbar]")
    assert bar.get_attribute("aria-valuenow") == bar.get_attribute("aria-valuemax") == str(steps)
    assert "RUNNING → SUCCEEDED" in ui.find("ol.timeline").text
    finished = admin.job(job_id)
    assert len(ui.all("table.checkpoints tbody tr")) == len(finished["checkpoints"]) >= 1
    shown = [r.text.split()[:2] for r in ui.all("#placement-table tbody tr")]
    assert shown == [[str(p["rank"]), p["node"]] for p in finished["placement"]]
    assert not ui.all("#cancel-job"), "a finished job has nothing to cancel"
    ui.screenshot(ARTIFACTS / "job-succeeded.png")

    # The jobs list: live, filtered by state and by queue (the runner is in team-b).
    ui.find("nav a[href='#/jobs']").click()
    ui.wait(lambda d: ui.job_rows().get(job_id) == "SUCCEEDED" and runner["id"] in ui.job_rows(),
            30, "both jobs in the list")
    Select(ui.find("#filter-state")).select_by_value("SUCCEEDED")
    ui.wait(lambda d: job_id in ui.job_rows() and runner["id"] not in ui.job_rows(), 10, "state filter")
    Select(ui.find("#filter-state")).select_by_value("")
    Select(ui.find("#filter-queue")).select_by_value("team-b")
    ui.wait(lambda d: runner["id"] in ui.job_rows() and job_id not in ui.job_rows(), 10, "queue filter")
    Select(ui.find("#filter-queue")).select_by_value("")

    # The cluster map puts the runner's ranks on the GPUs its placement names.
    placement = running_placement(admin, runner["id"])
    expected = {(p["node"], g): str(p["rank"]) for p in placement for g in gpus_of(p)}
    ui.find("nav a[href='#/cluster']").click()
    ui.wait(lambda d: map_cells_for(ui, runner["id"]) == expected, 30, "the runner on the map")
    cell = ui.find(f"li.gpu[data-node='{placement[0]['node']}'][data-gpu='{gpus_of(placement[0])[0]}']")
    assert f"rank {placement[0]['rank']}" in cell.text


def test_bad_spec_shows_field_paths_not_a_traceback(stack, admin, ui):
    ui.sign_in(stack.key)
    ui.go("#/submit", "#spec")
    ui.find("#spec").send_keys(BAD_SPEC)
    for button in ("#validate", "#submit"):  # the dry run and the real submit answer alike
        ui.js("document.getElementById('spec-errors').replaceChildren()")
        ui.find(button).click()
        ui.wait(lambda d: ui.all("#spec-errors li"), 30, f"errors after {button}")
        errors = [li.text for li in ui.all("#spec-errors li")]
        assert ui.find("#spec-errors").get_attribute("role") == "alert"
        assert any(e.startswith("training.steps: ") for e in errors), errors
        assert "training.bogus_key: unknown field; check the spelling against docs/user-guide.md" in errors
        assert "Traceback" not in ui.d.page_source
    assert "console-bad" not in {j["name"] for j in admin.jobs()}
    assert ui.js("return location.hash") == "#/submit"
    # Text that is not YAML at all: one message, still no traceback.
    ui.find("#spec").clear()
    ui.find("#spec").send_keys("task: [unclosed")
    ui.find("#validate").click()
    ui.wait(lambda d: any("neither valid JSON nor YAML" in li.text for li in ui.all("#spec-errors li")),
            30, "the parse error")
    assert "Traceback" not in ui.d.page_source
    # What the server echoes back from the spec is text on the page, never markup.
    ui.find("#spec").clear()
    ui.find("#spec").send_keys('task:\n  name: "<img src=x id=injected>"\n')
    ui.find("#validate").click()
    ui.wait(lambda d: any("<img src=x id=injected>" in li.text for li in ui.all("#spec-errors li")),
            30, "the echoed name as text")
    assert not ui.all("#injected") and not ui.all("#spec-errors img")


def test_viewer_sees_jobs_but_no_submit_or_cancel(stack, admin, ui, people, runner):
    who = ui.sign_in(people["a_viewer"])
    assert "role viewer" in who and people["tenant_a"] in who
    assert not any(a.is_displayed() for a in ui.all("a[href='#/submit']"))
    ui.wait(lambda d: runner["id"] in ui.job_rows(), 30, "the tenant's job in the viewer's list")
    ui.go("#/submit", "#submit-denied")
    assert not ui.all("#spec") and not ui.all("#submit") and not ui.all("#validate")
    running_placement(admin, runner["id"])
    ui.go(f"#/jobs/{runner['id']}", "#job-state")
    ui.wait(lambda d: ui.find("#job-state").text == "RUNNING", 30, "the running job's page")
    assert not ui.all("#cancel-job") and not ui.all("#cancel-confirm")
    # The server refuses it too, whatever the page shows.
    resp = httpx.post(f"{stack.state['api_url']}/v1/jobs/{runner['id']}/cancel",
                      headers={"Authorization": f"Bearer {people['a_viewer']}"})
    assert resp.status_code == 403

    # The same page for a submitter of the tenant has Cancel, behind a confirm step.
    ui.sign_in(people["a_submitter"])
    ui.go(f"#/jobs/{runner['id']}", "#cancel-job")
    ui.find("#cancel-job").click()
    ui.wait(lambda d: ui.find("#cancel-confirm").is_displayed(), 10, "the confirm step")
    assert ui.d.switch_to.active_element.get_attribute("id") == "cancel-keep"  # the safe default
    ui.find("#cancel-keep").click()
    ui.wait(lambda d: ui.all("#cancel-job"), 10, "the Cancel button back")
    assert admin.job(runner["id"])["state"] == "RUNNING"

    # A key revoked mid-session: the next poll answers 401 and the sign-in view says why.
    short = new_key(admin, people["tenant_a"], "viewer")
    ui.sign_in(short["key"])
    ui.go("#/jobs", "tr[data-job]")
    admin("DELETE", f"/v1/admin/keys/{short['key_id']}")
    ui.wait(lambda d: ui.find("#signin").is_displayed(), 30, "the sign-in view after a 401")
    assert "revoked" in ui.find("#signin-error").text
    assert ui.js("return sessionStorage.getItem('kc.apiKey')") is None


def test_tenants_never_see_each_others_jobs(stack, admin, ui, people, runner):
    other = Rest(stack.state["api_url"], people["b_submitter"])
    mine = other.submit(stack.job_doc(task={"name": f"console-b-{uid()}"},
                                      training={"steps": 5, "seed": 7, "log_interval": 5}))
    try:
        placement = running_placement(admin, runner["id"])
        ui.sign_in(people["b_submitter"])
        ui.wait(lambda d: mine["id"] in ui.job_rows(), 30, "tenant B's own job in its list")
        assert runner["id"] not in ui.job_rows()
        ui.go("#/cluster", "li.gpu")
        held = {(p["node"], g) for p in placement for g in gpus_of(p)}

        def hidden_for_b():
            cells = {(c["node"], c["gpu"]): c for c in ui.gpu_cells()}
            return all(cells[k]["hidden"] and cells[k]["job"] == "" and cells[k]["rank"] == ""
                       and "in use" in cells[k]["text"] for k in held)
        ui.wait(lambda d: hidden_for_b(), 30, "tenant A's GPUs shown as in use, unnamed")
        ui.screenshot(ARTIFACTS / "cluster-other-tenant.png")
        source = ui.d.page_source
        assert runner["id"] not in source and runner["name"] not in source
        ui.go(f"#/jobs/{runner['id']}", "main h1")
        ui.wait(lambda d: ui.find("main h1").text == "Job not found", 30, "a 404 for A's job")
    finally:
        other.cancel_quietly(mine["id"])


def test_keyboard_only_and_every_control_named(stack, admin, ui, runner):
    ui.reset()
    assert ui.unnamed_controls() == []
    ui.js("document.activeElement.blur()")
    keys = ActionChains(ui.d)
    for _ in range(6):  # from the top of the page: the skip link, then the key field
        keys.send_keys(Keys.TAB).perform()
        if ui.d.switch_to.active_element.get_attribute("id") == "api-key":
            break
    assert ui.d.switch_to.active_element.get_attribute("id") == "api-key"
    keys.send_keys("not-a-key", Keys.ENTER).perform()
    ui.wait(lambda d: "malformed" in ui.find("#signin-error").text, 30, "the refusal")
    assert ui.d.switch_to.active_element.get_attribute("id") == "api-key"
    keys.send_keys(stack.key, Keys.TAB).perform()
    assert ui.d.switch_to.active_element.get_attribute("id") == "signin-button"
    keys.key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).send_keys(Keys.ENTER).perform()
    ui.signed_in()
    # Focus starts at the page heading; Shift+Tab reaches the nav, Enter follows a link.
    ui.wait(lambda d: d.switch_to.active_element.tag_name == "h1", 10, "focus on the heading")
    for _ in range(8):
        keys.key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
        if ui.d.switch_to.active_element.text == "Cluster":
            break
    keys.send_keys(Keys.ENTER).perform()
    ui.wait(lambda d: ui.find("main h1").text == "Cluster" and ui.all("li.gpu"), 30, "the cluster page")

    running_placement(admin, runner["id"])
    pages = {"#/jobs": "tr[data-job]", f"#/jobs/{runner['id']}": "#cancel-job",
             f"#/jobs/{runner['id']}/logs": "#log-rank", "#/submit": "#spec", "#/cluster": "li.gpu"}
    for route, ready in pages.items():
        ui.go(route, ready)
        assert ui.unnamed_controls() == [], route
    ui.go(f"#/jobs/{runner['id']}", "#cancel-job")
    ui.find("#cancel-job").send_keys(Keys.ENTER)  # a real <button>: Enter works
    ui.wait(lambda d: ui.all("#cancel-confirm"), 10, "the confirm step")
    assert ui.unnamed_controls() == []
    ui.d.switch_to.active_element.send_keys(Keys.ENTER)  # "No, keep it" has focus
    ui.wait(lambda d: ui.all("#cancel-job"), 10, "the Cancel button back")


def test_screenshots_of_each_page(stack, admin, ui, runner):
    shots = {n: ARTIFACTS / f"{n}.png" for n in ("jobs", "job-detail", "logs", "submit-errors", "cluster")}
    for path in shots.values():
        path.unlink(missing_ok=True)
    running_placement(admin, runner["id"])
    wait_for(lambda: len(metric_points(admin, runner["id"])) >= 3, JOB_DEADLINE, "the runner's loss points")
    ui.sign_in(stack.key)
    ui.go("#/jobs", "tr[data-job]")
    ui.screenshot(shots["jobs"])
    ui.go(f"#/jobs/{runner['id']}", "#job-state")
    ui.wait(lambda d: len(ui.loss_steps()) >= 3 and ui.all("#placement-table"), 30, "the curve")
    ui.screenshot(shots["job-detail"])
    ui.find("a[href$='/logs']").click()
    ui.wait(lambda d: len(ui.all("ol.logs li")) >= 3, 30, "the runner's log lines")
    ui.screenshot(shots["logs"])
    ui.go("#/submit", "#spec")
    ui.find("#spec").send_keys(BAD_SPEC)
    ui.find("#validate").click()
    ui.wait(lambda d: len(ui.all("#spec-errors li")) >= 2, 30, "the errors")
    ui.screenshot(shots["submit-errors"])
    ui.go("#/cluster", "li.gpu")
    ui.wait(lambda d: map_cells_for(ui, runner["id"]), 30, "the runner on the map")
    ui.screenshot(shots["cluster"])
    for name, path in shots.items():
        facts = png_facts(path)
        assert facts["width"] >= 1000 and facts["height"] >= 700, (name, facts)
        assert facts["bytes"] > 20_000 and facts["distinct"] > 64, (name, facts)


def test_failure_and_recovery_on_the_timeline(stack, admin, ui, runner):
    """A rank SIGKILLed: the timeline marks the failure with its detection time, the
    job goes RECOVERING and back, and the recovery's phase timings are listed."""
    placement = running_placement(admin, runner["id"])
    wait_for(lambda: admin.job(runner["id"])["checkpoints"], JOB_DEADLINE, "the runner's first checkpoint")
    ui.sign_in(stack.key)
    ui.go(f"#/jobs/{runner['id']}", "#job-state")
    victim = next(p for p in placement if p["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    ui.wait(lambda d: ui.all("ol.timeline li[data-type=failure]"), 60, "the failure on the timeline")
    failure = ui.find("ol.timeline li[data-type=failure]")
    assert "ev-failure" in failure.get_attribute("class")
    assert "rank: 1" in failure.text and "detected after: " in failure.text, failure.text
    ui.wait(lambda d: "RUNNING → RECOVERING" in ui.find("ol.timeline").text, 30, "RECOVERING")

    def recovered():
        cells = [c.text for c in ui.all("table.recoveries tbody tr:first-child td")]
        # The phase timings land one by one; the first step after the recovery is the last.
        return (ui.find("#job-state").text == "RUNNING" and cells and cells[1] == "died"
                and cells[4] != "-" and cells[8] != "-")
    ui.wait(lambda d: recovered(), JOB_DEADLINE, "the recovery and its timings")
    assert "RECOVERING → RUNNING" in ui.find("ol.timeline").text
    ui.screenshot(ARTIFACTS / "job-recovered.png")
