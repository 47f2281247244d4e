"""A front end's side of engines in other processes; no torch.

One Unix stream socket to each engine, carrying length-framed msgpack both ways
(app/engine/wire.py), read and written by the front end's own event loop: no thread and no
broker between the two processes, one write for what a turn of the event loop sends and one
for each batch's answers. (ZeroMQ hands every
message to I/O threads of its own on both sides, which costs several times the CPU per round
trip; docs/decisions.md.) Work goes to the engine that would finish it first by
the backlog each publishes (app/engine/state.py), which also decides the fast 429. An engine
whose connection closes has died: its requests fail, and /live says so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import cast

import msgspec

from app.engine.protocol import Admission, Outcome, Wants
from app.engine.state import EngineBoard
from app.engine.wire import (
    Abort,
    Failed,
    Frames,
    encoded_message,
    failure_error,
    framed_requests,
    outcomes,
    reply_decoder,
    submit_message,
)
from app.errors import BackendError, ServiceError
from model.codec import ModelCard
from model.tokenizer import Encoded

log = logging.getLogger(__name__)


def engine_address(run_dir: Path, engine: int) -> Path:
    return run_dir / f"engine-{engine}.sock"


class RemotePending:
    __slots__ = ("engine", "future", "request")

    def __init__(self, engine: EngineLink, request: int, future: asyncio.Future[Outcome]) -> None:
        self.engine = engine
        self.request = request
        self.future = future

    def abort(self, error: ServiceError) -> None:
        if not self.future.done():
            self.future.set_exception(error)
        if self.engine.pending.pop(self.request, None) is not None:
            self.engine.send(encoded_message(Abort(self.request)))


class EngineLink(asyncio.Protocol):
    """The connection to one engine: its requests in flight, its replies as they come."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pending: dict[int, RemotePending] = {}
        self.closed = False
        self._frames = Frames()
        self._transport: asyncio.Transport | None = None
        # Messages of one turn of the event loop, each encoded when sent, written together at
        # its end as one message: under load one write, one wake-up of the engine and one
        # decode there carry many requests.
        self._outgoing: list[msgspec.Raw] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def send(self, message: msgspec.Raw) -> None:
        if self._transport is None or self.closed:
            return
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(message)

    def _flush(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(framed_requests(self._outgoing))
        self._outgoing = []

    def data_received(self, data: bytes) -> None:
        for raw in self._frames.feed(data):
            message = reply_decoder.decode(raw)
            if isinstance(message, Failed):
                self._resolve(message.request, failure_error(message))
                continue
            for request, outcome in outcomes(message):
                self._resolve(request, outcome)

    def _resolve(self, request: int, outcome: Outcome | ServiceError) -> None:
        pending = self.pending.pop(request, None)
        if pending is None or pending.future.done():  # aborted meanwhile
            return
        if isinstance(outcome, ServiceError):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.pending:
            log.error(
                "engine %d has stopped: failing its %d requests", self.index, len(self.pending)
            )
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(BackendError("the engine has stopped"))
        self.pending.clear()

    def close(self) -> None:
        """At the front end's stop: nothing is written after it."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class RemoteEngine:
    def __init__(
        self,
        card: ModelCard,
        run_dir: Path,
        board: EngineBoard,
        admission: Admission,
    ) -> None:
        self.card = card
        self.run_dir = run_dir
        self.board = board
        self.admission = admission
        self.links: list[EngineLink] = []
        self._requests = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> ModelCard:
        self._loop = loop = asyncio.get_running_loop()
        for index in range(len(self.board)):
            path = str(engine_address(self.run_dir, index))
            _, link = await loop.create_unix_connection(partial(EngineLink, index), path)
            self.links.append(link)
        return self.card

    async def stop(self) -> None:
        for link in self.links:
            link.close()

    @property
    def alive(self) -> bool:
        return not any(link.closed for link in self.links)

    def check_room(self, within: float) -> None:
        self._admit(self._least_busy(), 0, within)

    def submit(self, encoded: Sequence[Encoded], wants: Wants, deadline: float) -> RemotePending:
        assert self._loop is not None, "started"
        engine = self._least_busy()
        link = self.links[engine]
        if link.closed:
            raise BackendError("the engine has stopped")
        self._admit(engine, sum(len(e.ids) for e in encoded), deadline - time.perf_counter())
        request = next(self._requests)
        message = encoded_message(submit_message(request, deadline, encoded, wants))
        pending = RemotePending(link, request, self._loop.create_future())
        link.pending[request] = pending
        link.send(message)
        return pending

    def _least_busy(self) -> int:
        return least_busy(self.board, [len(link.pending) for link in self.links])

    def _admit(self, engine: int, tokens: int, within: float) -> None:
        backlog, pace = self.board.backlog(engine)
        if (error := self.admission.verdict(backlog, tokens, pace, within)) is not None:
            raise error


def least_busy(board: EngineBoard, in_flight: Sequence[int]) -> int:
    """The engine that would finish new work first by its published backlog; between equals,
    the one with the fewest of this front end's requests in flight (a burst sent within one
    event-loop turn is spread before any engine has published it), then the first. So a lone
    client's requests stay on one engine, whose threads are awake and whose caches are warm:
    turning to each idle engine in turn measured slower on a CPU (it woke the other engine's
    threads for every request)."""
    if len(in_flight) == 1:
        return 0
    return min(
        range(len(board)), key=lambda engine: (board.seconds_ahead(engine), in_flight[engine])
    )
