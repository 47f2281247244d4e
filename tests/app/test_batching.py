"""Dynamic batching: real batches, bounded queue, failure isolation, abandoned inputs dropped."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.cores import CoreLease, CorePool
from app.engine.batcher import Batcher, Delivery, Ticket, WorkItem
from app.engine.compute import ComputeThread
from app.engine.local import deliver_on
from app.engine.protocol import Outcome, Wants
from app.errors import BackendError, ClientDisconnectedError, OverloadedError
from app.metrics import GAUGE_INTERVAL, Metrics
from app.params import EncodeOptions
from model import AttentionSpec, Embedder, Encoded
from tests.app.conftest import (
    GatedForward,
    local_engine,
    make_settings,
    running_app,
    service_of,
    wait_until,
)
from tests.helpers import TINY_VOCAB

pytestmark = pytest.mark.anyio
SENTENCES = [" ".join(["hello", "world", "fox"][: 1 + i % 3] * (1 + i % 7)) for i in range(24)]


async def test_concurrent_requests_are_batched_and_equal_to_alone(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        alone = [(await client.post("/embed", json={"inputs": s})).json()[0] for s in SENTENCES]
        gate = GatedForward(service_of(app))
        gate.gate.clear()  # hold the worker so that the concurrent requests queue up together
        tasks = [asyncio.create_task(client.post("/embed", json={"inputs": s})) for s in SENTENCES]
        batcher = local_engine(app).model.batcher
        assert batcher is not None
        # Every input is either queued or in the batch the held worker took.
        await wait_until(lambda: batcher.depth + sum(map(len, gate.batches)) == len(SENTENCES))
        gate.gate.set()
        responses = await asyncio.gather(*tasks)
        metrics = (await client.get("/metrics")).text
    assert all(r.status_code == 200 for r in responses)
    assert max(len(batch) for batch in gate.batches) > 1
    together = [r.json()[0] for r in responses]
    assert np.abs(np.array(together) - np.array(alone)).max() <= 1e-5
    count = float(
        next(
            line.split()[-1]
            for line in metrics.splitlines()
            if line.startswith("embed_batch_size_count")
        )
    )
    total = float(
        next(
            line.split()[-1]
            for line in metrics.splitlines()
            if line.startswith("embed_batch_size_sum")
        )
    )
    assert total / count > 1  # the metrics show batches of more than one input


async def test_queue_bounded_in_work_answers_429_and_loses_nothing(tiny_checkpoint: Path) -> None:
    """The queue admits work while its estimated time fits the request timeout: here 1 s at
    0.01 s per token, so 100 tokens; each "fox i" request holds 4 of them."""
    settings = make_settings(tiny_checkpoint, request_timeout=1.0, max_batch_inputs=1)
    async with running_app(settings) as (app, client):
        batcher = local_engine(app).model.batcher
        assert batcher is not None
        gate = GatedForward(service_of(app))
        first = await gate.hold(client)  # the worker holds "hello" (3 tokens)
        batcher._seconds, batcher._tokens = 0.01, 1.0  # a known pace: 0.01 s per token
        queued = [
            asyncio.create_task(client.post("/embed", json={"inputs": f"fox {i}"}))
            for i in range(24)  # 3 + 24 x 4 = 99 tokens, 0.99 s: at the limit
        ]
        await wait_until(lambda: batcher.depth == 24)
        rejected = await client.post("/embed", json={"inputs": "fox 9"})  # 103 tokens
        rejected_openai = await client.post("/v1/embeddings", json={"input": "fox"})
        batcher._seconds = 0.0  # let the held work finish quickly once released
        gate.gate.set()
        accepted = await asyncio.gather(first, *queued)
    assert rejected.status_code == 429
    assert rejected.json()["error_type"] == "Overloaded"
    assert "1 s" in rejected.json()["error"]
    assert int(rejected.headers["retry-after"]) >= 1
    assert rejected_openai.status_code == 429
    assert rejected_openai.json()["error"]["type"] == "rate_limit_error"
    assert [r.status_code for r in accepted] == [200] * 25
    assert len(gate.batches) == 25  # every accepted input ran exactly once


async def test_failing_batch_fails_only_its_requests(tiny_checkpoint: Path) -> None:
    fox = TINY_VOCAB.index("fox")
    settings = make_settings(tiny_checkpoint, max_batch_inputs=1)
    async with running_app(settings) as (app, client):
        gate = GatedForward(service_of(app))
        gate.fail_when = lambda batch: any(fox in ids for ids in batch)
        healthy, failing = await asyncio.gather(
            client.post("/embed", json={"inputs": "hello"}),
            client.post("/embed", json={"inputs": "fox"}),
        )
        after = await client.post("/embed", json={"inputs": "hello world"})
        health = await client.get("/health")
    assert healthy.status_code == 200
    assert failing.status_code == 500
    assert failing.json()["error_type"] == "Backend"
    assert "injected" not in failing.text and "Traceback" not in failing.text
    assert "request id" in failing.json()["error"]
    assert after.status_code == 200 and health.status_code == 200


async def test_timed_out_input_is_dropped_before_it_runs(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, request_timeout=0.3, max_batch_inputs=1)
    async with running_app(settings) as (app, client):
        gate = GatedForward(service_of(app))
        held = await gate.hold(client)
        late = await client.post("/embed", json={"inputs": "fox"})
        gate.gate.set()
        await held
        after = await client.post("/embed", json={"inputs": "world"})
        metrics = (await client.get("/metrics")).text
    assert late.status_code == 504  # not 503: a load balancer must not run it again
    assert late.json()["error_type"] == "Timeout" and "timeout" in late.json()["error"]
    # It and the held request (timed out under the gate) count as failures by their reason;
    # the queue's wait histogram holds the one request answered.
    assert 'embed_failures_total{reason="Timeout"} 2.0' in metrics
    assert re.search(r"^embed_queue_duration_seconds_count\{[^}]*\} 1\.0$", metrics, re.M)
    fox = TINY_VOCAB.index("fox")
    assert not any(fox in ids for batch in gate.batches for ids in batch)
    assert after.status_code == 200


async def test_disconnected_client_is_dropped_before_it_runs(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_batch_inputs=1)) as (app, client):
        service = service_of(app)
        gate = GatedForward(service)
        held = await gate.hold(client)

        async def gone() -> None:
            await asyncio.sleep(0.05)

        with pytest.raises(ClientDisconnectedError):
            await service.encode(["fox"], EncodeOptions(), gone)
        gate.gate.set()
        await held
    fox = TINY_VOCAB.index("fox")
    assert not any(fox in ids for batch in gate.batches for ids in batch)


async def test_a_cancelled_request_is_dropped_before_it_runs(tiny_checkpoint: Path) -> None:
    """Cancelled with its task (as uvicorn cancels requests at shutdown): nobody waits for its
    results, so the worker drops its inputs."""
    async with running_app(make_settings(tiny_checkpoint, max_batch_inputs=1)) as (app, client):
        service = service_of(app)
        gate = GatedForward(service)
        held = await gate.hold(client)
        queued = asyncio.create_task(service.encode(["fox"], EncodeOptions()))
        batcher = local_engine(service).model.batcher
        assert batcher is not None
        await wait_until(lambda: batcher.depth == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.gate.set()
        await held
        after = await client.post("/embed", json={"inputs": "dog"})  # the worker carries on
    assert after.status_code == 200
    fox = TINY_VOCAB.index("fox")
    assert not any(fox in ids for batch in gate.batches for ids in batch)


def make_ticket(*lengths: int, wants: Wants | None = None) -> Ticket:
    """One request's ticket, inputs of these token counts; its future is never awaited."""
    loop = asyncio.new_event_loop()
    try:
        encoded = [Encoded(list(range(n)), False) for n in lengths]
        return Ticket(encoded, wants or Wants(), time.perf_counter() + 30, loop.create_future())
    finally:
        loop.close()


