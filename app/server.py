"""One server process: the app under uvicorn, with a drain between a stop signal and the exit.

SIGTERM (or Ctrl-C) drains: /health turns 503 at once; after --drain-delay seconds (for load
balancers to notice) new inference gets 503 too; accepted requests finish (up to
--shutdown-grace seconds), then the server exits 0. A second signal exits at once, with 128 +
the signal's number. Under the split placement a front end takes these signals from its
supervisor, as SUPERVISOR_STOP (app/stop_signal.py).
Worst case from the first signal to the exit: drain_delay + shutdown_grace, then up to
CLOSE_GRACE seconds for uvicorn to close connections, then the forward pass in progress, if
clients that left are all it still serves (up to shutdown_grace again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from app.balance import ConnectionBalance
from app.engine.protocol import Engine
from app.main import create_app
from app.metrics import Metrics
from app.models import ServedModels
from app.settings import Settings
from app.stop_signal import SUPERVISOR_STOP

if TYPE_CHECKING:
    from app.grpc.server import GrpcServer

log = logging.getLogger("app")

# Seconds uvicorn waits, after the drain, for connections to close (keep-alive ones close at
# once; accepted requests have finished by then).
CLOSE_GRACE = 3


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain step between the first signal and the shutdown."""

    def __init__(
        self,
        config: uvicorn.Config,
        models: ServedModels,
        delay: float,
        grace: float,
        balance: ConnectionBalance | None = None,
        grpc: GrpcServer | None = None,
        supervised: bool = False,
    ) -> None:
        super().__init__(config)
        self.models = models
        self.balance = balance
        self.supervised = supervised  # a front end: stopped by its supervisor's signal
        self.grpc = grpc  # tei.v1 on its own port, drained with the HTTP server
        self.delay = delay
        self.grace = grace
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # Holds the drain task, so that it is not garbage-collected while it runs.
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.grpc is not None and not self.should_exit:
            try:
                await self.grpc.start()
            except OSError as exc:
                log.error("%s", exc)
                self.fail()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:
            await self.grpc.stop()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGTERM and SIGINT; a front end's SUPERVISOR_STOP instead, its SIGTERM
        and SIGINT left ignored (app/supervisor.py's `_child`)."""
        if not self.supervised:
            with super().capture_signals():
                yield
            return
        previous = signal.signal(SUPERVISOR_STOP, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(SUPERVISOR_STOP, previous)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn ticks every 0.1 s; the connections are counted every other tick.
        if self.balance is not None and counter % 2 == 0:
            self.balance.publish(len(self.server_state.connections))
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:  # before start-up finished: nothing to drain
            super().handle_exit(sig, frame)
            return
        if self.models.stopping:
            # uvicorn would start another graceful wait; an operator who signals twice
            # wants the process gone now.
            log.warning(
                "second signal during the drain: exiting now, %d requests in flight",
                self.models.inflight,
            )
            logging.shutdown()
            os._exit(128 + sig)
        self.models.begin_stop()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await asyncio.sleep(self.delay)
        self.models.begin_drain()
        # gRPC takes no new calls from now on; its calls in flight get the same grace.
        grpc = asyncio.ensure_future(self.grpc.drain(self.grace)) if self.grpc else None
        if not await self.models.wait_idle(self.grace):
            log.warning(
                "grace period of %s s over with %d requests in flight",
                self.grace,
                self.models.inflight,
            )
        if grpc is not None:
            await grpc
        self.should_exit = True

    def fail(self) -> None:
        """The model could not load: stop serving and exit non-zero."""
        self.exit_code = 1
        self.should_exit = True


def serve(
    settings: Settings,
    engine: Engine | Mapping[str, Engine] | None = None,
    sock: socket.socket | None = None,
    balance: ConnectionBalance | None = None,
    metrics: Metrics | None = None,
    *,
    supervised: bool = False,
) -> int:
    """Serve until stopped, on `sock` if given (a front end, with its `balance`) or on
    settings' host and port; return the exit code. `engine`: each model's, by name; by
    default in this process. `supervised`: stopped by the split placement's supervisor."""
    server: DrainingServer | None = None

    def on_fatal(reason: str) -> None:
        # create_app has logged the reason; the process only has to stop with an error code.
        if server is not None:
            server.fail()

    app = create_app(settings, engine, on_fatal=on_fatal, balance=balance, metrics=metrics)
    grpc = None
    if settings.grpc_port is not None:
        try:  # only a server with gRPC imports grpcio
            from app.grpc.server import GrpcServer
        except ImportError as exc:  # the generated code is missing: the error says what to run
            log.error("%s", exc)
            return 1
        # A front end shares the port with the others (SO_REUSEPORT), as it shares HTTP's.
        grpc = GrpcServer(
            settings, lambda: app.state.service, app.state.metrics, shared_port=sock is not None
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=settings.access_log,
        timeout_graceful_shutdown=CLOSE_GRACE,
        # Connections and requests in progress past this get uvicorn's fast 503. uvicorn counts
        # the connection asking among those open, so N + 1 is what lets N connections in.
        limit_concurrency=settings.max_connections + 1,
    )
    server = DrainingServer(
        config,
        app.state.models,
        settings.drain_delay,
        settings.shutdown_grace,
        balance,
        grpc,
        supervised,
    )
    server.run(sockets=[sock] if sock is not None else None)
    return server.exit_code
