"""The one body parser: every POST route's raw body to its request model, or one
ServiceError (415 not JSON, 400 malformed or empty, 422 invalid).

pydantic's own JSON parser does the work in one step. What it refuses as JSON is read again
with `json.loads`, which takes a lone surrogate (`"\\ud800"`: valid JSON, but not text), so
that the error says that rather than "invalid JSON". Bodies that are not UTF-8 are refused,
as JSON must be UTF-8 (RFC 8259), although `json.loads` would guess UTF-16 or UTF-32.
The request models (app/schemas.py) raise `empty_input` where an input is empty and
`not_unicode` for a lone surrogate, and say what a union field takes: this module maps error
types, never field names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.errors import (
    EmptyInputError,
    MalformedRequestError,
    ServiceError,
    ValidationFailedError,
    require_json,
)

Model = TypeVar("Model", bound=BaseModel)
# The error types app/schemas.py raises itself.
EMPTY_INPUT = "empty_input"
NOT_UNICODE = "not_unicode"


def parse_body(model: type[Model], raw: bytes, content_type: str) -> Model:
    require_json(content_type)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc
    if any(e["type"] == "json_invalid" for e in error.errors()):
        try:
            return model.model_validate(read_json(raw))
        except ValidationError as again:
            error = again
    raise validation_error(error.errors()) from None


def read_json(raw: bytes) -> Any:
    """The body as `json.loads` reads it: what pydantic's and orjson's parsers refuse but
    JSON allows (a byte order mark, a lone surrogate), or a MalformedRequestError."""
    try:
        text = raw.decode("utf-8-sig")  # a leading byte order mark may be ignored (RFC 8259)
    except UnicodeDecodeError as exc:
        raise MalformedRequestError("the body is not UTF-8, as JSON must be") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # json.loads recurses into nested arrays
        raise MalformedRequestError("the body is not valid JSON") from exc


def validation_error(errors: Sequence[Any]) -> ServiceError:
    """pydantic's errors as the one the client gets: an empty input first, then the first
    problem, with where it is."""
    if any(e["type"] == EMPTY_INPUT for e in errors):
        return EmptyInputError("an input is empty, or the request holds no input")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    field = str(loc[0]) if loc else None
    if first["type"] == NOT_UNICODE:
        # A union's validator (app/schemas.py `expecting`) says where in it, past its field.
        where = _location(loc) + first.get("ctx", {}).get("where", "")
        return ValidationFailedError(
            f"{where} is not valid Unicode: it holds a lone surrogate", param=field
        )
    path = ".".join(str(part) for part in loc)
    return ValidationFailedError(f"{path or 'body'}: {first['msg']}", param=path or None)


def _location(loc: Sequence[Any]) -> str:
    """An error's location as the body writes it: `inputs.sentences[1]`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text