def make_items(lengths: list[int], wants: Wants | None = None) -> list[WorkItem]:
    """One ticket per input, as if each came in its own request."""
    return [make_ticket(n, wants=wants).work_items()[0] for n in lengths]


def tickets(batch: list[WorkItem] | None) -> list[Ticket] | None:
    """A batch as the requests whose inputs it holds: the queue makes work items of its own
    from a ticket (`Ticket.work_items`), so those of `make_items` are never in a batch."""
    return None if batch is None else [item.ticket for item in batch]


def make_batcher(embedder: Embedder, **overrides: float) -> Batcher:
    values: dict[str, float] = {
        "max_batch_tokens": 1000,
        "max_batch_inputs": 3,
        "max_attention_values": 10**9,
        "max_wait": 30.0,
    }
    values.update(overrides)
    return Batcher(
        embedder,
        Metrics().of("tiny"),
        lambda deliveries: None,
        max_batch_tokens=int(values["max_batch_tokens"]),
        max_batch_inputs=int(values["max_batch_inputs"]),
        max_attention_values=int(values["max_attention_values"]),
        max_wait=values["max_wait"],
        max_queue_wait=values.get("max_queue_wait"),
        batch_wait=values.get("batch_wait", 0.0),
    )


def test_batch_holds_the_oldest_and_groups_by_length(tiny_embedder: Embedder) -> None:
    batcher = make_batcher(tiny_embedder, max_batch_tokens=40)
    items = make_items([20, 3, 19, 4, 18, 2])
    batch = batcher._choose(items)
    assert batch[0] is items[0]  # the oldest always runs, however long
    assert [i.length for i in batch] == [20, 19]  # 20 x 3 would pass the 40-token budget
    lone = batcher._choose(make_items([64, 2, 2]))
    assert [i.length for i in lone] == [64]  # over budget alone, yet it runs


