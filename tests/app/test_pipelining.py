"""The batch worker's overlap: a pass still running on the device is answered only after the
next batch is launched behind it (app/engine/batcher.py); a complete pass at once."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from app.engine.batcher import Batcher, Delivery, Ticket
from app.engine.compute import ComputeThread
from app.engine.local import deliver_on
from app.engine.model_engine import GPU_SWITCH_INTERVAL, share_the_gil
from app.engine.protocol import Outcome, Wants
from app.errors import BackendError
from model import BatchOutput, Embedder, Encoded
from tests.app.test_batching import make_batcher

pytestmark = pytest.mark.anyio


class Pending:
    """A pass's output as `Embedder.launch` hands it back: `result` says when it is awaited."""

    def __init__(self, output: BatchOutput, name: str, events: list[str], fails: bool):
        self.output, self.name, self.events, self.fails = output, name, events, fails

    def result(self) -> BatchOutput:
        self.events.append(f"result {self.name}")
        if self.fails:
            raise RuntimeError("injected failure while the pass's output came back")
        return self.output


class FakeDevice:
    """Wraps `Embedder.launch`: names each pass by its texts, holds the first until released,
    can make some passes fail when their output is awaited. `graph_shape` says which come
    back still running (all with `in_flight`, but the `eager` ones, as on a GPU)."""

    def __init__(self, embedder: Embedder, in_flight: bool) -> None:
        self.real = embedder.launch
        self.decode = embedder.decode
        self.in_flight = in_flight
        self.events: list[str] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.failing: set[str] = set()
        self.eager: set[str] = set()
        embedder.launch = self  # type: ignore[method-assign,assignment]
        embedder.graph_shape = self.graph_shape  # type: ignore[method-assign,assignment]

    def name(self, batch: Sequence[Encoded]) -> str:
        return "+".join(sorted(self.decode([item.ids for item in batch], skip_special_tokens=True)))

    def graph_shape(self, batch: Sequence[Encoded], **kwargs: Any) -> tuple[int, int] | None:
        return (len(batch), 1) if self.in_flight and self.name(batch) not in self.eager else None

    def __call__(self, batch: Sequence[Encoded], **kwargs: Any) -> Pending:
        name = self.name(batch)
        self.events.append(f"launch {name}")
        self.entered.set()
        self.release.wait(timeout=30)
        fails = name in self.failing
        self.failing.discard(name)  # fails once: its rerun succeeds
        return Pending(self.real(batch, **kwargs).result(), name, self.events, fails)


async def run_requests(
    embedder: Embedder, device: FakeDevice, first: str, then: Sequence[str], broken: int = 0
) -> tuple[Batcher, list[Outcome | BaseException]]:
    """`first` alone in a held pass; then `then`'s texts, as requests of their own, queued
    behind it; every answer or error. The first `broken` deliveries raise (a worker's bug)."""
    batcher = make_batcher(embedder, max_batch_inputs=8)
    loop = asyncio.get_running_loop()
    deliver = deliver_on(loop)

    def delivering(deliveries: list[Delivery]) -> None:
        nonlocal broken
        if broken > 0:
            broken -= 1
            raise RuntimeError("injected bug while answering")
        deliver(deliveries)

    batcher.deliver = delivering
    compute = ComputeThread()
    batcher.start(compute)
    deadline = time.perf_counter() + 30
    futures: list[asyncio.Future[Outcome]] = []
    try:
        for texts in ([first], *[[text] for text in then]):
            futures.append(loop.create_future())
            batcher.submit(Ticket(embedder.tokenize(texts), Wants(), deadline, futures[-1]))
            if len(futures) == 1:
                await asyncio.to_thread(device.entered.wait, 10)  # the worker holds `first`
        device.release.set()
        answers = asyncio.gather(*futures, return_exceptions=True)
        return batcher, await asyncio.wait_for(answers, timeout=20)
    finally:
        batcher.stop(timeout=2)
        compute.close()


