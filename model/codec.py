"""The text side of a loaded model, without torch: prompts, tokenizing, decoding.

A `ModelCard` is what a front end needs of a model (its description and its tokenizer's
recipe); the engine makes it once and hands it over, across a process boundary where the
two are split, and each front end builds its own `TextCodec` from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.errors import PromptError
from model.info import ModelInfo
from model.tokenizer import Direction, Encoded, TextTokenizer, TokenizerInput, TokenizerSpec
from model.vectors import FloatArray


@dataclass(frozen=True)
class ModelCard:
    info: ModelInfo
    tokenizer: TokenizerSpec
    # An embedding model's vectors of its calibration texts (model/quantization.py).
    calibration: FloatArray | None = None


class TextCodec:
    """Thread-safe, as its tokenizer is."""

    def __init__(self, info: ModelInfo, tokenizer: TextTokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer

    @classmethod
    def from_card(cls, card: ModelCard) -> TextCodec:
        return cls(card.info, card.tokenizer.build())

    @property
    def card(self) -> ModelCard:
        return ModelCard(self.info, self.tokenizer.spec)

    def prompt(self, name: str | None) -> str:
        """The text a prompt name stands for: None is the model's default prompt (if any),
        "" is no prompt."""
        if name is None:
            name = self.info.default_prompt_name
        if not name:
            return ""
        if name not in self.info.prompts:
            known = ", ".join(sorted(self.info.prompts)) or "none"
            raise PromptError(f"unknown prompt_name {name!r} (this model's prompts: {known})")
        return self.info.prompts[name]

    def tokenize(
        self,
        inputs: Sequence[TokenizerInput],
        *,
        truncate: bool = True,
        direction: Direction | None = None,
        prompt_name: str | None = None,
        add_special_tokens: bool = True,
        details: bool = True,
    ) -> list[Encoded]:
        return self.tokenizer.encode(
            inputs,
            truncate=truncate,
            direction=direction,
            add_special_tokens=add_special_tokens,
            prompt=self.prompt(prompt_name),
            details=details,
        )

    def tokenize_whole(self, text: str, prompt_name: str | None = None) -> Encoded:
        """A document's every token, for chunking (app/chunking.py)."""
        return self.tokenizer.encode_whole(text, self.prompt(prompt_name))

    def tokenize_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncate: bool = True,
        direction: Direction | None = None,
    ) -> list[Encoded]:
        """Pairs of texts (a query and a text, for a cross-encoder) by the tokenizer's pair
        template, cut longest-first as transformers does."""
        return self.tokenizer.encode_pairs(pairs, truncate=truncate, direction=direction)

    def decode(self, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        """Token ids back to text, a list per sequence; the ids must be in the vocabulary."""
        return [
            self.tokenizer.decode(sequence, skip_special_tokens=skip_special_tokens)
            for sequence in ids
        ]