def test_batch_respects_the_input_count(tiny_embedder: Embedder) -> None:
    batcher = make_batcher(tiny_embedder)
    items = make_items([5, 9, 5, 6, 5])
    assert [i.length for i in batcher._choose(items)] == [5, 5, 5]


def test_batch_bounds_the_attention_maps_it_computes(tiny_embedder: Embedder) -> None:
    """Each input is under the per-request limit, but a batch computes maps for all of them
    at the padded width: 2 layers x 2 heads x 10^2 = 400 values per input."""
    maps = Wants(attention=AttentionSpec((0, 1), (0, 1)))
    batcher = make_batcher(tiny_embedder, max_attention_values=800, max_batch_inputs=8)
    batch = batcher._choose(make_items([10, 10, 10, 10], maps))
    assert len(batch) == 2  # 3 x 400 would pass 800
    plain = batcher._choose(make_items([10, 10, 10]) + make_items([10], maps))
    assert len(plain) == 3  # inputs that want maps never join a batch that does not


def test_submit_is_all_or_nothing_and_an_empty_queue_takes_anything(
    tiny_embedder: Embedder,
) -> None:
    batcher = make_batcher(tiny_embedder, max_wait=1.0)
    batcher._seconds, batcher._tokens = 0.1, 1.0  # 0.1 s per token: 10 tokens fit in 1 s
    batcher.submit(make_ticket(30))  # over the estimate alone, but the queue was empty
    with pytest.raises(OverloadedError) as caught:
        batcher.submit(make_ticket(1, 2))
    assert caught.value.retry_after == 3  # 33 tokens x 0.1 s, 2.3 s past the 1 s bound
    assert batcher.depth == 1


def test_every_queue_change_reaches_the_admission_state_and_the_gauges_knowing_arrivals(
    tiny_embedder: Embedder,
) -> None:
    """Front ends admit on every arrival; the gauges are told which changes were arrivals,
    which an engine's shared metrics files take at intervals (app/metrics.py)."""
    batcher = make_batcher(tiny_embedder)
    gauges: list[tuple[int, bool]] = []
    board: list[int] = []
    batcher._publish_queue = lambda arrival: gauges.append((batcher.depth, arrival))
    batcher.publish_to(lambda backlog, pace: board.append(backlog))
    batcher.submit(make_ticket(4))
    batcher.submit(make_ticket(5, 6))
    assert board[-2:] == [4, 15] and gauges == [(1, True), (3, True)]
    batch = batcher._next_batch()
    assert batch is not None and len(batch) == 3
    assert gauges[-1] == (0, False) and board[-1] == 15  # all three now run


def test_an_engine_writes_its_queue_gauges_after_arrivals_at_intervals_else_at_once() -> None:
    metrics = Metrics()
    model = metrics.of("tiny")
    model.multiprocess_dir = "/metrics"  # as in an engine of its own: the gauges are written
    depth = [0]
    publish = model.watch_queue(lambda: depth[0], lambda: 10 * depth[0])

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("embed_queue_depth", {"model": "tiny"})

    for depth[0], arrival, written in ((1, True, 1), (2, True, 1), (0, False, 0), (3, True, 0)):
        publish(arrival)
        assert gauge() == written
    time.sleep(GAUGE_INTERVAL)
    publish(True)
    assert gauge() == 3


