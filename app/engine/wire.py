"""The messages between front ends and engines in other processes, as msgpack (msgspec),
each framed by its length on a Unix stream socket.

Front end to engine: `Requests`, what one turn of its event loop sends at once: `Submit` (one
request's token ids and what it wants back) and `Abort`, in order.
Engine to front end: `Answers` (every request a batch finished for that front end, at once)
and `Failed`. Arrays travel as raw little-endian bytes and become numpy views on the front
end, never Python lists. No torch here.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence

import msgspec
import numpy as np

from app.engine.protocol import ItemResult, LateDocument, Outcome, Output, Wants
from app.errors import BackendError, OverloadedError, ServiceError
from model.info import AttentionSpec
from model.tokenizer import Encoded

FLOAT32 = np.dtype("<f4")
INT64 = np.dtype("<i8")


# Each message is preceded by its length, a little-endian uint32.
HEADER = struct.Struct("<I")


def framed(message: msgspec.Struct) -> bytes:
    return _framed(encoder.encode(message))


def _framed(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def encoded_message(message: ToEngine) -> msgspec.Raw:
    """A message to an engine, encoded on its request's own time: one that cannot be
    encoded fails that request alone, not the others it would have travelled with."""
    return msgspec.Raw(encoder.encode(message))


def framed_requests(messages: Sequence[msgspec.Raw]) -> bytes:
    """`Requests` of messages already encoded (`encoded_message`), framed: the bytes
    `framed(Requests(...))` gives (a one-field array_like struct is a one-item array),
    without encoding the messages again."""
    return _framed(encoder.encode((messages,)))


class Frames:
    """A stream's bytes, as they arrive, cut into whole messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytearray]:
        buffer = self._buffer
        buffer += data
        messages = []
        start = 0
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            messages.append(buffer[start + HEADER.size : end])  # a copy: the buffer moves on
            start = end
        del buffer[:start]
        return messages


class Submit(msgspec.Struct, array_like=True, tag=0):
    request: int
    # When the request's time is up, on time.perf_counter's clock: CLOCK_MONOTONIC on Linux,
    # one clock for every process of the machine, so that the time a message waits for the
    # engine to read it counts against the request.
    deadline: float
    ids: list[list[int]]
    prompt_lengths: list[int]
    type_ids: list[list[int] | None] | None
    pooled: bool
    normalize: bool
    dimensions: int | None
    token_embeddings: bool
    # layers, heads, mean
    attention: tuple[list[int], list[int], bool] | None
    # Late chunking: per document, its windows' keeps and its chunks' spans.
    late: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] | None = None


class Abort(msgspec.Struct, array_like=True, tag=1):
    request: int


class Failed(msgspec.Struct, array_like=True, tag=0):
    """One request refused (429) or failed."""

    request: int
    error_type: str
    message: str
    retry_after: int = 0


class Answers(msgspec.Struct, array_like=True, tag=1):
    """Requests a batch finished for one front end, whose results have the same parts and
    widths (`_kind`): one message for them all, so that a batch of single sentences costs
    both sides one encode, one decode and one set of arrays, not one of each per request.
    The results' arrays lie one after another in request order."""

    # Per request: its number, how many results it has, its longest queue wait and pass.
    requests: list[int]
    results: list[int]
    queue_seconds: list[float]
    inference_seconds: list[float]
    # (N, D): every result's output vector (an embedding's, a classifier's logits).
    vectors: bytes | None = None
    vector_width: int = 0
    # Late chunking: each document's rows of `vectors`, one per chunk.
    vector_rows: list[int] | None = None
    # Per-token vectors: every result's rows, one after another, and their counts.
    token_embeddings: bytes | None = None
    token_counts: list[int] | None = None
    hidden_size: int = 0
    # SPLADE: each result's vocabulary ids and weights, one after another, and their counts.
    sparse_ids: bytes | None = None
    sparse_weights: bytes | None = None
    sparse_counts: list[int] | None = None
    # Attention: per result, per layer (in `attention_layers` order), one after another.
    attention: bytes | None = None
    attention_layers: list[int] | None = None
    attention_shapes: list[list[int]] | None = None


ToEngine = Submit | Abort


