"""A minimal W3C WebDriver client over HTTP (no selenium): drives Debian's ``chromium`` through its
``chromedriver`` for the web page's tests and the docs' screenshot (benchmarks/page_screenshot.py)."""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


def browser_paths() -> tuple[str, str] | None:
    """``(chromium, chromedriver)`` when both are installed (Debian: ``apt install chromium chromium-driver``)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Browser:
    """A headless chromium session: :meth:`open`, :meth:`find`, :meth:`type`, :meth:`click`, :meth:`js`,
    :meth:`screenshot`; a context manager (the driver is stopped on exit)."""

    def __init__(self, width: int = 1100, height: int = 820) -> None:
        paths = browser_paths()
        if paths is None:
            raise RuntimeError("chromium and chromedriver are not installed")
        browser, driver = paths
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.time() + 30
        while True:
            try:
                if self._http.get("/status").json()["value"]["ready"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)
        options = {"binary": browser, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                               "--disable-dev-shm-usage", f"--window-size={width},{height}"]}
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None):
        r = self._http.request(method, path, json=body)
        value = r.json().get("value")
        if r.status_code != 200:
            raise RuntimeError(f"webdriver {method} {path}: {value}")
        return value

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def open(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def find(self, css: str) -> str:
        return self._call("POST", self._s("/element"), {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css: str, text: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/value"), {"text": text})

    def click(self, css: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/click"), {})

    def js(self, script: str, *args):
        return self._call("POST", self._s("/execute/sync"), {"script": script, "args": list(args)})

    def wait(self, script: str, timeout: float = 60.0, what: str = "the page"):
        """Poll ``script`` until it returns something truthy; returns it."""
        deadline = time.time() + timeout
        while True:
            value = self.js(script)
            if value:
                return value
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def screenshot(self, path: str | Path) -> None:
        Path(path).write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))

    def close(self) -> None:
        try:
            if getattr(self, "session", None):
                self._http.delete(self._s(""))
        finally:
            self._http.close()
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
