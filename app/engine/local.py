"""The engine in the front end's own process: the placement for one process alone.

Results come back from the compute thread to the event loop in one call per batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from app.engine.batcher import Deliver, Delivery, Ticket
from app.engine.model_engine import ModelEngine
from app.engine.protocol import Outcome, Wants
from app.errors import ServiceError
from app.metrics import Metrics
from app.settings import ServedModel, Settings
from model import Encoded
from model.codec import ModelCard

log = logging.getLogger(__name__)


class LocalPending:
    __slots__ = ("future", "ticket")

    def __init__(self, future: asyncio.Future[Outcome], ticket: Ticket) -> None:
        self.future = future
        self.ticket = ticket

    def abort(self, error: ServiceError) -> None:
        self.ticket.abandoned = True  # the worker drops its queued inputs
        if not self.future.done():
            self.future.set_exception(error)


class LocalEngine:
    def __init__(self, settings: Settings, served: ServedModel, metrics: Metrics) -> None:
        self.model = ModelEngine(settings, served, metrics.of(served.name), settings.devices[0])
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> ModelCard:
        self._loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self.model.load, deliver_on(self._loop))

    async def stop(self) -> None:
        await asyncio.to_thread(self.model.stop)

    @property
    def alive(self) -> bool:
        return self.model.alive

    def check_room(self, within: float) -> None:
        assert self.model.batcher is not None, "started"
        self.model.batcher.check_room(within)

    def submit(self, encoded: Sequence[Encoded], wants: Wants, deadline: float) -> LocalPending:
        assert self.model.batcher is not None and self._loop is not None, "started"
        future: asyncio.Future[Outcome] = self._loop.create_future()
        ticket = Ticket(encoded, wants, deadline, future)
        self.model.batcher.submit(ticket, deadline - time.perf_counter())
        return LocalPending(future, ticket)


def deliver_on(loop: asyncio.AbstractEventLoop) -> Deliver:
    """Deliveries from the compute thread, handed to `loop` at once: each ticket's
    `reply_to` is a future of that loop."""

    def deliver(deliveries: list[Delivery]) -> None:
        try:
            loop.call_soon_threadsafe(_resolve, deliveries)
        except RuntimeError:  # the event loop closed during shutdown: nobody is waiting
            log.warning("dropping %d results: the event loop is closed", len(deliveries))

    return deliver


def _resolve(deliveries: list[Delivery]) -> None:
    for ticket, outcome in deliveries:
        future: asyncio.Future[Outcome] = ticket.reply_to  # type: ignore[assignment]
        if future.done():  # failed meanwhile: the request stopped waiting
            continue
        if isinstance(outcome, ServiceError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
