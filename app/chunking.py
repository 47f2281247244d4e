"""Long texts cut into chunks, and the encoder windows that late chunking runs them in.

A chunk is a run of a text's tokens, at most `size` of them, ending where a sentence ends
when one does in its second half, and overlapping the previous chunk by `overlap` tokens.
`independent` embeds each chunk's text on its own; `late` runs the whole text through the
encoder (in overlapping windows where it is longer than the model takes) and pools each
chunk's token vectors, so that every chunk's vector has seen its context. No torch here:
the engine pools (app/engine/protocol.py's `LateDocument`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.protocol import LateDocument
from app.errors import PayloadTooLargeError
from app.limits import chunk_size
from app.params import ChunkOptions
from model.tokenizer import Encoded

# Marks that end a sentence when whitespace follows them, and full-width ones that end it
# whatever follows (Chinese and Japanese put no space after a sentence).
SENTENCE_ENDS = frozenset(".!?;:")
FULL_WIDTH_ENDS = frozenset("\u3002\uff01\uff1f\uff1b")


@dataclass(frozen=True, slots=True)
class Chunk:
    start: int  # characters of the text as sent (without the prompt), end exclusive
    end: int
    first: int  # positions in the whole text's tokens, stop exclusive
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.first


@dataclass(frozen=True, slots=True)
class Content:
    """Where a tokenized text's own tokens lie: after the leading special tokens and the
    prompt's, before the trailing special tokens."""

    first: int
    stop: int

    @classmethod
    def of(cls, encoded: Encoded, prompt_chars: int) -> Content:
        """By the offsets: the text's first token is the first that ends past the prompt (a
        byte-level tokenizer may fold the prompt's last space into it)."""
        assert encoded.offsets is not None, "a text's tokens have offsets"
        first = 0
        while first < len(encoded.ids) and (
            encoded.special[first] or encoded.offsets[first][1] <= prompt_chars
        ):
            first += 1
        stop = len(encoded.ids)
        while stop > first and encoded.special[stop - 1]:
            stop -= 1
        return cls(first, stop)

    def around(self, encoded: Encoded) -> int:
        """Tokens that are not the text's own: special tokens and the prompt's."""
        return len(encoded.ids) - (self.stop - self.first)


@dataclass(frozen=True, slots=True)
class TextPlan:
    """A text's tokens, where its own lie among them, and its chunks."""

    document: Encoded
    content: Content
    chunks: list[Chunk]


def plan_texts(
    documents: Sequence[Encoded],
    texts: Sequence[str],
    prompt_chars: int,
    chunking: ChunkOptions,
    limit: int,
    most: tuple[int, int],
) -> list[TextPlan]:
    """Each text's chunks, each at most as many tokens as the model takes (`limit`) beside
    its special tokens and the prompt. `most`: chunks per text and per request, past which
    planning stops with a 413; 422 for an overlap not below the size asked."""
    contents = [Content.of(document, prompt_chars) for document in documents]
    room = limit - contents[0].around(documents[0])  # the same around every text
    size, overlap = chunk_size(chunking.size, chunking.overlap, max(room, 1))
    per_text, per_request = most
    plans: list[TextPlan] = []
    left = per_request
    for index, (document, content, text) in enumerate(zip(documents, contents, texts, strict=True)):
        chunks = plan_chunks(
            document, content, text, prompt_chars, (size, overlap), min(per_text, left)
        )
        if len(chunks) > per_text:
            raise PayloadTooLargeError(
                f"input {index} makes more than {per_text} chunks, the limit per input; send "
                "a shorter text or ask for larger chunks"
            )
        left -= len(chunks)
        if left < 0:
            raise PayloadTooLargeError(
                f"the request makes more than {per_request} chunks, the limit per request"
            )
        plans.append(TextPlan(document, content, chunks))
    return plans


