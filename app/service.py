"""The serving layer of a front end: readiness and draining, request limits, tokenization,
and the engine (app/engine/protocol.py), wherever it runs.

Routes call `encode` and `tokenize` and never touch the model. A request, once accepted,
completes even while the server drains: nothing after admission checks readiness again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.types import Receive

from app.chunking import TextPlan, late_inputs, plan_texts
from app.collector import settle_collector
from app.engine.protocol import Engine, ItemResult, Pending, Wants
from app.errors import (
    ClientDisconnectedError,
    DeadlineError,
    ServiceError,
    UnavailableError,
    ValidationFailedError,
)
from app.limits import Limits
from app.metrics import ModelMetrics
from app.params import ChunkOptions, EncodeOptions, RawInput
from app.settings import Settings
from app.tokenization import Input, Tokenization, characters
from model.codec import TextCodec
from model.errors import PromptError
from model.info import AttentionSpec, ModelInfo
from model.quantization import Calibration, CodeArray, Precision, quantize
from model.similarity import similarity
from model.tokenizer import Encoded
from model.vectors import FloatArray

log = logging.getLogger(__name__)

# Pooling modes that read one token (the first, the last): late chunking cannot pool a chunk
# by them.
TOKEN_POOLING = frozenset({"cls", "lasttoken"})
# Seconds a request waits before its client is watched for a disconnect (see `Watch`).
WATCH_AFTER = 0.05
# Makes a coroutine that completes when the client goes away.
DisconnectWatch = Callable[[], Coroutine[Any, Any, None]]


def watch_disconnect(receive: Receive) -> DisconnectWatch:
    """The watch over a request whose body has been read."""

    async def disconnected() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass

    return disconnected


@dataclass(frozen=True, slots=True)
class Timings:
    started: float  # perf_counter() when the request reached the service
    tokenization: float
    queue: float
    inference: float


@dataclass(frozen=True, slots=True)
class EncodeResult:
    model: ModelInfo
    encoded: list[Encoded]
    items: list[ItemResult]
    timings: Timings
    attention: AttentionSpec | None = None  # the maps computed, resolved against the model
    char_count: int = 0  # characters of the text inputs

    @property
    def token_count(self) -> int:
        return sum(len(e.ids) for e in self.encoded)

    def vectors(self) -> FloatArray:
        """(N, D) float32, C-contiguous: every input's finished pooled vector."""
        rows = [item.vector for item in self.items if item.output is not None]
        # One vector (the most common request) needs no copy: it is a row of its batch's array.
        return rows[0][None] if len(rows) == 1 else np.stack(rows)


@dataclass(frozen=True, slots=True)
class ChunkedResult:
    model: ModelInfo
    plans: list[TextPlan]  # each text's every token, and its chunks
    vectors: list[FloatArray]  # per text, (chunks, D), finished
    timings: Timings
    token_count: int  # the tokens the encoder ran
    char_count: int

    @property
    def values(self) -> int:
        """Numbers in the vectors: what a response renders."""
        return sum(vectors.size for vectors in self.vectors)


@dataclass(frozen=True, slots=True)
class Tokenized:
    # The texts as the tokenizer saw them (with the prompt), for slicing by offsets.
    texts: list[RawInput]
    encoded: list[Encoded]


def per_text(counts: Sequence[int], items: Sequence[ItemResult], width: int) -> list[FloatArray]:
    """Each text's chunk vectors, (chunks, width), from the results of a chunked request:
    one vector per chunk (independent), or one (chunks, width) array per text that has
    chunks (late)."""
    if not items or items[0].vector.ndim == 2:
        late = iter(items)
        empty = np.zeros((0, width), dtype=np.float32)
        return [next(late).vector if count else empty for count in counts]
    rows = np.stack([item.vector for item in items])
    return np.split(rows, np.cumsum(counts)[:-1])


