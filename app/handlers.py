"""One place that turns errors into responses: native `{error, error_type}` or OpenAI's shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from app.errors import (
    EmptyInputError,
    FrameworkError,
    MalformedRequestError,
    OverloadedError,
    ServiceError,
    UnsupportedMediaError,
    ValidationFailedError,
    is_json,
)
from app.metrics import Metrics
from app.responses import JSONResponse
from app.schemas import IDS_DESCRIPTION, INPUTS_DESCRIPTION

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


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    content_type = request.headers.get("content-type", "")
    error: ServiceError
    if not is_json(content_type):
        error = UnsupportedMediaError(content_type)
    elif any(e.get("type") == "json_invalid" for e in errors):
        error = MalformedRequestError("the body is not valid JSON")
    elif _is_empty_input(errors):
        error = EmptyInputError("an input is empty, or the request holds no input")
    else:
        error = _not_unicode(errors) or _first_problem(errors)
    return error_response(request, error)


# Fields that hold what is to be encoded; an empty one is a 400 (Empty), not a 422.
_INPUT_FIELDS = ("inputs", "input", "texts", "query")


def _is_empty_input(errors: Sequence[Any]) -> bool:
    """An empty string or list where inputs go (the schema says minLength 1): a 400, as
    OpenAI and text-embeddings-inference answer it, rather than a 422."""
    for error in errors:
        where = [part for part in error.get("loc", ()) if part != "body"]
        too_short = error.get("type") in ("string_too_short", "too_short")
        if too_short and where and where[0] in _INPUT_FIELDS:
            return True
    return False


def _not_unicode(errors: Sequence[Any]) -> ValidationFailedError | None:
    """A lone surrogate ("\\ud800" is valid JSON) in a string: pydantic refuses it before the
    tokenizer sees it; say so, rather than that a string was expected."""
    for e in errors:
        if e.get("type") == "string_unicode":
            loc = [part for part in e.get("loc", ()) if part != "body"]
            field = str(loc[0]) if loc else "body"
            where = "".join(f"[{part}]" for part in loc if isinstance(part, int))
            return ValidationFailedError(
                f"{field}{where} is not valid Unicode: it holds a lone surrogate",
                param=field,
            )
    return None


def _first_problem(errors: Sequence[Any]) -> ValidationFailedError:
    loc = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    field = loc[0] if loc else None
    if field in _UNION_FIELDS and _is_union_error(loc):
        # A union: pydantic reports one error per branch, none of which says what would fit.
        expected = _UNION_FIELDS[field].lower()
        return ValidationFailedError(f"{field}: expected {expected}", param=field)
    where = ".".join(loc)
    return ValidationFailedError(f"{where or 'body'}: {errors[0].get('msg')}", param=where or None)


# Fields whose type is a union, and what fits them.
_UNION_FIELDS = {"inputs": INPUTS_DESCRIPTION, "input": INPUTS_DESCRIPTION, "ids": IDS_DESCRIPTION}


def _is_union_error(loc: Sequence[str]) -> bool:
    """pydantic names a union's branch after the field, by its type ("constrained-str",
    "list[...]"), never a Python name as a field of a nested model is (a similarity body's
    inputs.sentences, say), whose own message says what is wrong."""
    return len(loc) > 1 and not loc[1].isidentifier()


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error_type = _HTTP_TYPES.get(exc.status_code, "Malformed")
    response = error_response(request, FrameworkError(str(exc.detail), exc.status_code, error_type))
    # 405 carries the methods that are allowed (Allow), as HTTP requires.
    response.headers.update(exc.headers or {})
    return response


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
