from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.engine.local import LocalEngine
from app.main import create_app
from app.service import EmbeddingService
from app.settings import Settings
from model import BatchOutput, Encoded


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


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan running, and a client; yields once /health says ready."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(200):
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
    """Wraps the model's forward pass: counts calls, can hold them, can fail some."""

    def __init__(self, service: EmbeddingService) -> None:
        embedder = local_engine(service).embedder
        assert embedder is not None
        self.original = embedder.forward
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[list[list[int]]] = []
        self.fail_when: Callable[[list[list[int]]], bool] = lambda batch: False
        self.error: Callable[[], BaseException] = lambda: RuntimeError(
            "injected failure in the forward pass"
        )
        embedder.forward = self  # type: ignore[method-assign,assignment]

    def __call__(self, batch: Sequence[Encoded], **kwargs: Any) -> BatchOutput:
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
