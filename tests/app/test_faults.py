"""Faults: a drain completes what each route accepted, a dead worker fails liveness, an
out-of-memory batch is split down to its culprit, a failed batch fails only the request the
model fails on, each request with an error of its own."""

from __future__ import annotations

import asyncio
import base64
import gc
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.engine.batcher import Ticket
from app.engine.compute import ComputeThread
from app.engine.local import deliver_on
from app.engine.protocol import Outcome, Wants
from app.errors import BackendError, ClientDisconnectedError
from app.params import EncodeOptions
from model import Embedder
from tests.app.conftest import (
    GatedForward,
    local_engine,
    make_settings,
    running_app,
    service_of,
    wait_until,
)
from tests.app.test_batching import make_batcher
from tests.helpers import TINY_VOCAB

pytestmark = pytest.mark.anyio
FOX = TINY_VOCAB.index("fox")
# Each inference route, a body for it, and how many vectors of the tiny model's 32 values
# its answer holds.
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/embed", {"inputs": ["hello", "world"]}),
    ("/embed_all", {"inputs": "hello world"}),
    ("/v1/embeddings", {"input": ["hello", "world"], "encoding_format": "base64"}),
    ("/encode", {"inputs": "hello", "token_embeddings": True, "attention": {"layers": [0]}}),
]


def vectors(path: str, body: Any) -> np.ndarray:
    """The answer's vectors as one (N, 32) array, whatever the route's shape."""
    if path == "/embed":
        return np.array(body, dtype=np.float32)
    if path == "/embed_all":
        return np.concatenate([np.array(item, dtype=np.float32) for item in body])
    if path == "/v1/embeddings":
        raw = [base64.b64decode(item["embedding"]) for item in body["data"]]
        return np.stack([np.frombuffer(item, dtype="<f4") for item in raw])
    [item] = body["data"]
    return np.array([item["embedding"], *item["token_embeddings"]], dtype=np.float32)


async def test_a_drain_completes_what_every_inference_route_accepted(
    tiny_checkpoint: Path,
) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_batch_inputs=1)) as (app, client):
        service = service_of(app)
        expected = {path: (await client.post(path, json=body)).json() for path, body in ROUTES}
        gate = GatedForward(service)
        gate.gate.clear()
        accepted = {
            path: asyncio.create_task(client.post(path, json=body)) for path, body in ROUTES
        }
        # All four are in: one in the held forward pass, the others' inputs queued.
        await wait_until(lambda: service.inflight == len(ROUTES))
        service.begin_drain()
        refused = await client.post("/embed", json={"inputs": "too late"})
        health = await client.get("/health")
        gate.gate.set()
        done = {path: await task for path, task in accepted.items()}
        assert await service.wait_idle(10)
    assert refused.status_code == 503 and health.status_code == 503
    for path, response in done.items():
        assert response.status_code == 200, (path, response.text)
        got, want = vectors(path, response.json()), vectors(path, expected[path])
        assert got.shape == want.shape and got.shape[1] == 32
        assert np.abs(got - want).max() <= 1e-5, path
    assert done["/encode"].json()["data"][0]["attention"][0]["layer"] == 0


# Pytest turns an exception that ends a thread into a warning, and this suite's warnings into
# errors: here the worker's death is the point.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_dead_worker_fails_liveness_and_what_waits(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_batch_inputs=1)) as (app, client):
        service = service_of(app)
        batcher = local_engine(service).model.batcher
        assert batcher is not None
        gate = GatedForward(service)
        running = await gate.hold(client)
        queued = asyncio.create_task(client.post("/embed", json={"inputs": "world"}))
        await wait_until(lambda: batcher.depth == 1)
        assert (await client.get("/live")).status_code == 200

        def broken() -> None:
            raise RuntimeError("injected: the worker's loop broke")

        # The test hook: the worker's next look at the queue raises, outside any forward pass.
        monkeypatch.setattr(batcher, "_next_batch", broken)
        with caplog.at_level(logging.CRITICAL, logger="app.engine.batcher"):
            gate.gate.set()
            finished, failed = await running, await queued
            await wait_until(lambda: not batcher.alive)
        live = await client.get("/live")
        health = await client.get("/health")
        after = await client.post("/embed", json={"inputs": "hello"})
    assert finished.status_code == 200  # the batch already running was delivered
    assert failed.status_code == 500
    assert failed.json()["error"].startswith("the batch worker has stopped")
    assert live.status_code == 503
    assert live.json()["error"] == "the batch worker has stopped; the process needs a restart"
    assert health.status_code == 503 and after.status_code == 503
    assert "the batch worker stopped" in caplog.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("device_works", [True, False])
