"""BERT, RoBERTa, XLM-R, and the seeds' own variant of the encoder.

Attribute names follow the Hugging Face BERT checkpoint keys
(`encoder.layer.0.attention.self.query.weight`, ...), so weights load without a renaming table.
Dropout is left out: this network only runs inference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.prepacked import linear_activated, linear_plus

PositionKind = Literal["learned", "sinusoidal"]


@dataclass(frozen=True, kw_only=True)
class BertConfig(EncoderConfig):
    """Architecture of a BERT-family encoder, or of the seeds' own variant."""

    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("bert.", "roberta.")

    intermediate_size: int
    max_position_embeddings: int
    hidden_act: Activation = "gelu"
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
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
        super().__post_init__()
        if self.position_kind == "sinusoidal" and self.hidden_size % 2:
            raise ConfigError("sinusoidal positions need an even hidden_size")

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @property
    def positions(self) -> str:
        return self.position_kind

    @classmethod
    def from_hf(cls, config: ConfigReader) -> BertConfig:
        model_type = str(config.raw["model_type"])
        config.expect("position_embedding_type", "absolute", "absolute")
        # transformers runs a decoder's self-attention causally: each token sees only those
        # before it. This encoder attends both ways.
        config.expect("is_decoder", False, False)
        is_roberta = model_type != "bert"
        pad_token_id = config.integer("pad_token_id", 1 if is_roberta else 0)
        return cls(
            model_type=model_type,
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=config.positive_int("num_hidden_layers"),
            num_attention_heads=config.positive_int("num_attention_heads"),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings"),
            hidden_act=config.choice("hidden_act", ACTIVATIONS, "gelu"),
            layer_norm_eps=config.number("layer_norm_eps", 1e-12),
            type_vocab_size=config.integer("type_vocab_size", 1 if is_roberta else 2),
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
    ) -> BertConfig:
        """The seeds' encoder: scaled embeddings, sinusoidal positions, no token types."""
        return cls(
            model_type="seed",
            vocab_size=vocab_size,
            hidden_size=d_model,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=d_ff,
            max_position_embeddings=max_len,
            hidden_act=activation,
            layer_norm_eps=layer_norm_eps,
            type_vocab_size=0,
            pad_token_id=pad_token_id,
            position_kind="sinusoidal",
            norm_first=norm_first,
            embedding_layer_norm=False,
            scale_embeddings=True,
        )

    def build(self) -> TransformerEncoder:
        return TransformerEncoder(self)


def sinusoidal_table(length: int, d_model: int) -> Tensor:
    """Seed 004's positional encoding: sin on even features, cos on odd ones."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)
    return table


class Embeddings(nn.Module):
    """Token (optionally scaled) + position (+ token type) embeddings, then LayerNorm for BERT."""

    sinusoidal_positions: Tensor

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_kind == "learned":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size
            )
        else:
            table = sinusoidal_table(config.max_position_embeddings, config.hidden_size)
            self.register_buffer("sinusoidal_positions", table, persistent=False)
        if config.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        if config.embedding_layer_norm:
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.embedding_scale = math.sqrt(config.hidden_size) if config.scale_embeddings else 1.0

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None
    ) -> Tensor:
        config = self.config
        x: Tensor = self.word_embeddings(input_ids)  # (B, T, D)
        if config.scale_embeddings:
            x = x * self.embedding_scale
        if config.position_kind == "learned":
            if config.position_offset:
                # RoBERTa numbers real tokens from pad_token_id + 1; padding gets pad_token_id.
                mask = attention_mask.long()
                positions = torch.cumsum(mask, dim=1) * mask + config.pad_token_id
                x = x + self.position_embeddings(positions)
            else:
                x = x + self.position_embeddings.weight[: input_ids.shape[1]]
        else:
            x = x + self.sinusoidal_positions[: input_ids.shape[1]]
        if config.type_vocab_size:
            if token_type_ids is None:  # one segment: every token has type 0
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        if config.embedding_layer_norm:
            x = self.LayerNorm(x)
        return x


class SelfAttention(nn.Module):
    """Multi-head self-attention with a key padding mask; optionally returns probabilities.

    The query, key and value projections run as one (D, 3D) matrix product: one pass over the
    tokens instead of three, and a third of the parallel regions, which is what a short input
    pays for. Checkpoints hold them as three Linear layers (`query`, `key`, `value`); the
    state-dict hooks below join them on loading and split them when the state is read, so
    the names outside this module stay the checkpoint's.
    """

    PARTS = ("query", "key", "value")

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        # torch leaves both registration methods unannotated.
        self.register_state_dict_post_hook(_split_projections)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_join_projections)  # type: ignore[no-untyped-call]

    def forward(
        self, h: Tensor, layout: TokenLayout, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) context, and (B, h, T, T) probabilities if asked."""
        q, k, v = layout.heads(self.qkv(h), 3 * self.num_heads).chunk(3, dim=1)  # (B, H, T, hd)
        context, probs = attend(q, k, v, layout.key_mask, map_heads=map_heads)
        return layout.merge_heads(context), probs


