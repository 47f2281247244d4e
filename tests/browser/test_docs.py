"""/docs and /redoc in Chromium: every route listed, with nothing loaded from off the machine."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.browser.conftest import RecordedPage, Server


def operations(server: Server) -> dict[str, tuple[str, str]]:
    """operationId -> (METHOD, path), from the schema both pages render."""
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    return {
        operation["operationId"]: (method.upper(), path)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    }


def test_swagger_ui_lists_every_route_offline(
    server: Server, recorded: RecordedPage, tmp_path: Path
) -> None:
    page = recorded.page
    expected = operations(server)
    page.goto(f"{server.url}/docs")
    blocks = page.locator(".opblock")
    blocks.first.wait_for()
    shown = {
        (
            blocks.nth(k).locator(".opblock-summary-method").inner_text(),
            blocks.nth(k).locator(".opblock-summary-path").get_attribute("data-path"),
        )
        for k in range(blocks.count())
    }
    assert shown == set(expected.values())
    assert {"/embed", "/encode", "/tokenize", "/info"} <= {path for _, path in shown}

    # Opening an operation renders its request body schema, still without leaving the machine.
    page.locator(".opblock-summary", has_text="/encode").first.click()
    page.locator(
        ".opblock-body .body-param, .opblock-body .opblock-section-request-body"
    ).first.wait_for()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(tmp_path / "docs.png"))
    assert recorded.csp_violations() == []
    assert recorded.requests_leaving_loopback() == []


def test_redoc_lists_every_route_offline(
    server: Server, recorded: RecordedPage, tmp_path: Path
) -> None:
    page = recorded.page
    expected = operations(server)
    page.goto(f"{server.url}/redoc")
    sections = page.locator("[data-section-id^='operation/']")
    sections.first.wait_for()
    shown = {
        (sections.nth(k).get_attribute("data-section-id") or "").removeprefix("operation/")
        for k in range(sections.count())
    }
    assert shown == set(expected)
    page.wait_for_load_state("networkidle")  # every request the page starts has ended
    page.screenshot(path=str(tmp_path / "redoc.png"))
    # ReDoc's bundle always asks for its attribution logo from its CDN; the page's CSP blocks
    # it inside the browser, so it never goes out. Anything else would have to stay local.
    blocked = [request for request in recorded.requests if request.failure == "csp"]
    assert {request.url for request in blocked} == set(recorded.requests_leaving_loopback())
    assert all(violation.startswith("img-src ") for violation in recorded.csp_violations())
