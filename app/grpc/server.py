"""The tei.v1 gRPC server of a front-end process: grpc.aio on its own port (`grpc_port`),
with server reflection, beside the HTTP server and on the same event loop and service.

Every call goes through one wrapper: the API key (when one is set), the same limit of
requests in progress as HTTP (`max_concurrent_requests`; a unary call past it gets a fast
RESOURCE_EXHAUSTED, a stream waits for room), the service's errors as gRPC statuses with
their messages, and the request counters HTTP counts too. A bidirectional stream runs its
messages concurrently, so that they batch together, and answers them in order; it ends at
its first error. A client that cancels cancels its call's work, which leaves the engine's
queue. Draining (app/server.py) stops new calls, ends idle streams with UNAVAILABLE and lets
the calls in flight finish within the grace period.

Under the split placement every front end listens on the port: gRPC sets SO_REUSEPORT, and
the kernel spreads connections over them; a server alone binds the port exclusively.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from app.errors import (
    MalformedRequestError,
    OverloadedError,
    ServiceError,
    UnauthorizedError,
    UnavailableError,
)
from app.grpc.health import SERVICE_NAME as HEALTH_SERVICE
from app.grpc.health import add_health
from app.grpc.protocol import pb
from app.grpc.service import Answer, Reply, TeiServicer
from app.logs import RequestIds
from app.metrics import Metrics
from app.service import EmbeddingService
from app.settings import Settings

log = logging.getLogger(__name__)

# The HTTP status of each service error, as text-embeddings-inference maps its errors.
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    424: grpc.StatusCode.FAILED_PRECONDITION,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Messages of one stream in flight or answered but not yet sent: bounds what a client that
# sends faster than it reads holds in memory (HTTP/2 flow control then holds it back).
STREAM_WINDOW = 256
Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())


def status_of(error: ServiceError) -> grpc.StatusCode:
    return CODES.get(error.status, grpc.StatusCode.INTERNAL)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message that did not parse (bytes that are not the message, text that is not UTF-8):
    handed to the call, which answers INVALID_ARGUMENT, where grpc would answer INTERNAL."""

    reason: str

    def error(self) -> MalformedRequestError:
        return MalformedRequestError(f"the message cannot be parsed: {self.reason}")


