"""A headless Chromium driven over the DevTools protocol through a pipe, standard library only.

Chromium started with ``--remote-debugging-pipe`` reads protocol messages from fd 3 and writes
to fd 4, each a JSON object followed by a NUL byte (what Puppeteer's ``pipe: true`` does), so no
websocket client and no port are needed. A :class:`Page` records what a test asks about a load:
console errors and warnings, uncaught exceptions, log entries (failed resource loads land there)
and every URL requested.

Example::

    with Browser() as browser:
        page = browser.open(Path("site/index.html"))
        assert not page.problems
        page.evaluate("document.querySelectorAll('svg').length")
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--remote-debugging-pipe")
TIMEOUT_S = 60.0


def chromium() -> str | None:
    """The path of an installed Chromium or Chrome, or None."""
    return next((p for name in CANDIDATES if (p := shutil.which(name))), None)


class BrowserError(RuntimeError):
    """The browser answered a command with an error, died, or did not answer in time."""


class Browser:
    """A headless Chromium for the duration of a ``with`` block.

    Args:
        width (int): viewport width in CSS pixels. Default: 1280.
        height (int): viewport height in CSS pixels. Default: 900.
    """

    def __init__(self, width: int = 1280, height: int = 900):
        path = chromium()
        if path is None:
            raise BrowserError(f"no Chromium found (looked for {', '.join(CANDIDATES)})")
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def onto_fds_3_and_4():  # in the child, before exec
            r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 10)
            w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self._process = subprocess.Popen(
            [path, *FLAGS, f"--window-size={width},{height}", f"--user-data-dir={self._profile.name}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=onto_fds_3_and_4, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._listeners: dict[str, list] = {}  # session id -> event lists of its pages
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.width, self.height = width, height

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except BrowserError:
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_chrome)
        self._profile.cleanup()

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_chrome, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    self._replies[message["id"]].put(message)
                else:
                    for events in self._listeners.get(message.get("sessionId"), ()):
                        events.append(message)
        os.close(self._from_chrome)
        for pending in self._replies.values():
            pending.put({"error": {"message": "the browser closed the connection"}})

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = TIMEOUT_S) -> dict:
        """Send one protocol command and wait for its result."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            self._replies[ident] = queue.Queue()
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"{method}: the browser is gone") from None
        try:
            reply = self._replies[ident].get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer within {timeout:g} s") from None
        finally:
            del self._replies[ident]
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply["result"]

    def open(self, path: Path) -> Page:
        """Load the file at ``path`` in a new tab and wait for its load event."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self._listeners.setdefault(session, []).append(page.events)
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                          "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.navigate", {"url": Path(path).resolve().as_uri()}, session)
        page.wait_for("Page.loadEventFired")
        return page


class Page:
    """One loaded tab: its protocol events and a few questions about them."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session
        self.events: list[dict] = []

    def wait_for(self, method: str, timeout: float = TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if event["method"] == method:
                    return event
            time.sleep(0.02)
        raise BrowserError(f"no {method} within {timeout:g} s")

    def _params(self, method: str) -> list[dict]:
        return [e["params"] for e in list(self.events) if e["method"] == method]

    @property
    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, error log entries and failed loads."""
        out = [f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
               for p in self._params("Runtime.consoleAPICalled") if p["type"] in ("error", "warning", "assert")]
        out += [f"exception: {p['exceptionDetails'].get('exception', {}).get('description') or p['exceptionDetails']['text']}"
                for p in self._params("Runtime.exceptionThrown")]
        out += [f"log.{p['entry']['level']}: {p['entry']['text']} {p['entry'].get('url', '')}"
                for p in self._params("Log.entryAdded") if p["entry"]["level"] in ("error", "warning")]
        out += [f"failed load: {p['errorText']}" for p in self._params("Network.loadingFailed")]
        return out

    @property
    def requested(self) -> list[str]:
        """Every URL the page asked for, the page itself included."""
        return [p["request"]["url"] for p in self._params("Network.requestWillBeSent")]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable results only)."""
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   self.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Write a PNG of the whole page (not just the viewport) to ``path``."""
        data = self.browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                                 self.session)["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
