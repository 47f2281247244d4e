"""The browser-facing routes: home page, playground, static files and offline API docs."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

from app.main import create_app
from app.routes import playground
from tests.app.conftest import make_settings, running_app

pytestmark = pytest.mark.anyio
LINK = re.compile(r'(?:src|href)="([^"]+)"')


@pytest.fixture
async def client(tiny_checkpoint: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A ready app, since the home page links /health too."""
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        yield client


@pytest.mark.parametrize("path", ["/", "/playground"])
async def test_pages_link_only_to_what_the_app_serves(client: httpx.AsyncClient, path: str) -> None:
    page = await client.get(path)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == playground.PAGE_CSP
    assert page.headers["x-content-type-options"] == "nosniff"
    links = LINK.findall(page.text)
    assert links
    for link in links:
        target = await client.get(urljoin(f"http://test{path}", link))
        assert target.status_code == 200, link


async def test_the_home_page_links_the_playground_and_the_docs(
    client: httpx.AsyncClient,
) -> None:
    links = set(LINK.findall((await client.get("/")).text))
    assert {"playground", "docs", "redoc"} <= links


def test_get_slash_leaves_post_to_the_api() -> None:
    methods = {
        method
        for route in playground.router.routes
        if getattr(route, "path", None) == "/"
        for method in getattr(route, "methods", set())
    }
    assert methods == {"GET"}


async def test_own_files_name_no_other_origin(client: httpx.AsyncClient) -> None:
    for path in ("/", "/playground", "/static/playground.js", "/static/playground.css"):
        body = (await client.get(path)).text
        assert "http://" not in body and "https://" not in body, path


JAVASCRIPT = ("text/javascript", "application/javascript")  # the name varies with Python


@pytest.mark.parametrize(
    ("name", "media_types"),
    [
        ("playground.js", JAVASCRIPT),
        ("playground.css", ("text/css",)),
        ("swagger-ui-bundle.js", JAVASCRIPT),
        ("swagger-ui.css", ("text/css",)),
        ("redoc.standalone.js", JAVASCRIPT),
        ("favicon.png", ("image/png",)),
    ],
)
async def test_static_files_are_served_and_revalidated(
    client: httpx.AsyncClient, name: str, media_types: tuple[str, ...]
) -> None:
    first = await client.get(f"/static/{name}")
    assert first.status_code == 200
    assert first.headers["content-type"].split(";")[0] in media_types
    assert first.headers["cache-control"] == "no-cache"
    assert len(first.content) > 100
    again = await client.get(f"/static/{name}", headers={"if-none-match": first.headers["etag"]})
    assert again.status_code == 304


@pytest.mark.parametrize("name", ["index.html", "nope.js", "..%2Fmain.py", "%2E%2E"])
async def test_only_the_listed_static_files_exist(client: httpx.AsyncClient, name: str) -> None:
    response = await client.get(f"/static/{name}")
    assert response.status_code == 404
    assert response.json() == {"error": "Not Found", "error_type": "NotFound"}


def inline_script_hashes(html: str) -> set[str]:
    return {
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    }


@pytest.mark.parametrize(
    ("path", "asset"),
    [("/docs", "/static/swagger-ui-bundle.js"), ("/redoc", "/static/redoc.standalone.js")],
)
async def test_docs_load_their_assets_from_the_app(
    client: httpx.AsyncClient, path: str, asset: str
) -> None:
    page = await client.get(path)
    assert page.status_code == 200
    assert f'src="{asset}"' in page.text
    assert "/openapi.json" in page.text
    assert "https://" not in page.text and "http://" not in page.text
    policy = page.headers["content-security-policy"]
    assert "http" not in policy
    assert "default-src 'self'" in policy
    # Swagger UI starts from one inline script, allowed by its hash and by nothing broader.
    script_src = next(d for d in policy.split("; ") if d.startswith("script-src "))
    assert set(script_src.split()[2:]) == inline_script_hashes(page.text)
    assert "'unsafe-inline'" not in script_src


async def test_only_redoc_gets_inline_styles(client: httpx.AsyncClient) -> None:
    swagger = (await client.get("/docs")).headers["content-security-policy"]
    redoc = (await client.get("/redoc")).headers["content-security-policy"]
    assert "style-src 'self';" in swagger
    assert "style-src 'self' 'unsafe-inline';" in redoc


async def test_docs_follow_the_proxy_prefix(tiny_checkpoint: Path) -> None:
    app = create_app(make_settings(tiny_checkpoint))
    transport = httpx.ASGITransport(app=app, root_path="/embedder")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        swagger = (await client.get("/docs")).text
        redoc = (await client.get("/redoc")).text
    assert "url: '/embedder/openapi.json'" in swagger
    assert 'href="/embedder/static/swagger-ui.css"' in swagger
    assert 'spec-url="/embedder/openapi.json"' in redoc
    assert 'src="/embedder/static/redoc.standalone.js"' in redoc


async def test_pages_stay_out_of_the_schema(client: httpx.AsyncClient) -> None:
    paths = set((await client.get("/openapi.json")).json()["paths"])
    assert paths.isdisjoint({"/", "/playground", "/docs", "/redoc", "/static/{name}"})
    assert "/embed" in paths


async def test_the_files_are_counted_under_their_route(client: httpx.AsyncClient) -> None:
    """Under the templated route, not `other`; a path below it that no route takes stays
    `other`, so that no label comes from a client's path."""
    await client.get("/static/playground.js")
    await client.get("/static/a/b")
    metrics = (await client.get("/metrics")).text
    assert 'embed_requests_total{route="/static/{name}",status="200"} 1.0' in metrics
    assert 'embed_requests_total{route="other",status="404"} 1.0' in metrics