def parser(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    return parse


class GrpcServer:
    """The gRPC server of one front end; `service()` is the service the calls go to."""

    def __init__(
        self,
        settings: Settings,
        service: Callable[[], EmbeddingService],
        metrics: Metrics,
        *,
        shared_port: bool = False,
    ) -> None:
        assert settings.grpc_port is not None, "a gRPC port is set"
        self.settings = settings
        self.port = settings.grpc_port
        self.metrics = metrics
        self.shared_port = shared_port
        self.servicer = TeiServicer(service)
        self.api_key = (
            settings.api_key.get_secret_value().encode() if settings.api_key is not None else None
        )
        self.slots = asyncio.Semaphore(settings.max_concurrent_requests)
        self.closing = False
        # Each open bidirectional stream's queue, to end idle ones on drain.
        self.streams: set[asyncio.Queue[Any]] = set()
        self.server: grpc.aio.Server | None = None
        self._ids = RequestIds()
        self._counters: dict[tuple[str, int], Any] = {}

    # Lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        """Listen and serve; the port (OSError if it cannot be bound)."""
        host = self.settings.host
        address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", int(self.shared_port)),
                # The HTTP routes' body limit, for one message.
                ("grpc.max_receive_message_length", self.settings.payload_limit),
            ]
        )
        self._add_handlers(server)
        add_health(server, self._ready, SERVICE_NAMES)
        names = (*SERVICE_NAMES, HEALTH_SERVICE, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        await server.start()
        self.server = server
        log.info("gRPC (tei.v1) on %s:%d", host, self.port)
        return self.port

    async def drain(self, grace: float) -> None:
        """Refuse new calls, end idle streams, and wait up to `grace` seconds for the calls in
        flight (cancelled after it)."""
        self.closing = True
        for queue in self.streams:
            queue.put_nowait(CLOSING)
        if self.server is not None:
            await self.server.stop(grace)

    async def stop(self) -> None:
        if self.server is not None:
            self.closing = True
            await self.server.stop(0)

    def _add_handlers(self, server: grpc.aio.Server) -> None:
        """A handler for every rpc tei.proto declares, by its kind: a proto and a servicer that
        disagree fail here, at start-up."""
        answers = self.servicer.answers()
        for name, service in pb.DESCRIPTOR.services_by_name.items():
            handlers = {}
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                request = getattr(pb, method.input_type.name)
                response = getattr(pb, method.output_type.name)
                options = {
                    "request_deserializer": parser(request),
                    "response_serializer": response.SerializeToString,
                }
                if method.client_streaming and method.server_streaming:
                    answer = answers[method.name.removesuffix("Stream")]
                    handler = grpc.stream_stream_rpc_method_handler(
                        self._stream(path, answer), **options
                    )
                elif method.client_streaming:
                    collect = self.servicer.rerank_stream
                    assert method.name == "RerankStream", f"no answer for {path}"
                    handler = grpc.stream_unary_rpc_method_handler(
                        self._collect(path, collect), **options
                    )
                else:
                    handler = grpc.unary_unary_rpc_method_handler(
                        self._unary(path, answers[method.name]), **options
                    )
                handlers[method.name] = handler
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service.full_name, handlers),)
            )
            server.add_registered_method_handlers(service.full_name, handlers)
            log.debug("gRPC service %s: %s", name, ", ".join(handlers))

    def _ready(self) -> bool:
        """Readiness, as /health says it for the model gRPC serves, until a drain starts."""
        return not self.closing and self.servicer.service().ready

    # Calls -----------------------------------------------------------------------------
    def _unary(self, path: str, answer: Answer) -> Callable[..., Any]:
        async def unary(request: Any, context: Context) -> Any:
            async def run() -> Reply[Any]:
                if isinstance(request, Malformed):
                    raise request.error()
                return await answer(request)

            await self._check(context, path)
            try:
                reply = await self._run(path, run, wait=False)
            except ServiceError as error:
                await self._abort(context, error)
            if reply.headers:
                # With the status, in the message's own write: sending them ahead as initial
                # metadata costs a write of their own per call (docs/benchmarks.md).
                context.set_trailing_metadata(tuple(reply.headers.items()))
            return reply.message

        return unary

    def _collect(
        self, path: str, answer: Callable[[AsyncIterator[Any]], Awaitable[Reply[Any]]]
    ) -> Callable[..., Any]:
        async def collect(requests: AsyncIterator[Any], context: Context) -> Any:
            await self._check(context, path)
            # Read before a slot is taken, as an HTTP body is read before its route runs: the
            # client may take its time. One message past the inputs' limit is enough for the
            # answer's 413.
            limit = self.servicer.service().settings.max_inputs_per_request
            received: list[Any] = []
            async for request in requests:
                received.append(request)
                if isinstance(request, Malformed) or len(received) > limit:
                    break

            async def checked() -> AsyncIterator[Any]:
                for request in received:
                    if isinstance(request, Malformed):
                        raise request.error()
                    yield request

            try:
                reply = await self._run(path, lambda: answer(checked()), wait=False)
            except ServiceError as error:
                await self._abort(context, error)
            return reply.message

        return collect

    def _stream(self, path: str, answer: Answer) -> Callable[..., Any]:
        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            await self._check(context, path)
            # Each message's task, in arrival order, then END (or CLOSING, from a drain).
            queue: asyncio.Queue[Any] = asyncio.Queue()
            window = asyncio.Semaphore(STREAM_WINDOW)

            async def run(request: Any) -> Reply[Any]:
                if isinstance(request, Malformed):
                    raise request.error()
                return await answer(request)

            async def read() -> None:
                try:
                    async for request in requests:
                        await window.acquire()
                        queue.put_nowait(
                            asyncio.ensure_future(self._run(path, partial(run, request), wait=True))
                        )
                finally:
                    queue.put_nowait(END)

            reader = asyncio.ensure_future(read())
            self.streams.add(queue)
            if self.closing:
                queue.put_nowait(CLOSING)
            try:
                while (item := await queue.get()) is not END:
                    if item is CLOSING:
                        raise UnavailableError("the server is shutting down")
                    reply = await item
                    window.release()
                    yield reply.message
                await reader  # an error of the client's stream, if reading failed
            except ServiceError as error:
                await self._abort(context, error)
            finally:
                self.streams.discard(queue)
                for task in [reader, *drained(queue)]:
                    task.cancel()
                    task.add_done_callback(retrieved)

        return stream

    async def _run(
        self, path: str, run: Callable[[], Awaitable[Reply[Any]]], *, wait: bool
    ) -> Reply[Any]:
        """One request: room among the requests in progress (waited for, or a fast 429), then
        its answer, counted. Errors are ServiceErrors; an unexpected one is logged and
        becomes an internal error with an id to find it in the log."""
        started = time.perf_counter()
        status = 499  # unless it ends otherwise: the client cancelled
        self.metrics.tally.begin()
        try:
            if not wait and self.slots.locked():
                raise OverloadedError(
                    f"{self.settings.max_concurrent_requests} requests are in progress, the "
                    "limit of this server; retry in 1 s",
                    retry_after=1,
                )
            async with self.slots:
                reply = await run()
            status = 200
            return reply
        except ServiceError as error:
            status = error.status
            self.metrics.failures.labels(error.error_type).inc()
            raise
        except Exception as exc:
            status = 500
            request_id = self._ids.next()
            log.exception("unexpected error in %s, request id %s", path, request_id)
            self.metrics.failures.labels(ServiceError.error_type).inc()
            raise ServiceError(f"internal error (request id {request_id})") from exc
        finally:
            self._count(path, status)
            if not wait:
                self.metrics.tally.observe(
                    self.metrics.request_seconds, time.perf_counter() - started
                )
            self.metrics.tally.end()

    async def _check(self, context: Context, path: str) -> None:
        """The API key, as the HTTP routes take it: `authorization: Bearer <key>`; a call
        refused is counted as the HTTP routes count theirs."""
        if self.api_key is None:
            return
        header = next(
            (value for key, value in context.invocation_metadata() or () if key == "authorization"),
            "",
        )
        raw = header.encode() if isinstance(header, str) else header
        scheme, _, token = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.api_key):
            error = UnauthorizedError(
                "missing or wrong API key (send metadata 'authorization: Bearer <key>')"
            )
            self.metrics.failures.labels(error.error_type).inc()
            self._count(path, error.status)
            await self._abort(context, error)

    @staticmethod
    async def _abort(context: Context, error: ServiceError) -> NoReturn:
        trailers: tuple[tuple[str, str], ...] = ()
        if isinstance(error, OverloadedError):
            trailers = (("retry-after", str(error.retry_after)),)
        await context.abort(status_of(error), error.message, trailers)

    def _count(self, path: str, status: int) -> None:
        counter = self._counters.get((path, status))
        if counter is None:
            counter = self.metrics.requests.labels(path, str(status))
            self._counters[path, status] = counter
        self.metrics.tally.count(counter)


def drained(queue: asyncio.Queue[Any]) -> list[asyncio.Future[Any]]:
    """The tasks left in a stream's queue."""
    left = []
    while not queue.empty():
        if isinstance(item := queue.get_nowait(), asyncio.Future):
            left.append(item)
    return left


def retrieved(task: asyncio.Future[Any]) -> None:
    """Marks the error of a task nobody awaits as seen: a stream that ended at one message's
    error leaves the others' unread, which asyncio would log as never retrieved."""
    if not task.cancelled():
        task.exception()


# A stream's queue ends with END (the client sent its last message) or CLOSING (the drain).
END = object()
CLOSING = object()
