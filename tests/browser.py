"""A headless Chromium driven by Selenium through chromedriver, and what a test asks about a load.

A :class:`Page` holds what the browser logged while loading a file: its console (Chromium's
``browser`` log: console messages, uncaught exceptions, resources that failed to load) and its
DevTools network events (the ``performance`` log), so a test can ask for the problems of a load
and for every URL it requested.

Example::

    with Browser() as browser:
        page = browser.open(Path("site/index.html"))
        assert not page.problems
        page.evaluate("document.querySelectorAll('svg').length")
"""
from __future__ import annotations

import base64
import importlib.util
import json
import shutil
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# The machine's network is closed: nothing is to be fetched or updated in the background.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars")


def chromium() -> str | None:
    """The path of an installed Chromium or Chrome, or None."""
    return next((p for name in CHROMIUM if (p := shutil.which(name))), None)


def missing() -> str | None:
    """What the browser tests lack on this machine (Selenium, Chromium, chromedriver), or None."""
    if importlib.util.find_spec("selenium") is None:
        return "Selenium is not installed (pip install -e '.[test]')"
    if chromium() is None:
        return f"no Chromium found (looked for {', '.join(CHROMIUM)}; apt-get install -y chromium)"
    if shutil.which("chromedriver") is None:
        return "no chromedriver found (apt-get install -y chromium-driver)"
    return None


class Browser:
    """A headless Chromium for the duration of a ``with`` block.

    Args:
        width (int): viewport width in CSS pixels. Default: 1280.
        height (int): viewport height in CSS pixels. Default: 900.
    """

    def __init__(self, width: int = 1280, height: int = 900):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = chromium()
        for flag in FLAGS:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        # A named driver keeps Selenium Manager from looking for one (online); the browser is named
        # because chromedriver would otherwise look for Google Chrome.
        self.driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.driver.quit()

    def open(self, path: Path) -> Page:
        """Load the file at ``path`` (returns after its load event) with what the load logged."""
        for log in ("browser", "performance"):  # what earlier loads left
            self.driver.get_log(log)
        self.driver.get(Path(path).resolve().as_uri())
        events = [json.loads(e["message"])["message"] for e in self.driver.get_log("performance")]
        return Page(self.driver, self.driver.get_log("browser"), events)


class Page:
    """One loaded page: its log entries, its network events and a few questions about them."""

    def __init__(self, driver, console: list[dict], events: list[dict]):
        self.driver, self.console, self.events = driver, console, events

    def _params(self, method: str) -> list[dict]:
        return [e["params"] for e in self.events if e["method"] == method]

    @property
    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and resources that failed to load."""
        out = [f"{e['level']} ({e['source']}): {e['message']}" for e in self.console
               if e["level"] in ("SEVERE", "WARNING")]
        out += [f"failed load: {p['errorText']}" for p in self._params("Network.loadingFailed")]
        return out

    @property
    def requested(self) -> list[str]:
        """Every URL the page asked for, the page itself included."""
        return [p["request"]["url"] for p in self._params("Network.requestWillBeSent")]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        return self.driver.execute_script(f"return ({expression});")

    def screenshot(self, path: Path) -> Path:
        """Write a PNG of the whole page (not just the viewport) to ``path``."""
        size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        data = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
