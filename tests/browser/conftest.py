"""A real server process and Debian's Chromium, driven through Playwright (no browser download)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, Request, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
# Headless as root needs --no-sandbox; the rest stop Chromium's own background connections,
# which this closed network refuses.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_KEY = "playground-test-key"
# The playground asks for a mean over the default model's 12 heads, which computes each: small
# enough that a 30-token sentence's maps (12 x 900 values) are over it, large enough for the
# short sentences' (under 20 tokens, so under 12 x 400 values).
MAX_ATTENTION_VALUES = 12 * 400
# Collects the page's Content-Security-Policy violations; Playwright injects it before any
# page script, outside the page's CSP.
RECORD_CSP_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', (event) => {
  window.__cspViolations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_ready(server: Server, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log.read_text()
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not ready:\n{server.log.read_text()}")


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for every browser test: the default model, an API key, a small attention cap."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "app",
        *("--host", "127.0.0.1", "--port", str(port), "--devices", "cpu", "--threads", "1"),
        *("--api-key", API_KEY, "--max-attention-values", str(MAX_ATTENTION_VALUES)),
    ]
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_ready(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# Package scope, not session: Playwright's sync API keeps an event loop running in this
# thread until it stops, and the async tests in other folders need the thread free of one.
@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    assert CHROMIUM.exists(), "Debian's chromium is missing: `make system-deps` installs it"
    with sync_playwright() as playwright:
        # launch() starts Chromium on a fresh temporary profile of its own.
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        yield browser
        browser.close()


@dataclass
class RecordedPage:
    """A fresh page that remembers every request it makes."""

    page: Page
    requests: list[Request] = field(default_factory=list)

    def csp_violations(self) -> list[str]:
        violations: list[str] = self.page.evaluate("() => window.__cspViolations")
        return violations

    def requests_leaving_loopback(self) -> list[str]:
        """http(s) requests to any host but 127.0.0.1 (data: and blob: stay in the page)."""
        return [
            request.url
            for request in self.requests
            if urlsplit(request.url).scheme not in ("data", "blob")
            and urlsplit(request.url).hostname != "127.0.0.1"
        ]


@pytest.fixture
def recorded(browser: Browser) -> Iterator[RecordedPage]:
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    context.add_init_script(RECORD_CSP_VIOLATIONS)
    requests: list[Request] = []
    # Playwright wraps handlers with an attribute, which a builtin method cannot take.
    context.on("request", lambda request: requests.append(request))
    recorded = RecordedPage(context.new_page(), requests)
    try:
        yield recorded
    finally:
        context.close()
