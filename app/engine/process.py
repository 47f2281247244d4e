"""An engine in a process of its own: the model, its queue, and a Unix socket that every
front end connects to. No HTTP.

One thread does all the work: the compute thread accepts the front ends' connections, reads
their submissions and aborts between batches and while it waits (`Batcher.take_from`), runs
the batches, and writes each batch's answers, one write per front end. The main thread
only watches: for the supervisor's stop (app/stop_signal.py), which it sends once every front
end has exited (finish what is queued, then exit 0), and for a batch worker that has stopped
(exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import select
import selectors
import signal
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType

from app.collector import settle_collector
from app.cores import CoreLease
from app.engine.batcher import Delivery, Ticket
from app.engine.model_engine import ModelEngine
from app.engine.protocol import Outcome
from app.engine.remote import engine_address
from app.engine.state import EngineBoard
from app.engine.wire import (
    Abort,
    Frames,
    answers,
    failed_message,
    framed,
    submitted,
    to_engine_decoder,
)
from app.metrics import Metrics
from app.settings import ServedModel, Settings
from app.stop_signal import SUPERVISOR_STOP
from model.shared_weights import WeightStore

log = logging.getLogger(__name__)

# How often the main thread looks for a stop signal or a dead worker, and a writer waiting
# for room looks whether its front end has gone.
POLL_SECONDS = 0.1
# Room in the kernel for replies a front end has not read yet, before a writer waits.
SEND_BUFFER = 4 << 20


class FrontEnd:
    """One front end's connection: its bytes cut into messages."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = Frames()
        self.gone = False

    def write(self, message: bytes) -> None:
        """Waits while the front end's side is full (its event loop reads it whatever its
        clients do). A front end that has gone takes nothing more (its requests are
        abandoned when its connection is read as closed)."""
        view = memoryview(message)
        while view and not self.gone:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                self._wait_for_room()
            except OSError:
                self._lose()

    def _wait_for_room(self) -> None:
        try:
            room = select.poll()  # not select.select, which takes no descriptor past 1023
            room.register(self.sock, select.POLLOUT)
            room.poll(POLL_SECONDS * 1000)
        except (OSError, ValueError):  # closed meanwhile
            self._lose()

    def _lose(self) -> None:
        """After a failed write the stream is out of step (a reply may be cut short), so
        the connection is ended both ways: the front end fails what it waits for and reads
        its engine as gone, and this engine's reading of it abandons its requests."""
        self.gone = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Once the front end has gone."""
        self.gone = True
        self.sock.close()


# A request's inputs in the queue, by its front end and the front end's number for it.
Key = tuple[FrontEnd, int]


class EngineProcess:
    def __init__(
        self,
        settings: Settings,
        served: ServedModel,
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
        self.path = engine_address(run_dir, index)
        self.model = ModelEngine(
            settings, served, Metrics().of(served.name), device, cores, weights
        )
        self.tickets: dict[Key, Ticket] = {}
        self.stopping = False
        # The listener and every front end's connection, read by the compute thread.
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def run(self, ready: Connection) -> int:
        try:
            card = self.model.load(self._deliver)
        except Exception as exc:
            log.error("engine %d failed to start", self.index, exc_info=exc)
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
            return 1
        batcher = self.model.batcher
        assert batcher is not None, "loaded"
        batcher.publish_to(lambda backlog, pace: self.board.publish(self.index, backlog, pace))
        self.listener.bind(str(self.path))
        self.listener.listen()
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        settle_collector()
        signal.signal(SUPERVISOR_STOP, self._stop)
        batcher.take_from(self._intake)
        ready.send(("ready", card))
        ready.close()
        code = self._watch()
        self._drain()
        if not self.model.alive:  # else its worker may read them yet: the exit closes them
            self.selector.close()
            self.listener.close()
        return code

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _watch(self) -> int:
        while not self.stopping:
            time.sleep(POLL_SECONDS)
            if not self.model.alive:
                log.critical("engine %d: the batch worker has stopped", self.index)
                return 1
        return 0

    def _intake(self, timeout: float) -> None:
        """On the compute thread: accept and read whatever is ready, waiting up to `timeout`
        seconds for something to be."""
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            else:
                self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # the front end gave up meanwhile, or no descriptor is left
            log.warning("engine %d: a front end's connection failed", self.index, exc_info=True)
            return
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self.selector.register(sock, selectors.EVENT_READ, FrontEnd(sock))

    def _read(self, frontend: FrontEnd) -> None:
        try:
            data = frontend.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the front end has gone: nobody waits for its requests
            self.selector.unregister(frontend.sock)
            frontend.close()
            for key in [key for key in self.tickets if key[0] is frontend]:
                self.tickets.pop(key).abandoned = True
            return
        # A message the engine cannot read is no request's doing: its front end and it are out
        # of step (a bug). It stops the worker, so the engine and with it the server exit 1,
        # for the orchestrator to restart, rather than serve on half broken.
        if arrived := self._arrivals(frontend, data):
            self._submit(frontend, arrived)

    def _arrivals(self, frontend: FrontEnd, data: bytes) -> list[tuple[Ticket, float | None]]:
        """The submissions in what a front end sent, each with its ticket; aborts applied."""
        arrived: list[tuple[Ticket, float | None]] = []
        decode = to_engine_decoder.decode
        messages = [m for raw in frontend.frames.feed(data) for m in decode(raw).messages]
        for message in messages:
            key = (frontend, message.request)
            if isinstance(message, Abort):
                if (ticket := self.tickets.pop(key, None)) is not None:
                    ticket.abandoned = True
                continue
            encoded, wants = submitted(message)
            ticket = Ticket(encoded, wants, message.deadline, key)
            self.tickets[key] = ticket
            arrived.append((ticket, message.deadline - time.perf_counter()))
        return arrived

    def _submit(self, frontend: FrontEnd, arrived: list[tuple[Ticket, float | None]]) -> None:
        assert self.model.batcher is not None, "loaded"
        refused = self.model.batcher.submit_all(arrived)
        failures = []
        for (ticket, _), error in zip(arrived, refused, strict=True):
            key: Key = ticket.reply_to  # type: ignore[assignment]
            # Not there: aborted in the same read; its front end waits for nothing.
            if error is not None and self.tickets.pop(key, None) is not None:
                failures.append(framed(failed_message(key[1], error)))
        if failures:
            frontend.write(b"".join(failures))

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """The batch's replies, one write per front end: its failures, and one message for
        all its finished requests (of each kind of result)."""
        finished: dict[FrontEnd, list[tuple[int, Outcome]]] = {}
        failures: dict[FrontEnd, list[bytes]] = {}
        for ticket, outcome in deliveries:
            key: Key = ticket.reply_to  # type: ignore[assignment]
            if self.tickets.pop(key, None) is None:  # aborted meanwhile
                continue
            frontend, request = key
            if isinstance(outcome, Outcome):
                finished.setdefault(frontend, []).append((request, outcome))
            else:
                failures.setdefault(frontend, []).append(framed(failed_message(request, outcome)))
        for frontend in finished.keys() | failures.keys():
            answered = [framed(message) for message in answers(finished.get(frontend, []))]
            frontend.write(b"".join(failures.get(frontend, []) + answered))

    def _drain(self) -> None:
        """What is queued still runs (its front ends have gone, or are failing it)."""
        batcher = self.model.batcher
        deadline = time.monotonic() + self.settings.shutdown_grace
        while batcher is not None and not batcher.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        self.model.stop()
        log.info("engine %d stopped", self.index)
