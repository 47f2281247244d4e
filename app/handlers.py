"""One place that turns errors into responses: native `{error, error_type}` or OpenAI's shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from app.errors import (
    MalformedRequestError,
    OverloadedError,
    ServiceError,
    UnsupportedMediaError,
    ValidationFailedError,
)
from app.metrics import Metrics
from app.responses import JSONResponse

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed"}


def error_body(path: str, error: ServiceError, request_id: str | None = None) -> dict[str, object]:
    message = error.message if request_id is None else f"{error.message} (request id {request_id})"
    if path.startswith("/v1/"):
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


def error_response(request: Request, error: ServiceError) -> JSONResponse:
    metrics: Metrics = request.app.state.metrics
    metrics.failures.labels(error.error_type).inc()
    headers = (
        {"Retry-After": str(error.retry_after)} if isinstance(error, OverloadedError) else None
    )
    request_id = request.scope.get("state", {}).get("request_id") if error.status == 500 else None
    return JSONResponse(error_body(request.url.path, error, request_id), error.status, headers)


async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(request, exc)


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    content_type = request.headers.get("content-type", "")
    error: ServiceError
    if not content_type.split(";")[0].strip().endswith("json"):
        error = UnsupportedMediaError(
            f"expected Content-Type application/json, got {content_type!r}"
        )
    elif any(e.get("type") == "json_invalid" for e in errors):
        error = MalformedRequestError("the body is not valid JSON")
    else:
        first = errors[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        # Union types report one error per branch; the first names the field and the problem.
        error = ValidationFailedError(f"{where or 'body'}: {first.get('msg')}", param=where or None)
    return error_response(request, error)


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error = ServiceError(str(exc.detail))
    error.status = exc.status_code
    error.error_type = _HTTP_TYPES.get(exc.status_code, "Malformed")
    error.openai_type = "invalid_request_error"
    return error_response(request, error)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
