"""The engine in a process of its own, reached over a Unix socket from this process's app: what the
protocol adds to the in-process tests (aborts, deadlines and the fast 429 across processes,
outputs crossing as buffers)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI

from app.engine.protocol import ItemResult, Outcome, Wants
from app.engine.remote import EngineLink, RemoteEngine, RemotePending, least_busy
from app.engine.state import EngineBoard
from app.engine.wire import (
    Abort,
    Frames,
    answers,
    encoded_message,
    framed,
    submit_message,
    to_engine_decoder,
)
from app.errors import ClientDisconnectedError, DeadlineError, ServiceError
from app.main import create_app
from app.service import WATCH_AFTER, Watch
from model.tokenizer import Encoded
from tests.app.conftest import (
    engine_process,
    make_settings,
    running_app,
    service_of,
    wait_until,
)

pytestmark = pytest.mark.anyio
MANY = ["the quick brown fox jumps over the lazy dog"] * 2000


def remote(app: FastAPI) -> RemoteEngine:
    engine = service_of(app).engine
    assert isinstance(engine, RemoteEngine)
    return engine


async def test_batches_across_processes_give_each_input_its_own_vector(
    tiny_checkpoint: Path,
) -> None:
    texts = ["hello", "the quick brown fox", "jumps over the lazy dog " * 3, "world"]
    async with running_app(make_settings(tiny_checkpoint), "split") as (_, client):
        alone = [(await client.post("/embed", json={"inputs": t})).json()[0] for t in texts]
        together = await asyncio.gather(
            *(client.post("/embed", json={"inputs": t}) for t in texts * 4)
        )
    for index, response in enumerate(together):
        assert response.status_code == 200
        got = np.array(response.json()[0])
        assert np.abs(got - np.array(alone[index % len(texts)])).max() < 1e-5


async def test_a_client_that_leaves_takes_its_inputs_out_of_the_engines_queue(
    tiny_checkpoint: Path,
) -> None:
    settings = make_settings(tiny_checkpoint, max_batch_inputs=1)
    async with running_app(settings, "split") as (app, client):
        engine = remote(app)
        request = asyncio.create_task(client.post("/embed", json={"inputs": MANY}))
        await wait_until(lambda: engine.board.backlog(0)[0] > 0)
        request.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await request
        started = time.monotonic()
        await wait_until(lambda: engine.board.backlog(0)[0] == 0)
        assert time.monotonic() - started < 2  # dropped, not run: 2,000 passes take longer
        assert engine.links[0].pending == {}
        assert (await client.post("/embed", json={"inputs": "next"})).status_code == 200


async def test_a_deadline_that_passes_removes_the_work(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, max_batch_inputs=1, request_timeout=0.5)
    async with running_app(settings, "split") as (app, client):
        engine = remote(app)
        late = await client.post("/embed", json={"inputs": MANY})
        assert late.status_code == 504
        await wait_until(lambda: engine.board.backlog(0)[0] == 0, within=2)
        assert (await client.post("/embed", json={"inputs": "next"})).status_code == 200


async def test_an_overloaded_engine_is_refused_by_the_front_end_with_retry_after(
    tiny_checkpoint: Path,
) -> None:
    settings = make_settings(tiny_checkpoint, max_batch_inputs=1, max_queue_wait=0.05)
    async with running_app(settings, "split") as (app, client):
        engine = remote(app)
        busy = asyncio.create_task(client.post("/embed", json={"inputs": MANY}))
        await wait_until(lambda: engine.board.seconds_ahead(0) > 0.05)
        sent_before = len(engine.links[0].pending)
        refused = await client.post("/embed", json={"inputs": "one more"})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error_type"] == "Overloaded"
        assert len(engine.links[0].pending) == sent_before  # refused before anything was sent
        assert (await busy).status_code == 200


class CountingPending:
    def __init__(self) -> None:
        self.future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.errors: list[ServiceError] = []

    def abort(self, error: ServiceError) -> None:
        self.errors.append(error)


async def test_the_watch_aborts_once_and_watches_only_requests_that_wait() -> None:
    watched = 0

    async def disconnected() -> None:
        nonlocal watched
        watched += 1
        await asyncio.Event().wait()  # the client never leaves

    quick = CountingPending()
    Watch(quick, 0.01, lambda: DeadlineError("late"), disconnected)
    slow = CountingPending()
    waiting = Watch(slow, 5.0, lambda: DeadlineError("late"), disconnected)
    await asyncio.sleep(WATCH_AFTER + 0.1)
    assert [type(error) for error in quick.errors] == [DeadlineError]
    assert watched == 1 and slow.errors == []  # only the one that waited past WATCH_AFTER
    waiting.close()


def test_idle_engines_leave_work_on_the_first_and_a_busy_one_passes_it_on(
    tmp_path: Path,
) -> None:
    board = EngineBoard.create(tmp_path / "board", 3)
    assert least_busy(board, [0, 0, 0]) == 0  # all idle: always the first, never in turn
    assert least_busy(board, [0, 0, 0]) == 0
    assert least_busy(board, [1, 0, 0]) == 1  # a request sent, not yet published
    assert least_busy(board, [1, 1, 0]) == 2
    board.publish(0, 100, 0.001)
    assert least_busy(board, [0, 0, 0]) == 1
    board.publish(1, 50, 0.001)
    board.publish(2, 80, 0.001)
    assert least_busy(board, [0, 9, 0]) == 1  # the least work ahead comes first


async def test_a_front_end_is_ready_before_its_server_takes_requests(tiny_checkpoint: Path) -> None:
    """Its lifespan connects to the engines before it ends (uvicorn listens after that), so
    that no request reaches a front end still starting while the others answer."""
    settings = make_settings(tiny_checkpoint)
    with engine_process(settings) as engine:
        app = create_app(settings, engine)
        async with app.router.lifespan_context(app):
            assert service_of(app).ready


class Written(asyncio.Transport):
    """A transport that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))


