"""Tokenization over the `tokenizers` library: truncation side, truncated flag, offsets, ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Encoding, Tokenizer

from model.errors import InputTooLongError, TokenIdError

Direction = Literal["right", "left"]
TokenizerInput = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input after tokenization (and truncation)."""

    ids: list[int]
    tokens: list[str]
    # Character offsets into the input text; None for pre-tokenized input.
    offsets: list[tuple[int, int]] | None
    special: list[bool]
    truncated: bool


class TextTokenizer:
    """Thread-safe: each truncation setting has its own immutable `Tokenizer`."""

    def __init__(self, tokenizer_json: str, max_length: int, vocab_size: int) -> None:
        self.max_length = max_length
        self.vocab_size = vocab_size
        self._untruncated = self._configured(tokenizer_json, None)
        self._truncating: dict[Direction, Tokenizer] = {
            "right": self._configured(tokenizer_json, "right"),
            "left": self._configured(tokenizer_json, "left"),
        }
        added = self._untruncated.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)

    @classmethod
    def from_file(cls, path: Path, max_length: int, vocab_size: int) -> TextTokenizer:
        return cls(path.read_text(encoding="utf-8"), max_length, vocab_size)

    def _configured(self, tokenizer_json: str, direction: Direction | None) -> Tokenizer:
        # tokenizer.json files often carry padding and truncation from training; drop both.
        tokenizer = Tokenizer.from_str(tokenizer_json)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        if direction is not None:
            tokenizer.enable_truncation(self.max_length, direction=direction)
        return tokenizer

    def encode(
        self,
        inputs: Sequence[TokenizerInput],
        *,
        truncate: bool = True,
        direction: Direction = "right",
        add_special_tokens: bool = True,
    ) -> list[Encoded]:
        """Texts go through the tokenizer in one batch call; id lists are checked and cut."""
        texts = [(i, item) for i, item in enumerate(inputs) if isinstance(item, str)]
        results: list[Encoded | None] = [None] * len(inputs)
        tokenizer = self._truncating[direction] if truncate else self._untruncated
        batch = [text for _, text in texts]
        encodings = (
            tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens) if texts else []
        )
        for (index, _), encoding in zip(texts, encodings, strict=True):
            results[index] = self._from_encoding(index, encoding)
        for index, item in enumerate(inputs):
            if not isinstance(item, str):
                results[index] = self._from_ids(index, item, truncate, direction)
        return [result for result in results if result is not None]

    def _from_encoding(self, index: int, encoding: Encoding) -> Encoded:
        if len(encoding.ids) > self.max_length:
            raise InputTooLongError(index, len(encoding.ids), self.max_length)
        return Encoded(
            ids=encoding.ids,
            tokens=encoding.tokens,
            offsets=encoding.offsets,
            special=[bool(flag) for flag in encoding.special_tokens_mask],
            truncated=bool(encoding.overflowing),
        )

    def _from_ids(
        self, index: int, ids: Sequence[int], truncate: bool, direction: Direction
    ) -> Encoded:
        for position, token_id in enumerate(ids):
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise TokenIdError(
                    f"input {index}: token id {token_id!r} at position {position} is outside "
                    f"the vocabulary [0, {self.vocab_size})",
                    index,
                )
        kept = list(ids)
        if len(kept) > self.max_length:
            if not truncate:
                raise InputTooLongError(index, len(kept), self.max_length)
            # A plain cut: ids are taken as the caller made them, so a right cut drops their
            # closing special token rather than guessing which id that is.
            kept = kept[: self.max_length] if direction == "right" else kept[-self.max_length :]
        return Encoded(
            ids=kept,
            tokens=[self._untruncated.id_to_token(i) or "" for i in kept],
            offsets=None,
            special=[i in self._special_ids for i in kept],
            truncated=len(kept) < len(ids),
        )
