"""One place that turns errors into responses: native `{error, error_type}` or OpenAI's shape."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from app.errors import FrameworkError, OverloadedError, ServiceError
from app.metrics import Metrics
from app.responses import JSONResponse

_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed"}


def error_body(path: str, error: ServiceError, request_id: str | None = None) -> dict[str, object]:
    message = error.message if request_id is None else f"{error.message} (request id {request_id})"
    if speaks_openai(path):
        code = error.error_type.lower()
        return {
            "error": {
                "message": message,
                "type": error.openai_type,
                "param": error.param,
                "code": code,
            }
        }
    return {"error": message, "error_type": error.error_type}


def speaks_openai(path: str) -> bool:
    """An OpenAI route, for any model: /v1/... or /embeddings (TEI's alias of
    /v1/embeddings), also under /models/{name}/ where no model has that name (a name may hold
    slashes, so the route is found by how the path goes on)."""
    if path.startswith("/v1/") or path == "/embeddings":
        return True
    return path.startswith("/models/") and ("/v1/" in path or path.endswith("/embeddings"))


def render_error(
    metrics: Metrics, path: str, error: ServiceError, request_id: str | None
) -> JSONResponse:
    """Count the failure and answer it; only a 500 shows the request id to look up in the log."""
    metrics.failures.labels(error.error_type).inc()
    headers = (
        {"Retry-After": str(error.retry_after)} if isinstance(error, OverloadedError) else None
    )
    shown_id = request_id if error.status == 500 else None
    return JSONResponse(error_body(path, error, shown_id), error.status, headers)


def error_response(request: Request, error: ServiceError) -> JSONResponse:
    request_id = request.scope.get("state", {}).get("request_id")
    return render_error(request.app.state.metrics, request.url.path, error, request_id)


async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(request, exc)


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error_type = _HTTP_TYPES.get(exc.status_code, "Malformed")
    response = error_response(request, FrameworkError(str(exc.detail), exc.status_code, error_type))
    # 405 carries the methods that are allowed (Allow), as HTTP requires.
    response.headers.update(exc.headers or {})
    return response


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(HTTPException, on_http_error)
