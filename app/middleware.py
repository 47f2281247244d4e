"""Pure ASGI middleware (cheaper than BaseHTTPMiddleware), in front of every route.

It gives each request an id, counts it in the metrics, and protects the service from
careless or hostile clients before any route runs: past `max_concurrent_requests` in
progress a request gets a fast 429 (probes and metrics never count), a missing or wrong API
key is refused before the body is read, a body over the payload limit as soon as that is
known, and a body that trickles in slower than `body_timeout` gets a 408.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Collection, Container, Mapping

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.balance import ConnectionBalance
from app.dispatch import PostRoute, dispatch, main_route
from app.errors import (
    ClientDisconnectedError,
    OverloadedError,
    PayloadTooLargeError,
    ServiceError,
    SlowBodyError,
    UnauthorizedError,
    UnknownModelError,
    require_plain,
)
from app.handlers import render_error
from app.logs import RequestIds
from app.metrics import Metrics
from app.models import ServedModels

log = logging.getLogger(__name__)


class ServiceMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        payload_limit: int,
        body_timeout: float,
        routes: Collection[str],
        protected: Container[tuple[str, str]],
        api_key: str | None,
        max_concurrent: int,
        unlimited: Container[str],
        models: ServedModels,
        post_routes: Mapping[str, PostRoute],
        balance: ConnectionBalance | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.payload_limit = payload_limit
        self.body_timeout = body_timeout
        self.routes = routes
        # A templated route's own label (/static/{name}), by the path's start before it.
        self.templates = {route.partition("{")[0]: route for route in routes if "{" in route}
        self.protected = protected
        self.api_key = api_key.encode() if api_key else None
        # Requests in progress, and the paths that never count: probes must answer whatever
        # the load, or an orchestrator restarts a busy replica.
        self.max_concurrent = max_concurrent
        self.unlimited = unlimited
        self.active = 0
        self.models = models
        self.post_routes = post_routes
        self.balance = balance
        self._ids = RequestIds()
        # The requests counter's child per (route, status): `labels()` takes a lock and builds
        # a key on every call. Both sets are small (the app's routes and "other", the statuses).
        self._counters: dict[tuple[str, int], Counter] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or self._ids.next()
        scope.setdefault("state", {})["request_id"] = request_id
        path: str = scope["path"]
        route = "other"
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
                if self.balance is not None and self.balance.should_close():
                    message["headers"].append((b"connection", b"close"))
                    self.metrics.connections_rebalanced.inc()
            await send(message)

        admitted = False
        self.metrics.tally.begin()
        try:
            # A path under /models/{name}/ is that model's route (app/models.py); the served
            # names are told only to a client with the key.
            try:
                named, path = self.models.route(path)
            except UnknownModelError:
                self._require_key(headers)
                raise
            route = path if path in self.routes else self._templated(path)
            self._check_key(scope["method"], path, headers)  # a wrong key is a 401, busy or not
            if path not in self.unlimited:
                self._admit()
                admitted = True
            if scope["method"] == "POST" and (path == "/" or path in self.post_routes):
                if (encoding := headers.get(b"content-encoding")) is not None:
                    require_plain(encoding.decode("latin-1"))
                raw = await self._read_body(headers, receive)
                post = (
                    main_route(self.post_routes, named or self.models.default, raw)
                    if path == "/"
                    else self.post_routes[path]
                )
                content_type = headers.get(b"content-type", b"").decode("latin-1")
                response = await dispatch(
                    path, post, raw, content_type, self.models, named, receive
                )
                await response(scope, receive, send_with_id)
                return
            if named is not None:  # the framework's routes, for that model (its /info, say)
                scope = {**scope, "path": path, "raw_path": path.encode()}
                scope["state"]["service"] = named
            await self.app(scope, receive, send_with_id)
        except ServiceError as error:  # raised here (limits, the API key, the body) or a route
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
            if admitted:
                self.active -= 1
            self._count(route, status)
            if route != "other":
                self.metrics.tally.observe(
                    self.metrics.request_seconds, time.perf_counter() - started
                )
            self.metrics.tally.end()

    def _templated(self, path: str) -> str:
        """The templated route a path is one of (one path segment in place of its
        parameter), else `other`: a label for every path would grow without bound."""
        for start, template in self.templates.items():
            if path.startswith(start) and "/" not in path[len(start) :]:
                return template
        return "other"

    def _count(self, route: str, status: int) -> None:
        counter = self._counters.get((route, status))
        if counter is None:
            counter = self.metrics.requests.labels(route, str(status))
            self._counters[route, status] = counter
        self.metrics.tally.count(counter)

    def _admit(self) -> None:
        if self.active >= self.max_concurrent:
            raise OverloadedError(
                f"{self.active} requests are in progress, the limit of this server; retry in 1 s",
                retry_after=1,
            )
        self.active += 1

    def _check_key(self, method: str, path: str, headers: dict[bytes, bytes]) -> None:
        """Inference and /info need `Authorization: Bearer <key>` when an API key is set."""
        if (method, path) in self.protected:
            self._require_key(headers)

    def _require_key(self, headers: dict[bytes, bytes]) -> None:
        if self.api_key is None:
            return
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.api_key):
            raise UnauthorizedError("missing or wrong API key (send 'Authorization: Bearer <key>')")

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        """Read the whole body, within the payload limit and the body timeout."""
        declared = headers.get(b"content-length")
        if declared is not None and declared_over(declared, self.payload_limit):
            raise self._too_large()
        body = bytearray()
        with BodyDeadline(self.body_timeout) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":  # never a partial body as whole
                    raise ClientDisconnectedError("the client disconnected mid-body")
                body += message.get("body", b"")
                if len(body) > self.payload_limit:
                    raise self._too_large()
                if not message.get("more_body", False):
                    break
        if deadline.expired:
            raise SlowBodyError(
                f"the body did not arrive within the body timeout of {self.body_timeout:g} s"
            )
        return bytes(body)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the body is over the payload limit of {self.payload_limit} bytes"
        )


class BodyDeadline:
    """Cancels the current task once `seconds` have passed, and swallows that cancellation
    (`expired` then says so); a cancellation from elsewhere goes on. As asyncio.timeout does,
    which costs several times the CPU of this one timer on every request (under uvloop),
    although most bodies arrive with their headers."""

    __slots__ = ("_cancelling", "_fired", "_task", "_timer", "expired")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        assert task is not None, "inside a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)
        self._fired = False
        self.expired = False

    def _expire(self) -> None:
        self._fired = True
        self._task.cancel()

    def __enter__(self) -> BodyDeadline:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> bool:
        self._timer.cancel()
        if self._fired:
            # The cancellation asked for is taken back whatever the block did, and swallowed
            # only if it ended the block and no one else asked for one meanwhile.
            taken_back = self._task.uncancel() <= self._cancelling
            self.expired = taken_back and kind is asyncio.CancelledError
        return self.expired


def declared_over(declared: bytes, limit: int) -> bool:
    """Whether a Content-Length header states more bytes than `limit`. One that is not a
    number is left to the body's own reading; leading zeros are taken off first, as `int`
    refuses numbers of more than 4,300 digits."""
    if not declared.isdigit():
        return False
    digits = declared.lstrip(b"0")
    return len(digits) > len(str(limit)) or int(digits or b"0") > limit
