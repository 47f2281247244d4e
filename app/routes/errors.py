"""The error bodies each route documents in OpenAPI."""

from __future__ import annotations

from typing import Any

from app.schemas import ErrorResponse, OpenAIErrorResponse

_DESCRIPTIONS = {
    400: "Malformed JSON, or an empty input",
    401: "Missing or wrong API key",
    413: "Body over the payload limit, or too many inputs",
    415: "Body is not application/json",
    422: "Invalid field: too long with truncation off, bad dimensions, ids outside the vocabulary",
    429: "Queue full; retry after the Retry-After header's seconds",
    500: "The forward pass failed, or an unexpected error (with a request id)",
    503: "Not ready, draining, or no result within the request timeout",
}


def error_responses(openai: bool = False) -> dict[int | str, dict[str, Any]]:
    model = OpenAIErrorResponse if openai else ErrorResponse
    return {status: {"model": model, "description": text} for status, text in _DESCRIPTIONS.items()}
