"""The one frozen description of an encoder's architecture."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from model.errors import ConfigError

Activation = Literal["gelu", "gelu_tanh", "relu"]
PositionKind = Literal["learned", "sinusoidal"]

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
# Checkpoint spellings of the activations this encoder implements.
_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class EncoderConfig:
    """Architecture of a BERT-family encoder, or of the seeds' own variant."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    model_type: str = "bert"
    hidden_act: Activation = "gelu"
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    pad_token_id: int = 0
    position_kind: PositionKind = "learned"
    # RoBERTa and XLM-R number positions from pad_token_id + 1, BERT from 0.
    position_offset: int = 0
    # False: residual then LayerNorm after each sub-layer (BERT); True: LayerNorm before
    # each sub-layer and once more after the stack (seed 004, norm_first=True in torch).
    norm_first: bool = False
    embedding_layer_norm: bool = True
    # Seed 004 multiplies token embeddings by sqrt(d_model).
    scale_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.position_kind == "sinusoidal" and self.hidden_size % 2:
            raise ConfigError("sinusoidal positions need an even hidden_size")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """How many tokens the position table can number."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> EncoderConfig:
        """Build from a Hugging Face `config.json`; a missing or unsupported key is named."""
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError(f"{source}: missing key 'model_type'")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for key in _REQUIRED_KEYS:
            if key not in raw:
                raise ConfigError(f"{source}: missing key {key!r}")
            if not isinstance(raw[key], int) or raw[key] <= 0:
                raise ConfigError(f"{source}: key {key!r} must be a positive integer")
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ConfigError(f"{source}: unsupported position_embedding_type {position_type!r}")
        act = raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{source}: unsupported hidden_act {act!r}")
        is_roberta = model_type != "bert"
        pad_token_id = raw.get("pad_token_id", 1 if is_roberta else 0)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            model_type=model_type,
            hidden_act=_ACTIVATIONS[act],
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            type_vocab_size=raw.get("type_vocab_size", 1 if is_roberta else 2),
            pad_token_id=pad_token_id,
            position_offset=pad_token_id + 1 if is_roberta else 0,
        )

    @classmethod
    def seed_variant(
        cls,
        *,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        d_ff: int,
        max_len: int,
        norm_first: bool = True,
        activation: Activation = "relu",
        layer_norm_eps: float = 1e-5,
        pad_token_id: int = 0,
    ) -> EncoderConfig:
        """The seeds' encoder: scaled embeddings, sinusoidal positions, no token types."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=d_model,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=d_ff,
            max_position_embeddings=max_len,
            model_type="seed",
            hidden_act=activation,
            layer_norm_eps=layer_norm_eps,
            type_vocab_size=0,
            pad_token_id=pad_token_id,
            position_kind="sinusoidal",
            norm_first=norm_first,
            embedding_layer_norm=False,
            scale_embeddings=True,
        )
