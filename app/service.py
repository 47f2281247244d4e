"""The serving layer: readiness and draining, tokenization off the event loop, the queue."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from app.batcher import Batcher, ItemResult, WorkItem
from app.errors import (
    EmptyInputError,
    PayloadTooLargeError,
    ServiceError,
    UnavailableError,
    ValidationFailedError,
)
from app.metrics import Metrics
from app.settings import Settings
from model import Direction, Embedder, Encoded, InputError, ModelInfo

log = logging.getLogger(__name__)

RawInput = str | list[int]
# Makes a coroutine that completes when the client goes away.
DisconnectWatch = Callable[[], Coroutine[Any, Any, None]]
WARM_UP_TEXTS = ["warm-up", "a longer warm-up sentence " * 8]


class ClientDisconnectedError(ServiceError):
    """The client went away before its results were ready (nginx's 499)."""

    status, error_type = 499, "ClientDisconnected"


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    truncate: bool | None = None
    direction: Direction = "right"
    prompt_name: str | None = None
    token_embeddings: bool = False
    attention_layers: frozenset[int] = frozenset()
    # Values per layer and token pair that the response will hold (heads kept, or 1 for a mean).
    attention_maps_per_layer: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    tokenization: float
    queue: float
    inference: float


@dataclass(frozen=True, slots=True)
class EncodeResult:
    encoded: list[Encoded]
    items: list[ItemResult]
    timings: Timings

    @property
    def token_count(self) -> int:
        return sum(len(e.ids) for e in self.encoded)


class EmbeddingService:
    """Owns the model and the batcher; routes call it and never touch the model directly."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.embedder: Embedder | None = None
        self.batcher: Batcher | None = None
        self.warmed_up = False
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    # Lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model, run a warm-up batch, then start the worker (all off the loop)."""
        settings = self.settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            embedder = await asyncio.to_thread(
                Embedder.load,
                settings.model_id,
                device=settings.device,
                dtype=settings.dtype,
                allow_download=settings.allow_download,
                max_input_tokens=settings.max_input_tokens,
            )
            await asyncio.to_thread(self._warm_up, embedder)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.embedder = embedder
        info = embedder.info
        self.metrics.model_info.labels(info.model_id, info.dtype, info.device).set(1)
        self.batcher = Batcher(
            embedder,
            self.metrics,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_inputs=settings.max_batch_inputs,
            max_queued_inputs=settings.max_queued_inputs,
            batch_wait=settings.batch_wait_ms / 1000,
        )
        self.batcher.start(asyncio.get_running_loop())
        self.warmed_up = True
        log.info("ready: %s (%s, %s)", info.model_id, info.device, info.dtype)

    @staticmethod
    def _warm_up(embedder: Embedder) -> None:
        encoded = embedder.tokenize(WARM_UP_TEXTS)
        embedder.forward([e.ids for e in encoded], token_embeddings=True)

    async def stop(self) -> None:
        if self.batcher is not None:
            await asyncio.to_thread(self.batcher.stop)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def begin_drain(self) -> None:
        """From now on /health is 503 and new inference gets 503; accepted work finishes."""
        if not self.draining:
            log.info("draining: %d requests in flight", self.inflight)
        self.draining = True

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no accepted request is in flight; False if the grace period ran out."""
        try:
            async with asyncio.timeout(grace):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    @property
    def ready(self) -> bool:
        return (
            self.warmed_up and not self.draining and self.batcher is not None and self.batcher.alive
        )

    def not_ready_reason(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.load_error:
            return f"the model failed to load: {self.load_error}"
        if not self.warmed_up:
            return "the model is loading"
        return "the batch worker has stopped"

    def check_ready(self) -> Embedder:
        if not self.ready or self.embedder is None:
            raise UnavailableError(self.not_ready_reason())
        return self.embedder

    @property
    def info(self) -> ModelInfo:
        return self.check_ready().info

    # Requests --------------------------------------------------------------------------
    def validate_inputs(self, inputs: Sequence[RawInput]) -> None:
        if not inputs:
            raise EmptyInputError("the request holds no input")
        limit = self.settings.max_inputs_per_request
        if len(inputs) > limit:
            raise PayloadTooLargeError(
                f"the request holds {len(inputs)} inputs, more than the limit of {limit}"
            )
        for index, item in enumerate(inputs):
            if len(item) == 0:
                raise EmptyInputError(f"input {index} is empty")

    def validate_dimensions(self, dimensions: int | None) -> None:
        size = self.info.dimensions
        if dimensions is not None and not 1 <= dimensions <= size:
            raise ValidationFailedError(
                f"dimensions must be between 1 and {size}, got {dimensions}", param="dimensions"
            )

    async def tokenize(
        self, inputs: Sequence[RawInput], options: EncodeOptions, *, add_special_tokens: bool = True
    ) -> list[Encoded]:
        encoded, _ = await self._tokenize(self.check_ready(), inputs, options, add_special_tokens)
        return encoded

    async def _tokenize(
        self,
        embedder: Embedder,
        inputs: Sequence[RawInput],
        options: EncodeOptions,
        add_special_tokens: bool = True,
    ) -> tuple[list[Encoded], float]:
        """Validate, prompt and tokenize in the tokenizer pool; also return the seconds taken."""
        self.validate_inputs(inputs)
        texts = self._apply_prompt(embedder, inputs, options.prompt_name)
        truncate = self.settings.auto_truncate if options.truncate is None else options.truncate
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            encoded = await loop.run_in_executor(
                self._tokenizer_pool,
                lambda: embedder.tokenizer.encode(
                    texts,
                    truncate=truncate,
                    direction=options.direction,
                    add_special_tokens=add_special_tokens,
                ),
            )
        except InputError as exc:
            raise ValidationFailedError(str(exc), param="input") from exc
        seconds = time.perf_counter() - started
        self.metrics.tokenization_seconds.observe(seconds)
        return encoded, seconds

    async def encode(
        self,
        inputs: Sequence[RawInput],
        options: EncodeOptions,
        disconnected: DisconnectWatch | None = None,
    ) -> EncodeResult:
        """Tokenize, queue every input, and wait for all results (timeout and disconnect aware)."""
        deadline = time.perf_counter() + self.settings.request_timeout
        embedder = self._enter()
        try:
            encoded, tokenization = await self._tokenize(embedder, inputs, options)
            self._check_attention_size(encoded, options)
            results = await self._run(encoded, options, deadline, disconnected)
        finally:
            self._leave()
        timings = Timings(
            tokenization,
            max(r.queue_seconds for r in results),
            max(r.inference_seconds for r in results),
        )
        result = EncodeResult(encoded, results, timings)
        for e in encoded:
            self.metrics.input_tokens.observe(len(e.ids))
        self.metrics.inputs.inc(len(encoded))
        self.metrics.tokens.inc(result.token_count)
        return result

    def _enter(self) -> Embedder:
        """Count an accepted request, so that a drain waits for it."""
        embedder = self.check_ready()
        self.inflight += 1
        self._idle.clear()
        return embedder

    def _leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def _apply_prompt(
        self, embedder: Embedder, inputs: Sequence[RawInput], prompt_name: str | None
    ) -> list[RawInput]:
        if prompt_name is None:
            return list(inputs)
        prompts = embedder.info.prompts
        if prompt_name not in prompts:
            known = ", ".join(sorted(prompts)) or "none"
            raise ValidationFailedError(
                f"unknown prompt_name {prompt_name!r} (this model's prompts: {known})",
                param="prompt_name",
            )
        prefix = prompts[prompt_name]
        return [prefix + item if isinstance(item, str) else item for item in inputs]

    def _check_attention_size(self, encoded: list[Encoded], options: EncodeOptions) -> None:
        if not options.attention_layers:
            return
        per_token_pair = len(options.attention_layers) * options.attention_maps_per_layer
        values = sum(per_token_pair * len(e.ids) ** 2 for e in encoded)
        limit = self.settings.max_attention_values
        if values > limit:
            raise ValidationFailedError(
                f"the attention maps asked for hold {values} values (layers x heads x tokens^2), "
                f"over the limit of {limit}; ask for fewer layers or heads, a mean over heads, "
                "or shorter inputs",
                param="attention",
            )

    async def _run(
        self,
        encoded: list[Encoded],
        options: EncodeOptions,
        deadline: float,
        disconnected: DisconnectWatch | None,
    ) -> list[ItemResult]:
        assert self.batcher is not None, "check_ready() guarantees a batcher"
        loop = asyncio.get_running_loop()
        items = [
            WorkItem(
                e.ids,
                loop.create_future(),
                token_embeddings=options.token_embeddings,
                attention_layers=options.attention_layers,
            )
            for e in encoded
        ]
        self.batcher.submit(items)
        # return_exceptions: a failed batch fails every input alike; collect them all so that
        # no future's exception goes unretrieved.
        waiter = asyncio.gather(*(item.future for item in items), return_exceptions=True)
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        waiting: set[asyncio.Future[Any]] = {waiter}
        if watcher is not None:
            waiting.add(watcher)
        try:
            done, _ = await asyncio.wait(
                waiting,
                timeout=max(0.0, deadline - time.perf_counter()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if waiter in done:
                results: list[ItemResult] = []
                for outcome in waiter.result():
                    if isinstance(outcome, BaseException):
                        raise outcome
                    results.append(outcome)
                return results
            for item in items:
                item.abandoned = True
            waiter.cancel()
            if watcher is not None and watcher in done:
                raise ClientDisconnectedError("the client disconnected")
            raise UnavailableError(
                f"no result within the request timeout of {self.settings.request_timeout} s"
            )
        finally:
            if watcher is not None:
                watcher.cancel()
