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
from app.limits import chunk_size
from app.params import ChunkOptions
from model.tokenizer import Encoded

# Characters that end a sentence when whitespace follows them.
SENTENCE_ENDS = frozenset(".!?;:\u3002\uff01\uff1f")


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
    def of(cls, encoded: Encoded) -> Content:
        first = encoded.prompt_length
        while first < len(encoded.ids) and encoded.special[first]:
            first += 1
        stop = len(encoded.ids)
        while stop > first and encoded.special[stop - 1]:
            stop -= 1
        return cls(first, stop)


def plan_texts(
    documents: Sequence[Encoded],
    texts: Sequence[str],
    prompt_chars: int,
    chunking: ChunkOptions,
    limit: int,
) -> list[list[Chunk]]:
    """Each text's chunks, at most as many tokens as the model takes (`limit`) beside its
    special tokens and the prompt; 422 for an overlap not below the size asked."""
    first = documents[0]  # every text of a request has the same special tokens and prompt
    content = Content.of(first)
    room = limit - content.first - (len(first.ids) - content.stop)
    size, overlap = chunk_size(chunking.size, chunking.overlap, max(room, 1))
    return [
        plan_chunks(document, text, prompt_chars, size, overlap)
        for document, text in zip(documents, texts, strict=True)
    ]


def plan_chunks(
    encoded: Encoded, text: str, prompt_chars: int, size: int, overlap: int
) -> list[Chunk]:
    """The chunks of `text`, whose tokens (with the prompt of `prompt_chars` characters in
    front) are `encoded`; `overlap` < `size`."""
    assert encoded.offsets is not None, "a text's tokens have offsets"
    offsets = encoded.offsets
    content = Content.of(encoded)
    chunks: list[Chunk] = []
    first = content.first
    while first < content.stop:
        stop = min(first + size, content.stop)
        if stop < content.stop:
            later_half = range(stop, first + size // 2, -1)
            ends = (p for p in later_half if _starts_sentence(text, offsets, p, prompt_chars))
            stop = next(ends, stop)
        start, end = offsets[first][0] - prompt_chars, offsets[stop - 1][1] - prompt_chars
        chunks.append(Chunk(start, end, first, stop))
        if stop == content.stop:
            break
        first = max(stop - overlap, first + 1)
    return chunks


def _starts_sentence(
    text: str, offsets: list[tuple[int, int]], position: int, prompt_chars: int
) -> bool:
    """Whether the token at `position` begins a sentence: a line break before it, or a
    sentence's closing mark and whitespace."""
    before = offsets[position - 1][1] - prompt_chars
    gap = text[before : offsets[position][0] - prompt_chars]
    if "\n" in gap:
        return True
    return bool(gap) and gap.isspace() and before > 0 and text[before - 1] in SENTENCE_ENDS


def late_inputs(
    documents: Sequence[Encoded], chunks: Sequence[list[Chunk]], limit: int
) -> tuple[list[Encoded], tuple[LateDocument, ...]]:
    """Every text's windows, one after another, and how each text's chunks are pooled from
    them; a text without chunks (whitespace or special tokens alone) runs nothing."""
    inputs: list[Encoded] = []
    plans = []
    for document, own in zip(documents, chunks, strict=True):
        if own:
            windows, plan = late_windows(document, own, limit)
            inputs += windows
            plans.append(plan)
    return inputs, tuple(plans)


def late_windows(
    encoded: Encoded, chunks: list[Chunk], limit: int
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
    content = Content.of(encoded)
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
        windows.append(Encoded(ids, [], None, [], False, encoded.prompt_length))
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