async def test_a_pass_that_breaks_the_device_stops_the_worker(
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    device_works: bool,
) -> None:
    """After a failed pass the engine asks whether the device still runs work: a CUDA error
    such as an illegal memory access leaves every later call failing, and then liveness says
    so (a restart helps) instead of each request failing while the server reads as healthy.
    Where the device works, only the failing request gets its 500, as before."""
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        service = service_of(app)
        engine = local_engine(service).model
        batcher = engine.batcher
        assert batcher is not None and engine.embedder is not None
        gate = GatedForward(service)
        gate.gate.set()
        gate.error = lambda: torch.AcceleratorError("injected: CUDA error: illegal memory access")
        gate.fail_when = lambda batch: any(FOX in ids for ids in batch)
        monkeypatch.setattr(engine.embedder, "device_works", lambda: device_works)
        with caplog.at_level(logging.CRITICAL, logger="app.engine.batcher"):
            failed = await client.post("/embed", json={"inputs": "fox"})
            if not device_works:
                await wait_until(lambda: not batcher.alive)
        live = await client.get("/live")
        after = await client.post("/embed", json={"inputs": "hello"})
    assert failed.status_code == 500
    if device_works:
        assert live.status_code == 200 and after.status_code == 200
    else:
        assert live.status_code == 503 and after.status_code == 503
        assert "the device runs nothing since this failure" in caplog.text


