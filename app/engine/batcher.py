"""Dynamic batching: a queue bounded in work, and one worker thread that runs forward passes.

A request's inputs enter the queue together as one `Ticket`, or not at all: the queue admits
them only while the work ahead (queued tokens x measured seconds per token) would still
finish within the request timeout; past that a request gets a fast 429 whose Retry-After
comes from the same estimate, instead of a slow timeout.

A batch always holds the oldest waiting input (so long inputs never starve); it is filled
from a window of the next-oldest inputs, closest in length first (to cut padding), while the
padded cost `longest x count` stays within the token budget, the count within its limit,
and, for inputs that want attention maps, the maps within their budget.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import ParamSpec, TypedDict, TypeVar

import numpy as np
import torch

from app.cores import CoreLease
from app.engine.compute import ComputeThread
from app.engine.protocol import Admission, ItemResult, LateDocument, Outcome, Wants
from app.errors import BackendError, OverloadedError, ServiceError
from app.memory import Trimmer
from app.metrics import ModelMetrics
from app.tally import Tally
from app.tasks import TASKS
from model import AttentionSpec, BatchOutput, Embedder, Encoded, PendingOutput
from model.vectors import finish

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# How far past the oldest input the worker looks for inputs of a similar length.
WINDOW_FACTOR = 4
# Seconds without a new input after which the worker stops waiting for a fuller batch.
QUIET_GAP = 0.002
# Weight of the past in the seconds-per-token estimate, per batch.
ESTIMATE_DECAY = 0.9
# Longest an idle worker reading its own arrivals waits before it looks for a stop.
IDLE_POLL = 0.1


@dataclass(eq=False, slots=True)
class WorkItem:
    encoded: Encoded
    ticket: Ticket
    row: int  # the input's position in its request
    # Its tokens, counted once: the queue's bounds and the batch choice read it many times.
    length: int


class PassArguments(TypedDict):
    """What `Embedder.launch` (and `graph_shape`) take for a batch."""

    batch: list[Encoded]
    token_embeddings: bool
    attention: AttentionSpec | None


@dataclass(slots=True)
class Launched:
    """A batch whose pass has started: what `_complete` needs once its output is back."""

    batch: list[WorkItem]
    tokens: int
    running: int  # of them, counted as running until it is done (0: a retry's, released)
    output: PendingOutput
    started: float  # time.perf_counter()
    cpu_seconds: float  # the launch's, on the worker thread


class Ticket:
    """One request's inputs; delivered once, when the last one is done. `reply_to` is the
    caller's (the future of an in-process request, the address of a remote one)."""

    __slots__ = (
        "abandoned",
        "deadline",
        "encoded",
        "enqueued_at",
        "inference_seconds",
        "queue_seconds",
        "remaining",
        "reply_to",
        "results",
        "tokens",
        "wants",
    )

    def __init__(
        self, encoded: Sequence[Encoded], wants: Wants, deadline: float, reply_to: object
    ) -> None:
        self.wants = wants
        self.deadline = deadline  # time.perf_counter(): past it, nobody waits for the result
        self.reply_to = reply_to
        self.encoded = encoded
        self.results: list[ItemResult | None] = [None] * len(encoded)
        self.remaining = len(encoded)
        self.tokens = sum(len(e.ids) for e in encoded)
        self.enqueued_at = time.perf_counter()
        self.queue_seconds = 0.0
        self.inference_seconds = 0.0
        # Set by the caller when nobody waits for the result any more (client gone); the
        # worker then drops the inputs instead of running them.
        self.abandoned = False

    def work_items(self) -> list[WorkItem]:
        """Its inputs as the queue holds them, made when it is queued and not kept: each
        refers to its ticket, and a ticket referring back would make every request a cycle,
        freed only by the cycle collector, whose passes cost an engine about 10 µs of CPU
        per input (docs/benchmarks.md)."""
        return [WorkItem(e, self, row, len(e.ids)) for row, e in enumerate(self.encoded)]

    def expired(self, now: float) -> bool:
        return self.abandoned or now > self.deadline


# What a late-chunked request's windows finish into: nothing (their tokens are pooled later).
NO_OUTPUT = Wants(pooled=False)

