"""The service's errors and the one table from error to HTTP status.

    ServiceError
     ├── EmptyInputError        400  no input, or an empty string
     ├── MalformedRequestError  400  body is not valid JSON / UTF-8
     ├── UnauthorizedError      401  missing or wrong API key
     ├── SlowBodyError          408  the body did not arrive within body_timeout
     ├── PayloadTooLargeError   413  body over the payload limit, or too many inputs
     ├── UnknownModelError      404  the request names a model this server does not serve
     ├── UnsupportedMediaError  415  body is not application/json, or comes compressed
     ├── ValidationFailedError  422  a field is invalid (too long, bad dimensions, ...)
     ├── OverloadedError        429  the queue is full (with Retry-After)
     ├── WrongTaskError         424  the loaded model does not do what the route does
     ├── ClientDisconnectedError 499 the client went away (logged and counted, never sent)
     ├── BackendError           500  the forward pass failed for this input
     ├── UnavailableError       503  not ready or draining: nothing ran, safe to retry elsewhere
     ├── DeadlineError          504  no result within request_timeout: work may have run
     └── FrameworkError         4xx  what the framework rejects: unknown route, wrong method, ...
Anything else is a 500 with a request id; its traceback goes to the log only.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of errors that map to an HTTP status; the message is safe to show to clients."""

    status = 500
    error_type = "Internal"
    openai_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EmptyInputError(ServiceError):
    """The request has no input, or an empty one."""

    status, error_type, openai_type = 400, "Empty", "invalid_request_error"


class MalformedRequestError(ServiceError):
    """The body cannot be parsed."""

    status, error_type, openai_type = 400, "Malformed", "invalid_request_error"


class UnauthorizedError(ServiceError):
    """The API key is missing or wrong."""

    status, error_type, openai_type = 401, "Unauthorized", "authentication_error"


class SlowBodyError(ServiceError):
    """The client sent its body too slowly."""

    status, error_type, openai_type = 408, "BodyTimeout", "invalid_request_error"


class PayloadTooLargeError(ServiceError):
    """The body or the number of inputs is over its limit."""

    status, error_type, openai_type = 413, "PayloadTooLarge", "invalid_request_error"


class UnknownModelError(ServiceError):
    """The request names a model this server does not serve (OpenAI answers 404 too)."""

    status, error_type, openai_type = 404, "UnknownModel", "invalid_request_error"


class UnsupportedMediaError(ServiceError):
    """The body is not JSON, or comes in a Content-Encoding (compressed)."""

    status, error_type, openai_type = 415, "UnsupportedMediaType", "invalid_request_error"


def is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON as FastAPI reads bodies: application/json or
    application/*+json."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def require_json(content_type: str) -> None:
    if not is_json(content_type):
        raise UnsupportedMediaError(f"expected Content-Type application/json, got {content_type!r}")


def require_plain(content_encoding: str) -> None:
    """A body as it is: no Content-Encoding (gzip, say) but `identity`, which the server
    does not undo (RFC 9110 answers one it does not support with 415)."""
    if content_encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaError(
            f"Content-Encoding {content_encoding!r} is not supported: send the body as it is"
        )


class ValidationFailedError(ServiceError):
    """A field is invalid."""

    status, error_type, openai_type = 422, "Validation", "invalid_request_error"


class WrongTaskError(ServiceError):
    """The route needs another kind of model (text-embeddings-inference answers 424 too)."""

    status, error_type, openai_type = 424, "WrongModelType", "invalid_request_error"


class OverloadedError(ServiceError):
    """The queue is full; the client should retry later."""

    status, error_type, openai_type = 429, "Overloaded", "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClientDisconnectedError(ServiceError):
    """The client went away before its results were ready (nginx's 499)."""

    status, error_type = 499, "ClientDisconnected"


class BackendError(ServiceError):
    """The forward pass failed for an input of this request."""

    status, error_type, openai_type = 500, "Backend", "server_error"


class UnavailableError(ServiceError):
    """The service is not ready or is draining; nothing of the request ran."""

    status, error_type, openai_type = 503, "Unhealthy", "server_error"


class DeadlineError(ServiceError):
    """No result within the request timeout. Not a 503: a load balancer that retries 503s
    elsewhere must not run work again that may already have run."""

    status, error_type, openai_type = 504, "Timeout", "server_error"


class FrameworkError(ServiceError):
    """An HTTP-level rejection from the framework (404, 405, an unreadable body)."""

    openai_type = "invalid_request_error"

    def __init__(self, message: str, status: int, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