async def test_out_of_memory_splits_the_batch_down_to_the_culprit(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        gate = GatedForward(service_of(app))
        batcher = local_engine(app).model.batcher
        assert batcher is not None
        gate.error = lambda: torch.OutOfMemoryError("injected: CUDA out of memory")
        # Any batch holding "fox" runs out of memory, as a too-long input would.
        gate.fail_when = lambda batch: any(FOX in ids for ids in batch)
        held = await gate.hold(client, "dog")
        texts = ["hello", "world", "fox", "quick"]
        tasks = [asyncio.create_task(client.post("/embed", json={"inputs": t})) for t in texts]
        await wait_until(lambda: batcher.depth == len(texts))
        gate.gate.set()
        responses = dict(zip(texts, await asyncio.gather(*tasks), strict=True))
        await held
        batches = gate.batches[1:]
        after = await client.post("/embed", json={"inputs": "fox jumps"})
        health = await client.get("/health")
    fox = responses.pop("fox")
    assert fox.status_code == 500 and fox.json()["error_type"] == "Backend"
    assert fox.json()["error"].startswith("out of memory on this input alone")
    assert all(r.status_code == 200 for r in responses.values())
    # The batch of four, its halves, and the culprit's half in halves: every healthy input
    # ran once, in the half without the culprit or alone.
    assert [len(batch) for batch in batches] == [4, 2, 2, 1, 1]
    assert sum(1 for batch in batches for ids in batch if FOX in ids) == 3
    assert after.status_code == 500 and health.status_code == 200  # the worker carries on


async def test_a_failed_batch_fails_only_the_request_the_model_fails_on(
    tiny_checkpoint: Path,
) -> None:
    """A batch mixes requests: when its pass fails, each request runs again alone, and only
    the one that fails alone gets the error (one bad request never fails another)."""
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        gate = GatedForward(service_of(app))
        batcher = local_engine(app).model.batcher
        assert batcher is not None
        gate.fail_when = lambda batch: any(FOX in ids for ids in batch)
        held = await gate.hold(client, "dog")
        texts = ["hello", "fox", ["world", "quick"]]
        tasks = [asyncio.create_task(client.post("/embed", json={"inputs": t})) for t in texts]
        await wait_until(lambda: batcher.depth == 4)
        gate.gate.set()
        hello, fox, pair = await asyncio.gather(*tasks)
        await held
        batches = gate.batches[1:]
        health = await client.get("/health")
    assert fox.status_code == 500 and fox.json()["error_type"] == "Backend"
    assert fox.json()["error"].startswith("the model failed on this request's inputs")
    assert hello.status_code == 200 and pair.status_code == 200
    assert len(pair.json()) == 2
    # The mixed batch, then each request's inputs alone, in the order they came.
    assert [len(batch) for batch in batches] == [4, 1, 1, 2]
    assert health.status_code == 200


async def test_a_failed_batch_gives_each_request_its_own_error(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One exception object shared by several futures would gather every awaiting task's
    traceback onto it (and leak them); each request gets its own."""
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8, batch_wait=0.5)

    def broken(batch: object) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(batcher, "_forward", broken)
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Outcome]] = [loop.create_future() for _ in range(3)]
    deadline = time.perf_counter() + 30
    for text, future in zip(("hello", "world", "fox"), futures, strict=True):
        batcher.submit(Ticket(tiny_embedder.tokenize([text]), Wants(), deadline, future))
    compute = ComputeThread()
    batcher.deliver = deliver_on(loop)
    batcher.start(compute)
    try:
        errors = []
        for future in futures:
            with pytest.raises(BackendError) as caught:
                await asyncio.wait_for(future, timeout=10)
            errors.append(caught.value)
    finally:
        batcher.stop(timeout=2)
        compute.close()
    assert len({id(error) for error in errors}) == 3
    assert all(error.message == "the model failed on this request's inputs" for error in errors)


async def test_inputs_dropped_for_gone_clients_leave_the_queue_gauges_at_zero(
    tiny_checkpoint: Path,
) -> None:
    """Found by bench/soak.py: the queue emptied of abandoned inputs, but /metrics went on
    saying it held them."""
    async with running_app(make_settings(tiny_checkpoint, max_batch_inputs=1)) as (app, client):
        service = service_of(app)
        batcher = local_engine(service).model.batcher
        assert batcher is not None
        gate = GatedForward(service)
        held = await gate.hold(client)

        async def gone() -> None:
            await asyncio.sleep(0.05)

        with pytest.raises(ClientDisconnectedError):
            await service.encode(["fox", "dog"], EncodeOptions(), gone)
        assert batcher.depth == 2  # queued, abandoned, not yet dropped
        gate.gate.set()
        await held
        await wait_until(lambda: batcher.depth == 0)  # dropped by the worker
        metrics = (await client.get("/metrics")).text  # the gauges are read at the scrape
    assert re.search(r"^embed_queue_depth\{model=\S+\} 0.0$", metrics, re.M)
    assert re.search(r"^embed_queue_tokens\{model=\S+\} 0.0$", metrics, re.M)
    assert not any(FOX in ids for batch in gate.batches for ids in batch)


async def test_start_up_objects_are_frozen_out_of_the_cyclic_collector(
    tiny_checkpoint: Path,
) -> None:
    """A full collection walks every tracked object: those start-up made (the model, the
    modules) are frozen once the model is warm, so that it never stalls the event loop."""
    gc.unfreeze()
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        frozen = gc.get_freeze_count()
        assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200
    assert frozen > 10_000


async def test_requests_in_flight_make_no_young_collection(tiny_checkpoint: Path) -> None:
    """Requests in flight hold their objects until answered: under CPython's default young
    threshold (700) 32 of them ran a collection every few dozen requests, through objects that
    were all alive. Raised once start-up is done, nothing a request leaves behind reaches it."""
    young: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(1)

    before = gc.get_threshold()
    try:
        async with running_app(make_settings(tiny_checkpoint)) as (_, client):
            texts = [f"sentence number {i} of the burst" for i in range(32)]
            await asyncio.gather(*(client.post("/embed", json={"inputs": t}) for t in texts))
            gc.callbacks.append(count)
            try:
                for _ in range(4):
                    answers = await asyncio.gather(
                        *(client.post("/embed", json={"inputs": t}) for t in texts)
                    )
                    assert all(answer.status_code == 200 for answer in answers)
            finally:
                gc.callbacks.remove(count)
    finally:
        gc.set_threshold(*before)
    assert not young