def _split_projections(
    module: nn.Module, state: dict[str, Tensor], prefix: str, metadata: object
) -> None:
    """`qkv.weight` -> `query.weight`, `key.weight`, `value.weight` (and the biases)."""
    for name in ("weight", "bias"):
        joined = state.pop(f"{prefix}qkv.{name}")
        for part, piece in zip(SelfAttention.PARTS, joined.chunk(3), strict=True):
            state[f"{prefix}{part}.{name}"] = piece


def _join_projections(
    module: nn.Module, state: dict[str, Tensor], prefix: str, *args: object
) -> None:
    """The inverse, before loading; keys that are absent are left for load_state_dict to
    report as missing."""
    for name in ("weight", "bias"):
        keys = [f"{prefix}{part}.{name}" for part in SelfAttention.PARTS]
        if all(key in state for key in keys):
            state[f"{prefix}qkv.{name}"] = torch.cat([state.pop(key) for key in keys])


class DenseNorm(nn.Module):
    """A sub-layer's output projection and the LayerNorm that goes with its residual."""

    def __init__(self, in_features: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class AttentionSublayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseNorm(config.hidden_size, config)


class Intermediate(nn.Module):
    """First half of the position-wise feed-forward: expand, then GELU or ReLU."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        return linear_activated(self.dense, x, self.activation)


class EncoderBlock(nn.Module):
    """Self-attention and feed-forward, each with a residual and a LayerNorm after or before."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.attention = AttentionSublayer(config)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)

    def forward(
        self, x: Tensor, layout: TokenLayout, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        attn = self.attention.output
        if self.norm_first:
            context, probs = self.attention.self(attn.LayerNorm(x), layout, map_heads)
            x = linear_plus(attn.dense, context, x)
        else:
            context, probs = self.attention.self(x, layout, map_heads)
            x = attn.LayerNorm(linear_plus(attn.dense, context, x))
        return in_row_chunks(self.feed_forward, x), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        """The feed-forward sub-layer with its residual and norm, on (N, D) tokens."""
        ffn = self.output
        out: Tensor
        if self.norm_first:
            out = linear_plus(ffn.dense, self.intermediate(ffn.LayerNorm(x)), x)
        else:
            out = ffn.LayerNorm(linear_plus(ffn.dense, self.intermediate(x), x))
        return out


class EncoderStack(nn.Module):
    """N blocks; pre-norm stacks end with one more LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_hidden_layers))
        if config.norm_first:
            self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, x: Tensor, attention_mask: Tensor, maps: MapRequest = NO_MAPS
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """(B, T, D) in and out; padded positions hold no meaningful values."""
        layout = TokenLayout.from_mask(attention_mask)
        h = layout.pack(x)  # (N, D)
        h, kept = run_layers(self.layer, h, layout, maps)
        if hasattr(self, "norm"):
            h = self.norm(h)
        return layout.unpack(h), kept


class TransformerEncoder(Encoder):
    """Embeddings followed by the stacked encoder."""

    config: BertConfig

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = EncoderStack(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        x = self.embeddings(input_ids, attention_mask, token_type_ids)  # (B, T, D)
        hidden, kept = self.encoder(x, attention_mask, maps or NO_MAPS)
        return EncoderOutput(hidden, kept)

    def reset_buffers(self) -> None:
        config = self.config
        if config.position_kind == "sinusoidal":
            table = sinusoidal_table(config.max_position_embeddings, config.hidden_size)
            self.embeddings.sinusoidal_positions = table
