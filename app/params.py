"""A request's internal parameters: what the protocol (schemas.py) hands the serving layer.

Plain frozen dataclasses, so that the protocol types and the serving layer both depend on
this module and never on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from model import Direction

RawInput = str | list[int]
# Two texts scored together by a cross-encoder (a query and a passage, say).
TextPair = tuple[str, str]


@dataclass(frozen=True, slots=True)
class AttentionQuery:
    """Attention maps as a request asks for them: indices may count from the end, None is
    all of them; the serving layer resolves them against the model."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    mean: bool = False


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    truncate: bool | None = None  # None: the server's auto_truncate
    direction: Direction | None = None  # None: the model's truncation side
    prompt_name: str | None = None  # None: the model's default prompt; "": none
    normalize: bool = True
    dimensions: int | None = None
    pooled: bool = True
    token_embeddings: bool = False
    attention: AttentionQuery | None = None
    # Each input's tokens and offsets, kept for a route that shows them; the others need only
    # the ids, which the tokenizer finds faster for texts sent together without tracking
    # offsets.
    token_details: bool = False


ChunkMode = Literal["independent", "late"]


@dataclass(frozen=True, slots=True)
class ChunkOptions:
    """How long texts are cut into chunks (app/chunking.py)."""

    mode: ChunkMode = "late"
    size: int | None = None  # tokens per chunk; None: as many as the model takes, up to 256
    overlap: int = 0  # tokens each chunk shares with the one before