@pytest.mark.parametrize("in_flight", [True, False], ids=["on-its-way", "complete"])
async def test_a_running_pass_is_answered_after_the_next_is_launched(
    tiny_embedder: Embedder, in_flight: bool
) -> None:
    alone = {
        text: tiny_embedder.forward(tiny_embedder.tokenize([text])).pooled.numpy()[0]
        for text in ("hello", "fox")
    }
    device = FakeDevice(tiny_embedder, in_flight)
    batcher, outcomes = await run_requests(tiny_embedder, device, "hello", ["fox"])
    if in_flight:  # answering "hello" overlaps the pass of "fox"
        assert device.events == ["launch hello", "launch fox", "result hello", "result fox"]
    else:  # a complete pass is answered before the worker takes the next batch
        assert device.events == ["launch hello", "result hello", "launch fox", "result fox"]
    for text, outcome in zip(("hello", "fox"), outcomes, strict=True):
        assert isinstance(outcome, Outcome)
        [item] = outcome.items
        expected = alone[text] / np.linalg.norm(alone[text])
        assert np.abs(item.vector - expected).max() <= 1e-6
    assert batcher.idle  # both passes' tokens released


async def test_a_pass_that_comes_back_complete_waits_for_the_running_one_to_be_answered(
    tiny_embedder: Embedder,
) -> None:
    """An eager pass behind a graphed one would wait for it on the GPU: the running pass is
    answered first, not after both."""
    device = FakeDevice(tiny_embedder, in_flight=True)
    device.eager.add("fox")
    batcher, outcomes = await run_requests(tiny_embedder, device, "hello", ["fox"])
    assert device.events == ["launch hello", "result hello", "launch fox", "result fox"]
    assert all(isinstance(outcome, Outcome) for outcome in outcomes)
    assert batcher.idle


async def test_a_pass_that_fails_on_its_way_back_reruns_each_request(
    tiny_embedder: Embedder,
) -> None:
    """The failure comes when the output is awaited, after the next pass was launched; the
    failed batch's requests run again alone, and the queue's accounting stays whole."""
    device = FakeDevice(tiny_embedder, in_flight=True)
    device.failing.add("fox+world")
    batcher, outcomes = await run_requests(tiny_embedder, device, "hello", ["world", "fox"])
    assert device.events[:4] == [
        "launch hello",
        "launch fox+world",
        "result hello",
        "result fox+world",
    ]
    assert sorted(device.events[4:]) == sorted(
        ["launch world", "result world", "launch fox", "result fox"]
    )
    assert all(isinstance(outcome, Outcome) for outcome in outcomes)
    assert batcher.idle and batcher._running_tokens == 0


async def test_a_request_whose_pass_fails_alone_gets_its_error_and_the_others_their_answers(
    tiny_embedder: Embedder,
) -> None:
    device = FakeDevice(tiny_embedder, in_flight=True)
    device.failing.add("fox")
    batcher, outcomes = await run_requests(tiny_embedder, device, "hello", ["fox"])
    hello, fox = outcomes
    assert isinstance(hello, Outcome)
    assert isinstance(fox, BackendError) and "failed on this request" in str(fox)
    assert batcher.idle and batcher.crashed is None


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_a_gpu_engine_lets_the_other_threads_at_the_gil_sooner(device: str) -> None:
    before = sys.getswitchinterval()
    try:
        share_the_gil(device)
        expected = GPU_SWITCH_INTERVAL if device.startswith("cuda") else before
        assert sys.getswitchinterval() == pytest.approx(expected)
    finally:
        sys.setswitchinterval(before)


async def test_a_worker_that_breaks_while_a_pass_runs_fails_that_pass_s_requests_too(
    tiny_embedder: Embedder,
) -> None:
    """The worker breaks answering "hello" after launching "fox" behind it: both requests get
    an error (none waits forever) and no token stays counted as running."""
    device = FakeDevice(tiny_embedder, in_flight=True)
    batcher, outcomes = await run_requests(tiny_embedder, device, "hello", ["fox"], broken=1)
    assert device.events == ["launch hello", "launch fox", "result hello"]
    assert all(isinstance(outcome, BackendError) for outcome in outcomes)
    assert batcher.crashed is not None and batcher._running_tokens == 0