class EmbeddingService:
    """Owns the engine client and the tokenizer; routes call it and never touch the model."""

    def __init__(self, settings: Settings, metrics: ModelMetrics, engine: Engine) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine = engine
        self.limits = Limits(settings)
        self.codec: TextCodec | None = None
        self.warmed_up = False
        self.loaded_at = 0  # Unix seconds, once the model is loaded
        # A stop signal came: /health says 503, so that balancers stop sending work here.
        self.stopping = False
        # New inference is refused; what was accepted finishes.
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # An embedding model's calibration vectors: the ranges of int8 and uint8 codes.
        self.calibration: Calibration | None = None
        self.tokenization = Tokenization(metrics, settings.auto_truncate)

    # Lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Wait for the engine to be ready, and build the tokenizer from its model card."""
        try:
            card = await self.engine.start()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.codec = TextCodec.from_card(card)
        if card.calibration is not None:
            self.calibration = Calibration(card.calibration)
        self.loaded_at = int(time.time())
        settle_collector()
        self.warmed_up = True

    async def stop(self) -> None:
        await self.engine.stop()
        self.tokenization.shutdown()

    def begin_stop(self) -> None:
        """/health turns 503 while inference is still accepted (for `drain_delay`): load
        balancers take the replica out before it refuses anything."""
        if not self.stopping:
            log.info("stopping: /health is 503, new requests accepted for now")
        self.stopping = True

    def begin_drain(self) -> None:
        """From now on new inference gets 503 too; accepted work finishes."""
        if not self.draining:
            log.info("draining: %d requests in flight", self.inflight)
        self.stopping = self.draining = True

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no accepted request is in flight; False if the grace period ran out."""
        try:
            async with asyncio.timeout(grace):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    @property
    def worker_alive(self) -> bool:
        return self.warmed_up and self.engine.alive

    @property
    def ready(self) -> bool:
        """Readiness (/health): loaded, warmed up, worker alive, no stop signal."""
        return self.warmed_up and not self.stopping and self.worker_alive

    @property
    def accepting(self) -> bool:
        return self.warmed_up and not self.draining and self.worker_alive

    @property
    def broken(self) -> bool:
        """The engine died after warm-up: only a restart helps (liveness fails), also while
        the process drains on its way out."""
        return self.warmed_up and not self.worker_alive

    def not_ready_reason(self) -> str:
        if self.stopping:
            return "the server is shutting down"
        if self.load_error:
            return f"the model failed to load: {self.load_error}"
        if not self.warmed_up:
            return "the model is loading"
        return "the engine has stopped"

    def check_ready(self) -> TextCodec:
        if not self.accepting or self.codec is None:
            raise UnavailableError(self.not_ready_reason())
        return self.codec

    @property
    def info(self) -> ModelInfo:
        """The loaded model's description (also while draining)."""
        if self.codec is None:
            raise UnavailableError(self.not_ready_reason())
        return self.codec.info

    # Requests --------------------------------------------------------------------------
    async def tokenize(
        self, inputs: Sequence[RawInput], options: EncodeOptions, *, add_special_tokens: bool = True
    ) -> Tokenized:
        codec = self.check_ready()
        self.limits.check_inputs(inputs)
        encoded, seconds = await self.tokenization.run(
            codec, inputs, options, add_special_tokens=add_special_tokens
        )
        self.tokenization.record(seconds)
        prompt = codec.prompt(options.prompt_name)  # known good: tokenizing checked it
        texts = [prompt + item if isinstance(item, str) else item for item in inputs]
        return Tokenized(texts, encoded)

    async def encode(
        self,
        inputs: Sequence[Input],
        options: EncodeOptions,
        disconnected: DisconnectWatch | None = None,
    ) -> EncodeResult:
        """Check, tokenize, queue every input, and wait for all results (timeout and
        disconnect aware). The model's task is the route's (app/dispatch.py checks it)."""
        started = time.perf_counter()
        deadline = started + self.settings.request_timeout
        codec = self._enter()
        try:
            info = codec.info
            self.limits.check_inputs(inputs)
            self.limits.check_dimensions(options.dimensions, info)
            attention = self.limits.resolve_attention(options.attention, info)
            # A full queue refuses before tokenizing: under overload a 429 then costs next to
            # nothing, and comes fast.
            self.engine.check_room(deadline - time.perf_counter())
            try:
                encoded, tokenization = await self.tokenization.run(
                    codec, inputs, options, details=options.token_details, deadline=deadline
                )
            except TimeoutError as exc:  # still waiting for the tokenizer's threads
                raise self._deadline_error() from exc
            self.tokenization.record(tokenization)
            tokens = self.limits.check_tokens(encoded, options, attention, info)
            wants = Wants(
                options.pooled,
                options.normalize,
                options.dimensions,
                options.token_embeddings,
                attention,
            )
            results, queued, inference = await self._run(encoded, wants, deadline, disconnected)
        finally:
            self._leave()
        self._count(encoded, tokens)
        timings = Timings(started, tokenization, queued, inference)
        chars = sum(characters(item) for item in inputs if not isinstance(item, list))
        return EncodeResult(info, encoded, results, timings, attention, chars)

    async def chunk(
        self,
        inputs: Sequence[RawInput],
        options: EncodeOptions,
        chunking: ChunkOptions,
        disconnected: DisconnectWatch | None = None,
    ) -> ChunkedResult:
        """Each text cut into chunks, and one finished vector per chunk (app/chunking.py):
        each chunk's text embedded alone, or the whole text's token vectors pooled."""
        started = time.perf_counter()
        deadline = started + self.settings.request_timeout
        codec = self._enter()
        try:
            info = codec.info
            self.limits.check_inputs(inputs)
            texts = [item for item in inputs if isinstance(item, str)]
            if len(texts) < len(inputs):
                raise ValidationFailedError(
                    "chunking takes texts, not token ids: chunks are located by characters",
                    param="input",
                )
            self.limits.check_dimensions(options.dimensions, info)
            if chunking.mode == "late" and (pooled := TOKEN_POOLING.intersection(info.pooling)):
                raise ValidationFailedError(
                    f"late chunking pools each chunk's token vectors; this model pools by "
                    f"{', '.join(sorted(pooled))}, which reads one token, not a chunk: use "
                    "mode independent",
                    param="chunking.mode",
                )
            self.engine.check_room(deadline - time.perf_counter())
            try:
                prompt_chars = len(codec.prompt(options.prompt_name))
            except PromptError as exc:
                raise ValidationFailedError(str(exc), param="prompt_name") from exc
            most = (self.settings.max_chunks_per_input, self.settings.max_chunks_per_request)

            def plan(documents: list[Encoded]) -> list[TextPlan]:
                return plan_texts(
                    documents, texts, prompt_chars, chunking, info.max_input_tokens, most
                )

            try:
                plans, tokenization = await self.tokenization.whole(
                    codec, texts, options.prompt_name, deadline, plan
                )
            except TimeoutError as exc:
                raise self._deadline_error() from exc
            wants = Wants(True, options.normalize, options.dimensions)
            encoded: list[Encoded] = []
            if chunking.mode == "independent":
                pieces = [
                    text[c.start : c.end]
                    for text, plan_of_text in zip(texts, plans, strict=True)
                    for c in plan_of_text.chunks
                ]
                if pieces:
                    encoded, seconds = await self.tokenization.run(
                        codec,
                        pieces,
                        replace(options, truncate=True),
                        details=False,  # each piece's vector is all its chunk gives
                        deadline=deadline,
                    )
                    tokenization += seconds
            else:
                encoded, late = late_inputs(plans, info.max_input_tokens)
                wants = replace(wants, late=late)
            self.tokenization.record(tokenization)
            tokens = self.limits.check_tokens(encoded, options, None, info)
            items: list[ItemResult] = []
            queued = inference = 0.0
            if encoded:
                items, queued, inference = await self._run(encoded, wants, deadline, disconnected)
        finally:
            self._leave()
        self._count(encoded, tokens)
        counts = [len(plan.chunks) for plan in plans]
        vectors = per_text(counts, items, options.dimensions or info.dimensions)
        timings = Timings(started, tokenization, queued, inference)
        return ChunkedResult(info, plans, vectors, timings, tokens, sum(map(len, texts)))

    async def similarity(
        self,
        source: str,
        sentences: Sequence[str],
        options: EncodeOptions,
        disconnected: DisconnectWatch | None = None,
    ) -> tuple[FloatArray, EncodeResult]:
        """Scores of each sentence against the source, by the model's similarity function,
        on its vectors as the model gives them (normalised if its modules normalise)."""
        info = self.check_ready().info
        own = replace(options, normalize=info.normalize, dimensions=None)
        result = await self.encode([source, *sentences], own, disconnected)
        vectors = result.vectors()
        return similarity(vectors[0], vectors[1:], info.similarity_fn_name), result

    def quantized(
        self, vectors: FloatArray, precision: Precision, options: EncodeOptions
    ) -> CodeArray:
        """Finished vectors as int8, uint8 or packed-bit codes, on the ranges of the
        calibration vectors finished the same way (model/quantization.py)."""
        assert self.calibration is not None, "an embedding model's route"
        ranges = self.calibration.ranges(options.normalize, options.dimensions)
        return quantize(vectors, precision, ranges)

    async def decode(self, ids: Sequence[list[int]], *, skip_special_tokens: bool) -> list[str]:
        codec = self.check_ready()
        self.limits.check_inputs(ids)  # an id list is an input, an id a token
        self.limits.check_token_count(sum(map(len, ids)))
        vocabulary = codec.info.vocab_size
        if max(map(max, ids)) >= vocabulary:  # the lists are not empty (the schema's rule)
            row, position, token_id = next(
                (row, position, token_id)
                for row, sequence in enumerate(ids)
                for position, token_id in enumerate(sequence)
                if token_id >= vocabulary
            )
            raise ValidationFailedError(
                f"ids {row}: token id {token_id} at position {position} is outside the "
                f"vocabulary [0, {vocabulary})",
                param="ids",
            )
        return await self.tokenization.decode(codec, ids, skip_special_tokens)

    def _count(self, encoded: Sequence[Encoded], tokens: int) -> None:
        """A finished request's inputs and tokens, in the metrics."""
        tally = self.metrics.tally
        tally.count(self.metrics.inputs, len(encoded))
        tally.count(self.metrics.tokens, tokens)
        for e in encoded:
            tally.observe(self.metrics.input_tokens, len(e.ids))

    def _enter(self) -> TextCodec:
        """Count an accepted request, so that a drain waits for it."""
        codec = self.check_ready()
        self.inflight += 1
        self._idle.clear()
        return codec

    def _leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def _deadline_error(self) -> DeadlineError:
        return DeadlineError(
            f"no result within the request timeout of {self.settings.request_timeout} s"
        )

    async def _run(
        self,
        encoded: list[Encoded],
        wants: Wants,
        deadline: float,
        disconnected: DisconnectWatch | None,
    ) -> tuple[list[ItemResult], float, float]:
        """The request's results, its longest queue wait and its longest forward pass.

        The pending future is the one thing awaited: the timeout and a disconnect abort it
        through callbacks (`Watch`), which also drops its inputs from the engine's queue."""
        left = deadline - time.perf_counter()
        if left <= 0:  # the tokenizer took it all: queuing would run work nobody waits for
            raise self._deadline_error()
        # Admitted only if the work ahead fits in the time this request has left (it may have
        # spent some waiting for its body or the tokenizer): else it would be a 504.
        pending = self.engine.submit(encoded, wants, deadline)
        watch = Watch(pending, left, self._deadline_error, disconnected)
        try:
            outcome = await pending.future
        except asyncio.CancelledError:  # with its task (uvicorn's at shutdown): nobody waits
            pending.abort(ClientDisconnectedError("the request was cancelled"))
            raise
        finally:
            watch.close()
        # Observed by the front ends, which are many, per request: not by the engine, which
        # must keep its device busy, per input.
        self.metrics.tally.observe(self.metrics.queue_seconds, outcome.queue_seconds)
        return outcome.items, outcome.queue_seconds, outcome.inference_seconds