async def test_what_one_turn_of_the_event_loop_sends_goes_as_one_message_in_order() -> None:
    link = EngineLink(0)
    transport = Written()
    link.connection_made(transport)
    encoded = [Encoded([2, 5, 3], False)]
    for request in (1, 2):
        link.send(
            encoded_message(submit_message(request, time.perf_counter() + 1, encoded, Wants()))
        )
    link.send(encoded_message(Abort(1)))
    await asyncio.sleep(0)  # the turn ends
    link.send(encoded_message(submit_message(3, time.perf_counter() + 1, encoded, Wants())))
    await asyncio.sleep(0)
    sent = [
        [(type(m).__name__, m.request) for m in to_engine_decoder.decode(raw).messages]
        for write in transport.writes
        for raw in Frames().feed(write)
    ]
    assert sent == [[("Submit", 1), ("Submit", 2), ("Abort", 1)], [("Submit", 3)]]


async def test_answers_for_a_request_aborted_meanwhile_leave_it_be_and_answer_the_rest() -> None:
    link = EngineLink(0)
    link.connection_made(Written())
    loop = asyncio.get_running_loop()
    gone, kept = (RemotePending(link, request, loop.create_future()) for request in (1, 2))
    link.pending.update({1: gone, 2: kept})
    gone.abort(ClientDisconnectedError("the client disconnected"))
    vectors = [np.array([i, i + 1], dtype=np.float32) for i in (1, 2)]
    finished = [(r, Outcome([ItemResult(v)], 0, 0)) for r, v in zip((1, 2), vectors, strict=True)]
    [message] = answers(finished)
    link.data_received(framed(message))
    with pytest.raises(ClientDisconnectedError):
        gone.future.result()
    [item] = kept.future.result().items
    np.testing.assert_array_equal(item.vector, vectors[1])
    assert link.pending == {}


async def test_requests_for_different_dimensions_in_one_batch_each_get_their_own(
    tiny_checkpoint: Path,
) -> None:
    """Their vectors differ in width, so they cross in messages of their own. A long request
    holds the engine meanwhile, so that the others queue, and run, together."""
    text = "the quick brown fox"
    async with running_app(make_settings(tiny_checkpoint), "split") as (_, client):
        whole = np.array((await client.post("/embed", json={"inputs": text})).json()[0])
        busy = asyncio.create_task(client.post("/embed", json={"inputs": MANY[:512]}))
        mixed = await asyncio.gather(
            *(
                client.post(
                    "/embed", json={"inputs": text, "dimensions": 8} if i % 2 else {"inputs": text}
                )
                for i in range(8)
            )
        )
        assert (await busy).status_code == 200
    cut = whole[:8] / np.linalg.norm(whole[:8])
    for index, response in enumerate(mixed):
        assert response.status_code == 200
        got = np.array(response.json()[0])
        expected = cut if index % 2 else whole
        assert got.shape == expected.shape and np.abs(got - expected).max() < 1e-5
