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

from app.engine.batcher import Batcher, Ticket
from app.engine.compute import ComputeThread
from app.engine.local import deliver_on
from app.engine.model_engine import GPU_SWITCH_INTERVAL, share_the_gil
from app.engine.protocol import Outcome, Wants
from app.errors import BackendError
from model import BatchOutput, Embedder, Encoded
from tests.app.test_batching import make_batcher

pytestmark = pytest.mark.anyio


class Pending:
    """A pass's output as a GPU's graphed pass hands it back (`in_flight`), or complete."""

    def __init__(self, output: BatchOutput, name: str, events: list[str], in_flight: bool):
        self.output, self.name, self.events, self.in_flight = output, name, events, in_flight
        self.fails = False

    def result(self) -> BatchOutput:
        self.events.append(f"result {self.name}")
        if self.fails:
            raise RuntimeError("injected failure while the pass's output came back")
        return self.output


class FakeDevice:
    """Wraps `Embedder.launch`: names each pass by its texts, holds the first until released,
    and can make some passes fail when their output is awaited."""

    def __init__(self, embedder: Embedder, in_flight: bool) -> None:
        self.real = embedder.launch
        self.decode = embedder.decode
        self.in_flight = in_flight
        self.events: list[str] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.failing: set[str] = set()
        embedder.launch = self  # type: ignore[method-assign,assignment]

    def __call__(self, batch: Sequence[Encoded], **kwargs: Any) -> Pending:
        texts = self.decode([item.ids for item in batch], skip_special_tokens=True)
        name = "+".join(sorted(texts))
        self.events.append(f"launch {name}")
        self.entered.set()
        self.release.wait(timeout=30)
        pending = Pending(self.real(batch, **kwargs).result(), name, self.events, self.in_flight)
        pending.fails = name in self.failing
        self.failing.discard(name)  # fails once: its rerun succeeds
        return pending


async def run_requests(
    embedder: Embedder, device: FakeDevice, first: str, then: Sequence[str]
) -> tuple[Batcher, list[Outcome | BaseException]]:
    """`first` alone in a held pass; then `then`'s texts, as requests of their own, queued
    behind it; every answer or error."""
    batcher = make_batcher(embedder, max_batch_inputs=8)
    loop = asyncio.get_running_loop()
    batcher.deliver = deliver_on(loop)
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
        batcher.stop()
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
