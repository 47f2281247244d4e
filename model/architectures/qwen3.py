"""Qwen3 (Qwen3-Embedding): a decoder run as an encoder, its last token pooled.

Pre-norm blocks with RMSNorm, grouped-query attention (`num_key_value_heads` key and value
heads shared by the query heads) over an explicit `head_dim`, an RMSNorm on each query and key
head before rotary positions, and a SwiGLU feed-forward. Attention is causal: each token sees
itself and the tokens before it, and never padding.

Qwen3-Embedding folders ask for left padding (`padding_side` in tokenizer_config.json); this
server pads on the right and gets the same vectors. A real token's state depends only on the
real tokens up to it (causal attention, padded keys hidden), and rotary positions enter the
scores only as the distance between query and key, which left padding shifts for both alike.
Last-token pooling then reads the last real token wherever it sits (tests/model/test_qwen3.py).

Attribute names follow the checkpoint keys of transformers' Qwen3Model
(`layers.0.self_attn.q_proj.weight`, ...), so weights load without a renaming table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, Mask, attend
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.rotary import rotary_tables, rotate


@dataclass(frozen=True, kw_only=True)
class Qwen3Config(EncoderConfig):
    # Qwen3ForCausalLM (the class Qwen3-Embedding's config.json names) keeps the encoder there.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("model.",)

    intermediate_size: int
    max_position_embeddings: int
    num_key_value_heads: int
    # config.json's `head_dim`: explicit, and need not be hidden_size / num_attention_heads.
    head_size: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        # Not the base check that the heads split hidden_size: the projections map
        # hidden_size to heads x head_dim, whatever the two are.
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_size % 2:
            raise ConfigError("rotary positions need an even head_dim")

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "rotary"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> Qwen3Config:
        num_layers = config.positive_int("num_hidden_layers")
        num_heads = config.positive_int("num_attention_heads")
        config.expect("hidden_act", "silu", "silu")
        # Sliding-window layers would see only the last `sliding_window` tokens.
        config.expect("use_sliding_window", False, False)
        # Every layer attends to all before it: no sliding layers.
        config.layer_types(num_layers, {"full_attention": True})
        return cls(
            model_type="qwen3",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            # Qwen3 names no padding token; padded positions are masked, so any id will do.
            pad_token_id=config.integer("pad_token_id", 0),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings", 32768),
            num_key_value_heads=config.positive_int("num_key_value_heads", num_heads),
            head_size=config.positive_int("head_dim", 128),
            rms_norm_eps=config.number("rms_norm_eps", 1e-6),
            attention_bias=config.flag("attention_bias", False),
            rope_theta=rope_theta(config),
        )

    def build(self) -> Qwen3Encoder:
        return Qwen3Encoder(self)


def rope_theta(config: ConfigReader) -> float:
    """The rotary base, from `rope_parameters` (transformers 5) or, as transformers falls back,
    the older flat `rope_theta`. Only plain rotary positions are implemented: `rope_scaling`
    (the older spelling of a scaled scheme) and any other `rope_type` are refused."""
    config.expect("rope_scaling", None, None)
    parameters = config.raw.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise config.error("key 'rope_parameters' must be an object")
    nested = ConfigReader(parameters, f"{config.source}: rope_parameters")
    # transformers reads the type from `type` where a config predates `rope_type`.
    nested.expect("rope_type", "default", parameters.get("type", "default"))
    return nested.number("rope_theta", config.number("rope_theta", 10_000.0))


class RMSNorm(nn.Module):
    """Scaled by the root mean square, computed in float32; the weight multiplies the result
    rounded back to the input's dtype, as transformers' Qwen3RMSNorm does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out: Tensor = self.weight * normed.to(x.dtype)
        return out


class Attention(nn.Module):
    """Causal grouped-query self-attention with per-head RMSNorm on queries and keys."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        size, head, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(size, self.num_heads * head, bias=bias)
        self.k_proj = nn.Linear(size, self.num_kv_heads * head, bias=bias)
        self.v_proj = nn.Linear(size, self.num_kv_heads * head, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head, size, bias=bias)
        self.q_norm = RMSNorm(head, config.rms_norm_eps)
        self.k_norm = RMSNorm(head, config.rms_norm_eps)

    def forward(
        self,
        h: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        q = self.q_norm(layout.heads(self.q_proj(h), self.num_heads))  # (B, H, T, hd)
        k = self.k_norm(layout.heads(self.k_proj(h), self.num_kv_heads))  # (B, KV, T, hd)
        v = layout.heads(self.v_proj(h), self.num_kv_heads)  # (B, KV, T, hd)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        # Each key and value head serves `group` consecutive query heads (transformers'
        # repeat_kv order).
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        context, probs = attend(q, k, v, allowed, map_heads=map_heads)  # (B, H, T, hd)
        out: Tensor = self.o_proj(layout.merge_heads(context))
        return out, probs


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(size, inner, bias=False)
        self.up_proj = nn.Linear(size, inner, bias=False)
        self.down_proj = nn.Linear(inner, size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.self_attn(self.input_layernorm(x), layout, rotary, allowed, map_heads)
        return in_row_chunks(self.feed_forward, x + context), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Qwen3Encoder(Encoder):
    """Token embeddings, the layers, a final norm; Qwen3 has no token types, so any are
    ignored."""

    config: Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        x = self.embed_tokens(input_ids)  # (B, T, D)
        width, device = input_ids.shape[1], input_ids.device
        rotary = rotary_tables(self.config.rope_theta, self.config.head_dim, width, device, x.dtype)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (T, T)
        allowed = layout.key_mask.narrowed(causal)  # (B, 1, T, T)
        h = layout.pack(x)  # (N, D)
        h, kept = run_layers(self.layers, h, layout, maps, lambda index: (rotary, allowed))
        return EncoderOutput(layout.unpack(self.norm(h)), kept)