def test_while_the_worker_gathers_a_batch_only_the_arrival_that_completes_it_wakes_it(
    tiny_embedder: Embedder,
) -> None:
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8)
    woken: list[int] = []
    batcher._condition.notify = lambda n=1: woken.append(batcher.depth)  # type: ignore[method-assign]
    batcher._last_clients = 3  # the last batch served three requests: wait for three
    batcher._gathering = True
    for _ in range(3):
        batcher.submit(make_ticket(4))
    assert woken == [3]
    batcher._gathering = False
    batcher.submit(make_ticket(4))
    assert woken == [3, 4]  # a worker that waits for any input is woken by every arrival


async def test_a_lone_input_does_not_wait_out_the_batch_wait(tiny_embedder: Embedder) -> None:
    """Waiting for a fuller batch stops as soon as inputs stop arriving."""
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8, batch_wait=30.0)
    loop = asyncio.get_running_loop()
    compute = ComputeThread()
    batcher.deliver = deliver_on(loop)
    batcher.start(compute)
    try:
        future: asyncio.Future[Outcome] = loop.create_future()
        deadline = time.perf_counter() + 30
        batcher.submit(Ticket(tiny_embedder.tokenize(["hello"]), Wants(), deadline, future))
        outcome = await asyncio.wait_for(future, timeout=10)  # far below the 30 s cap
        [result] = outcome.items
        assert result.vector.shape == (tiny_embedder.info.dimensions,)
    finally:
        batcher.stop(timeout=2)
        compute.close()


async def test_a_stop_waits_for_the_pass_in_progress(tiny_checkpoint: Path) -> None:
    """A pass still runs at the exit when clients that left are all it serves (the drain
    waits for requests, not for them): the engine waits for it, up to the shutdown grace, as
    a process that exits while torch's threads are inside a pass aborts (SIGABRT)."""
    async with running_app(make_settings(tiny_checkpoint, shutdown_grace=30)) as (app, client):
        gate = GatedForward(service_of(app))
        held = await gate.hold(client)  # the worker is inside a forward pass
        model = local_engine(app).model
        stopping = asyncio.create_task(asyncio.to_thread(model.stop))
        await asyncio.sleep(3)  # longer than the 2 s the stop used to give it
        assert not stopping.done() and model.alive
        gate.gate.set()
        await asyncio.wait_for(stopping, timeout=10)
        assert not model.alive
        assert (await held).status_code == 200  # its pass finished and was answered


