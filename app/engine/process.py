"""An engine in a process of its own: the model, its queue, and ZeroMQ sockets to the front
ends. No HTTP.

The main thread reads submissions and aborts; the compute thread runs the batches and sends
each finished request's reply itself (a ZeroMQ socket belongs to the thread that uses it, so
each thread has its own towards each front end). SIGTERM, which the supervisor sends once
every front end has exited: finish what is queued, then exit 0.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType

import zmq

from app.cores import CoreLease
from app.engine.batcher import Delivery, Ticket
from app.engine.model_engine import ModelEngine
from app.engine.protocol import Outcome
from app.engine.remote import engine_address, frontend_address
from app.engine.state import EngineBoard, Status
from app.engine.wire import (
    Abort,
    encoder,
    failure_reply,
    outcome_reply,
    submitted,
    to_engine_decoder,
)
from app.errors import ServiceError
from app.metrics import Metrics
from app.settings import Settings
from model.shared_weights import WeightStore

log = logging.getLogger(__name__)

# How often the main thread looks up from its socket (for a stop signal, a dead worker).
POLL_MS = 100
# A request's inputs in the queue, by (front end, request number).
Key = tuple[int, int]


class Outboxes:
    """One thread's sockets towards the front ends, connected on first use."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], run_dir: Path) -> None:
        self._context = context
        self._run_dir = run_dir
        self._sockets: dict[int, zmq.Socket[bytes]] = {}

    def send(self, frontend: int, message: bytes) -> None:
        socket = self._sockets.get(frontend)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(frontend_address(self._run_dir, frontend))
            self._sockets[frontend] = socket
        socket.send(message, copy=False)

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close()


class EngineProcess:
    def __init__(
        self,
        settings: Settings,
        index: int,
        device: str,
        run_dir: Path,
        board: EngineBoard,
        cores: CoreLease | None,
        weights: WeightStore | None,
    ) -> None:
        self.settings = settings
        self.index = index
        self.board = board
        self.model = ModelEngine(settings, Metrics(), device, cores, weights)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.run_dir = run_dir
        self.tickets: dict[Key, Ticket] = {}
        self.stopping = False
        self._replies_from_main = Outboxes(self.context, run_dir)
        self._replies_from_compute = Outboxes(self.context, run_dir)

    def run(self, ready: Connection) -> int:
        try:
            card = self.model.load(self._deliver)
        except Exception as exc:
            log.error("engine %d failed to start", self.index, exc_info=exc)
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
            return 1
        assert self.model.batcher is not None, "loaded"
        self.model.batcher.publish_to(
            lambda backlog, pace: self.board.publish(self.index, backlog, pace)
        )
        inbox = self.context.socket(zmq.PULL)
        inbox.bind(engine_address(self.run_dir, self.index))
        gc.collect()
        gc.freeze()  # see app/service.py: start-up's objects out of the collector's sight
        signal.signal(signal.SIGTERM, self._stop)
        self.board.set_status(self.index, Status.READY)
        ready.send(("ready", card))
        ready.close()
        code = self._serve(inbox)
        self._drain()
        inbox.close()
        self._replies_from_main.close()
        self._replies_from_compute.close()
        self.context.term()
        return code

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _serve(self, inbox: zmq.Socket[bytes]) -> int:
        while not self.stopping:
            if inbox.poll(POLL_MS):
                while True:
                    try:
                        data = inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(data.buffer)
            if not self.model.alive:
                log.critical("engine %d: the batch worker has stopped", self.index)
                return 1
        return 0

    def _handle(self, data: memoryview) -> None:
        message = to_engine_decoder.decode(data)
        key = (message.frontend, message.request)
        if isinstance(message, Abort):
            ticket = self.tickets.pop(key, None)
            if ticket is not None:
                ticket.abandoned = True
            return
        encoded, wants = submitted(message)
        ticket = Ticket(encoded, wants, time.perf_counter() + message.left, key)
        self.tickets[key] = ticket
        assert self.model.batcher is not None, "loaded"
        try:
            self.model.batcher.submit(ticket, message.left)
        except ServiceError as error:
            del self.tickets[key]
            reply = failure_reply(message.request, error)
            self._replies_from_main.send(message.frontend, encoder.encode(reply))

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """On the compute thread: each finished request's reply, sent from here."""
        for ticket, outcome in deliveries:
            key: Key = ticket.reply_to  # type: ignore[assignment]
            if self.tickets.pop(key, None) is None:  # aborted meanwhile
                continue
            frontend, request = key
            reply = (
                outcome_reply(request, outcome)
                if isinstance(outcome, Outcome)
                else failure_reply(request, outcome)
            )
            self._replies_from_compute.send(frontend, encoder.encode(reply))

    def _drain(self) -> None:
        """What is queued still runs (its front ends have gone, or are failing it)."""
        batcher = self.model.batcher
        deadline = time.monotonic() + self.settings.shutdown_grace
        while batcher is not None and not batcher.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        self.model.stop()
        log.info("engine %d stopped", self.index)