class Watch:
    """Aborts a pending request at its deadline, or when its client leaves. The client is
    watched (a task waiting for its disconnect) only once the request has waited WATCH_AFTER:
    that task would cost more than a short request's own work, and a client that leaves
    sooner leaves at most that long of work behind."""

    __slots__ = ("_disconnected", "_error", "_left", "_loop", "_pending", "_timer", "_watcher")

    def __init__(
        self,
        pending: Pending,
        left: float,
        error: Callable[[], ServiceError],
        disconnected: DisconnectWatch | None,
    ) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._pending = pending
        self._error = error
        self._left = left
        self._disconnected = disconnected
        self._watcher: asyncio.Future[None] | None = None
        # One timer for a request answered within WATCH_AFTER (most are); a longer one gets
        # its watcher then, and a timer for its deadline. Neither timer looks at the clock:
        # an event loop may run one a little early (uvloop counts whole milliseconds).
        watch = disconnected is not None and left > WATCH_AFTER
        self._timer = (
            loop.call_later(WATCH_AFTER, self._start_watching)
            if watch
            else loop.call_later(left, self._expire)
        )

    def _expire(self) -> None:
        self._pending.abort(self._error())

    def _start_watching(self) -> None:
        assert self._disconnected is not None, "only scheduled with a watch"
        self._timer = self._loop.call_later(self._left - WATCH_AFTER, self._expire)
        self._watcher = asyncio.ensure_future(self._disconnected())
        self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():  # cancelled: the request ended first
            self._pending.abort(ClientDisconnectedError("the client disconnected"))

    def close(self) -> None:
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