async def test_live_and_metrics_answer_while_a_batch_runs(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        gate = GatedForward(service_of(app))
        held = await gate.hold(client)  # the worker is inside a forward pass
        live = await asyncio.wait_for(client.get("/live"), timeout=5)
        metrics = await asyncio.wait_for(client.get("/metrics"), timeout=5)
        assert not held.done()
        gate.gate.set()
        assert (await held).status_code == 200
    assert live.status_code == 200 and metrics.status_code == 200


def test_an_answered_batch_leaves_nothing_for_the_cycle_collector(
    tiny_embedder: Embedder,
) -> None:
    """An engine makes a ticket, work items and results for every input: they are freed by
    their reference counts once answered. In a reference cycle they would wait for the cycle
    collector, whose passes over them cost an engine more CPU per input than reading the
    request does (docs/benchmarks.md)."""
    batcher = make_batcher(tiny_embedder)
    answered: list[object] = []
    batcher.deliver = answered.extend
    deadline = time.perf_counter() + 30
    gc.collect()
    gc.disable()
    try:
        for text in ("hello", "hello world"):
            batcher.submit(Ticket(tiny_embedder.tokenize([text]), Wants(), deadline, None))
        batch = batcher._next_batch()
        assert batch is not None
        batcher._execute(batch)
        assert len(answered) == 2
        del batch
        answered.clear()
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_input_abandoned_during_the_batch_wait_does_not_run(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from app.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "QUIET_GAP", 30.0)  # the wait ends only when full
    batcher = make_batcher(tiny_embedder, max_batch_inputs=2, batch_wait=30.0)
    batcher._last_clients = 2  # as after a batch that served two clients
    first, second = make_items([3, 4])
    batcher.submit(first.ticket)
    chosen: list[list[WorkItem] | None] = []
    worker = threading.Thread(target=lambda: chosen.append(batcher._next_batch()))
    worker.start()
    time.sleep(0.2)  # the worker is now inside the wait for a fuller batch
    first.ticket.abandoned = True  # its client gives up meanwhile
    batcher.submit(second.ticket)  # the batch is full: the wait ends
    worker.join(timeout=10)
    assert [tickets(batch) for batch in chosen] == [[second.ticket]]


def test_a_worker_whose_queue_empties_without_a_pass_writes_its_figures(
    tiny_embedder: Embedder,
) -> None:
    """Pass figures are held (app/tally.py) and written when the worker goes quiet: also
    when its last inputs are dropped instead of answered by a pass."""
    batcher = make_batcher(tiny_embedder)
    [item] = make_items([3])
    batcher.submit(item.ticket)
    item.ticket.abandoned = True  # its client left: dropped, never run
    batcher._tally.observe(batcher.metrics.batch_size, 2)  # a pass's figure, still held
    worker = threading.Thread(target=batcher._next_batch, daemon=True)
    worker.start()  # drops the input, then waits for work

    def passes_written() -> float:
        [family] = batcher.metrics.batch_size.collect()
        return next(s.value for s in family.samples if s.name.endswith("_count"))

    deadline = time.monotonic() + 10
    while passes_written() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert passes_written() == 1 and batcher.depth == 0
    batcher.stop(timeout=2)
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_the_batch_wait_follows_how_many_clients_the_last_batch_served(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone client is never kept waiting for company; after a batch of several clients,
    the worker waits for the others to come back."""
    import threading

    from app.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "QUIET_GAP", 30.0)  # a wait would end only when full
    batcher = make_batcher(tiny_embedder, max_batch_inputs=2, batch_wait=30.0)
    lone, again, one, other, first, second = make_items([3, 3, 4, 4, 5, 5])
    for item in (lone, again):  # one client, one request after the other
        batcher.submit(item.ticket)
        started = time.perf_counter()
        assert tickets(batcher._next_batch()) == [item.ticket]
        assert time.perf_counter() - started < 5
    batcher.submit(one.ticket)
    batcher.submit(other.ticket)
    assert tickets(batcher._next_batch()) == [one.ticket, other.ticket]  # served together
    batcher.submit(first.ticket)
    chosen: list[list[WorkItem] | None] = []
    worker = threading.Thread(target=lambda: chosen.append(batcher._next_batch()))
    worker.start()
    time.sleep(0.2)
    assert chosen == []  # waiting for the other client to come back
    batcher.submit(second.ticket)
    worker.join(timeout=10)
    assert [tickets(batch) for batch in chosen] == [[first.ticket, second.ticket]]


def test_the_batch_wait_ends_once_the_last_batch_s_clients_are_back(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is not full, but every client it expects has come back: no quiet gap more."""
    from app.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "QUIET_GAP", 30.0)  # else the wait ends in 2 ms
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8, batch_wait=30.0)
    one, other, first, second = make_items([4, 4, 5, 5])
    batcher.submit(one.ticket)
    batcher.submit(other.ticket)
    assert tickets(batcher._next_batch()) == [one.ticket, other.ticket]  # served together
    batcher.submit(first.ticket)
    batcher.submit(second.ticket)
    started = time.perf_counter()
    assert tickets(batcher._next_batch()) == [first.ticket, second.ticket]
    assert time.perf_counter() - started < 5  # far below the 30 s quiet gap


def test_the_quiet_gap_counts_from_the_last_arrival_or_from_the_wait_s_start(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "QUIET_GAP", 0.3)
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8, batch_wait=30.0)
    batcher._last_clients = 3  # waits for three requests; one comes
    ticket = make_ticket(4)
    batcher.submit(ticket)
    for arrived_in, at_least in ((-10.0, 0.3), (0.6, 0.9)):  # long ago; a moment from now
        ticket.enqueued_at = time.perf_counter() + arrived_in
        started = time.perf_counter()
        with batcher._condition:
            batcher._wait_for_fuller_batch()
        assert at_least - 0.05 <= time.perf_counter() - started < 10


