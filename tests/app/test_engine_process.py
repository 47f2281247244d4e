"""The engine process's reading of its front ends, with a stand-in for its model: what one
read from a front end may hold, and a front end that goes away."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import msgspec
import pytest

from app.engine.batcher import Ticket
from app.engine.process import EngineProcess, FrontEnd
from app.engine.protocol import LateDocument, Wants
from app.engine.wire import (
    Abort,
    Frames,
    framed,
    reply_decoder,
    submit_message,
    submitted,
    to_engine_decoder,
)
from app.errors import OverloadedError, ServiceError
from model.info import AttentionSpec
from model.tokenizer import Encoded


class RefusingBatcher:
    """Refuses every request, as a full queue does."""

    def __init__(self) -> None:
        self.seen: list[Ticket] = []

    def submit_all(
        self, tickets: Sequence[tuple[Ticket, float | None]]
    ) -> list[ServiceError | None]:
        self.seen.extend(ticket for ticket, _ in tickets)
        return [OverloadedError("full", retry_after=1) for _ in tickets]


@pytest.fixture
def engine() -> Iterator[tuple[EngineProcess, socket.socket, FrontEnd]]:
    process = EngineProcess.__new__(EngineProcess)
    process.index = 0
    process.tickets = {}
    process.model = SimpleNamespace(batcher=RefusingBatcher())  # type: ignore[assignment]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    frontend = FrontEnd(theirs)
    process.selector = selectors.DefaultSelector()
    process.selector.register(theirs, selectors.EVENT_READ, frontend)
    with ours, theirs, process.selector:
        yield process, ours, frontend


def submit(request: int) -> bytes:
    encoded = [Encoded([2, 5, 3], [], None, [], False)]
    return framed(submit_message(request, 10.0, encoded, Wants()))


@pytest.mark.parametrize(
    "wants",
    [
        Wants(),
        Wants(pooled=False, normalize=False, dimensions=16, token_embeddings=True),
        Wants(attention=AttentionSpec((0,), (1,), True)),
        Wants(late=(LateDocument(((0, 3),), ((0, 2), (2, 3))),)),
    ],
)
def test_what_a_request_wants_crosses_the_wire_and_plain_kinds_are_built_once(
    wants: Wants,
) -> None:
    encoded = [Encoded([2, 5, 3], [], None, [], False)]
    [raw] = Frames().feed(framed(submit_message(1, 10.0, encoded, wants)))
    message = to_engine_decoder.decode(raw)
    (inputs, first), (_, again) = submitted(message), submitted(message)
    assert [e.ids for e in inputs] == [[2, 5, 3]]
    assert first == wants == again
    assert (first is again) == (wants.attention is None and wants.late is None)


def test_a_refused_request_gets_its_429(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ours.sendall(submit(7))
    process._read(frontend)
    [message] = Frames().feed(ours.recv(65536))
    reply = reply_decoder.decode(message)
    assert reply.request == 7 and reply.failure is not None
    assert reply.failure.error_type == "Overloaded" and reply.failure.retry_after == 1
    assert process.tickets == {}


def test_a_request_aborted_in_the_same_read_is_refused_without_a_word(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ours.sendall(submit(7) + framed(Abort(7)))
    process._read(frontend)  # no KeyError
    ours.setblocking(False)
    with pytest.raises(BlockingIOError):
        ours.recv(65536)  # nothing to say: nobody waits for it
    assert process.tickets == {}


def test_a_front_end_that_goes_away_abandons_its_requests(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ticket = Ticket([Encoded([2, 3], [], None, [], False)], Wants(), time.perf_counter(), None)
    process.tickets[(frontend, 1)] = ticket
    ours.close()
    process._read(frontend)
    assert ticket.abandoned and process.tickets == {} and frontend.gone
    frontend.write(b"more")  # a late reply goes nowhere, and raises nothing


def test_a_frame_that_is_no_message_stops_the_engine_rather_than_being_skipped(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    """No request can send one (front ends frame what they encode): it means a front end
    and the engine out of step. It reaches the worker, whose stop takes the server down for
    its orchestrator to restart (tests/app/test_split.py: a dead engine stops the rest)."""
    process, ours, frontend = engine
    ours.sendall(submit(7) + framed(Abort(8))[:4] + b"\xc1 not msgpack")
    with pytest.raises(msgspec.DecodeError):
        process._read(frontend)