class Requests(msgspec.Struct, array_like=True):
    """A front end's submissions and aborts of one turn of its event loop, in one message:
    on the engine's side one decode for them all."""

    messages: list[ToEngine]


to_engine_decoder = msgspec.msgpack.Decoder(Requests)
reply_decoder: msgspec.msgpack.Decoder[Failed | Answers] = msgspec.msgpack.Decoder(Failed | Answers)
encoder = msgspec.msgpack.Encoder()


def submit_message(
    request: int, deadline: float, encoded: Sequence[Encoded], wants: Wants
) -> Submit:
    attention = wants.attention
    has_types = any(e.type_ids for e in encoded)
    return Submit(
        request,
        deadline,
        [e.ids for e in encoded],
        [e.prompt_length for e in encoded],
        [e.type_ids for e in encoded] if has_types else None,
        wants.pooled,
        wants.normalize,
        wants.dimensions,
        wants.token_embeddings,
        (list(attention.layers), list(attention.heads), attention.mean) if attention else None,
        [(list(doc.keeps), list(doc.spans)) for doc in wants.late] if wants.late else None,
    )


def submitted(message: Submit) -> tuple[list[Encoded], Wants]:
    """The engine's side: inputs the model can run (ids, prompt and segments only)."""
    types = message.type_ids or [None] * len(message.ids)
    encoded = [
        Encoded(ids, False, prompt, type_ids)
        for ids, prompt, type_ids in zip(message.ids, message.prompt_lengths, types, strict=True)
    ]
    attention = message.attention
    if attention is None and message.late is None:
        plain = _plain_wants(
            message.pooled, message.normalize, message.dimensions, message.token_embeddings
        )
        return encoded, plain
    spec = None
    if attention is not None:
        spec = AttentionSpec(tuple(attention[0]), tuple(attention[1]), attention[2])
    late = None
    if message.late is not None:
        late = tuple(LateDocument(tuple(keeps), tuple(spans)) for keeps, spans in message.late)
    wants = Wants(
        message.pooled, message.normalize, message.dimensions, message.token_embeddings, spec, late
    )
    return encoded, wants


@functools.lru_cache(maxsize=256)
def _plain_wants(
    pooled: bool, normalize: bool, dimensions: int | None, token_embeddings: bool
) -> Wants:
    """The few kinds of request most send, each built once: building a frozen dataclass
    costs a request more than decoding it does."""
    return Wants(pooled, normalize, dimensions, token_embeddings)


def failed_message(request: int, error: ServiceError) -> Failed:
    retry_after = error.retry_after if isinstance(error, OverloadedError) else 0
    return Failed(request, error.error_type, error.message, retry_after)


def answers(finished: Sequence[tuple[int, Outcome]]) -> list[Answers]:
    """The engine's side: one message per kind of result among the requests (a batch that
    mixes pooled vectors with per-token ones, say), in most batches one."""
    kinds: dict[tuple[object, ...], list[tuple[int, Outcome]]] = {}
    for request, outcome in finished:
        kinds.setdefault(_kind(outcome.items[0]), []).append((request, outcome))
    return [_answers(group) for group in kinds.values()]


def _kind(item: ItemResult) -> tuple[object, ...]:
    """What parts a result has, and their widths (requests of one batch may ask for
    different `dimensions`): what decides which fields carry it, and how they are cut."""
    output = item.output
    shape = (output.ndim, output.shape[-1]) if isinstance(output, np.ndarray) else type(output)
    attention = tuple(sorted(item.attention)) if item.attention is not None else None
    return shape, item.token_embeddings is not None, attention