def plan_chunks(
    encoded: Encoded,
    content: Content,
    text: str,
    prompt_chars: int,
    size_and_overlap: tuple[int, int],
    most: int,
) -> list[Chunk]:
    """The chunks of `text`, whose tokens (with the prompt of `prompt_chars` characters in
    front) are `encoded`, up to one past `most`. A chunk ends at the last sentence end, else
    the last word start, in its second half (and past the overlap), else after `size`."""
    assert encoded.offsets is not None, "a text's tokens have offsets"
    size, overlap = size_and_overlap
    offsets = encoded.offsets
    chunks: list[Chunk] = []
    first = content.first
    while first < content.stop and len(chunks) <= most:
        stop = min(first + size, content.stop)
        if stop < content.stop:
            # Never at or before first + overlap: the next chunk then starts past this one's.
            lowest = first + max(size // 2, overlap)
            stop = _best_end(text, offsets, range(stop, lowest, -1), prompt_chars) or stop
        start = max(offsets[first][0] - prompt_chars, 0)
        end = offsets[stop - 1][1] - prompt_chars
        chunks.append(Chunk(start, end, first, stop))
        if stop == content.stop:
            break
        first = max(stop - overlap, first + 1)
    return chunks


def _best_end(
    text: str, offsets: list[tuple[int, int]], candidates: range, prompt_chars: int
) -> int | None:
    """The last candidate where a sentence begins, else the last where a word begins."""
    word = None
    for position in candidates:
        before = offsets[position - 1][1] - prompt_chars
        gap = text[before : offsets[position][0] - prompt_chars]
        mark = text[before - 1] if before > 0 else ""
        if "\n" in gap or mark in FULL_WIDTH_ENDS or (gap.isspace() and mark in SENTENCE_ENDS):
            return position
        if word is None and gap and gap.isspace():
            word = position
    return word


def late_inputs(
    plans: Sequence[TextPlan], limit: int
) -> tuple[list[Encoded], tuple[LateDocument, ...]]:
    """Every text's windows, one after another, and how each text's chunks are pooled from
    them; a text without chunks (whitespace or special tokens alone) runs nothing."""
    inputs: list[Encoded] = []
    documents = []
    for plan in plans:
        if plan.chunks:
            windows, document = late_windows(plan.document, plan.content, plan.chunks, limit)
            inputs += windows
            documents.append(document)
    return inputs, tuple(documents)


def late_windows(
    encoded: Encoded, content: Content, chunks: list[Chunk], limit: int
) -> tuple[list[Encoded], LateDocument]:
    """The encoder inputs for a late-chunked text: the text whole where its tokens fit in
    `limit`, else overlapping windows of its content, each with the leading tokens (special
    and prompt) and trailing special tokens around it. Each window keeps the token vectors
    of its middle: in an overlap, a token's vector comes from the window where it has the
    most context on both sides."""
    spans = tuple((chunk.first, chunk.stop) for chunk in chunks)
    total = len(encoded.ids)
    if total <= limit:
        return [encoded], LateDocument(((0, total),), spans)
    head, tail = encoded.ids[: content.first], encoded.ids[content.stop :]
    width = limit - len(head) - len(tail)  # content tokens per window
    # A quarter of each window overlaps the next: its tokens keep that much context.
    stride = max(width - width // 4, 1)
    starts = [*range(content.first, content.stop - width, stride), content.stop - width]
    windows: list[Encoded] = []
    keeps: list[tuple[int, int]] = []
    for index, start in enumerate(starts):
        end = start + width
        ids = head + encoded.ids[start:end] + tail
        windows.append(Encoded(ids, False, encoded.prompt_length))
        # Positions of the whole text this window gives: those nearer its centre than any
        # other window's (the later window's on a tie).
        lower = 0 if index == 0 else (start + starts[index - 1] + width + 1) // 2
        upper = total if index == len(starts) - 1 else (starts[index + 1] + end + 1) // 2
        keeps.append(
            (_local(lower, start, head, content, width), _local(upper, start, head, content, width))
        )
    return windows, LateDocument(tuple(keeps), spans)


def _local(position: int, start: int, head: list[int], content: Content, width: int) -> int:
    """A position of the whole text's tokens as a position in the window whose content
    begins at `start` (the leading and trailing tokens map to the window's own)."""
    if position <= content.first:
        return position
    if position >= content.stop:
        return len(head) + width + (position - content.stop)
    return len(head) + position - start