def test_a_worker_that_reads_its_own_arrivals_batches_them_and_sees_a_stop(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine process's worker reads its front ends itself (`Batcher.take_from`): every
    read runs on the worker's thread, what a read brings during the wait for a fuller batch
    joins that batch, and an idle worker, waiting in its reads, still sees a stop."""
    from app.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "QUIET_GAP", 30.0)  # the wait ends only when full
    batcher = make_batcher(tiny_embedder, max_batch_inputs=2, batch_wait=30.0)
    batcher._last_clients = 2  # as after a batch that served two clients
    first, second = make_items([3, 4])
    arrivals: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
    for item in (first, second):
        arrivals.put(item.ticket)
    readers: set[int | None] = set()
    waits: list[float] = []

    def intake(timeout: float) -> None:
        readers.add(threading.get_ident())
        waits.append(timeout)
        with contextlib.suppress(queue.Empty):
            batcher.submit(arrivals.get(timeout=timeout) if timeout else arrivals.get_nowait())

    batcher.take_from(intake)
    chosen: list[list[WorkItem] | None] = []
    for stop in (False, True):  # the batch; then an empty queue, until the stop
        worker = threading.Thread(target=lambda: chosen.append(batcher._next_batch()))
        worker.start()
        if stop:
            time.sleep(0.3)
            batcher.stop(timeout=2)
        worker.join(timeout=10)
        assert readers == {worker.ident}
        readers.clear()
    assert [tickets(batch) for batch in chosen] == [[first.ticket, second.ticket], None]
    assert batcher_module.IDLE_POLL in waits  # idle: reads with a bounded wait


def test_with_a_pass_running_the_worker_reads_before_it_chooses(tiny_embedder: Embedder) -> None:
    """The worker that does not wait (a pass still runs on the GPU) still reads what has
    arrived, so that it goes next, instead of an empty batch."""
    batcher = make_batcher(tiny_embedder)
    [item] = make_items([3])
    polls: list[float] = []

    def intake(timeout: float) -> None:
        polls.append(timeout)
        if len(polls) == 1:
            batcher.submit(item.ticket)

    batcher.take_from(intake)
    assert tickets(batcher._next_batch(wait=False)) == [item.ticket]
    assert batcher._next_batch(wait=False) == [] and polls == [0, 0]


def passes_on(batcher: Batcher, threads: int) -> float:
    [family] = batcher.metrics.forward_passes_on(threads).collect()
    return next(s.value for s in family.samples if s.name.endswith("_total"))


def test_each_pass_runs_on_as_many_torch_threads_as_its_cores(
    tiny_embedder: Embedder, tmp_path: Path
) -> None:
    """Under --workers the lease says how many cores a pass may take (app/cores.py); the
    batcher runs it on that many threads: all of them alone, its share beside a busy worker."""
    pool = CorePool(multiprocessing.get_context("spawn"), workers=2, share=1, folder=tmp_path)
    before = torch.get_num_threads()
    try:
        mine, other = CoreLease(pool, 0), CoreLease(pool, 1)
        batcher = make_batcher(tiny_embedder)
        batcher.cores = mine
        seen: list[int] = []
        real = tiny_embedder.launch

        def launch(*args: object, **kwargs: object) -> object:
            seen.append(torch.get_num_threads())
            return real(*args, **kwargs)  # type: ignore[arg-type]

        tiny_embedder.launch = launch  # type: ignore[method-assign,assignment]
        batcher._forward(batcher._pass_of(make_items([5])))
        other.set_busy(True)
        batcher._forward(batcher._pass_of(make_items([5])))
        assert seen == [2, 1]
        batcher._tally.flush()  # embed_forward_passes_total{threads} says the same
        assert [passes_on(batcher, threads) for threads in (2, 1)] == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_an_out_of_memory_split_keeps_the_engine_busy_and_fails_a_request_once(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the halves of a batch that ran out of memory run, its tokens still count (the
    engine is not idle, so admission and the engines' balance see the work); a request
    whose input fails alone gets one error, and its inputs still in other halves do not run."""
    answered: list[Delivery] = []
    batcher = make_batcher(tiny_embedder, max_batch_inputs=8)
    batcher.deliver = answered.extend
    passes: list[tuple[int, bool]] = []

    def out_of_memory(arguments: dict[str, Any]) -> None:
        passes.append((len(arguments["batch"]), batcher.idle))
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(batcher, "_forward", out_of_memory)
    ticket = make_ticket(3, 4, 5, 6)
    batcher.submit(ticket)
    batch = batcher._next_batch(wait=False)
    assert batch is not None and len(batch) == 4
    assert batcher._launch(batch, batcher._pass_of(batch), release=True) is None
    # The four, the first half, its first input alone (which fails the request); nothing
    # more of a request that has failed.
    assert passes == [(4, False), (2, False), (1, False)]
    assert [(t, type(e)) for t, e in answered] == [(ticket, BackendError)]
    assert batcher.idle
