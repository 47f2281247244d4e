"""The error bodies each route documents in OpenAPI."""

from __future__ import annotations

from typing import Any

from app.schemas import ErrorResponse, OpenAIErrorResponse

_DESCRIPTIONS = {
    400: "Malformed JSON, or an empty input",
    401: "Missing or wrong API key",
    408: "The body did not arrive within the body timeout",
    413: "Body over the payload limit, or too many inputs, characters or tokens",
    415: "Body is not application/json",
    422: (
        "Invalid field: too long with truncation off, bad dimensions, ids outside the "
        "vocabulary, text that is not valid Unicode, too many per-token or attention values"
    ),
    424: "The loaded model does not do what this route does (e.g. /rerank on an embedding model)",
    429: "Queue full (nothing ran); retry after the Retry-After header's seconds",
    500: "The forward pass failed, or an unexpected error (with a request id)",
    503: "Not ready or draining (nothing ran; safe to retry on another replica)",
    504: "No result within the request timeout (the work may have run)",
}


def error_responses(openai: bool = False) -> dict[int | str, dict[str, Any]]:
    model = OpenAIErrorResponse if openai else ErrorResponse
    return {status: {"model": model, "description": text} for status, text in _DESCRIPTIONS.items()}
