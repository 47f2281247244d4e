"""Dynamic batching: a bounded queue of inputs and one worker thread that runs forward passes.

A batch always holds the oldest waiting input (so long inputs never starve); it is filled from
a window of the next-oldest inputs, closest in length first (to cut padding), while the padded
cost `longest x count` stays within the token budget and the count within its limit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from app.errors import BackendError, OverloadedError
from app.metrics import Metrics
from model import Embedder

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
# How far past the oldest input the worker looks for inputs of a similar length.
WINDOW_FACTOR = 4
# Seconds without a new input after which the worker stops waiting for a fuller batch.
QUIET_GAP = 0.002


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One input's raw outputs (pooled, not normalised) and how long it waited and ran."""

    pooled: FloatArray  # (D,)
    token_embeddings: FloatArray | None  # (T, D)
    attentions: dict[int, FloatArray] | None  # layer -> (H, T, T)
    queue_seconds: float
    inference_seconds: float


@dataclass(eq=False, slots=True)
class WorkItem:
    ids: list[int]
    future: asyncio.Future[ItemResult]
    token_embeddings: bool = False
    attention_layers: frozenset[int] = frozenset()
    enqueued_at: float = field(default_factory=time.perf_counter)
    # Set from the event loop when nobody waits for the result any more (client gone,
    # timeout); the worker then drops the item instead of running it.
    abandoned: bool = False


class Batcher:
    def __init__(
        self,
        embedder: Embedder,
        metrics: Metrics,
        *,
        max_batch_tokens: int,
        max_batch_inputs: int,
        max_queued_inputs: int,
        batch_wait: float = 0.0,
    ) -> None:
        self.embedder = embedder
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_inputs = max_batch_inputs
        self.max_queued_inputs = max_queued_inputs
        self.batch_wait = batch_wait
        self._queue: list[WorkItem] = []
        self._condition = threading.Condition()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="embed-batcher", daemon=True)
        self._seconds_per_batch = 0.1  # running estimate, for Retry-After

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue all of a request's inputs, or none of them (429) when they do not fit."""
        with self._condition:
            if len(self._queue) + len(items) > self.max_queued_inputs:
                batches_ahead = len(self._queue) / self.max_batch_inputs + 1
                retry_after = max(1, round(batches_ahead * self._seconds_per_batch))
                raise OverloadedError(
                    f"the queue holds {len(self._queue)} inputs (limit "
                    f"{self.max_queued_inputs}); retry in {retry_after} s",
                    retry_after=retry_after,
                )
            self._queue.extend(items)
            self.metrics.queue_depth.set(len(self._queue))
            self._condition.notify()

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._execute(batch)

    def _next_batch(self) -> list[WorkItem] | None:
        with self._condition:
            while not self._stopping:
                if not self._queue:
                    self._condition.wait()
                    continue
                self._wait_for_fuller_batch()
                # Dropped only now: an input can be abandoned during the wait too.
                self._queue = [item for item in self._queue if not item.abandoned]
                if self._queue:
                    break
            if self._stopping:
                return None
            batch = self._choose(self._queue[: self.max_batch_inputs * WINDOW_FACTOR])
            chosen = {id(item) for item in batch}
            self._queue = [item for item in self._queue if id(item) not in chosen]
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _wait_for_fuller_batch(self) -> None:
        """Clients answered a moment ago come back within milliseconds: while inputs keep
        arriving, wait for them (up to batch_wait) so that one full batch runs instead of two
        half ones. A lone request waits only one quiet gap. Called with the lock held."""
        deadline = time.perf_counter() + self.batch_wait
        while len(self._queue) < self.max_batch_inputs and not self._stopping:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            waiting = len(self._queue)
            self._condition.wait(min(remaining, QUIET_GAP))
            if len(self._queue) == waiting:
                return

    def _choose(self, window: list[WorkItem]) -> list[WorkItem]:
        oldest = window[0]
        # Attention maps take the explicit attention path, so such inputs run only with
        # inputs that ask for the same layers.
        similar = sorted(
            (item for item in window[1:] if item.attention_layers == oldest.attention_layers),
            key=lambda item: abs(len(item.ids) - len(oldest.ids)),
        )
        batch, longest = [oldest], len(oldest.ids)
        for item in similar:
            if len(batch) == self.max_batch_inputs:
                break
            width = max(longest, len(item.ids))
            if width * (len(batch) + 1) <= self.max_batch_tokens:
                batch.append(item)
                longest = width
        return batch

    def _execute(self, batch: list[WorkItem]) -> None:
        lengths = [len(item.ids) for item in batch]
        padded = max(lengths) * len(batch)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_tokens.observe(padded)
        self.metrics.padding_ratio.observe(1 - sum(lengths) / padded if padded else 0.0)
        started = time.perf_counter()
        try:
            output = self.embedder.forward(
                [item.ids for item in batch],
                token_embeddings=any(item.token_embeddings for item in batch),
                attention_layers=batch[0].attention_layers,
            )
        except Exception:
            # One failing batch fails its own requests only; the worker carries on.
            log.exception("forward pass failed for a batch of %d inputs", len(batch))
            error = BackendError("the model failed on the batch holding this input")
            self._deliver([(item.future, error) for item in batch])
            return
        seconds = time.perf_counter() - started
        self._seconds_per_batch = 0.8 * self._seconds_per_batch + 0.2 * seconds
        self.metrics.inference_seconds.observe(seconds)
        pooled = output.pooled.numpy()
        deliveries: list[tuple[asyncio.Future[ItemResult], ItemResult | Exception]] = []
        for row, item in enumerate(batch):
            queued = started - item.enqueued_at
            self.metrics.queue_seconds.observe(queued)
            tokens = output.token_embeddings[row].numpy() if output.token_embeddings else None
            maps = (
                {layer: probs.numpy() for layer, probs in output.attentions[row].items()}
                if output.attentions
                else None
            )
            result = ItemResult(pooled[row], tokens, maps, queued, seconds)
            deliveries.append((item.future, result))
        self._deliver(deliveries)

    def _deliver(
        self, deliveries: list[tuple[asyncio.Future[ItemResult], ItemResult | Exception]]
    ) -> None:
        assert self._loop is not None, "start() sets the loop before the worker runs"
        try:
            self._loop.call_soon_threadsafe(_resolve, deliveries)
        except RuntimeError:  # the event loop closed during shutdown: nobody is waiting
            log.warning("dropping %d results: the event loop is closed", len(deliveries))


def _resolve(deliveries: list[tuple[asyncio.Future[ItemResult], ItemResult | Exception]]) -> None:
    for future, outcome in deliveries:
        if future.done():  # cancelled: the request stopped waiting
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
