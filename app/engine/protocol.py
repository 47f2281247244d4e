"""What crosses between a front end and an engine, and the interface a front end calls.

A front end submits one request's tokenized inputs with what it wants back and its deadline,
gets a `Pending` whose future resolves with the finished outputs, and aborts it when the
client leaves or the deadline passes, which drops its inputs from the engine's queue. Before
tokenizing, `check_room` refuses work the queue would not finish in time (429), from the
state the engine publishes. No torch here.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from app.errors import OverloadedError, ServiceError
from model.codec import ModelCard
from model.info import AttentionSpec
from model.tokenizer import Encoded
from model.vectors import FloatArray

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class LateDocument:
    """A late-chunked text (app/chunking.py): the token vectors of its windows, each cut to
    `keeps`, laid end to end are the text's; each of `spans` (token positions in the text)
    is pooled into one chunk's vector."""

    keeps: tuple[tuple[int, int], ...]  # per window: the positions in it that it gives
    spans: tuple[tuple[int, int], ...]

    @property
    def windows(self) -> int:
        return len(self.keeps)


@dataclass(frozen=True, slots=True)
class Wants:
    """What each input of a request asks to get back."""

    pooled: bool = True
    normalize: bool = True
    dimensions: int | None = None
    token_embeddings: bool = False
    attention: AttentionSpec | None = None
    # Late chunking: the inputs are these documents' windows, in order, and each document's
    # result is one finished vector per chunk, (chunks, D).
    late: tuple[LateDocument, ...] | None = None

    @property
    def needs_tokens(self) -> bool:
        """Whether the forward pass must hand back its token vectors."""
        return self.token_embeddings or self.late is not None


# A task's finished output for one input (app/tasks/): a vector (an embedding's, cut and
# normalised as asked, or a classifier's logits), or SPLADE's vocabulary ids and weights.
SparseVector = tuple[IntArray, FloatArray]
Output = FloatArray | SparseVector


# ItemResult and Outcome are not frozen, though nothing changes one once made: they are
# made per input and per request, in an engine and again in a front end, and a frozen
# dataclass's __init__ costs four times a plain one's (model/tokenizer.py's Encoded).
@dataclass(slots=True)
class ItemResult:
    """One input's outputs, finished."""

    output: Output | None
    token_embeddings: FloatArray | None = None  # (T, hidden)
    attention: dict[int, FloatArray] | None = None  # layer -> (h, T, T), or (T, T) for a mean

    @property
    def vector(self) -> FloatArray:
        """The output of an embedding or a classifier."""
        assert isinstance(self.output, np.ndarray), "a vector was asked for"
        return self.output

    @property
    def sparse(self) -> SparseVector:
        assert isinstance(self.output, tuple), "sparse weights were asked for"
        return self.output


@dataclass(slots=True)
class Outcome:
    """A request's results, in input order, with its longest queue wait and forward pass."""

    items: list[ItemResult]
    queue_seconds: float
    inference_seconds: float


@dataclass(frozen=True, slots=True)
class Admission:
    """Which work a queue takes: the engine's rule, also applied by front ends to the state
    it publishes, so that an overloaded engine's 429 costs a front end no round trip."""

    max_wait: float  # a request's whole time (request_timeout)
    max_queue_wait: float  # the work a request may find queued ahead of it

    def verdict(
        self, backlog: int, tokens: int, seconds_per_token: float, within: float
    ) -> OverloadedError | None:
        """429 when the `backlog` tokens queued and running, with `tokens` more, would not
        finish within `within` seconds (at most `max_wait`), or when the backlog alone is
        over `max_queue_wait`. An empty queue takes any request."""
        if backlog == 0:
            return None
        limit = min(within, self.max_wait)
        wait = (backlog + tokens) * seconds_per_token
        if wait > limit:
            with_own = f", with this request's {tokens} tokens," if tokens else ""
            return _overloaded(
                wait - self.max_wait,
                f"the queue holds about {backlog * seconds_per_token:.1f} s of work{with_own} "
                f"and would not finish within the {limit:.1f} s left of the request's "
                f"{self.max_wait:g} s",
            )
        ahead = backlog * seconds_per_token
        if ahead > self.max_queue_wait:
            return _overloaded(
                ahead - self.max_queue_wait,
                f"the queue holds about {ahead:.1f} s of work, more than the "
                f"{self.max_queue_wait:g} s a request may wait behind others",
            )
        return None


def _overloaded(excess: float, reason: str) -> OverloadedError:
    """Retry-After: once `excess` seconds of the queue's work have drained."""
    retry_after = max(1, math.ceil(excess))
    return OverloadedError(f"{reason}; retry in {retry_after} s", retry_after=retry_after)


class Pending(Protocol):
    """A submitted request: `future` resolves once every input is done."""

    future: asyncio.Future[Outcome]

    def abort(self, error: ServiceError) -> None:
        """Nobody waits any more: fail the future with `error`, drop the queued inputs."""


class Engine(Protocol):
    """The model as a front end sees it, wherever it runs."""

    async def start(self) -> ModelCard:
        """Ready to serve (the model loaded and warmed up); the model's card."""

    async def stop(self) -> None:
        """After the front end's drain; what was submitted has finished."""

    @property
    def alive(self) -> bool:
        """False once the engine has died: only a restart helps."""

    def check_room(self, within: float) -> None:
        """OverloadedError (429) unless the queued work would finish within `within`
        seconds: asked before tokenizing, so that refusing costs nothing."""

    def submit(self, encoded: Sequence[Encoded], wants: Wants, deadline: float) -> Pending:
        """Queue all of a request's inputs or none (OverloadedError); `deadline` is a
        time.perf_counter() value of the calling process (an engine elsewhere is told the
        seconds left)."""
