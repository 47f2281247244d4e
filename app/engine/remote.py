"""A front end's side of engines in other processes, over ZeroMQ; no torch.

Each engine pulls submissions from every front end on its own socket; each front end pulls
replies on one socket of its own, read from the event loop when its descriptor says so (no
thread, no poller task). Work goes to the engine that would finish it first by the backlog
each publishes (app/engine/state.py), which also decides the fast 429. A watchdog turns an
engine the supervisor marked dead into failed requests and a failing /live.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

from app.engine.protocol import Admission, Outcome, Wants
from app.engine.state import EngineBoard, Status
from app.engine.wire import (
    Abort,
    encoder,
    reply_decoder,
    reply_outcome,
    submit_message,
)
from app.errors import BackendError, ServiceError
from model.codec import ModelCard
from model.tokenizer import Encoded

log = logging.getLogger(__name__)

# How often the watchdog reads the engines' status.
WATCH_INTERVAL = 0.05


def engine_address(run_dir: Path, engine: int) -> str:
    return f"ipc://{run_dir}/engine-{engine}"


def frontend_address(run_dir: Path, frontend: int) -> str:
    return f"ipc://{run_dir}/frontend-{frontend}"


class RemotePending:
    __slots__ = ("client", "count", "engine", "future", "request")

    def __init__(
        self,
        client: RemoteEngine,
        engine: int,
        request: int,
        count: int,
        future: asyncio.Future[Outcome],
    ) -> None:
        self.client = client
        self.engine = engine
        self.request = request
        self.count = count
        self.future = future

    def abort(self, error: ServiceError) -> None:
        if not self.future.done():
            self.future.set_exception(error)
        if self.client.pending.pop(self.request, None) is not None:
            self.client.send(self.engine, encoder.encode(Abort(self.client.index, self.request)))


class RemoteEngine:
    def __init__(
        self,
        card: ModelCard,
        index: int,
        run_dir: Path,
        board: EngineBoard,
        admission: Admission,
    ) -> None:
        self.card = card
        self.index = index
        self.board = board
        self.admission = admission
        self.pending: dict[int, RemotePending] = {}
        self._requests = itertools.count()
        self._turn = itertools.count()
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(frontend_address(run_dir, index))
        self._outboxes = []
        for engine in range(len(board)):
            outbox = self._context.socket(zmq.PUSH)
            outbox.setsockopt(zmq.LINGER, 0)
            outbox.connect(engine_address(run_dir, engine))
            self._outboxes.append(outbox)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._dead = False

    async def start(self) -> ModelCard:
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self._inbox.fileno(), self._read_replies)
        self._watchdog = asyncio.create_task(self._watch())
        return self.card

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._inbox.fileno())
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._context.destroy(linger=0)

    @property
    def alive(self) -> bool:
        return not self._dead

    def check_room(self, tokens: int, within: float) -> None:
        self._admit(self._choose(), tokens, within)

    def submit(self, encoded: Sequence[Encoded], wants: Wants, deadline: float) -> RemotePending:
        assert self._loop is not None, "started"
        if self._dead:
            raise BackendError("the engine has stopped")
        engine = self._choose()
        left = deadline - time.perf_counter()
        self._admit(engine, sum(len(e.ids) for e in encoded), left)
        request = next(self._requests)
        pending = RemotePending(self, engine, request, len(encoded), self._loop.create_future())
        self.pending[request] = pending
        self.send(engine, encoder.encode(submit_message(self.index, request, left, encoded, wants)))
        return pending

    def send(self, engine: int, message: bytes) -> None:
        # Never blocks: the queue towards an engine is unbounded (admission bounds the work).
        self._outboxes[engine].send(message, copy=False)

    def _choose(self) -> int:
        """The engine that would finish new work first; among idle ones, each in turn."""
        engines = len(self._outboxes)
        if engines == 1:
            return 0
        start = next(self._turn) % engines
        order = [(start + offset) % engines for offset in range(engines)]
        return min(order, key=self.board.seconds_ahead)

    def _admit(self, engine: int, tokens: int, within: float) -> None:
        backlog, pace = self.board.backlog(engine)
        if (error := self.admission.verdict(backlog, tokens, pace, within)) is not None:
            raise error

    def _read_replies(self) -> None:
        """Everything the inbox holds: its descriptor signals edges, not levels."""
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            reply = reply_decoder.decode(data.buffer)
            pending = self.pending.pop(reply.request, None)
            if pending is None or pending.future.done():  # aborted meanwhile
                continue
            outcome = reply_outcome(reply, pending.count)
            if isinstance(outcome, ServiceError):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome)

    async def _watch(self) -> None:
        while not self._dead:
            await asyncio.sleep(WATCH_INTERVAL)
            dead = {i for i in range(len(self.board)) if self.board.status(i) is Status.DEAD}
            if dead:
                self._dead = True
                log.error("engine %s has stopped: failing its requests", sorted(dead))
                for request, pending in list(self.pending.items()):
                    if pending.engine in dead:
                        del self.pending[request]
                        if not pending.future.done():
                            pending.future.set_exception(BackendError("the engine has stopped"))
