"""All torch work on one thread (app/compute.py): loading, warm-up and every forward pass."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine.compute import ComputeThread, ComputeThreadClosedError
from app.engine.model_engine import ModelEngine
from app.metrics import Metrics
from model import Embedder
from tests.app.conftest import make_settings, running_app


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller() -> None:
    compute = ComputeThread(threads=1)
    try:
        seen: list[tuple[int, str]] = []

        def record(n: int) -> None:
            seen.append((threading.get_ident(), f"call {n}"))

        futures = [compute.submit(record, n) for n in range(5)]
        for future in futures:
            future.result(timeout=10)
        assert [name for _, name in seen] == [f"call {n}" for n in range(5)]
        assert len({ident for ident, _ in seen}) == 1
        assert seen[0][0] != threading.get_ident()
        assert compute.submit(torch.get_num_threads).result(timeout=10) == 1

        def broken() -> None:
            raise ValueError("injected")

        with pytest.raises(ValueError, match="injected"):
            compute.submit(broken).result(timeout=10)
        assert compute.submit(lambda: 2 + 2).result(timeout=10) == 4  # still serving
    finally:
        compute.close()


@pytest.mark.anyio
async def test_the_service_loads_and_runs_the_model_on_one_thread(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenMP keeps a worker pool per thread that starts parallel work; more than one such
    thread made every forward pass twice as slow (see app/compute.py)."""
    threads: dict[str, set[int]] = {"load": set(), "forward": set()}
    original_load, original_launch = Embedder.load, Embedder.launch

    def load(*args: Any, **kwargs: Any) -> Embedder:
        threads["load"].add(threading.get_ident())
        return original_load(*args, **kwargs)

    def launch(self: Embedder, *args: Any, **kwargs: Any) -> Any:
        threads["forward"].add(threading.get_ident())
        assert torch.get_num_threads() == 2
        return original_launch(self, *args, **kwargs)

    monkeypatch.setattr(Embedder, "load", load)
    monkeypatch.setattr(Embedder, "launch", launch)
    async with running_app(make_settings(tiny_checkpoint, threads=2)) as (_, client):
        response = await client.post("/embed", json={"inputs": ["hello", "world"]})
    assert response.status_code == 200
    assert len(threads["load"]) == 1
    assert threads["forward"] == threads["load"]  # warm-up and requests alike
    assert threading.get_ident() not in threads["load"]


def test_work_submitted_after_close_fails_instead_of_waiting_for_ever(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped while its model loads (SIGTERM then, or a port already taken, which
    makes uvicorn stop at once) closes the compute thread under the load: the load's next
    step fails, and the process can exit."""
    compute = ComputeThread()
    compute.close()
    with pytest.raises(ComputeThreadClosedError):
        compute.submit(lambda: 1).result(timeout=10)

    loading, stopped = threading.Event(), threading.Event()
    original_load = Embedder.load

    def slow_load(*args: Any, **kwargs: Any) -> Embedder:
        loading.set()
        stopped.wait(10)
        return original_load(*args, **kwargs)

    monkeypatch.setattr(Embedder, "load", slow_load)
    settings = make_settings(tiny_checkpoint)
    engine = ModelEngine(settings, settings.models()[0], Metrics().of("tiny"), "cpu")
    failed: list[BaseException] = []

    def load() -> None:
        try:
            engine.load(lambda deliveries: None)
        except BaseException as exc:
            failed.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    assert loading.wait(10)
    engine.stop()  # while the model loads
    stopped.set()
    loader.join(timeout=30)
    assert not loader.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], ComputeThreadClosedError)