def _answers(group: Sequence[tuple[int, Outcome]]) -> Answers:
    items = [item for _, outcome in group for item in outcome.items]
    message = Answers(
        [request for request, _ in group],
        [len(outcome.items) for _, outcome in group],
        [outcome.queue_seconds for _, outcome in group],
        [outcome.inference_seconds for _, outcome in group],
    )
    first = items[0]
    if isinstance(first.output, np.ndarray):
        message.vectors = b"".join(_bytes(item.vector) for item in items)
        message.vector_width = first.output.shape[-1]
        if first.output.ndim == 2:  # late chunking's (chunks, D) per document
            message.vector_rows = [len(item.vector) for item in items]
    if first.token_embeddings is not None:
        states = [item.token_embeddings for item in items if item.token_embeddings is not None]
        message.token_embeddings = b"".join(_bytes(rows) for rows in states)
        message.token_counts = [len(rows) for rows in states]
        message.hidden_size = states[0].shape[-1]
    if isinstance(first.output, tuple):
        pairs = [item.sparse for item in items]
        message.sparse_ids = b"".join(ids.astype(INT64, copy=False).tobytes() for ids, _ in pairs)
        message.sparse_weights = b"".join(_bytes(weights) for _, weights in pairs)
        message.sparse_counts = [len(ids) for ids, _ in pairs]
    if first.attention is not None:
        layers = sorted(first.attention)
        maps = [item.attention[layer] for item in items if item.attention for layer in layers]
        message.attention = b"".join(_bytes(values) for values in maps)
        message.attention_layers = layers
        message.attention_shapes = [list(values.shape) for values in maps]
    return message


def outcomes(message: Answers) -> list[tuple[int, Outcome]]:
    """The front end's side: each request's results, as views on the message's bytes."""
    count = sum(message.results)
    vectors: list[np.ndarray] | None = None
    if message.vectors is not None and message.vector_rows is not None:
        vectors = _split(message.vectors, message.vector_rows, message.vector_width)
    elif message.vectors is not None:
        vectors = list(_rows(message.vectors, (count, message.vector_width)))
    sparse = _sparse(message)
    outputs: list[Output | None] = (
        list(vectors) if vectors is not None else list(sparse) if sparse else [None] * count
    )
    tokens = _split(message.token_embeddings, message.token_counts, message.hidden_size)
    attention = _attention(message, count)
    items = [
        ItemResult(
            outputs[row],
            tokens[row] if tokens is not None else None,
            attention[row] if attention is not None else None,
        )
        for row in range(count)
    ]
    done = []
    for request, (start, stop), queue_seconds, inference_seconds in zip(
        message.requests,
        _spans(message.results),
        message.queue_seconds,
        message.inference_seconds,
        strict=True,
    ):
        done.append((request, Outcome(items[start:stop], queue_seconds, inference_seconds)))
    return done


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=FLOAT32).tobytes()


def _rows(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(data, dtype=FLOAT32).reshape(shape)


def _split(data: bytes | None, counts: list[int] | None, width: int) -> list[np.ndarray] | None:
    if data is None or counts is None:
        return None
    rows = _rows(data, (sum(counts), width))
    return [rows[start:stop] for start, stop in _spans(counts)]


def _sparse(message: Answers) -> list[tuple[np.ndarray, np.ndarray]] | None:
    if (
        message.sparse_ids is None
        or message.sparse_weights is None
        or message.sparse_counts is None
    ):
        return None
    ids = np.frombuffer(message.sparse_ids, dtype=INT64)
    weights = np.frombuffer(message.sparse_weights, dtype=FLOAT32)
    return [(ids[start:stop], weights[start:stop]) for start, stop in _spans(message.sparse_counts)]


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """Each part's (start, stop) where parts of these sizes lie one after another."""
    return list(itertools.pairwise(itertools.accumulate(counts, initial=0)))


def _attention(message: Answers, count: int) -> list[dict[int, np.ndarray]] | None:
    if (
        message.attention is None
        or message.attention_layers is None
        or not message.attention_shapes
    ):
        return None
    values = np.frombuffer(message.attention, dtype=FLOAT32)
    layers = message.attention_layers
    shapes = iter(message.attention_shapes)
    offset = 0
    per_input: list[dict[int, np.ndarray]] = []
    for _ in range(count):
        maps = {}
        for layer in layers:
            shape = next(shapes)
            size = int(np.prod(shape))
            maps[layer] = values[offset : offset + size].reshape(shape)
            offset += size
        per_input.append(maps)
    return per_input


def failure_error(failure: Failed) -> ServiceError:
    """An engine refuses work (429) or fails it (500): the two errors it raises."""
    if failure.error_type == OverloadedError.error_type:
        return OverloadedError(failure.message, retry_after=failure.retry_after)
    return BackendError(failure.message)
