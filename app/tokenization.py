"""A request's inputs to token ids: small requests on the event loop, large ones in a pool.

For a sentence, the hop to a thread costs more than the tokenizing; for a large request,
tokenizing on the event loop would stall every other request. Texts, pre-tokenized ids and
pairs of texts (for cross-encoders) may be mixed; the model's input errors become 422s.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from app.errors import ValidationFailedError
from app.metrics import ModelMetrics
from app.params import EncodeOptions, RawInput, TextPair
from model.codec import TextCodec
from model.errors import InputError, PromptError, TokenIdError
from model.tokenizer import Encoded

# Threads that tokenize large requests, beside the event loop and the batch worker.
TOKENIZER_THREADS = 2
# Requests with fewer characters than this are tokenized on the event loop.
INLINE_CHARS = 2048
# The same for token ids to decode: a token is a few characters.
INLINE_IDS = INLINE_CHARS // 4
# Said with every out-of-vocabulary id: the usual source is a client that tokenizes itself.
TOKEN_ID_HINT = (
    "token ids must come from this model's tokenizer (LangChain's OpenAIEmbeddings sends "
    "tiktoken ids unless check_embedding_ctx_length=False)"
)

# Read by `tokenizers` when it first tokenizes a batch, so setting it at start-up is enough;
# "false" keeps each batch on the calling thread.
PARALLELISM_VARIABLE = "TOKENIZERS_PARALLELISM"

Input = RawInput | TextPair
Done = TypeVar("Done")


def tokenize_on_calling_threads() -> None:
    """Unless the operator chose otherwise, a batch of texts is tokenized on the thread that
    asks. `tokenizers` would spread it over a pool of its own, a thread per CPU in every
    process, whose threads spin while they wait: on a 16-core GPU machine's front ends that
    cost several times the CPU of tokenizing each text in turn (docs/benchmarks.md). A
    server's parallelism comes from its requests: front-end processes, the tokenizer threads
    of large requests."""
    os.environ.setdefault(PARALLELISM_VARIABLE, "false")


def characters(item: Input) -> int:
    return sum(map(len, item)) if isinstance(item, tuple) else len(item)


def in_request_order(positions: list[int], encode: Callable[[], list[Encoded]]) -> list[Encoded]:
    """Run `encode` on some of a request's inputs; an error names the input's position in
    the request, not in the subset."""
    try:
        return encode()
    except InputError as exc:
        if positions[exc.index] != exc.index:
            exc.args = (f"{exc} (input {positions[exc.index]} of the request)",)
        raise


class Tokenization:
    def __init__(self, metrics: ModelMetrics, auto_truncate: bool) -> None:
        self.metrics = metrics
        self.auto_truncate = auto_truncate
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(
        self,
        codec: TextCodec,
        inputs: Sequence[Input],
        options: EncodeOptions,
        *,
        add_special_tokens: bool = True,
        details: bool = True,
        deadline: float | None = None,
    ) -> tuple[list[Encoded], float]:
        """Every input encoded, in order; also the seconds it took. TimeoutError past
        `deadline` (perf_counter) while waiting for the pool (whose threads still finish the
        work: they cannot be stopped). Without `details`, texts keep only what the model
        runs on (model/tokenizer.py's `TextTokenizer.encode`)."""
        truncate = self.auto_truncate if options.truncate is None else options.truncate

        def encode_singles(items: Sequence[RawInput]) -> list[Encoded]:
            return codec.tokenize(
                items,
                truncate=truncate,
                direction=options.direction,
                prompt_name=options.prompt_name,
                add_special_tokens=add_special_tokens,
                details=details,
            )

        def encode() -> list[Encoded]:
            singles = {i: item for i, item in enumerate(inputs) if not isinstance(item, tuple)}
            if len(singles) == len(inputs):  # the usual request: positions are the request's
                return encode_singles(list(singles.values()))
            pairs = {i: item for i, item in enumerate(inputs) if isinstance(item, tuple)}
            encoded: dict[int, Encoded] = {}
            if singles:
                done = in_request_order(
                    list(singles), lambda: encode_singles(list(singles.values()))
                )
                encoded.update(zip(singles, done, strict=True))
            done = in_request_order(
                list(pairs),
                lambda: codec.tokenize_pairs(
                    list(pairs.values()), truncate=truncate, direction=options.direction
                ),
            )
            encoded.update(zip(pairs, done, strict=True))
            return [encoded[i] for i in range(len(inputs))]

        return await self._timed(encode, sum(characters(item) for item in inputs), deadline)

    async def whole(
        self,
        codec: TextCodec,
        texts: Sequence[str],
        prompt_name: str | None,
        deadline: float,
        then: Callable[[list[Encoded]], Done],
    ) -> tuple[Done, float]:
        """Each text's every token, never truncated (documents to be cut into chunks), and
        what `then` makes of them, in the same hop off the event loop."""

        def encode() -> Done:
            return then([codec.tokenize_whole(text, prompt_name) for text in texts])

        return await self._timed(encode, sum(map(len, texts)), deadline)

    async def decode(
        self, codec: TextCodec, ids: Sequence[Sequence[int]], skip_special_tokens: bool
    ) -> list[str]:
        """Token ids back to text; many of them in the pool, as long texts are tokenized."""

        def decode() -> list[str]:
            return codec.decode(ids, skip_special_tokens=skip_special_tokens)

        if sum(map(len, ids)) < INLINE_IDS:
            return decode()
        return await asyncio.get_running_loop().run_in_executor(self._pool, decode)

    def record(self, seconds: float) -> None:
        """One request's tokenizing (all of it, however many calls it took), in the metrics."""
        self.metrics.tally.observe(self.metrics.tokenization_seconds, seconds)

    async def _timed(
        self, encode: Callable[[], Done], chars: int, deadline: float | None
    ) -> tuple[Done, float]:
        started = time.perf_counter()
        try:
            if chars < INLINE_CHARS:
                encoded = encode()
            else:
                pooled = asyncio.get_running_loop().run_in_executor(self._pool, encode)
                within = None if deadline is None else max(0.0, deadline - time.perf_counter())
                encoded = await asyncio.wait_for(pooled, within)
        except PromptError as exc:
            raise ValidationFailedError(str(exc), param="prompt_name") from exc
        except TokenIdError as exc:
            raise ValidationFailedError(f"{exc}; {TOKEN_ID_HINT}", param="input") from exc
        except InputError as exc:
            raise ValidationFailedError(str(exc), param="input") from exc
        return encoded, time.perf_counter() - started
