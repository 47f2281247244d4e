"""The engine process's reading of its front ends, with a stand-in for its model: what one
read from a front end may hold, and a front end that goes away."""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from app.engine.batcher import Ticket
from app.engine.process import EngineProcess, FrontEnd
from app.engine.protocol import ItemResult, LateDocument, Outcome, Wants
from app.engine.wire import (
    Abort,
    Answers,
    Failed,
    Frames,
    Requests,
    Submit,
    answers,
    framed,
    outcomes,
    reply_decoder,
    submit_message,
    submitted,
    to_engine_decoder,
)
from app.errors import BackendError, OverloadedError, ServiceError
from model.info import AttentionSpec
from model.tokenizer import Encoded


class RefusingBatcher:
    """Refuses every request, as a full queue does."""

    def __init__(self) -> None:
        self.seen: list[tuple[Ticket, float | None]] = []

    def submit_all(
        self, tickets: Sequence[tuple[Ticket, float | None]]
    ) -> list[ServiceError | None]:
        self.seen.extend(tickets)
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


def submit(request: int) -> Submit:
    return submit_message(request, time.perf_counter() + 10, [Encoded([2, 5, 3], False)], Wants())


def sent(*messages: Submit | Abort) -> bytes:
    """What a front end writes for one turn of its event loop."""
    return framed(Requests(list(messages)))


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
    encoded = [Encoded([2, 5, 3], False)]
    [raw] = Frames().feed(sent(submit_message(1, time.perf_counter() + 10, encoded, wants)))
    [message] = to_engine_decoder.decode(raw).messages
    assert isinstance(message, Submit)
    (inputs, first), (_, again) = submitted(message), submitted(message)
    assert [e.ids for e in inputs] == [[2, 5, 3]]
    assert first == wants == again
    assert (first is again) == (wants.attention is None and wants.late is None)


