"""MPNet (all-mpnet-base-v2 and its kin): BERT's post-norm blocks plus a relative position bias.

Attribute names follow the Hugging Face checkpoint keys
(`encoder.layer.0.attention.attn.q.weight`, ...), so weights load without a renaming table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation, activate
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.packing import TokenLayout, in_row_chunks

# transformers numbers positions from 2 whatever `pad_token_id` says: its embeddings hard-code
# padding_idx 1 and give real tokens padding_idx + 1, + 2, ...
POSITION_OFFSET = 2
# transformers always buckets with these values; `relative_attention_num_buckets` only sizes
# the bias table, so any other value is refused rather than half honoured.
NUM_BUCKETS = 32
MAX_DISTANCE = 128


@dataclass(frozen=True, kw_only=True)
class MPNetConfig(EncoderConfig):
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("mpnet.",)

    intermediate_size: int
    max_position_embeddings: int
    hidden_act: Activation = "gelu"
    layer_norm_eps: float = 1e-12

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings - POSITION_OFFSET

    @property
    def positions(self) -> str:
        return "learned + relative buckets"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> MPNetConfig:
        config.expect("relative_attention_num_buckets", NUM_BUCKETS, NUM_BUCKETS)
        return cls(
            model_type="mpnet",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=config.positive_int("num_hidden_layers"),
            num_attention_heads=config.positive_int("num_attention_heads"),
            pad_token_id=config.integer("pad_token_id", 1),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings"),
            hidden_act=config.choice("hidden_act", ACTIVATIONS, "gelu"),
            layer_norm_eps=config.number("layer_norm_eps", 1e-12),
        )

    def build(self) -> MPNetEncoder:
        return MPNetEncoder(self)


def relative_position_bucket(relative: Tensor) -> Tensor:
    """(T, T) key position - query position -> bucket: one half of the buckets per direction,
    exact distances below a quarter of them, log-spaced up to MAX_DISTANCE beyond."""
    half = NUM_BUCKETS // 2
    exact = half // 2
    distance = -relative
    bucket = (distance < 0).long() * half
    distance = distance.abs()
    # log(0) is -inf for distance 0; that lane is never selected below.
    spread = torch.log(distance.float() / exact) / math.log(MAX_DISTANCE / exact) * (half - exact)
    far = (exact + spread.long()).clamp(max=half - 1)
    return bucket + torch.where(distance < exact, distance, far)


class Embeddings(nn.Module):
    """Token + position embeddings, then LayerNorm; positions count real tokens from 2."""

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        mask = attention_mask.long()
        positions = torch.cumsum(mask, dim=1) * mask + POSITION_OFFSET - 1  # padding: 1
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)  # (B, T, D)
        out: Tensor = self.LayerNorm(x)
        return out


class SelfAttention(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.q = nn.Linear(size, size)
        self.k = nn.Linear(size, size)
        self.v = nn.Linear(size, size)
        self.o = nn.Linear(size, size)


class AttentionSublayer(nn.Module):
    """Self-attention with the shared position bias, then residual and LayerNorm."""

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, h: Tensor, layout: TokenLayout, bias: Tensor, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out; `bias` is (1, H, T, T)."""
        attn = self.attn
        q, k, v = (
            layout.heads(projection(h), attn.num_heads) for projection in (attn.q, attn.k, attn.v)
        )  # (B, H, T, hd) each
        context, probs = attend(q, k, v, layout.key_mask, bias=bias, map_heads=map_heads)
        out: Tensor = self.LayerNorm(h + attn.o(layout.merge_heads(context)))
        return out, probs


class Intermediate(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class Output(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class Layer(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.attention = AttentionSublayer(config)
        self.intermediate = Intermediate(config)
        self.output = Output(config)
        self.activation = config.hidden_act

    def forward(
        self, x: Tensor, layout: TokenLayout, bias: Tensor, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        x, probs = self.attention(x, layout, bias, map_heads)
        return in_row_chunks(self.feed_forward, x), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        expanded = activate(self.intermediate.dense(x), self.activation)
        out: Tensor = self.output.LayerNorm(x + self.output.dense(expanded))
        return out


class Stack(nn.Module):
    """The layers, and the bias table they share (one value per bucket and head)."""

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.relative_attention_bias = nn.Embedding(NUM_BUCKETS, config.num_attention_heads)

    def position_bias(self, width: int) -> Tensor:
        """(1, H, T, T) score bias from each key's offset to each query. Offsets count grid
        positions, which are token positions because every row starts at 0 (right padding)."""
        position = torch.arange(width, device=self.relative_attention_bias.weight.device)
        buckets = relative_position_bucket(position[None, :] - position[:, None])  # (T, T)
        bias: Tensor = self.relative_attention_bias(buckets)  # (T, T, H)
        return bias.permute(2, 0, 1).unsqueeze(0)


class MPNetEncoder(Encoder):
    """Embeddings followed by the layers; MPNet has no token types, so any given are ignored."""

    config: MPNetConfig

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Stack(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        h = layout.pack(self.embeddings(input_ids, attention_mask))  # (N, D)
        bias = self.encoder.position_bias(input_ids.shape[1])  # computed once, for all layers
        h, kept = run_layers(self.encoder.layer, h, layout, maps, lambda index: (bias,))
        return EncoderOutput(layout.unpack(h), kept)
