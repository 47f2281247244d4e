"""The messages between front ends and engines in other processes, as msgpack (msgspec),
each framed by its length on a Unix stream socket.

Front end to engine: `Submit` (one request's token ids and what it wants back) and `Abort`.
Engine to front end: `Reply`, whose arrays travel as raw little-endian bytes and become numpy
views on the front end, never Python lists. No torch here.
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
    payload = encoder.encode(message)
    return HEADER.pack(len(payload)) + payload


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
    left: float  # seconds left of the request's time, when it was sent
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


class Failure(msgspec.Struct, array_like=True):
    error_type: str
    message: str
    retry_after: int = 0


class Reply(msgspec.Struct, array_like=True):
    request: int
    failure: Failure | None = None
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0
    # (N, D): every input's output vector (an embedding's, a classifier's logits).
    vectors: bytes | None = None
    vector_width: int = 0
    # Late chunking: each document's rows of `vectors`, one per chunk.
    vector_rows: list[int] | None = None
    # Per-token vectors: every input's rows, one after another, and their counts.
    token_embeddings: bytes | None = None
    token_counts: list[int] | None = None
    hidden_size: int = 0
    # SPLADE: each input's vocabulary ids and weights, one after another, and their counts.
    sparse_ids: bytes | None = None
    sparse_weights: bytes | None = None
    sparse_counts: list[int] | None = None
    # Attention: per input, per layer (in `attention_layers` order), one after another.
    attention: bytes | None = None
    attention_layers: list[int] | None = None
    attention_shapes: list[list[int]] | None = None


ToEngine = Submit | Abort
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


def submit_message(request: int, left: float, encoded: Sequence[Encoded], wants: Wants) -> Submit:
    attention = wants.attention
    has_types = any(e.type_ids for e in encoded)
    return Submit(
        request,
        left,
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
        Encoded(ids, [], None, [], False, prompt, type_ids)
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


def failure_reply(request: int, error: ServiceError) -> Reply:
    retry_after = error.retry_after if isinstance(error, OverloadedError) else 0
    return Reply(request, Failure(error.error_type, error.message, retry_after))


def outcome_reply(request: int, outcome: Outcome) -> Reply:
    items = outcome.items
    reply = Reply(request, None, outcome.queue_seconds, outcome.inference_seconds)
    first = items[0]
    if isinstance(first.output, np.ndarray):
        reply.vectors = b"".join(_bytes(item.vector) for item in items)
        reply.vector_width = first.output.shape[-1]
        if first.output.ndim == 2:  # late chunking's (chunks, D) per document
            reply.vector_rows = [len(item.vector) for item in items]
    if first.token_embeddings is not None:
        states = [item.token_embeddings for item in items if item.token_embeddings is not None]
        reply.token_embeddings = b"".join(_bytes(rows) for rows in states)
        reply.token_counts = [len(rows) for rows in states]
        reply.hidden_size = states[0].shape[-1]
    if isinstance(first.output, tuple):
        pairs = [item.sparse for item in items]
        reply.sparse_ids = b"".join(ids.astype(INT64, copy=False).tobytes() for ids, _ in pairs)
        reply.sparse_weights = b"".join(_bytes(weights) for _, weights in pairs)
        reply.sparse_counts = [len(ids) for ids, _ in pairs]
    if first.attention is not None:
        layers = sorted(first.attention)
        maps = [item.attention[layer] for item in items if item.attention for layer in layers]
        reply.attention = b"".join(_bytes(values) for values in maps)
        reply.attention_layers = layers
        reply.attention_shapes = [list(values.shape) for values in maps]
    return reply


def reply_outcome(reply: Reply, count: int) -> Outcome | ServiceError:
    """The front end's side: the request's `count` results as views on the reply's bytes."""
    if reply.failure is not None:
        return _error(reply.failure)
    vectors: list[np.ndarray] | None = None
    if reply.vectors is not None and reply.vector_rows is not None:
        vectors = _split(reply.vectors, reply.vector_rows, reply.vector_width)
    elif reply.vectors is not None:
        vectors = list(_rows(reply.vectors, (count, reply.vector_width)))
    sparse = _sparse(reply)
    outputs: list[Output | None] = (
        list(vectors) if vectors is not None else list(sparse) if sparse else [None] * count
    )
    tokens = _split(reply.token_embeddings, reply.token_counts, reply.hidden_size)
    attention = _attention(reply, count)
    items = [
        ItemResult(
            outputs[row],
            tokens[row] if tokens is not None else None,
            attention[row] if attention is not None else None,
        )
        for row in range(count)
    ]
    return Outcome(items, reply.queue_seconds, reply.inference_seconds)


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=FLOAT32).tobytes()


def _rows(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(data, dtype=FLOAT32).reshape(shape)


def _split(data: bytes | None, counts: list[int] | None, width: int) -> list[np.ndarray] | None:
    if data is None or counts is None:
        return None
    rows = _rows(data, (sum(counts), width))
    return [rows[start:stop] for start, stop in _spans(counts)]


def _sparse(reply: Reply) -> list[tuple[np.ndarray, np.ndarray]] | None:
    if reply.sparse_ids is None or reply.sparse_weights is None or reply.sparse_counts is None:
        return None
    ids = np.frombuffer(reply.sparse_ids, dtype=INT64)
    weights = np.frombuffer(reply.sparse_weights, dtype=FLOAT32)
    return [(ids[start:stop], weights[start:stop]) for start, stop in _spans(reply.sparse_counts)]


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """Each part's (start, stop) where parts of these sizes lie one after another."""
    return list(itertools.pairwise(itertools.accumulate(counts, initial=0)))


def _attention(reply: Reply, count: int) -> list[dict[int, np.ndarray]] | None:
    if reply.attention is None or reply.attention_layers is None or not reply.attention_shapes:
        return None
    values = np.frombuffer(reply.attention, dtype=FLOAT32)
    layers = reply.attention_layers
    shapes = iter(reply.attention_shapes)
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


def _error(failure: Failure) -> ServiceError:
    """An engine refuses work (429) or fails it (500): the two errors it raises."""
    if failure.error_type == OverloadedError.error_type:
        return OverloadedError(failure.message, retry_after=failure.retry_after)
    return BackendError(failure.message)
