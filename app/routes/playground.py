"""Pages for a person with a browser: a landing page, the playground, and offline API docs.

Everything is served by the app itself, so the pages work on a machine without internet: the
playground's files are this package's data, and Swagger UI's and ReDoc's come from the pinned
`fastapi-offline` package (FastAPI's defaults load them from a CDN). Only GET is claimed here;
`POST /` belongs to the API.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, HTMLResponse, Response

router = APIRouter(include_in_schema=False)

PAGES = Path(__file__).resolve().parent.parent / "playground"
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
# The only files /static/ serves: a fixed table, so no request path ever reaches the disk.
STATIC_FILES = {
    "playground.js": PAGES / "playground.js",
    "playground.css": PAGES / "playground.css",
    "swagger-ui-bundle.js": DOCS_ASSETS / "swagger-ui-bundle.js",
    "swagger-ui.css": DOCS_ASSETS / "swagger-ui.css",
    "redoc.standalone.js": DOCS_ASSETS / "redoc.standalone.js",
    "favicon.png": DOCS_ASSETS / "favicon.png",
}

# The page's own origin and nothing else; no inline script or style on our own pages.
PAGE_CSP = (
    "default-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'self'"
)
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
# A <script> with no attributes is an inline one (those that load a file have src=...).
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def docs_csp(html: str, *, redoc: bool) -> str:
    """Own origin only, plus what the docs' libraries cannot work without.

    Inline scripts (Swagger UI's start-up call) are allowed by their hashes. ReDoc's
    styled-components insert <style> elements at run time, so ReDoc needs 'unsafe-inline'
    styles (FastAPI's page has one inline <style> too), and its search runs in a blob:
    worker. Both draw icons from data: URIs. Nothing here names another origin: ReDoc's
    attribution logo, which its bundle always loads from its CDN, is blocked.
    """
    hashes = "".join(f" {_sha256_source(body)}" for body in _INLINE_SCRIPT.findall(html))
    styles = " 'unsafe-inline'" if redoc else ""
    worker = "; worker-src 'self' blob:" if redoc else ""
    return (
        f"default-src 'self'; script-src 'self'{hashes}; style-src 'self'{styles}; "
        f"img-src 'self' data:{worker}; object-src 'none'; base-uri 'self'; "
        "form-action 'self'; frame-ancestors 'self'"
    )


def _sha256_source(body: str) -> str:
    digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode("ascii")
    return f"'sha256-{digest}'"


def _html(path: Path) -> HTMLResponse:
    return HTMLResponse(
        path.read_text(encoding="utf-8"),
        headers={**COMMON_HEADERS, "Content-Security-Policy": PAGE_CSP},
    )


def _root_path(request: Request) -> str:
    """The prefix a proxy mounts the app under, as FastAPI's own docs routes use it."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _docs_page(page: HTMLResponse, *, redoc: bool) -> HTMLResponse:
    html = bytes(page.body).decode("utf-8")
    csp = docs_csp(html, redoc=redoc)
    return HTMLResponse(html, headers={**COMMON_HEADERS, "Content-Security-Policy": csp})


@router.get("/")
async def home() -> HTMLResponse:
    return _html(PAGES / "home.html")


@router.get("/playground")
async def playground() -> HTMLResponse:
    return _html(PAGES / "index.html")


@router.get("/static/{name}")
async def static_file(name: str, request: Request) -> Response:
    path = STATIC_FILES.get(name)
    if path is None:
        raise HTTPException(404, "Not Found")
    # The names carry no version, so browsers revalidate each time (a 304 when unchanged)
    # and see a new release at once.
    headers = {**COMMON_HEADERS, "Cache-Control": "no-cache"}
    response = FileResponse(path, headers=headers, stat_result=path.stat())
    etag = response.headers["etag"]
    if etag in (tag.strip() for tag in request.headers.get("if-none-match", "").split(",")):
        return Response(status_code=304, headers={**headers, "ETag": etag})
    return response


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    root = _root_path(request)
    page = get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}/static/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/static/swagger-ui.css",
        swagger_favicon_url=f"{root}/static/favicon.png",
        # The default points at Swagger's public online validator; null turns validation off.
        swagger_ui_parameters={"validatorUrl": None},
    )
    return _docs_page(page, redoc=False)


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    root = _root_path(request)
    page = get_redoc_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}/static/redoc.standalone.js",
        redoc_favicon_url=f"{root}/static/favicon.png",
        with_google_fonts=False,
    )
    return _docs_page(page, redoc=True)
