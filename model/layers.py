"""The encoder network, built from the seeds' components.

Attribute names follow the Hugging Face BERT checkpoint keys
(`encoder.layer.0.attention.self.query.weight`, ...), so weights load without a renaming table.

Mask rule, used everywhere: `attention_mask` is (B, T) with 1 for a real token and 0 for
padding; it hides padded *keys* and broadcasts as (B, 1, 1, T) over heads and queries.
When a batch is mostly padding-free the whole network runs on the padded (B, T) grid; when
padding is a large share, position-wise layers (projections, feed-forward, LayerNorm) run on
the N real tokens only, packed as (N, D), and attention runs on the grid.
Dropout is left out: this network only runs inference.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import EncoderConfig


def key_padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 1/0 mask -> (B, 1, 1, T) bool, True where a key may be attended to."""
    return attention_mask.bool()[:, None, None, :]


# Tokens whose feed-forward runs at once on the CPU: the 4x-wide intermediate then stays in
# cache instead of going out to memory and back (1.11-1.20x on long batches, bench/layers.py).
FEED_FORWARD_CHUNK = 1024
# Below this share of padding, gathering and scattering the real tokens costs as much as the
# padded rows save (bench/layers.py, all-MiniLM-L6-v2 on CPU: 0.97x at 4% padding, 0.99x at
# 9%, 1.08x at 17%, 1.73x at 55%).
PACKING_MIN_PADDING = 0.1


@dataclass(frozen=True)
class TokenLayout:
    """Where the real tokens of a padded (B, T) batch sit."""

    batch: int
    width: int
    # Flat positions of the real tokens, (N,); None when the layers run on the whole grid.
    index: Tensor | None
    key_mask: Tensor  # (B, 1, 1, T)

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> TokenLayout:
        batch, width = attention_mask.shape
        flat = attention_mask.reshape(-1).bool()
        padding = 1 - int(flat.sum()) / max(flat.numel(), 1)
        index = flat.nonzero().squeeze(1) if padding >= PACKING_MIN_PADDING else None
        return cls(batch, width, index, key_padding_mask(attention_mask))

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, F) -> (N, F): the real tokens only (all B x T of them when unpacked)."""
        flat = x.reshape(self.batch * self.width, x.shape[-1])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, F) -> (B, T, F); padded positions hold no meaningful values."""
        if self.index is None:
            return x.view(self.batch, self.width, x.shape[-1])
        grid = x.new_zeros(self.batch * self.width, x.shape[-1])
        grid.index_copy_(0, self.index, x)
        return grid.view(self.batch, self.width, x.shape[-1])


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

    def __init__(self, config: EncoderConfig) -> None:
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

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
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
            # Single-segment inputs: every token has type 0.
            x = x + self.token_type_embeddings.weight[0]
        if config.embedding_layer_norm:
            x = self.LayerNorm(x)
        return x


class SelfAttention(nn.Module):
    """Multi-head self-attention with a key padding mask; optionally returns probabilities."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, h: Tensor, layout: TokenLayout, need_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) context, and (B, H, T, T) probabilities if asked."""
        B, T, D = layout.batch, layout.width, h.shape[-1]
        q, k, v = (
            layout.unpack(projection(h)).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
            for projection in (self.query, self.key, self.value)
        )  # (B, H, T, hd) each
        key_mask = layout.key_mask
        probs: Tensor | None = None
        if need_probs:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, T)
            scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
            # Softmax in float32 as the references do; zeroing padded keys afterwards makes a
            # fully padded row all zeros instead of a uniform (or NaN) distribution.
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) * key_mask
            context = probs @ v
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return layout.pack(context.transpose(1, 2).reshape(B, T, D)), probs


class DenseNorm(nn.Module):
    """A sub-layer's output projection and the LayerNorm that goes with its residual."""

    def __init__(self, in_features: int, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class AttentionSublayer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseNorm(config.hidden_size, config)


class Intermediate(nn.Module):
    """First half of the position-wise feed-forward: expand, then GELU or ReLU."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        x = self.dense(x)
        if self.activation == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")


class EncoderBlock(nn.Module):
    """Self-attention and feed-forward, each with a residual and a LayerNorm after or before."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.attention = AttentionSublayer(config)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)

    def forward(
        self, x: Tensor, layout: TokenLayout, need_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        attn = self.attention.output
        if self.norm_first:
            context, probs = self.attention.self(attn.LayerNorm(x), layout, need_probs)
            x = x + attn.dense(context)
        else:
            context, probs = self.attention.self(x, layout, need_probs)
            x = attn.LayerNorm(x + attn.dense(context))
        return self.feed_forward(x), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        """The feed-forward sub-layer with its residual and norm, on (N, D) tokens."""
        rows = x.shape[0]
        if x.device.type != "cpu" or rows <= FEED_FORWARD_CHUNK:
            return self._feed_forward_rows(x)
        out = torch.empty_like(x)
        for start in range(0, rows, FEED_FORWARD_CHUNK):
            stop = start + FEED_FORWARD_CHUNK
            out[start:stop] = self._feed_forward_rows(x[start:stop])
        return out

    def _feed_forward_rows(self, x: Tensor) -> Tensor:
        ffn = self.output
        out: Tensor
        if self.norm_first:
            out = x + ffn.dense(self.intermediate(ffn.LayerNorm(x)))
        else:
            out = ffn.LayerNorm(x + ffn.dense(self.intermediate(x)))
        return out


class EncoderStack(nn.Module):
    """N blocks; pre-norm stacks end with one more LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_hidden_layers))
        if config.norm_first:
            self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, x: Tensor, attention_mask: Tensor, attention_layers: Collection[int] = ()
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """(B, T, D) in and out; padded positions hold no meaningful values."""
        layout = TokenLayout.from_mask(attention_mask)
        h = layout.pack(x)  # (N, D)
        maps: dict[int, Tensor] = {}
        for index, block in enumerate(self.layer):
            h, probs = block(h, layout, index in attention_layers)
            if probs is not None:
                maps[index] = probs  # (B, H, T, T)
        if hasattr(self, "norm"):
            h = self.norm(h)
        return layout.unpack(h), maps


class TransformerEncoder(nn.Module):
    """Embeddings followed by the stacked encoder; returns last hidden states and asked-for maps."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = EncoderStack(config)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, attention_layers: Collection[int] = ()
    ) -> tuple[Tensor, dict[int, Tensor]]:
        x = self.embeddings(input_ids, attention_mask)  # (B, T, D)
        hidden: Tensor
        maps: dict[int, Tensor]
        hidden, maps = self.encoder(x, attention_mask, attention_layers)
        return hidden, maps
