from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from fastapi import FastAPI

from app.engine.local import LocalEngine
from app.engine.protocol import Admission
from app.engine.remote import RemoteEngine
from app.engine.state import EngineBoard
from app.main import create_app
from app.service import EmbeddingService
from app.settings import Settings
from app.supervisor import Shared, run_engine, stop_children
from model import Encoded, PendingOutput


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_settings(checkpoint: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "model_id": str(checkpoint),
        "devices": ["cpu"],
        "dtype": "float32",
        "threads": 1,
    }
    return Settings(**(values | overrides))


Placement = Literal["in-process", "split"]


@pytest.fixture(params=["in-process", "split"])
def placement(request: pytest.FixtureRequest) -> Placement:
    """Run a test against both placements of the engine."""
    chosen: Placement = request.param
    return chosen


@contextmanager
def engine_processes(settings: Settings) -> Iterator[dict[str, RemoteEngine]]:
    """Each served model's engine in a process of its own, as the supervisor starts them,
    and a front end's client for each, by name. (Their metrics stay in their own processes:
    the test's registry is not shared.)"""
    context = multiprocessing.get_context("spawn")
    served = settings.models()
    with tempfile.TemporaryDirectory(prefix="embed-test-") as folder:
        shared = Shared(Path(folder), 1, None, False, context.RawArray(ctypes.c_int, 1))
        shared.prepare(len(served))
        processes = []
        try:
            links = []
            for model, each in enumerate(served):
                receiving, sending = context.Pipe(duplex=False)
                process = context.Process(
                    target=run_engine,
                    args=(settings, each, model, 0, settings.devices[0], shared, sending),
                )
                process.start()
                sending.close()
                processes.append(process)
                links.append(receiving)
            engines = {}
            for model, (each, link) in enumerate(zip(served, links, strict=True)):
                kind, card = link.recv()
                assert kind == "ready", card
                board = EngineBoard(shared.board_path(model), 1)
                own = settings.for_model(each)
                admission = Admission(own.request_timeout, own.max_queue_wait)
                engines[each.name] = RemoteEngine(card, shared.model_dir(model), board, admission)
            yield engines
        finally:
            stop_children(processes)  # as the supervisor does: they ignore SIGTERM


@contextmanager
def engine_process(settings: Settings) -> Iterator[RemoteEngine]:
    """The first model's engine in a process of its own, and a front end's client for it."""
    with engine_processes(settings) as engines:
        yield next(iter(engines.values()))


@asynccontextmanager
async def running_app(
    settings: Settings, placement: Placement = "in-process", ready_within: float = 4.0
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan running, and a client; yields once /health says ready
    (within `ready_within` seconds). The engine runs in this process, or in one of its own
    (`placement`)."""
    if placement == "in-process":
        async with _serving(create_app(settings), ready_within) as running:
            yield running
        return
    with engine_processes(settings) as engines:
        async with _serving(create_app(settings, engines), ready_within) as running:
            yield running


@asynccontextmanager
async def _serving(
    app: FastAPI, ready_within: float
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(int(ready_within / 0.02)):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the app never became ready")
            yield app, client


def service_of(app: FastAPI) -> EmbeddingService:
    service: EmbeddingService = app.state.service
    return service


def local_engine(target: FastAPI | EmbeddingService) -> LocalEngine:
    """The engine of an app (or its service) that runs the model in this process."""
    service = target if isinstance(target, EmbeddingService) else service_of(target)
    assert isinstance(service.engine, LocalEngine)
    return service.engine


class GatedForward:
    """Wraps the model's forward pass (`Embedder.launch`, what the batcher calls): counts
    calls, can hold them, can fail some."""

    def __init__(self, service: EmbeddingService) -> None:
        embedder = local_engine(service).model.embedder
        assert embedder is not None
        self.original = embedder.launch
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[list[list[int]]] = []
        self.fail_when: Callable[[list[list[int]]], bool] = lambda batch: False
        self.error: Callable[[], BaseException] = lambda: RuntimeError(
            "injected failure in the forward pass"
        )
        embedder.launch = self  # type: ignore[method-assign,assignment]

    def __call__(self, batch: Sequence[Encoded], **kwargs: Any) -> PendingOutput:
        ids = [list(item.ids) for item in batch]
        self.batches.append(ids)
        self.entered.set()
        self.gate.wait(timeout=30)
        if self.fail_when(ids):
            raise self.error()
        return self.original(batch, **kwargs)

    async def hold(self, client: httpx.AsyncClient, text: str = "hello") -> asyncio.Task[Any]:
        """Close the gate and send one /embed of `text`: returns once its batch is held in
        the forward pass, with the task that will get its response."""
        self.gate.clear()
        held = asyncio.create_task(client.post("/embed", json={"inputs": text}))
        await asyncio.to_thread(self.entered.wait, 10)
        return held


async def wait_until(condition: Callable[[], bool], within: float = 10.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")