def test_a_refused_request_gets_its_429(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ours.sendall(sent(submit(7)))
    process._read(frontend)
    [message] = Frames().feed(ours.recv(65536))
    reply = reply_decoder.decode(message)
    assert isinstance(reply, Failed) and reply.request == 7
    assert reply.error_type == "Overloaded" and reply.retry_after == 1
    assert process.tickets == {}


def test_the_time_a_message_waits_to_be_read_counts_against_its_request(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    """The engine reads its front ends between passes: a request sent with 0.2 s left and
    read 0.3 s later has none left, not 0.2 s from the reading."""
    process, ours, frontend = engine
    deadline = time.perf_counter() + 0.2
    ours.sendall(sent(submit_message(7, deadline, [Encoded([2, 5, 3], False)], Wants())))
    time.sleep(0.3)  # a pass the engine was busy with
    process._read(frontend)
    batcher = process.model.batcher
    assert isinstance(batcher, RefusingBatcher)
    [(ticket, within)] = batcher.seen
    assert ticket.deadline == deadline
    assert within is not None and within < 0


def test_a_request_aborted_in_the_same_read_is_refused_without_a_word(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ours.sendall(sent(submit(7), Abort(7)))
    process._read(frontend)  # no KeyError
    ours.setblocking(False)
    with pytest.raises(BlockingIOError):
        ours.recv(65536)  # nothing to say: nobody waits for it
    assert process.tickets == {}


def test_a_front_end_that_goes_away_abandons_its_requests(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    ticket = Ticket([Encoded([2, 3], False)], Wants(), time.perf_counter(), None)
    process.tickets[(frontend, 1)] = ticket
    ours.close()
    process._read(frontend)
    assert ticket.abandoned and process.tickets == {} and frontend.gone
    frontend.write(b"more")  # a late reply goes nowhere, and raises nothing


class FailingSends:
    """A socket whose every send fails as a full kernel buffer of another kind does."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> int:
        raise OSError(errno.ENOBUFS, "No buffer space available")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_a_reply_that_cannot_be_written_ends_the_connection_both_ways(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    """Not a front end left waiting for replies that will never come: it reads the
    connection closed (and fails its requests), and so does the engine's own reading."""
    process, ours, frontend = engine
    ticket = Ticket([Encoded([2, 3], False)], Wants(), time.perf_counter(), None)
    process.tickets[(frontend, 1)] = ticket
    frontend.sock = FailingSends(frontend.sock)  # type: ignore[assignment]
    frontend.write(b"a reply")
    assert frontend.gone
    ours.settimeout(5)  # a timeout, not a test that hangs, where the connection stays open
    assert ours.recv(65536) == b""  # the front end's side: closed
    process._read(frontend)
    assert ticket.abandoned and process.tickets == {}


def test_a_frame_that_is_no_message_stops_the_engine_rather_than_being_skipped(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    """No request can send one (front ends frame what they encode): it means a front end
    and the engine out of step. It reaches the worker, whose stop takes the server down for
    its orchestrator to restart (tests/app/test_split.py: a dead engine stops the rest)."""
    process, ours, frontend = engine
    ours.sendall(sent(submit(7)) + sent(Abort(8))[:4] + b"\xc1 not msgpack")
    with pytest.raises(msgspec.DecodeError):
        process._read(frontend)


def vector(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def decoded_answers(raw: bytes | bytearray) -> Answers:
    message = reply_decoder.decode(raw)
    assert isinstance(message, Answers)
    return message


def test_requests_of_one_batch_cross_in_one_message_per_kind_of_result_and_keep_their_own() -> None:
    """Plain vectors of two widths (requests may ask for different `dimensions`), per-token
    vectors with no pooled one and with one, and late chunking's (chunks, D), in one batch:
    each kind travels in its own message, each request gets its own results."""
    rng = np.random.default_rng(0)

    def rows(*shape: int) -> np.ndarray:
        return rng.random(shape, dtype=np.float32)

    plain = [Outcome([ItemResult(vector(i, i + 1))], 0.1 * i, 0.5) for i in range(3)]
    tokens = Outcome([ItemResult(None, rows(n, 4)) for n in (2, 5)], 0, 1)
    late = Outcome([ItemResult(rows(3, 2))], 0.2, 0.7)
    narrower = Outcome([ItemResult(vector(7, 8, 9))], 0, 0.5)
    both = Outcome([ItemResult(vector(5, 6), rows(3, 4))], 0, 0.5)
    sent = [
        (10, plain[0]),
        (11, tokens),
        (12, plain[1]),
        (13, late),
        (14, plain[2]),
        (15, narrower),
        (16, both),
    ]
    messages = answers(sent)
    assert [m.requests for m in messages] == [[10, 12, 14], [11], [13], [15], [16]]
    [*raws] = Frames().feed(b"".join(framed(m) for m in messages))
    got = dict(pair for raw in raws for pair in outcomes(decoded_answers(raw)))
    assert sorted(got) == [10, 11, 12, 13, 14, 15, 16]
    for request, outcome in sent:
        back = got[request]
        assert (back.queue_seconds, back.inference_seconds) == (
            outcome.queue_seconds,
            outcome.inference_seconds,
        )
        assert len(back.items) == len(outcome.items)
        for mine, theirs in zip(back.items, outcome.items, strict=True):
            for part in ("output", "token_embeddings"):
                expected, arrived = getattr(theirs, part), getattr(mine, part)
                assert (arrived is None) == (expected is None)
                if expected is not None:
                    np.testing.assert_array_equal(arrived, expected)


def test_a_batch_answers_a_front_end_in_one_message_after_its_failures(
    engine: tuple[EngineProcess, socket.socket, FrontEnd],
) -> None:
    process, ours, frontend = engine
    tickets = []
    for request in (1, 2, 3):
        ticket = Ticket([Encoded([2, 3], False)], Wants(), 0.0, (frontend, request))
        process.tickets[frontend, request] = ticket
        tickets.append(ticket)
    process._deliver(
        [
            (tickets[0], Outcome([ItemResult(vector(1, 2))], 0, 0)),
            (tickets[1], BackendError("the model failed on this request's inputs")),
            (tickets[2], Outcome([ItemResult(vector(3, 4))], 0, 0)),
        ]
    )
    failed, answered = (reply_decoder.decode(m) for m in Frames().feed(ours.recv(65536)))
    assert isinstance(failed, Failed) and failed.request == 2 and failed.error_type == "Backend"
    assert isinstance(answered, Answers) and answered.requests == [1, 3]
    assert process.tickets == {}
