"""Pure ASGI middleware (cheaper than BaseHTTPMiddleware): request id, body limit, metrics."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Container

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import PayloadTooLargeError, ServiceError
from app.handlers import render_error
from app.metrics import Metrics

log = logging.getLogger(__name__)


class BodyTooLargeError(Exception):
    """The body is over the payload limit."""


class ServiceMiddleware:
    def __init__(
        self, app: ASGIApp, *, metrics: Metrics, payload_limit: int, routes: Container[str]
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.payload_limit = payload_limit
        self.routes = routes
        # Unique per process start, then a counter: cheaper than a uuid4 per request.
        self._id_prefix = uuid.uuid4().hex[:12]
        self._id_counter = itertools.count(1)

    def _next_id(self) -> str:
        return f"{self._id_prefix}-{next(self._id_counter)}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or self._next_id()
        scope.setdefault("state", {})["request_id"] = request_id
        path: str = scope["path"]
        route = path if path in self.routes else "other"
        status = 500
        started_response = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started_response
            if message["type"] == "http.response.start":
                status = message["status"]
                started_response = True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
            await send(message)

        try:
            declared = headers.get(b"content-length")
            if declared is not None and int(declared or 0) > self.payload_limit:
                raise BodyTooLargeError
            if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffered(receive)
            await self.app(scope, receive, send_with_id)
        except BodyTooLargeError:
            error = PayloadTooLargeError(
                f"the body is over the payload limit of {self.payload_limit} bytes"
            )
            response = render_error(self.metrics, path, error, request_id)
            await response(scope, receive, send_with_id)
        except Exception:
            # Starlette's outermost handler would answer without our headers; answer here,
            # with a generic message and the request id, and keep the traceback in the log.
            log.exception("unexpected error, request id %s", request_id)
            if started_response:
                raise
            response = render_error(self.metrics, path, ServiceError("internal error"), request_id)
            await response(scope, receive, send_with_id)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            if route != "other":
                self.metrics.request_seconds.observe(time.perf_counter() - started)

    async def _buffered(self, receive: Receive) -> Receive:
        """Read a chunked body up to the limit, then hand it on as one message."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.payload_limit:
                raise BodyTooLargeError
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect, as usual
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return replay
