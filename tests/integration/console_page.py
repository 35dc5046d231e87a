"""A page object for the web console (api/ui/), driven by a real headless
Chromium through Selenium: the tests read as what a user does.

The browser and its driver are Debian's (`chromium`, `chromium-driver`), named
by path so that Selenium Manager never goes to the network.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import httpx
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1400, 1000

# Every control a user can reach, and how the test asks Chrome for its
# accessible name (the accessibility tree's own computation, not a guess).
CONTROLS = "input:not([type=hidden]), select, textarea, button, a[href]"

# Returns, per page, the loss-curve steps the SVG holds.
_LOSS_STEPS = "return [...document.querySelectorAll('svg.chart [data-step]')].map(e => +e.dataset.step)"


def start_browser() -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={WIDTH},{HEIGHT}", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


class Console:
    def __init__(self, driver: webdriver.Chrome, api_url: str) -> None:
        self.d, self.base = driver, api_url.rstrip("/")

    # -- waiting ------------------------------------------------------------
    def wait(self, cond, timeout: float = 30, what: str = "") -> Any:
        """Poll `cond(driver)` until truthy (WebDriverWait), failing with `what`.

        The console redraws parts of a page on every poll, so an element found
        a moment ago may be gone: that is a retry, not a failure.
        """
        return WebDriverWait(self.d, timeout, poll_frequency=0.25, ignored_exceptions=(
            NoSuchElementException, StaleElementReferenceException)).until(
            cond, message=f"timed out after {timeout}s waiting for {what}")

    def find(self, css: str) -> WebElement:
        return self.d.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[WebElement]:
        return self.d.find_elements(By.CSS_SELECTOR, css)

    def js(self, script: str, *args: Any) -> Any:
        return self.d.execute_script(script, *args)

    def main_text(self) -> str:
        return self.find("main").text

    # -- signing in and out -------------------------------------------------
    def open(self, route: str = "") -> None:
        """Load the console fresh (a new document), at `route` (e.g. "#/cluster")."""
        self.d.get(f"{self.base}/ui{route}")
        self.wait(lambda d: d.execute_script("return document.readyState") == "complete", 30,
                  "the console to load")

    def reset(self) -> None:
        """A signed-out console: the key is forgotten and the page reloaded."""
        self.open()
        self.js("window.sessionStorage.clear()")
        self.open()
        self.wait(lambda d: self.find("#signin").is_displayed(), 30, "the sign-in view")

    def sign_in(self, key: str) -> str:
        """Sign in through the form; returns the shown name/tenant/role line."""
        self.reset()
        field = self.find("#api-key")
        field.clear()
        field.send_keys(key)
        self.find("#signin-button").click()
        return self.signed_in()

    def signed_in(self) -> str:
        """The "name · tenant · role" line, once the console has signed in."""
        self.wait(lambda d: self.find("#app").is_displayed() and self.find("#who-text").text,
                  30, "the console to sign in")
        return self.find("#who-text").text

    def go(self, route: str, ready_css: str, timeout: float = 30) -> None:
        """Follow an in-app route (hash change) and wait for `ready_css` to show."""
        self.js("window.location.hash = arguments[0]", route)
        self.wait(lambda d: any(e.is_displayed() for e in self.all(ready_css)), timeout,
                  f"{route} to show {ready_css}")

    # -- pages ------------------------------------------------------------
    def job_rows(self) -> dict[str, str]:
        """Job id -> state, as the jobs table shows them now."""
        return self.js("return Object.fromEntries([...document.querySelectorAll('tr[data-job]')]"
                       ".map(r => [r.dataset.job, r.dataset.state]))")

    def loss_steps(self) -> list[int]:
        return self.js(_LOSS_STEPS)

    def gpu_cells(self) -> list[dict[str, Any]]:
        """Every GPU cell of the cluster map with its data attributes and text."""
        return self.js("""return [...document.querySelectorAll('li.gpu')].map(c => ({
            node: c.dataset.node, gpu: +c.dataset.gpu, job: c.dataset.job,
            rank: c.dataset.rank, hidden: c.dataset.hidden === 'true', text: c.innerText}))""")

    def unnamed_controls(self) -> list[str]:
        """Controls on the page, displayed, whose accessible name is empty."""
        out = []
        for el in self.all(CONTROLS):
            if el.is_displayed() and not (el.accessible_name or "").strip():
                out.append((el.get_attribute("outerHTML") or "")[:160])
        return out

    def js_problems(self) -> list[str]:
        """Browser console entries that mean a bug: script errors or CSP violations.

        A refused request (401, 404) is logged by Chrome as a failed load; the
        tests cause those on purpose, so they are not counted.
        """
        return [e["message"] for e in self.d.get_log("browser")
                if "Content Security Policy" in e["message"] or "Uncaught" in e["message"]
                or ("SyntaxError" in e["message"]) or ("TypeError" in e["message"])]

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (the window grows to the page's height)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        height = self.js("return document.documentElement.scrollHeight")
        self.d.set_window_size(WIDTH, min(max(height + 140, HEIGHT), 8000))
        try:
            self.d.save_screenshot(str(path))
        finally:
            self.d.set_window_size(WIDTH, HEIGHT)
        return path


def png_facts(path: Path) -> dict[str, int]:
    """Width, height and the number of distinct byte values of a PNG's pixels.

    A blank or failed capture has a handful of distinct values; a rendered
    page has most of the 256.
    """
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    return {"width": width, "height": height, "bytes": len(data), "distinct": len(set(raw))}


class Rest:
    """The REST API with one key, for setting scenes and checking what the page
    shows against the API itself (plain HTTP: the page speaks nothing else)."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"})

    def raw(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.http.request(method, path, **kw)

    def __call__(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.raw(method, path, **kw)
        assert resp.status_code < 400, f"{method} {path}: {resp.status_code} {resp.text}"
        return resp.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self("GET", f"/v1/jobs/{job_id}")

    def jobs(self) -> list[dict[str, Any]]:
        return self("GET", "/v1/jobs")["jobs"]

    def submit(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self("POST", "/v1/jobs", json=doc)

    def cancel_quietly(self, job_id: str) -> None:
        """Cancel, if it is not over already (409) — for clean-ups."""
        self.raw("POST", f"/v1/jobs/{job_id}/cancel")