# A finished request: its ticket and its outcome or its error.
Delivery = tuple[Ticket, Outcome | ServiceError]
# Called on the worker thread once per batch with every request the batch finished.
Deliver = Callable[[list[Delivery]], None]
# Reads what has arrived and submits it, waiting up to the seconds given for something to
# arrive (0: only what is there); called on the worker thread (see `Batcher.take_from`).
Intake = Callable[[float], None]


def _requests_in(items: Sequence[WorkItem]) -> int:
    return len({id(item.ticket) for item in items})


class DeviceLostError(RuntimeError):
    """A pass failed and the device runs nothing any more: the worker stops, for liveness
    to say so, rather than fail every request one by one while it reads as healthy."""


class Batcher:
    def __init__(
        self,
        embedder: Embedder,
        metrics: ModelMetrics,
        deliver: Deliver,
        *,
        max_batch_tokens: int,
        max_batch_inputs: int,
        max_attention_values: int,
        max_wait: float,
        max_queue_wait: float | None = None,
        batch_wait: float = 0.0,
        seconds_per_token: float = 1e-3,
        cores: CoreLease | None = None,
    ) -> None:
        self.embedder = embedder
        self.metrics = metrics
        # The passes' figures, written in bulk by the worker (app/tally.py).
        self._tally = Tally()
        self.deliver = deliver
        # The task's last step on each input's pooled row (app/tasks/).
        self.finish = TASKS[embedder.info.task].finish
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_inputs = max_batch_inputs
        self.max_attention_values = max_attention_values
        # The work a request may find ahead of it (by default, all of its time).
        self.admission = Admission(max_wait, max_wait if max_queue_wait is None else max_queue_wait)
        self.batch_wait = batch_wait
        self.cores = cores
        self._publish_state: Callable[[int, float], None] | None = None
        self._intake: Intake | None = None
        # How many requests the last batch served: their clients come back within
        # milliseconds of their answers, so the wait for a fuller batch expects that many. A
        # lone client sends its next request only after its answer, so a wait for company
        # would cost it the whole quiet gap on every request.
        self._last_clients = 0
        # While the worker waits for a fuller batch, an arrival wakes it only once the batch
        # is full or its clients are back (`_gathered`): a wake-up per request cost the engine
        # more than the request's own work. A quiet gap is seen by the worker's timed waits.
        self._gathering = False
        self._queue: list[WorkItem] = []
        self._queued_tokens = 0
        self._running_tokens = 0  # of the batches taken and not yet done
        self._last_done = 0.0  # when the last pass's output came back
        self._condition = threading.Condition()
        self._stopping = False
        self._worker: Future[None] | None = None
        # Set when the worker's loop has ended: asked on every request, where Future.done
        # would take a lock.
        self._ended = False
        # Decayed sums of seconds and tokens over recent batches: their ratio estimates the
        # seconds one more queued token costs (big batches weigh most, as under load).
        self._seconds = seconds_per_token * 1000
        self._tokens = 1000.0
        self.crashed: BaseException | None = None
        self._trimmer = Trimmer()
        self._publish_queue = metrics.watch_queue(
            lambda: len(self._queue), lambda: self._queued_tokens
        )

    def _queue_changed(self, arrival: bool = False) -> None:
        """After every change to the queue, with the lock held; `arrival`: inputs joined it
        (the metrics may then skip the gauges, app/metrics.py)."""
        self._publish_queue(arrival)
        self._publish_busy()

    def _publish_busy(self) -> None:
        """Tell the other engines on this CPU (app/cores.py) whether this one has work queued
        or running, and the front ends its backlog. Called with the lock held."""
        if self.cores is not None:
            self.cores.set_busy(bool(self._queue) or self._running_tokens > 0)
        if self._publish_state is not None:
            self._publish_state(self._backlog, self.seconds_per_token)

    # State ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._worker is not None and not self._ended

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def seconds_per_token(self) -> float:
        return self._seconds / self._tokens

    @property
    def _backlog(self) -> int:
        """Tokens queued and running."""
        return self._queued_tokens + self._running_tokens

    # Lifecycle ------------------------------------------------------------------------
    def publish_to(self, publish: Callable[[int, float], None]) -> None:
        """Tell `publish` the tokens queued and running and the seconds per token after every
        change (app/engine/state.py), where front ends in other processes admit work."""
        with self._condition:
            self._publish_state = publish
            self._publish_busy()

    def take_from(self, intake: Intake) -> None:
        """Read arrivals on the worker thread, by calling `intake`, instead of having other
        threads submit them: before each batch is chosen, and whenever the worker waits for
        work (not during a pass, nor while it waits for a GPU's output). An engine of its own
        process reads its front ends' sockets so: with a second thread reading them, the two
        passed the GIL back and forth several times a batch, and each pass could wait for as
        long as the other held it. What arrives during a pass is read after it: on a CPU,
        where a pass can take a second, the backlog the front ends admit by lags by that
        long (the engine's own check still refuses what does not fit), and aborts and
        deadlines are seen that much later (the front end keeps its own deadline)."""
        with self._condition:
            self._intake = intake
            self._condition.notify()

    @property
    def idle(self) -> bool:
        """Nothing queued and no batch running."""
        return not self._queue and self._running_tokens == 0

    def start(self, compute: ComputeThread) -> None:
        """Run the worker loop on `compute`, the thread that loaded the model (see
        app/engine/compute.py); it holds that thread until `stop`."""
        self._worker = compute.submit(self._run)
        self._worker.add_done_callback(self._on_end)

    def _on_end(self, _: Future[None]) -> None:
        self._ended = True

    def stop(self, timeout: float) -> None:
        """The worker ends once its pass in progress does; waits up to `timeout` seconds."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._worker is not None and wait([self._worker], timeout).not_done:
            log.warning("the batch worker is still in a forward pass after %g s", timeout)

    # Admission (the event loop in process; the worker itself, reading, in an engine process)
    def submit(self, ticket: Ticket, within: float | None = None) -> None:
        """Queue all of a request's inputs, or none of them (429, see `_check_room`);
        `within` is what is left of the request's time (at most `max_wait`)."""
        if (error := self.submit_all([(ticket, within)])[0]) is not None:
            raise error

    def submit_all(
        self, tickets: Sequence[tuple[Ticket, float | None]]
    ) -> list[ServiceError | None]:
        """`submit` for several requests under one lock, the worker woken at most once (where
        it is not the caller): what came from a front end in one read. Each request's
        refusal, or None where it was queued."""
        refused: list[ServiceError | None] = []
        with self._condition:
            for ticket, within in tickets:
                try:
                    if self.crashed is not None:
                        raise BackendError("the batch worker has stopped")
                    limit = self.admission.max_wait if within is None else within
                    self._check_room(ticket.tokens, limit)
                except ServiceError as error:
                    refused.append(error)
                    continue
                refused.append(None)
                self._queue.extend(ticket.work_items())
                self._queued_tokens += ticket.tokens
            self._queue_changed(arrival=True)
            if not self._gathering or self._gathered():
                self._condition.notify()
        return refused

    def check_room(self, within: float) -> None:
        """The same bounds before a request is tokenized, so that refusing it costs nothing."""
        with self._condition:
            self._check_room(0, within)

    def _check_room(self, tokens: int, within: float) -> None:
        """429 by the admission rule (app/engine/protocol.py); before refusing, once more
        without the inputs of requests that nobody waits for any more (their clients left
        while they were queued), which the worker would drop. Called with the lock held."""
        if self._verdict(tokens, within) is None:
            return
        self._drop_abandoned()
        if (error := self._verdict(tokens, within)) is not None:
            raise error

    def _verdict(self, tokens: int, within: float) -> OverloadedError | None:
        return self.admission.verdict(self._backlog, tokens, self.seconds_per_token, within)

    # Worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        """Take a batch, launch it, answer the batch before it, and so on. On a GPU a graphed
        pass comes back still running: answering the last batch and choosing the next then
        overlap the GPU's work, instead of leaving it idle meanwhile. Complete passes (a
        CPU's, eager ones) are answered at once, and the pass before one is answered first:
        it would wait for that pass anyway."""
        in_flight: Launched | None = None
        taken: list[WorkItem] = []  # the batch taken and not yet launched or answered
        try:
            while True:
                # Hand what earlier batches freed back to the system (at most once a second).
                self._trimmer.maybe_trim()
                batch = self._next_batch(wait=in_flight is None)
                taken = batch or []
                arguments = self._pass_of(taken) if taken else None
                # Whether the pass comes back still running (model/embedder.py).
                overlaps = arguments is not None and (
                    self.embedder.graph_shape(**arguments) is not None
                )
                if in_flight is not None and not overlaps:
                    self._complete(in_flight)
                    in_flight = None
                launched = (
                    self._launch(taken, arguments, release=True) if arguments is not None else None
                )
                if in_flight is not None:
                    self._complete(in_flight)
                in_flight = launched if overlaps else None
                if launched is not None and not overlaps:
                    self._complete(launched)
                taken = []
                if batch is None:
                    return
        except BaseException as exc:
            # Not a forward-pass failure (those are handled per batch): the worker itself
            # broke. Say so loudly, fail what waits, and let liveness report it.
            log.critical("the batch worker stopped", exc_info=exc)
            self.crashed = exc
            with self._condition:
                orphans, self._queue = self._queue, []
                self._queued_tokens = 0
                self._running_tokens = 0
                self._queue_changed()
            orphans += taken + (in_flight.batch if in_flight is not None else [])
            self._fail({item.ticket for item in orphans}, "the batch worker has stopped")
            raise
        finally:
            self._tally.flush()  # stopped or broken: the pass figures it still holds

    def _next_batch(self, wait: bool = True) -> list[WorkItem] | None:
        """The next batch; None once stopping, and an empty one when the queue is empty and
        `wait` is off (a batch is still running: it comes first)."""
        if self._intake is not None and not self._stopping:
            self._intake(0)
        with self._condition:
            while not self._stopping:
                if not self._queue:
                    if not wait:
                        return []
                    # Quiet (the last pass answered, or its inputs dropped or failed): what
                    # the tally holds is written before the wait, however long it is.
                    self._tally.flush()
                    self._await_arrivals(None)
                    continue
                if wait:  # with a pass still running, what has come goes next
                    self._wait_for_fuller_batch()
                # Dropped only now: an input can be abandoned during the wait too.
                self._drop_abandoned()
                if self._queue:
                    break
            if self._stopping:
                return None
            batch = self._choose(self._queue[: self.max_batch_inputs * WINDOW_FACTOR])
            self._last_clients = _requests_in(batch)
            chosen = {id(item) for item in batch}
            self._queue = [item for item in self._queue if id(item) not in chosen]
            tokens = sum(item.length for item in batch)
            self._queued_tokens -= tokens
            self._running_tokens += tokens
            self._queue_changed()
            return batch

    def _drop_abandoned(self) -> None:
        now = time.perf_counter()
        kept = [item for item in self._queue if not item.ticket.expired(now)]
        if len(kept) != len(self._queue):
            self._queued_tokens = sum(item.length for item in kept)
            self._queue = kept
            self._queue_changed()

    def _wait_for_fuller_batch(self) -> None:
        """Clients answered a moment ago come back within milliseconds: while inputs keep
        arriving, wait for them (up to batch_wait) so that one full batch runs instead of two
        half ones. The wait ends once as many requests wait as the last batch served (its
        clients are back: waiting out a quiet gap then would idle the model for nothing) or
        after a quiet gap with no arrival, and is skipped when the last batch had a single
        client. Called with the lock held."""
        if self._last_clients < 2:
            return
        started = time.perf_counter()
        deadline = started + self.batch_wait
        self._gathering = True
        try:
            while self._queue and not self._stopping and not self._gathered():
                # The gap counts from the last arrival (its ticket's), or from the start.
                now = time.perf_counter()
                quiet_at = max(self._queue[-1].ticket.enqueued_at, started) + QUIET_GAP
                if now >= min(deadline, quiet_at):
                    return
                self._await_arrivals(min(deadline, quiet_at) - now)
        finally:
            self._gathering = False

    def _await_arrivals(self, timeout: float | None) -> None:
        """Until inputs arrive, or up to `timeout` seconds (None: no limit but a stop). Called
        with the lock held, once; like a condition's wait, lets go of it meanwhile."""
        if self._intake is None:
            self._condition.wait(timeout)
            return
        self._condition.release()
        try:
            self._intake(IDLE_POLL if timeout is None else timeout)
        finally:
            self._condition.acquire()

    def _gathered(self) -> bool:
        """The wait for a fuller batch is over: the batch is full, or as many requests wait
        as the last batch served. Called with the lock held."""
        return (
            len(self._queue) >= self.max_batch_inputs
            or _requests_in(self._queue) >= self._last_clients
        )

    def _choose(self, window: list[WorkItem]) -> list[WorkItem]:
        oldest = window[0]
        spec = oldest.ticket.wants.attention
        # Inputs that want maps run only with inputs that want the same maps.
        target = oldest.length
        similar = sorted(
            (item for item in window[1:] if item.ticket.wants.attention == spec),
            key=lambda item: abs(item.length - target),
        )
        batch, longest = [oldest], target
        for item in similar:
            if len(batch) == self.max_batch_inputs:
                break
            width = max(longest, item.length)
            if width * (len(batch) + 1) > self.max_batch_tokens:
                continue
            if spec and _map_values(spec, width, len(batch) + 1) > self.max_attention_values:
                continue
            batch.append(item)
            longest = width
        return batch

    def _execute(self, batch: list[WorkItem]) -> None:
        """Run a retry's batch and answer it (its tokens still count as the failed pass's),
        without the inputs nobody waits for any more, as the queue drops them."""
        now = time.perf_counter()
        batch = [item for item in batch if not item.ticket.expired(now)]
        if not batch:
            return
        if (launched := self._launch(batch, self._pass_of(batch), release=False)) is not None:
            self._complete(launched)

    def _launch(
        self, batch: list[WorkItem], arguments: PassArguments, *, release: bool
    ) -> Launched | None:
        """Start a batch's pass; None if it failed (then retried or failed here). `release`:
        its tokens count as running until it is done."""
        lengths = [item.length for item in batch]
        padded = max(lengths) * len(batch)
        tally, metrics = self._tally, self.metrics
        tally.observe(metrics.batch_size, len(batch))
        tally.observe(metrics.batch_tokens, padded)
        tally.observe(metrics.padding_ratio, 1 - sum(lengths) / padded if padded else 0.0)
        tokens = sum(lengths)
        running = tokens if release else 0
        started, cpu_started = time.perf_counter(), time.thread_time()
        if (output := self._attempt(batch, running, self._forward, arguments)) is None:
            return None
        cpu_seconds = time.thread_time() - cpu_started
        return Launched(batch, tokens, running, output, started, cpu_seconds)

    def _complete(self, launched: Launched) -> None:
        """Wait for a launched pass's output (at once for a complete one) and answer it."""
        cpu_started = time.thread_time()
        output = self._attempt(launched.batch, launched.running, launched.output.result)
        if output is None:
            return
        self._release(launched.running)
        now = time.perf_counter()
        # A pass launched behind another starts on the device when that one ends.
        seconds = now - max(launched.started, self._last_done)
        self._last_done = now
        self.record_pace(seconds, launched.tokens)
        self._tally.observe(self.metrics.inference_seconds, seconds)
        cpu = launched.cpu_seconds + time.thread_time() - cpu_started
        self._tally.count(self.metrics.forward_cpu_seconds, cpu)
        if self.idle:  # quiet: the metrics are exact before the answers go out
            self._tally.flush()
        self._deliver_finished(launched.batch, output, now - seconds, seconds)

    def _attempt(
        self,
        batch: list[WorkItem],
        tokens: int,
        step: Callable[P, T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T | None:
        """A step of a batch's pass; if it fails, the batch retried (the OOM split, or each
        request alone) or failed, its tokens released once that is done (until then the
        engine is busy with them), and None."""
        # The retry runs outside the `except` blocks, whose traceback holds the failed pass's
        # tensors (the memory an OOM retry needs).
        retry: Callable[[list[WorkItem]], None]
        try:
            return step(*args, **kwargs)
        except (torch.OutOfMemoryError, MemoryError):
            retry = self._split_after_oom
        except Exception as exc:
            log.exception("forward pass failed for a batch of %d inputs", len(batch))
            if not self.embedder.device_works():
                raise DeviceLostError("the device runs nothing since this failure") from exc
            retry = self._rerun_each_request
        try:
            retry(batch)
        finally:
            self._release(tokens)
        return None

    def _release(self, tokens: int) -> None:
        """A batch taken from the queue is done: its tokens no longer run."""
        if tokens:
            with self._condition:
                self._running_tokens -= tokens
                self._publish_busy()

    def record_pace(self, seconds: float, tokens: int) -> None:
        self._seconds = ESTIMATE_DECAY * self._seconds + seconds
        self._tokens = ESTIMATE_DECAY * self._tokens + max(tokens, 1)

    def _forward(self, arguments: PassArguments) -> PendingOutput:
        if self.cores is None:
            return self.embedder.launch(**arguments)
        with self.cores.cores() as threads:
            # On this thread, the one that runs torch: the thread count is per thread.
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            self._tally.count(self.metrics.forward_passes_on(threads))
            return self.embedder.launch(**arguments)

    @staticmethod
    def _pass_of(batch: list[WorkItem]) -> PassArguments:
        return {
            "batch": [item.encoded for item in batch],
            "token_embeddings": any(item.ticket.wants.needs_tokens for item in batch),
            "attention": batch[0].ticket.wants.attention,
        }

    def _rerun_each_request(self, batch: list[WorkItem]) -> None:
        """A failed pass that mixed requests runs each request's inputs again on their own,
        so that only the request the model fails on gets the error; the worker carries on."""
        requests = list(dict.fromkeys(item.ticket for item in batch))
        if len(requests) == 1:
            self._fail(set(requests), "the model failed on this request's inputs")
            return
        for ticket in requests:
            self._execute([item for item in batch if item.ticket is ticket])

    def _split_after_oom(self, batch: list[WorkItem]) -> None:
        """Out of memory: retry in halves, down to one input, which alone then fails."""
        if len(batch) == 1:
            log.error("out of memory on a single input of %d tokens", batch[0].length)
            self._fail({batch[0].ticket}, "out of memory on this input alone")
            return
        log.warning("out of memory on a batch of %d inputs; retrying in halves", len(batch))
        middle = len(batch) // 2
        for half in (batch[:middle], batch[middle:]):
            self._execute(half)

    def _deliver_finished(
        self, batch: list[WorkItem], output: BatchOutput, started: float, seconds: float
    ) -> None:
        # A late-chunked request's windows have no output of their own: its chunks' come
        # from their token vectors once all are done (`_pool_chunks`).
        asked = [item.ticket.wants for item in batch]
        outputs = self.finish(
            output.pooled.numpy(), [w if w.late is None else NO_OUTPUT for w in asked]
        )
        deliveries: list[Delivery] = []
        for row, item in enumerate(batch):
            ticket = item.ticket
            if ticket.abandoned:  # failed, timed out or disconnected meanwhile
                continue
            wants = ticket.wants
            ticket.queue_seconds = max(ticket.queue_seconds, started - ticket.enqueued_at)
            ticket.inference_seconds = max(ticket.inference_seconds, seconds)
            ticket.results[item.row] = ItemResult(
                outputs[row],
                output.token_embeddings[row].numpy()
                if wants.needs_tokens and output.token_embeddings
                else None,
                {layer: maps.numpy() for layer, maps in output.attentions[row].items()}
                if output.attentions
                else None,
            )
            ticket.remaining -= 1
            if ticket.remaining == 0:
                items = [r for r in ticket.results if r is not None]
                if wants.late is not None:
                    try:
                        items = self._pool_chunks(items, wants, wants.late)
                    except Exception:
                        log.exception("pooling a late-chunked request's chunks failed")
                        self._fail({ticket}, "the model failed on this request's chunks")
                        continue
                outcome = Outcome(items, ticket.queue_seconds, ticket.inference_seconds)
                deliveries.append((ticket, outcome))
        if deliveries:
            self.deliver(deliveries)

    def _pool_chunks(
        self, windows: list[ItemResult], wants: Wants, documents: Sequence[LateDocument]
    ) -> list[ItemResult]:
        """Each late-chunked document's chunk vectors, (chunks, D), finished as asked."""
        results = []
        parts = iter(windows)
        for document in documents:
            laid = []
            for (start, stop), window in zip(
                document.keeps, itertools.islice(parts, document.windows), strict=True
            ):
                assert window.token_embeddings is not None, "late windows run with token vectors"
                laid.append(window.token_embeddings[start:stop])
            pooled = self.embedder.pool_spans(np.concatenate(laid), document.spans)
            results.append(ItemResult(finish(pooled, wants.normalize, wants.dimensions)))
        return results

    def _fail(self, tickets: set[Ticket], message: str) -> None:
        """Each request gets an error of its own (never one shared exception object), once."""
        tickets = {ticket for ticket in tickets if ticket.remaining != -1}
        deliveries: list[Delivery] = [(t, BackendError(message)) for t in tickets]
        for ticket in tickets:
            ticket.remaining = -1  # its other inputs, if still queued, are skipped
            ticket.abandoned = True
        if deliveries:
            self.deliver(deliveries)


def _map_values(spec: AttentionSpec, width: int, count: int) -> int:
    """Attention probabilities a batch computes: every kept head, on the padded width."""
    return count * len(spec.layers) * len(spec.heads) * width * width
